"""What the Serve request routers read of a worker call: its first argument when it is Routable
(a WorkerRequest), nothing for a control call (stats, model_info), which any replica answers."""

from __future__ import annotations

from types import SimpleNamespace

from router.request_router import Routable, apply_admission, prediction_of, route_request_from_args
from serving.deployments.messages import WorkerRequest
from serving.engine.params import SamplingParams


def test_a_worker_request_is_routed_by_its_prompt_and_session():
    request = WorkerRequest("r1", [5, 6, 7], SamplingParams(), block_hashes=[11, 12], block_size=16, session="u1")
    assert isinstance(request, Routable)
    routed = route_request_from_args(SimpleNamespace(args=[request, None, []]))
    assert (routed.request_id, routed.num_prompt_tokens, tuple(routed.block_hashes), routed.block_size, routed.session) == (
        "r1", 3, (11, 12), 16, "u1",
    )
    assert routed.token_ids == [5, 6, 7]


def test_a_control_call_has_no_route_request():
    assert route_request_from_args(None) is None
    assert route_request_from_args(SimpleNamespace(args=[])) is None
    assert route_request_from_args(SimpleNamespace(args=["not a request"])) is None


def test_a_decisions_prediction_names_the_replica_as_its_worker_does():
    from router.route_types import Decision

    replica = SimpleNamespace(unique_id="abc123")
    prediction = prediction_of("prefix_cost", Decision([replica, "other"], "prefix_hit", num_matched_tokens=64, num_predicted_tokens=48))
    assert (prediction.policy, prediction.replica, prediction.num_tokens) == ("prefix_cost", "abc123", 48)
    assert prediction_of("pow2", Decision(["r1"], "pow2")).replica == "r1"  # ids without unique_id (tests)


def test_the_routers_admission_travels_with_the_request():
    from router.route_types import Decision

    request = WorkerRequest("r1", [5, 6, 7], SamplingParams(), block_hashes=[11], block_size=2)
    assert request.keep_cached is True
    apply_admission(SimpleNamespace(args=[request]), Decision(["a"], "least_cost", retain=False))
    assert request.keep_cached is False
    apply_admission(SimpleNamespace(args=[request]), Decision(["b"], "prefix_hit"))  # a retry elsewhere: kept
    assert request.keep_cached is True
