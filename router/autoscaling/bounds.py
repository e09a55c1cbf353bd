"""The bounds both autoscaling policies accept, declared once: the reactive policy's
(router/autoscaling/policy.py) and the planner's (router/autoscaling/planner_policy.py) latency
targets, replica counts and downscale delay. Each is a dict of pydantic Field constraints."""

from __future__ import annotations

__all__ = ["MAX_REPLICAS", "REPLICAS", "TTFT_MS", "TPOT_MS", "DOWNSCALE_DELAY_S", "DEFAULT_DOWNSCALE_DELAY_S"]

MAX_REPLICAS = 256
REPLICAS = dict(ge=1, le=MAX_REPLICAS)  # a pool's min_replicas and max_replicas
TTFT_MS = dict(gt=0, le=600_000)  # a TTFT target (p95 per replica, or the planner's bound), ms
TPOT_MS = dict(gt=0, le=60_000)  # a TPOT target, ms
DOWNSCALE_DELAY_S = dict(ge=0, le=86_400)  # how long a lower demand must last before a pool shrinks
DEFAULT_DOWNSCALE_DELAY_S = 120.0
