"""Every kvrelay metric, defined once (`METRICS`), and the recorders that feed them.

    ingress replica                                   worker replica (prefill / decode / worker)
    ───────────────                                   ──────────────────────────────────────────
    RequestRecord, one per HTTP request               WorkerRecorder (worker_metrics.py)
    (ingress_metrics.py)
      each delta: a clock read, token counts            first token: queue time, prefill time
      end: TTFT, TPOT, ITLs, E2E, status, tokens        KV claim: transfer time, bytes, fallback
        ──▶ IngressMetrics                              refresh(EngineStats) once per routing-
    routers: each decision ──▶ routing counter            stats period: gauges, counter deltas
    pool view (controller, every few s) ──▶ gauges
                    │                                                 │
                    └──────────▶ Instruments ◀────────────────────────┘
                 a prometheus_client registry of the process's recorder, and
                 ray.util.metrics (when the process is connected to Ray)

Two exports of the same definitions:

- Ray: every process records what it sees through `ray.util.metrics`; Ray's metrics agent on
  each node exports it, with Ray's `ray_` prefix (`ray_kvrelay_ttft_seconds_bucket`) and its
  own labels (`WorkerId`, `NodeAddress`, ...), to the Ray dashboard and to any Prometheus that
  reads Ray's service-discovery file. `deploy/prometheus/prometheus.yml` renames
  `ray_kvrelay_*` back to `kvrelay_*` so the dashboard and alerts use one set of names.
- `GET /metrics` on the ingress (serving/observability/export.py): this ingress replica's registry in
  the exposition format, plus the workers' metrics as their replicas last reported them in the
  routing stats this ingress's routers receive (every `routing.stats_period_s`).

Nothing here does I/O on the hot path: a request's latencies are kept in the RequestRecord and
recorded when it ends; engine gauges and counters are sampled once per stats period.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Literal

import prometheus_client
from prometheus_client import CollectorRegistry

__all__ = [
    "MetricSpec",
    "METRICS",
    "BY_NAME",
    "POOL_OF_DEPLOYMENT",
    "Instruments",
    "series_names",
    "record_routing_decision",
    "record_autoscaler_decision",
    "register_router",
    "live_routers",
]

logger = logging.getLogger(__name__)

# `_created` samples double every counter and histogram in the exposition and nothing here reads
# them; the registries here are the ones our replicas own.
prometheus_client.disable_created_metrics()

Kind = Literal["counter", "gauge", "histogram"]
Where = Literal["ingress", "worker", "controller"]

POOL_OF_DEPLOYMENT = {"PrefillWorker": "prefill", "DecodeWorker": "decode", "Worker": "worker"}


@dataclass(frozen=True)
class MetricSpec:
    name: str  # counters end in _total
    kind: Kind
    description: str
    labels: tuple[str, ...]
    recorded_at: Where
    buckets: tuple[float, ...] = ()


_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
_TOKEN_BUCKETS = (0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 120.0, 240.0, 480.0)
_SPLIT_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 10.0, 20.0, 40.0, 80.0)
_ERROR_TOKEN_BUCKETS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536, 131072)
_TRANSFER_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

_M, _MPR = ("model",), ("model", "pool", "replica")

METRICS: tuple[MetricSpec, ...] = (
    # ---- the ingress: requests as the client sees them --------------------------------------
    MetricSpec("kvrelay_ttft_seconds", "histogram",
               "Time to first token: request received at the ingress to its first generated token.",
               _M, "ingress", _TTFT_BUCKETS),
    MetricSpec("kvrelay_tpot_seconds", "histogram",
               "Time per output token after the first: (E2E - TTFT) / (output tokens - 1) of the longest choice; "
               "completed requests with 2+ tokens.",
               _M, "ingress", _TOKEN_BUCKETS),
    MetricSpec("kvrelay_inter_token_latency_seconds", "histogram",
               "Time from each token to the next, completed requests: one per token after each choice's first "
               "(k tokens that arrived together count k gaps of an equal share).",
               _M, "ingress", _TOKEN_BUCKETS),
    MetricSpec("kvrelay_e2e_request_latency_seconds", "histogram", "Request received to its last token, completed requests.", _M, "ingress", _E2E_BUCKETS),
    MetricSpec("kvrelay_requests_total", "counter",
               "HTTP requests to the completion APIs, by status (499: the client went away) and finish reason of "
               "choice 0 (stop, length, abort, error; none: rejected before generation).",
               ("model", "status", "finish_reason"), "ingress"),
    MetricSpec("kvrelay_prompt_tokens_total", "counter", "Prompt tokens of requests that reached generation.", _M, "ingress"),
    MetricSpec("kvrelay_generation_tokens_total", "counter", "Generated tokens delivered to the ingress (every choice).", _M, "ingress"),
    MetricSpec("kvrelay_recoveries_total", "counter",
               "Requests that survived a replica's death: decode_resumed (a decode replica died mid-stream; resumed "
               "on another from the tokens so far), prefill_on_decode (a prefill replica died before the first "
               "token; the decode pool computed the prompt).",
               ("model", "kind"), "ingress"),
    MetricSpec("kvrelay_degraded_requests_total", "counter",
               "Requests graceful degradation handled after the model's pools refused them before their first token "
               "(reason: saturated, down), by target (the fallback's model, or none when shed) and outcome (served: "
               "the fallback answered 2xx; failed: it answered an error or could not be reached; shed: 503 with "
               "Retry-After).",
               ("model", "reason", "target", "outcome"), "ingress"),
    MetricSpec("kvrelay_routing_decisions_total", "counter",
               "Replica choices of the ingress's request routers, by policy and reason.",
               ("pool", "policy", "reason"), "ingress"),
    # ---- the ingress: what the routers predicted, where the first token's time went
    # (serving/observability/request_path.py) ------------------------------------------------
    MetricSpec("kvrelay_prefix_tokens_total", "counter",
               "Requests whose router's prefix prediction was checked against the engine that computed the prompt: "
               "their prompt tokens (kind=prompt), the cached tokens the router predicted on its chosen replica "
               "(kind=predicted) and those the engine found (kind=cached).",
               ("model", "pool", "kind"), "ingress"),
    MetricSpec("kvrelay_prefix_predictions_total", "counter",
               "Checked prefix predictions by outcome (exact; miss: the engine found fewer cached tokens; surprise: "
               "more) and reason (match, reassigned, prompt_logprobs, evicted_in_queue, in_flight, stale, unseen).",
               ("model", "pool", "outcome", "reason"), "ingress"),
    MetricSpec("kvrelay_prefix_prediction_error_tokens", "histogram",
               "Mispredicted requests: |predicted - cached| prompt tokens, by outcome (miss, surprise).",
               ("model", "pool", "outcome"), "ingress", _ERROR_TOKEN_BUCKETS),
    MetricSpec("kvrelay_ttft_split_seconds", "histogram",
               "Each request's TTFT split into components that sum to it: queue (received -> the engine scheduled "
               "it), prefill (-> the engine's first token), handoff (disaggregated: the prefill's result at the "
               "ingress -> the decode call placed), delivery (the rest); pool: where the prompt was computed.",
               ("model", "pool", "component"), "ingress", _SPLIT_BUCKETS),
    MetricSpec("kvrelay_decode_start_seconds", "histogram",
               "Disaggregated requests whose KV the decode pool imported: the decode call placed -> the second token "
               "at the ingress, split into kv_transfer (the call reaching the decode replica, the claim), "
               "first_decode_step (the decode engine's arrival -> its first token) and delivery.",
               ("model", "component"), "ingress", _SPLIT_BUCKETS),
    MetricSpec("kvrelay_replicas", "gauge",
               "Replicas of a pool by Serve replica state (the controller's view, read every few seconds).",
               ("model", "pool", "state"), "ingress"),
    MetricSpec("kvrelay_desired_replicas", "gauge",
               "The pool's target replica count: the autoscaling policy's latest decision, or the fixed "
               "num_replicas.",
               ("model", "pool"), "ingress"),
    # ---- the workers: engines and KV transfer -----------------------------------------------
    MetricSpec("kvrelay_queue_time_seconds", "histogram", "Arrival at this engine to its first scheduling.", _MPR, "worker", _TTFT_BUCKETS),
    MetricSpec("kvrelay_prefill_time_seconds", "histogram",
               "First scheduling to first token, where this engine computed the prompt (not after a KV import).",
               _MPR, "worker", _TTFT_BUCKETS),
    MetricSpec("kvrelay_kv_transfer_seconds", "histogram",
               "Decode side: claiming a request's KV until the payload is in hand (successful imports).",
               _MPR, "worker", _TRANSFER_BUCKETS),
    MetricSpec("kvrelay_kv_transfer_bytes_total", "counter",
               "KV payload bytes exported (prefill side) or imported (decode side).",
               (*_MPR, "direction"), "worker"),
    MetricSpec("kvrelay_kv_transfer_fallbacks_total", "counter",
               "KV imports that failed or timed out, so the prompt was recomputed, by reason.",
               (*_MPR, "reason"), "worker"),
    MetricSpec("kvrelay_prefix_cache_queried_tokens_total", "counter", "Prompt tokens looked up in the prefix cache.", _MPR, "worker"),
    MetricSpec("kvrelay_prefix_cache_hit_tokens_total", "counter", "Prompt tokens found in the prefix cache.", _MPR, "worker"),
    MetricSpec("kvrelay_preemptions_total", "counter", "Sequences preempted (their KV freed, to be recomputed).", _MPR, "worker"),
    MetricSpec("kvrelay_decode_steps_total", "counter",
               "Decode steps the engine ran back to back (no prompt token in them, another step right after).",
               _MPR, "worker"),
    MetricSpec("kvrelay_decode_step_sequences_total", "counter",
               "Sequences those decode steps decoded (the batch, summed over the steps).", _MPR, "worker"),
    MetricSpec("kvrelay_decode_step_seconds_total", "counter",
               "Those decode steps' periods, each from its start to the next step's start: what a stream waits "
               "for a token.", _MPR, "worker"),
    MetricSpec("kvrelay_spec_decode_proposed_tokens_total", "counter",
               "Speculative decoding: proposed tokens a forward pass verified, by proposer.", (*_MPR, "proposer"), "worker"),
    MetricSpec("kvrelay_spec_decode_accepted_tokens_total", "counter",
               "Speculative decoding: verified proposed tokens the model agreed with (kept), by proposer.",
               (*_MPR, "proposer"), "worker"),
    MetricSpec("kvrelay_spec_decode_verify_steps_total", "counter",
               "Speculative decoding: sequence-steps that verified proposals; each keeps its accepted tokens + 1.",
               (*_MPR, "proposer"), "worker"),
    MetricSpec("kvrelay_spec_decode_acceptance_ratio", "gauge",
               "Speculative decoding since the engine started: accepted / proposed tokens, by proposer.",
               (*_MPR, "proposer"), "worker"),
    MetricSpec("kvrelay_spec_decode_tokens_per_step", "gauge",
               "Speculative decoding since the engine started: mean tokens a verifying sequence-step kept "
               "((accepted + verify steps) / verify steps), by proposer.",
               (*_MPR, "proposer"), "worker"),
    MetricSpec("kvrelay_num_requests_running", "gauge", "Sequences in the engine's running batch.", _MPR, "worker"),
    MetricSpec("kvrelay_num_requests_waiting", "gauge", "Sequences waiting in the engine's queue.", _MPR, "worker"),
    MetricSpec("kvrelay_kv_cache_usage_ratio", "gauge", "Fraction of the engine's KV blocks in use (0..1).", _MPR, "worker"),
    MetricSpec("kvrelay_engine_kernel_info", "gauge",
               "1 for the kernel path the engine runs (kernel_path: native or pytorch) and why (reason), so a silent"
               " fallback shows.",
               (*_MPR, "kernel_path", "reason"), "worker"),
    # ---- the Serve controller ---------------------------------------------------------------
    MetricSpec("kvrelay_autoscaler_decisions_total", "counter",
               "Autoscaling decisions that changed a pool's replica count, by action (up, down, clamp). Ray export "
               "only.",
               ("pool", "action"), "controller"),
)
BY_NAME: dict[str, MetricSpec] = {spec.name: spec for spec in METRICS}
assert len(BY_NAME) == len(METRICS), "a metric is defined twice"


def series_names(spec: MetricSpec) -> tuple[str, ...]:
    """The sample names a metric has in the exposition format."""
    if spec.kind == "histogram":
        return tuple(spec.name + s for s in ("_bucket", "_sum", "_count"))
    return (spec.name,)


# ---- instruments -----------------------------------------------------------------------------
_ray_metrics: dict[str, object] = {}  # one per process and name: Ray registers names globally


def _ray_metric(spec: MetricSpec):
    metric = _ray_metrics.get(spec.name)
    if metric is None:
        from ray.util import metrics as ray_metrics

        if spec.kind == "counter":
            metric = ray_metrics.Counter(spec.name, spec.description, tag_keys=spec.labels)
        elif spec.kind == "gauge":
            metric = ray_metrics.Gauge(spec.name, spec.description, tag_keys=spec.labels)
        else:
            metric = ray_metrics.Histogram(spec.name, spec.description, list(spec.buckets), tag_keys=spec.labels)
        _ray_metrics[spec.name] = metric
    return metric


def _ray_connected() -> bool:
    import ray

    return ray.is_initialized()


def _prom_metric(spec: MetricSpec, registry: CollectorRegistry):
    if spec.kind == "counter":
        return prometheus_client.Counter(spec.name, spec.description, spec.labels, registry=registry)
    if spec.kind == "gauge":
        return prometheus_client.Gauge(spec.name, spec.description, spec.labels, registry=registry)
    return prometheus_client.Histogram(spec.name, spec.description, spec.labels, registry=registry, buckets=spec.buckets)


class Instruments:
    """The metrics of one recorder: its own prometheus_client registry, and Ray's instruments
    when `use_ray` (default: whether this process is connected to Ray). `labels` are applied to
    every record; the rest come with each call."""

    def __init__(self, names: Iterable[str], labels: Mapping[str, str] | None = None, *, use_ray: bool | None = None):
        self.registry = CollectorRegistry(auto_describe=True)
        self.labels = dict(labels or {})
        specs = [BY_NAME[name] for name in names]
        self._prom = {spec.name: _prom_metric(spec, self.registry) for spec in specs}
        for spec in specs:  # a series with only the fixed labels shows from the start, at 0
            if set(spec.labels) <= self.labels.keys() and spec.kind != "gauge":
                self._prom[spec.name].labels(**self.labels)
        self.use_ray = _ray_connected() if use_ray is None else use_ray
        self._ray = {spec.name: _ray_metric(spec) for spec in specs} if self.use_ray else {}

    def inc(self, name: str, value: float = 1.0, **labels: str) -> None:
        if value <= 0:
            return
        tags = {**self.labels, **labels}
        self._prom[name].labels(**tags).inc(value)
        if self.use_ray:
            self._ray[name].inc(value, tags=tags)

    def observe(self, name: str, values: Iterable[float], **labels: str) -> None:
        tags = {**self.labels, **labels}
        child = self._prom[name].labels(**tags)
        ray_metric = self._ray.get(name)
        for value in values:
            child.observe(value)
            if ray_metric is not None:
                ray_metric.observe(value, tags=tags)

    def set(self, name: str, value: float, **labels: str) -> None:
        tags = {**self.labels, **labels}
        self._prom[name].labels(**tags).set(value)
        if self.use_ray:
            self._ray[name].set(value, tags=tags)


def _ray_inc(name: str, labels: dict[str, str]) -> None:
    """A count from a process with no registry of ours (routers, the Serve controller)."""
    if not _ray_connected():
        return
    try:
        _ray_metric(BY_NAME[name]).inc(1.0, tags=labels)
    except Exception:  # metrics must never fail a routing or scaling decision
        logger.debug("recording %s failed", name, exc_info=True)


_routers: weakref.WeakSet = weakref.WeakSet()


def register_router(router) -> None:
    """A request router of this process (router/request_router.py), for GET /metrics to read."""
    _routers.add(router)


def live_routers() -> list:
    return list(_routers)


def record_routing_decision(pool: str, policy: str, reason: str) -> None:
    """One router decision (Ray export; /metrics reads the routers' own counts)."""
    _ray_inc("kvrelay_routing_decisions_total", {"pool": pool, "policy": policy, "reason": reason})


def record_autoscaler_decision(pool: str, action: str) -> None:
    """An autoscaling decision that changed the pool's count (runs in the Serve controller)."""
    _ray_inc("kvrelay_autoscaler_decisions_total", {"pool": pool, "action": action})
