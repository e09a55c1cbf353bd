"""The planner on a local Ray: Serve 2.60 runs the application-level policy (plan_serve.plan_policy)
of a declaratively deployed app, so the decode pool is sized from the prefill pool's flow.

The stand-in replicas (planner_stub_app.py) report fixed signals: two prefill replicas (min = max)
see 1.5 req/s of 256-token prompts each; decode replicas see no arrivals now (63 tokens per request
before). Planned together, decode gets the 3 req/s prefill sends it: 6 replicas
(decode_replicas(planner, 3.0, 63)); planned alone, as per-deployment policies would, it stays at 1.
"""

from __future__ import annotations

import time

import pytest
import yaml

from load_tests.local_ray import free_port
from router.autoscaling.plan_serve import APP_POLICY_FUNCTION
from router.autoscaling.planner import decode_replicas
from router.autoscaling.policy import load_policy
from tests.helpers import REPO

pytestmark = pytest.mark.integration

APP = "planner-live"
DEADLINE_S = 120.0


def policy_file(tmp_path) -> str:
    policy = yaml.safe_load((REPO / "deploy/autoscaling/planner.yaml").read_text())
    fast = {"window_s": 2, "metrics_interval_s": 0.5, "stale_after_s": 5}
    policy["prefill"].update(fast, min_replicas=2, max_replicas=2)
    policy["decode"].update(fast, max_replicas=8)
    # No trend: the two stand-ins' first reports reach the controller one at a time (1.5 req/s,
    # then 3), a ramp a trend would carry past 3 req/s to the 8-replica cap on a slow machine (seen
    # on a loaded CI run), where the downscale delay then holds it. The test is the flow, not Holt.
    policy["planner"].update(interval_s=1, forecast={"alpha": 0.5, "beta": 0.0, "recurrence": False})
    path = tmp_path / "planner.yaml"
    path.write_text(yaml.safe_dump(policy))
    return str(path)


@pytest.mark.timeout(300)
def test_declarative_app_runs_the_joint_plan(tmp_path, tmp_path_factory):
    import ray
    from ray import serve
    from ray.serve._private.api import serve_start
    from ray.serve.schema import ServeDeploySchema

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    try:
        client = serve_start(http_options={"host": "127.0.0.1", "port": free_port()})
        args = {
            "policy": policy_file(tmp_path),
            "prefill": {"requests_per_s": 1.5, "prompt_tokens_per_request": 256, "num_queued_prefill_tokens": 0,
                        "prefill_tokens_per_s": 296.4},
            "decode": {"requests_per_s": 0.0, "output_tokens_per_request": 63.0, "num_seqs": 0.0, "output_tokens_per_s": 0.0},
        }
        client.deploy_apps(ServeDeploySchema.model_validate({"applications": [{
            "name": APP, "route_prefix": f"/{APP}", "import_path": "tests.router.autoscaling.planner_stub_app:build",
            "args": args, "autoscaling_policy": {"policy_function": APP_POLICY_FUNCTION},
        }]}))
        started = time.monotonic()
        while True:
            app = serve.status().applications.get(APP)
            states = {name: dict(d.replica_states) for name, d in app.deployments.items()} if app else {}
            if states.get("DecodeWorker") == {"RUNNING": 6}:
                break
            assert time.monotonic() - started < DEADLINE_S, f"replicas {states}"
            time.sleep(0.5)
        assert states["PrefillWorker"] == {"RUNNING": 2}
        assert decode_replicas(load_policy(args["policy"]).planner, 3.0, 63) == 6
    finally:
        serve.shutdown()
        ray.shutdown()
