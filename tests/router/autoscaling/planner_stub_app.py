"""A stand-in app for the planner's live test (test_planner_live.py): a PrefillWorker and a
DecodeWorker that report fixed per-replica signals and carry the planner's autoscaling configs,
deployed from a declarative config the way `kvrelay serve` deploys the real app."""

from __future__ import annotations

from ray import serve

from router.autoscaling.decide import ReplicaSignals, serve_autoscaling_config
from router.autoscaling.policy import load_policy


@serve.deployment(ray_actor_options={"num_cpus": 0})
class StubPool:
    def __init__(self, signals: dict[str, float], upstream=None):
        self._signals = ReplicaSignals(**signals)
        self._upstream = upstream  # decode binds prefill, so both are in the app's graph

    def record_autoscaling_stats(self) -> dict[str, float]:
        return self._signals.to_wire()

    def __call__(self) -> str:
        return "ok"


def build(args: dict):
    policy = load_policy(args["policy"])
    prefill = StubPool.options(name="PrefillWorker", autoscaling_config=serve_autoscaling_config("prefill", policy))
    decode = StubPool.options(name="DecodeWorker", autoscaling_config=serve_autoscaling_config("decode", policy))
    return decode.bind(args["decode"], prefill.bind(args["prefill"]))
