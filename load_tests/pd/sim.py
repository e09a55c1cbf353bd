"""A discrete-event simulator of prefill and decode pools: colocated against disaggregated serving,
each replica a continuous-batching engine whose steps cost what a CostFit says (pd/costs.py).

    colocated        arrival ──least loaded──▶ worker replica: prompt chunks and decoding rows
                                              share its steps (the interference)
    disaggregated    arrival ──least queued prompt tokens──▶ prefill replica: the prompt, its
                     first token ──KV hand-off (HandoffCost)──least loaded──▶ decode replica:
                     the other tokens

A replica is kvrelay's scheduler (serving/engine/scheduler.py) reduced to what sets its timing:
every step, the running sequences in arrival order each get min(tokens left, budget left)
tokens, one for a decoding row, a chunk for a prompt; a prompt with more than
`long_prefill_token_threshold` tokens left gets at most that many a step, and one such prompt
prefills at a time (a waiting long one is passed over, shorter ones are admitted past it);
waiting requests are admitted in arrival order while the budget and `max_num_seqs` last and the
replica's KV holds their prompt and output (reserved whole at admission: no preemption, which
kvrelay's engine would do instead when it ran out). A step takes CostFit.step's time for its
shape plus the served path's overhead (per step and per sampled row, and on a prefill replica
its own work per request, added to the step that admits it); its sampled tokens appear when it
ends.

The other serving processes (proxy, ingress, controller, client) share the cores the replicas
run on, one core each (pd-interference's layout), using LayoutOverhead.background_cpu cores
always, cpu_per_request_s per request and cpu_per_token_s per streamed token (a rate averaged
over SERVING_TAU_S). As a processor-sharing scheduler would: the idle replicas' cores, and any
spare ones no replica runs on (`spare_cores`: the served probe's colocated layout has one), take
that load first; what is left is spread over the busy replicas' cores, and a step that starts while
a share s of its core is taken lasts 1 / (1 - s) times its cost (s at most 0.9). A step that
starts while another replica is mid-step takes longer first (`corun_s`): on one CPU both replicas
read their weights through the same memory, the other as often as its step is short
(load_tests/pd/corun.py). Only a replica's node neighbours count: the probe measured one, the
other core of this machine, so a pool runs NODE_REPLICAS replicas to a node, in id order
(prefill replicas first). Summed over the whole pool, a step of 64 replicas paid 63 neighbours'
terms and goodput per replica fell with the pool's size.

Routing, by `router`:

    kvrelay       what a deployed kvrelay does: its own routers (load_tests/pd/routing.py: the
                  RouterState and policies Serve runs) on the routing stats every replica
                  reports every `stats_period_s` (0.5 s, as served): the prefill pool and the
                  colocated worker pool by prefix_cost (here without prefix hits: the queued
                  prefill tokens, the delay a prompt causes, the bounded load), the decode pool
                  by least_kv. Both count what the router sent a replica after its last stats.
                  The replay of the measured scenario routes so.
    least_loaded  on the replicas' state now: a prefill replica by the prompt tokens it has
                  still to compute, a worker or decode replica by the KV its running and waiting
                  sequences will hold (prompt and output), then their number; ties round-robin.
                  The sweep compares layouts, so it routes so.

Per request: TTFT = first token - arrival (the served path's request overhead included: the
request reaches an engine that much later); TPOT = (last token - first token) / (tokens - 1),
the hand-off included. Per run (`summarize`): TTFT/TPOT percentiles, goodput at each SLO
(requests meeting every bound / (last completion - first arrival)), SLO attainment, replica
utilisation (busy time / the run's span), the mean TTFT split into the served path's overhead,
the replica's queue and the prefill (`ttft_split_ms`, to set beside the ingress's measured split).
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections import deque
from dataclasses import dataclass, field

from load_tests.pd.costs import CostFit, chunk_pairs
from load_tests.pd.routing import KvrelayRouters, measure_step, routing_stats
from load_tests.serve.metrics import percentile
from router.replica_stats import RequestRate, RoutingStats
from serving.engine.prefill_rate import PrefillRate

__all__ = ["SimRequest", "RequestResult", "SimRun", "simulate", "summarize", "attainment", "ttft_split_ms", "MODES", "ROUTERS", "STATS_PERIOD_S"]

MODES = ("colocated", "disaggregated")
STATS_PERIOD_S = 0.5  # RoutingConfig.stats_period_s's default
SERVING_TAU_S = 1.0  # the serving processes' CPU rate is their use over about this long
NODE_REPLICAS = 2  # replicas sharing a node's memory, for the co-run term: this machine's two cores
ROUTERS = ("kvrelay", "least_loaded")


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    kind: str = "chat"


@dataclass
class RequestResult:
    request: SimRequest
    arrived_s: float | None = None  # it reached a replica's queue (arrival + the served path's request overhead)
    scheduled_s: float | None = None  # its prompt's first chunk was scheduled
    first_token_s: float | None = None
    last_token_s: float | None = None
    prefill_replica: int | None = None
    decode_replica: int | None = None

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.request.arrival_s

    @property
    def tpot_s(self) -> float | None:
        n = self.request.output_tokens
        return None if n < 2 else (self.last_token_s - self.first_token_s) / (n - 1)

    def meets(self, ttft_ms: float, tpot_ms: float) -> bool:
        tpot = self.tpot_s
        return self.ttft_s * 1e3 <= ttft_ms and (tpot is None or tpot * 1e3 <= tpot_ms)


@dataclass
class SimRun:
    mode: str
    num_prefill: int
    num_decode: int  # colocated: the workers
    results: list[RequestResult]
    busy_s: list[float]  # per replica: prefill ones first
    span_s: float
    num_steps: int


class _Seq:
    __slots__ = ("result", "num_prompt", "num_tokens", "num_computed", "max_new", "num_new", "kv_need", "arrival_s")

    def __init__(self, result: RequestResult, num_prompt: int, num_computed: int, max_new: int, arrival_s: float):
        self.result = result
        self.num_prompt = num_prompt
        self.num_computed = num_computed
        self.num_tokens = max(num_prompt, num_computed + 1)  # an imported prompt still computes its first token
        self.max_new = max_new
        self.num_new = 0
        self.kv_need = result.request.prompt_tokens + result.request.output_tokens
        self.arrival_s = arrival_s


def _account(seq: _Seq, n: int, tokens: int, rows: int, pairs: int, context: int, prefix: int) -> tuple[int, int, int, int, int]:
    """The step's shape with `n` tokens of `seq` added (pd_costs.StepShape's fields)."""
    if seq.num_computed < seq.num_prompt:  # a prompt chunk; it samples if it ends the prompt
        return (tokens + n, rows + (seq.num_computed + n >= seq.num_prompt), pairs + chunk_pairs(n, seq.num_computed), context,
                prefix + seq.num_computed)
    return tokens + n, rows + 1, pairs, context + seq.num_computed + n, prefix


class _Replica:
    __slots__ = ("rid", "fit", "step_overhead_s", "row_overhead_s", "request_overhead_s", "is_prefill", "waiting", "running", "kv_used",
                 "queued_kv", "queued_prompt", "busy", "busy_s", "step_s", "kv_held", "stats", "prefill_rate", "requests")

    def __init__(self, rid: int, fit: CostFit, mode: str, *, is_prefill: bool = False):
        self.rid, self.fit, self.is_prefill = rid, fit, is_prefill
        overhead = fit.overhead.of(mode)
        self.step_overhead_s, self.row_overhead_s = overhead.step_s, overhead.row_s
        self.request_overhead_s = overhead.prefill_request_s if is_prefill else 0.0  # per request it admits
        self.waiting: deque[_Seq] = deque()
        self.running: list[_Seq] = []
        self.kv_used = 0  # reserved by running sequences
        self.queued_kv = 0  # needed by waiting ones
        self.queued_prompt = 0  # prompt tokens left to compute, running and waiting
        self.busy = False
        self.busy_s = 0.0
        self.step_s = 0.0  # the running step's length (while busy)
        self.kv_held = 0  # KV tokens its running sequences hold now (computed ones)
        self.stats: RoutingStats | None = None  # its last routing stats
        self.prefill_rate = PrefillRate()  # prompt tokens per second of its prefill steps, as the engine measures it
        self.requests = RequestRate()  # requests it took lately

    def add(self, seq: _Seq) -> None:
        self.waiting.append(seq)
        self.queued_kv += seq.kv_need
        self.queued_prompt += max(0, seq.num_prompt - seq.num_computed)

    def _chunk(self, left: int, budget: int) -> tuple[int, bool]:
        """(tokens to compute this step, whether the prompt counts as long)."""
        threshold = self.fit.long_prefill_token_threshold
        is_long = 0 < threshold < left
        n = left if left < budget else budget
        if 0 < threshold < n:
            n = threshold
        return n, is_long

    def schedule(self) -> tuple[list[tuple[_Seq, int]], float]:
        """This step's (sequence, tokens) and its seconds."""
        fit = self.fit
        budget = fit.max_num_batched_tokens
        scheduled = []
        num_long = tokens = rows = pairs = context = prefix = 0
        for seq in self.running:
            if budget <= 0:
                break
            left = seq.num_tokens - seq.num_computed
            if left == 1 and seq.num_computed >= seq.num_prompt:  # a decoding row: the common case
                scheduled.append((seq, 1))
                budget -= 1
                tokens += 1
                rows += 1
                context += seq.num_computed + 1
                continue
            n, is_long = self._chunk(left, budget)
            num_long += is_long
            scheduled.append((seq, n))
            budget -= n
            tokens, rows, pairs, context, prefix = _account(seq, n, tokens, rows, pairs, context, prefix)
        skipped = []
        admitted = 0
        while self.waiting and budget > 0 and len(self.running) < fit.max_num_seqs:
            seq = self.waiting[0]
            left = seq.num_tokens - seq.num_computed
            threshold = fit.long_prefill_token_threshold
            if 0 < threshold < left and num_long >= 1:  # one long prompt at a time: pass it over
                skipped.append(self.waiting.popleft())
                continue
            if self.kv_used + seq.kv_need > fit.kv_capacity_tokens and self.running:
                break
            self.waiting.popleft()
            self.queued_kv -= seq.kv_need
            self.kv_used += seq.kv_need
            self.running.append(seq)
            admitted += 1
            n, is_long = self._chunk(left, budget)
            num_long += is_long
            scheduled.append((seq, n))
            budget -= n
            tokens, rows, pairs, context, prefix = _account(seq, n, tokens, rows, pairs, context, prefix)
        self.waiting.extendleft(reversed(skipped))
        if not scheduled:
            return scheduled, 0.0
        return scheduled, (fit.step.step_s(tokens, rows, pairs, context, prefix) + self.step_overhead_s + self.row_overhead_s * rows
                           + self.request_overhead_s * admitted)

    def finish(self, seq: _Seq) -> None:
        self.running.remove(seq)
        self.kv_used -= seq.kv_need
        self.kv_held -= seq.num_computed

    def report(self, now: float) -> None:
        """Its routing stats now, as its worker would send them."""
        self.stats = routing_stats(now, queued_prompt=self.queued_prompt, prefill_rate=self.prefill_rate.tokens_per_s,
                                   num_running=len(self.running), num_waiting=len(self.waiting), kv_held=self.kv_held,
                                   kv_capacity_tokens=self.fit.kv_capacity_tokens, requests_per_s=self.requests.per_s(now))


