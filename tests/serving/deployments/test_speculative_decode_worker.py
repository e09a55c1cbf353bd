"""A decode worker that speculates, after a KV hand-off from a prefill worker that does not (Ray
faked as in test_kv_arena_handoff): the same tokens, and its proposed and accepted tokens and
tokens per step in what the routers, the autoscaler and its metrics read."""

from __future__ import annotations

import asyncio

from serving.config import KVTransferConfig
from serving.deployments.engine_worker import EngineWorker
from serving.engine.config import SpeculativeConfig
from tests.helpers import tiny_engine_config
from tests.serving.deployments.test_kv_arena_handoff import PARAMS, PROMPT, actors, expected_tokens, hand_off
from tests.serving.engine.test_speculative import OracleProposer
from tests.serving.engine.test_speculative_handoff import oracle_counts

__all__ = ["actors"]  # the fixture, used by name


def test_a_speculating_decode_worker_reports_what_it_accepted(tiny_model_dir, actors):
    config = tiny_engine_config(tiny_model_dir)
    kv = KVTransferConfig(lease_s=30.0, timeout_s=5.0, arena_mib=1)
    prefill = EngineWorker("prefill", config, kv, "app")
    decode = EngineWorker("decode", config.model_copy(update={"speculative": SpeculativeConfig(adaptive=False)}), kv, "app")
    prefill._node_id = decode._node_id = "node-a"
    expected = expected_tokens(tiny_model_dir)
    decode.engine.engine.speculator.proposer = OracleProposer([PROMPT], [expected], k=4)
    try:
        tokens = asyncio.run(hand_off(prefill, decode))
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert tokens == expected
    # Proposals from the second token on (the first decode step samples it): 15 proposed, 6 kept
    # in 4 verify steps; the engine generated the other 11 tokens in 5 steps (11 / (11 - 6)).
    assert oracle_counts(len(PROMPT), 2, 4, PARAMS.max_tokens) == (15, 6, 4)
    routing = decode.routing_stats()
    assert (routing.spec_method, routing.spec_proposed_tokens, routing.spec_accepted_tokens, routing.spec_verify_steps) == (
        "oracle", 15, 6, 4)
    assert routing.spec_acceptance_rate == 6 / 15
    assert routing.decode_tokens_per_step == 11 / 5
    assert decode.autoscaling_signals().decode_tokens_per_step == 11 / 5
    # The prefill worker never speculated: it reports a token per step and no proposer.
    prefill_routing = prefill.routing_stats()
    assert (prefill_routing.spec_method, prefill_routing.spec_proposed_tokens, prefill_routing.decode_tokens_per_step) == ("", 0, 1.0)
    # Its metrics, by proposer (the ingress re-exports them from the routing stats).
    samples = {(name, labels.get("proposer")): value for family in routing.metrics for name, labels, value in family[3]
               if name.startswith("kvrelay_spec_decode")}
    assert samples == {
        ("kvrelay_spec_decode_proposed_tokens_total", "oracle"): 15.0,
        ("kvrelay_spec_decode_accepted_tokens_total", "oracle"): 6.0,
        ("kvrelay_spec_decode_verify_steps_total", "oracle"): 4.0,
        ("kvrelay_spec_decode_acceptance_ratio", "oracle"): 0.4,
        ("kvrelay_spec_decode_tokens_per_step", "oracle"): 2.5,
    }