@dataclass
class _Sim:
    fit: CostFit
    mode: str
    prefill: list[_Replica]
    decode: list[_Replica]
    cpu_per_token_s: float = 0.0
    cpu_per_request_s: float = 0.0
    background_cpu: float = 0.0
    events: list = field(default_factory=list)
    counter: itertools.count = field(default_factory=itertools.count)
    rr: int = 0
    num_steps: int = 0
    router: str = "kvrelay"
    report_always: bool = False  # routing sees the replicas' state now, not their last stats
    routers: KvrelayRouters | None = None  # router "kvrelay"
    serving_rate: float = 0.0  # the other serving processes' recent CPU use, in cores (background_cpu aside)
    serving_rate_at: float = 0.0
    num_busy: int = 0
    spare_cores: float = 0.0  # cores no replica runs on: they take the serving processes' load first
    neighbours: dict[int, list[_Replica]] = field(init=False)  # rid -> the others on its node (co-run term)

    def __post_init__(self) -> None:
        replicas = self.prefill + self.decode
        self.neighbours = {r.rid: [o for o in replicas if o is not r and o.rid // NODE_REPLICAS == r.rid // NODE_REPLICAS]
                           for r in replicas}

    @property
    def num_replicas(self) -> int:
        return len(self.prefill) + len(self.decode)

    def push(self, time_s: float, kind: int, payload) -> None:
        heapq.heappush(self.events, (time_s, next(self.counter), kind, payload))

    def pick(self, replicas: list[_Replica], key) -> _Replica:
        n = len(replicas)
        self.rr += 1
        return min(replicas, key=lambda r: (key(r), (r.rid - self.rr) % n))

    def least_loaded(self, request: SimRequest, now: float) -> _Replica:
        """The worker or decode replica for `request`."""
        if self.router == "least_loaded":  # the KV its sequences, running and waiting, will hold
            return self.pick(self.decode, lambda r: (r.kv_used + r.queued_kv, len(r.running) + len(r.waiting)))
        return self.route("decode", self.decode, request, now)

    def least_queued(self, request: SimRequest, now: float) -> _Replica:
        """The prefill replica for `request`."""
        if self.router == "least_loaded":
            return self.pick(self.prefill, lambda r: r.queued_prompt)
        return self.route("prefill", self.prefill, request, now)

    def route(self, pool: str, replicas: list[_Replica], request: SimRequest, now: float) -> _Replica:
        """kvrelay's router of `pool` on the replicas' last routing stats (or their state now)."""
        if self.routers is None:
            self.routers = KvrelayRouters(self.mode)
        if self.report_always:
            for replica in replicas:
                replica.report(now)
        chosen = self.routers.route(pool, request.request_id, request.prompt_tokens, [(r.rid, r.stats) for r in replicas], now)
        replica = next(r for r in replicas if r.rid == chosen)
        replica.requests.add(now)
        return replica

    def kick(self, replica: _Replica, now: float) -> None:
        if replica.busy:
            return
        scheduled, seconds = replica.schedule()
        if not scheduled:
            return
        for seq, _ in scheduled:
            if seq.result.scheduled_s is None:
                seq.result.scheduled_s = now
        replica.busy = True
        self.num_busy += 1
        if self.num_busy > 1 and self.fit.corun_s:
            seconds += self.corun_delay_s(replica)
        seconds /= 1.0 - self.stolen_share(now)
        replica.step_s = seconds
        measure_step(replica.prefill_rate, sum(n for seq, n in scheduled if seq.num_computed < seq.num_prompt), seconds)
        replica.busy_s += seconds
        self.num_steps += 1
        self.push(now + seconds, _STEP_DONE, (replica, scheduled))

    def corun_delay_s(self, replica: _Replica) -> float:
        """What its node neighbours' running steps add to `replica`'s next one: CostFit.corun_s for
        each that reads its weights as often as the probe's decode step did (a step of corun_ref_s
        or shorter), a share corun_ref_s / its length for a longer one (a 300-ms prefill chunk
        beside a 20-ms reference: a fifteenth)."""
        fit = self.fit
        return fit.corun_s * sum(min(1.0, fit.corun_ref_s / other.step_s)
                                 for other in self.neighbours[replica.rid] if other.busy and other.step_s > 0)

    def serving_work(self, now: float, cpu_s: float) -> None:
        """The other serving processes used `cpu_s` now: their rate, averaged over SERVING_TAU_S."""
        self.serving_rate = self.serving_rate * math.exp((self.serving_rate_at - now) / SERVING_TAU_S) + cpu_s / SERVING_TAU_S
        self.serving_rate_at = now

    def stolen_share(self, now: float) -> float:
        """The share of a busy replica's core the other serving processes take now: their load,
        less what the idle replicas' cores and the spare ones absorb, spread over the busy ones
        (at most 0.9)."""
        load = self.background_cpu + self.serving_rate * math.exp((self.serving_rate_at - now) / SERVING_TAU_S)
        idle_cores = self.num_replicas - self.num_busy + self.spare_cores
        return min(0.9, max(0.0, load - idle_cores) / self.num_busy)

    def step_done(self, replica: _Replica, scheduled: list[tuple[_Seq, int]], now: float) -> None:
        replica.busy = False
        self.num_busy -= 1
        for seq, n in scheduled:
            if seq.num_computed < seq.num_prompt:
                replica.queued_prompt -= n
            seq.num_computed += n
            replica.kv_held += n
            if seq.num_computed < seq.num_tokens:
                continue  # a prompt chunk that did not end the prompt
            seq.num_new += 1
            seq.num_tokens += 1
            if self.cpu_per_token_s:
                self.serving_work(now, self.cpu_per_token_s)
            result = seq.result
            if result.first_token_s is None:
                result.first_token_s = now
            result.last_token_s = now
            if seq.num_new >= seq.max_new:
                replica.finish(seq)
                if replica.is_prefill and result.request.output_tokens > 1:
                    self.push(now + self.fit.handoff.seconds(seq.num_prompt), _HANDOFF, result)
        self.kick(replica, now)

    def handoff(self, result: RequestResult, now: float) -> None:
        request = result.request
        replica = self.least_loaded(request, now)
        result.decode_replica = replica.rid
        replica.add(_Seq(result, request.prompt_tokens, request.prompt_tokens, request.output_tokens - 1, now))
        replica.kv_held += request.prompt_tokens  # the imported KV, written when it is admitted
        self.push(now, _KICK, replica)

    def arrive(self, result: RequestResult, now: float) -> None:
        request = result.request
        result.arrived_s = now
        if self.cpu_per_request_s:
            self.serving_work(now, self.cpu_per_request_s)
        if self.mode == "colocated":
            replica = self.least_loaded(request, now)
            result.decode_replica = replica.rid
            replica.add(_Seq(result, request.prompt_tokens, 0, request.output_tokens, now))
        else:
            replica = self.least_queued(request, now)
            result.prefill_replica = replica.rid
            replica.add(_Seq(result, request.prompt_tokens, 0, 1, now))
        # after every other arrival of this instant: the engine's next step sees them all
        self.push(now, _KICK, replica)


_ARRIVE, _STEP_DONE, _HANDOFF, _KICK, _STATS = 0, 1, 2, 3, 4


def simulate(requests: list[SimRequest], fit: CostFit, mode: str, *, num_prefill: int = 0, num_decode: int,
             router: str = "kvrelay", stats_period_s: float = STATS_PERIOD_S, foreign_cpu: float = 0.0,
             spare_cores: float = 0.0) -> SimRun:
    """Run `requests` through a colocated pool of `num_decode` workers, or a disaggregated one of
    `num_prefill` prefill and `num_decode` decode replicas. The worker and decode pools route by
    `router` (module docstring): "kvrelay" on routing stats taken every `stats_period_s` (0: on
    the replicas' state at each decision), or "least_loaded". `foreign_cpu`: cores that processes
    outside the served path took from the machine during the run (measured: load_tests/scenario/foreign_cpu.py),
    charged as the serving processes' background is. `spare_cores`: cores of the machine no
    replica runs on (the served probe's colocated layout: one worker on a two-core machine),
    which absorb the serving processes' load before the busy replicas' cores do."""
    assert router in ROUTERS, router
    assert mode in MODES, mode
    assert num_decode >= 1 and (mode == "colocated" or num_prefill >= 1), (mode, num_prefill, num_decode)
    prefill = [] if mode == "colocated" else [_Replica(i, fit, mode, is_prefill=True) for i in range(num_prefill)]
    decode = [_Replica(len(prefill) + i, fit, mode) for i in range(num_decode)]
    overhead = fit.overhead.of(mode)
    sim = _Sim(fit, mode, prefill, decode, router=router, cpu_per_token_s=overhead.cpu_per_token_s,
               cpu_per_request_s=overhead.cpu_per_request_s, background_cpu=overhead.background_cpu + foreign_cpu,
               spare_cores=spare_cores)
    request_s = overhead.request_s
    results = [RequestResult(r) for r in requests]
    for result in results:
        sim.push(result.request.arrival_s + request_s, _ARRIVE, result)
    if router == "kvrelay" and stats_period_s > 0:
        sim.push(min(r.arrival_s for r in requests), _STATS, None)
    else:
        sim.report_always = True
    while sim.events:
        now, _, kind, payload = heapq.heappop(sim.events)
        if kind == _ARRIVE:
            sim.arrive(payload, now)
        elif kind == _STEP_DONE:
            sim.step_done(payload[0], payload[1], now)
        elif kind == _HANDOFF:
            sim.handoff(payload, now)
        elif kind == _KICK:
            sim.kick(payload, now)
        else:  # every replica's routing stats; the next ones a period later while work remains
            for replica in sim.prefill + sim.decode:
                replica.report(now)
            if len(sim.events) > 0:
                sim.push(now + stats_period_s, _STATS, None)
    unfinished = [r for r in results if r.last_token_s is None]
    assert not unfinished, f"{len(unfinished)} requests never finished (a prompt larger than a replica's KV?)"
    start = min(r.arrival_s for r in requests)
    span = max(r.last_token_s for r in results) - start
    return SimRun(mode, len(prefill), len(decode), results, [r.busy_s for r in prefill + decode], span, sim.num_steps)


# ---- figures -------------------------------------------------------------------------------------
def _stats_ms(values_s: list[float]) -> dict:
    if not values_s:
        return {"mean": None, "p50": None, "p90": None, "p95": None, "p99": None}
    ms = [v * 1e3 for v in values_s]
    return {"mean": sum(ms) / len(ms), **{f"p{q}": percentile(ms, q) for q in (50, 90, 95, 99)}}


def attainment(results: list[RequestResult], ttft_ms: float, tpot_ms: float) -> float:
    """The fraction of requests meeting both bounds."""
    return sum(r.meets(ttft_ms, tpot_ms) for r in results) / len(results)


def summarize(run: SimRun, slos: dict[str, tuple[float, float]], *, kinds: set[str] | None = None) -> dict:
    """Latency percentiles of the requests of `kinds` (None: all); goodput and attainment at each
    named (ttft_ms, tpot_ms) SLO over all of them; utilisation per pool."""
    chosen = [r for r in run.results if kinds is None or r.request.kind in kinds]
    utilisation = [busy / run.span_s if run.span_s > 0 else 0.0 for busy in run.busy_s]
    prefill_u, decode_u = utilisation[:run.num_prefill], utilisation[run.num_prefill:]
    return {
        "num_requests": len(chosen),
        "ttft_ms": _stats_ms([r.ttft_s for r in chosen]),
        "tpot_ms": _stats_ms([t for r in chosen if (t := r.tpot_s) is not None]),
        "goodput": {name: sum(r.meets(*slo) for r in run.results) / run.span_s for name, slo in slos.items()},
        "attainment": {name: attainment(run.results, *slo) for name, slo in slos.items()},
        "span_s": run.span_s,
        "utilisation": {"prefill": sum(prefill_u) / len(prefill_u) if prefill_u else None,
                        "decode": sum(decode_u) / len(decode_u)},
        "num_steps": run.num_steps,
        "ttft_split_ms": ttft_split_ms(chosen),
    }


def ttft_split_ms(results: list[RequestResult]) -> dict[str, float | None]:
    """The mean TTFT of `results` split as the ingress splits a served one (request_path.py):
    overhead (the served path's request overhead: arrival -> the replica's queue), queue (-> its
    prompt's first chunk scheduled), prefill (-> its first token). The three sum to the mean TTFT."""
    if not results:
        return {"overhead": None, "queue": None, "prefill": None}
    n = len(results)
    return {"overhead": sum(r.arrived_s - r.request.arrival_s for r in results) / n * 1e3,
            "queue": sum(r.scheduled_s - r.arrived_s for r in results) / n * 1e3,
            "prefill": sum(r.first_token_s - r.scheduled_s for r in results) / n * 1e3}
