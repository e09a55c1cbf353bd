"""What one engine step costs, for the prefill/decode simulator (load_tests/pd/sim.py): a step-time
model fitted to measured costs, the KV hand-off's delay, the serving path's overheads, and two fits.

A step computes chunks of prompts and one token for each decoding row, as kvrelay's scheduler
forms it (serving/engine/scheduler.py). Its time is

    step_s = max over lines (base_s + token_s * tokens + row_s * rows)      the weights' work
             + pair_s * pairs + context_s * context + prefix_s * prefix     attention

    tokens   every token the step computes: the prompt chunks' tokens + one per decoding row
    rows     the sequences that sample a token: decoding rows + chunks that end their prompt
    pairs    the prompt chunks' causal attention pairs: a chunk of n tokens after k computed
             ones reads n * k + n * (n + 1) / 2 query-key pairs
    context  the decoding rows' context lengths, summed (the KV tokens each row reads)
    prefix   the prompt chunks' computed tokens, summed (the KV each chunk gathers from the cache
             before its attention, whatever its length: a short chunk after a long prompt pays it
             whole, which pairs alone, n * k, charge in proportion to n)

The max over lines is a roofline: on a GPU a small step is bound by reading the weights (a line
with a high base and a small per-row cost) and a large one by compute (a low base, a per-token
cost); one line is a plain linear model. A step that mixes prompt chunks with decoding rows
pays for both in one pass: that is the interference the colocated layout suffers.

The two fits (`CostFit`):

    cpu   this machine's engine (serving.engine, one torch thread, as a served replica runs),
          fitted by `fit_step_cost` to steps timed by load_tests/pd/probe.py; the hand-off and
          serving overheads measured on this machine too (the probe's JSON says which run)
    gpu   published figures, nothing measured here:
          - steps: DistServe's profile of OPT-13B on one A100-80GB (its simulator's fitted
            coefficients, LLMServe/DistServe simdistserve/estimators/profile_data/
            profiler-a100-80g.distserve.json at commit 4c68ed95, 2024-05-01; DistServe, OSDI 2024):
              prefill_ms = 18.103 + 0.10191 * sum(tokens) + 7.1223e-6 * sum(tokens^2)
              decode_ms  = 19.935 + 0.00062694 * sum(context) + 0.038507 * batch   (batch < 95)
                           7.1662 + 0.00057980 * sum(context) + 0.15831 * batch    (batch >= 95)
            as three lines: prefill (base 18.103 ms, 0.10191 - 7.12e-6 ms per token,
            pair_s = 2 * 7.12e-6 ms, so a whole prompt costs exactly DistServe's prefill), and
            the two decode fits (per row); context_s = 0.00062694 ms (the small-batch fit's;
            the large-batch one is 8% lower)
          - KV hand-off: NCCL send/recv between two A100s on different DGX nodes as Vidur
            measured it (microsoft/vidur data/profiling/network/a100_dgx/send_recv.csv, commit
            e26eb8f7): 0.024 ms for 2 KiB, 8.586 ms for 64 MiB, so 0.024 ms + bytes / 7.84 GB/s;
            OPT-13B's fp16 KV is 2 * 40 layers * 5120 * 2 bytes = 819,200 bytes per token
          - assumed, not published: a chunked step (prompt chunks and decoding rows in one pass,
            which DistServe's engine never runs) costs the max of the three lines plus attention,
            and a chunk after k computed tokens pays the same per-pair cost as a whole prompt;
            no serving overhead (ServeOverhead all 0); KV capacity 60,000 tokens
            (80 GB less 26 GB of fp16 weights, 0.8 MB per token, ~10% kept free: our assumption)
"""

from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field

import numpy as np

__all__ = [
    "CostFit", "CostLine", "HandoffCost", "LayoutOverhead", "ServeOverhead", "StepCost", "StepPoint", "StepShape",
    "chunk_pairs", "fit_step_cost", "gpu_fit", "FITS_WITHOUT_MEASUREMENT",
]


def chunk_pairs(num_new: int, num_computed: int) -> int:
    """Causal attention query-key pairs of a chunk of `num_new` tokens after `num_computed`."""
    return num_new * num_computed + num_new * (num_new + 1) // 2


@dataclass(frozen=True)
class StepShape:
    """What one step computes (see the module docstring)."""

    num_tokens: int
    num_rows: int
    num_pairs: int = 0
    num_context: int = 0
    num_prefix: int = 0


@dataclass(frozen=True)
class CostLine:
    base_s: float
    token_s: float = 0.0
    row_s: float = 0.0

    def seconds(self, num_tokens: int, num_rows: int) -> float:
        return self.base_s + self.token_s * num_tokens + self.row_s * num_rows


@dataclass(frozen=True)
class StepCost:
    lines: tuple[CostLine, ...]
    pair_s: float = 0.0
    context_s: float = 0.0
    prefix_s: float = 0.0

    def __post_init__(self):
        assert self.lines, "a step cost needs at least one line"

    def step_s(self, num_tokens: int, num_rows: int, num_pairs: int = 0, num_context: int = 0, num_prefix: int = 0) -> float:
        work = max(line.seconds(num_tokens, num_rows) for line in self.lines)
        return work + self.pair_s * num_pairs + self.context_s * num_context + self.prefix_s * num_prefix

    def shape_s(self, shape: StepShape) -> float:
        return self.step_s(shape.num_tokens, shape.num_rows, shape.num_pairs, shape.num_context, shape.num_prefix)

    def prefill_s(self, num_tokens: int) -> float:
        """One whole prompt alone in one step (no budget)."""
        return self.step_s(num_tokens, 1, chunk_pairs(num_tokens, 0))

    def decode_s(self, batch: int, context: int) -> float:
        """A step of `batch` decoding rows of `context` tokens each."""
        return self.step_s(batch, batch, 0, batch * context)


@dataclass(frozen=True)
class HandoffCost:
    """A prompt's KV from a prefill replica to a decode replica: fixed_s + tokens * bytes / rate."""

    fixed_s: float
    bytes_per_token: float
    bytes_per_s: float

    def seconds(self, num_tokens: int) -> float:
        return self.fixed_s + num_tokens * self.bytes_per_token / self.bytes_per_s


@dataclass(frozen=True)
class LayoutOverhead:
    """What the served path adds to the engine in one layout:

    request_s            to every request's first token (HTTP, ingress, routing; disaggregated:
                         the prefill call and placing the decode call too)
    step_s, row_s        to every step of a served replica, + row_s per sampled row (its step
                         loop, turning each token into a stream on the replica's own core)
    cpu_per_request_s,   CPU the other serving processes (proxy, ingress, controller, client)
    cpu_per_token_s,     spend per request, per streamed token and per second, on the cores the
    background_cpu       replicas run on: pd_sim charges it to the busy replicas (0 where the
                         replicas have cores of their own, as on a GPU host)
    prefill_request_s    disaggregated: the prefill replica's own CPU per request beyond its
                         engine steps (the call, the KV export, the first token's reply), on
                         its core: pd_sim adds it to the step that admits the request
    """

    request_s: float = 0.0
    step_s: float = 0.0
    row_s: float = 0.0
    cpu_per_request_s: float = 0.0
    cpu_per_token_s: float = 0.0
    background_cpu: float = 0.0
    prefill_request_s: float = 0.0


@dataclass(frozen=True)
class ServeOverhead:
    colocated: LayoutOverhead = LayoutOverhead()
    disaggregated: LayoutOverhead = LayoutOverhead()

    def of(self, mode: str) -> LayoutOverhead:
        return self.colocated if mode == "colocated" else self.disaggregated


@dataclass(frozen=True)
class CostFit:
    name: str
    step: StepCost
    handoff: HandoffCost
    overhead: ServeOverhead = ServeOverhead()
    max_num_batched_tokens: int = 512  # the served engine defaults (serving/config/sections.py)
    long_prefill_token_threshold: int = 256
    max_num_seqs: int = 128
    kv_capacity_tokens: int = 1_000_000
    # Seconds a step takes longer when it starts while another replica's core runs a decode step
    # of corun_ref_s (load_tests/pd/corun.py measures both): on one CPU the replicas' weights
    # stream through one memory system and last-level cache. Beside a longer step, which reads
    # the weights less often, proportionally less (pd_sim). 0 where replicas share no memory (the
    # GPU fits: a device each).
    corun_s: float = 0.0
    corun_ref_s: float = 0.02
    source: str = ""
    assumptions: tuple[str, ...] = ()
    info: dict = field(default_factory=dict)  # the fit's points, residuals, the machine

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict) -> CostFit:
        step = data["step"]
        return cls(
            name=data["name"],
            step=StepCost(tuple(CostLine(**line) for line in step["lines"]), step["pair_s"], step["context_s"],
                          step.get("prefix_s", 0.0)),  # fits before the prefix term had none
            handoff=HandoffCost(**data["handoff"]),
            overhead=ServeOverhead(**{mode: LayoutOverhead(**v) for mode, v in data["overhead"].items()}),
            max_num_batched_tokens=data["max_num_batched_tokens"],
            long_prefill_token_threshold=data["long_prefill_token_threshold"],
            max_num_seqs=data["max_num_seqs"], kv_capacity_tokens=data["kv_capacity_tokens"],
            corun_s=data.get("corun_s", 0.0), corun_ref_s=data.get("corun_ref_s", cls.corun_ref_s),  # fits before the co-run probe had none
            source=data.get("source", ""), assumptions=tuple(data.get("assumptions", ())), info=dict(data.get("info", {})),
        )


# ---- fitting measured steps --------------------------------------------------------------------
@dataclass(frozen=True)
class StepPoint:
    shape: StepShape
    seconds: float


_FEATURES = ("base_s", "token_s", "row_s", "pair_s", "context_s", "prefix_s")


def fit_step_cost(points: list[StepPoint]) -> tuple[StepCost, dict]:
    """One-line StepCost by least squares of the relative error over `points` with every
    coefficient >= 0: the best of the fits on each subset of the six features whose coefficients
    all come out >= 0. Relative, because a decode step of 15 ms and a prefill step of 700 ms
    matter alike to the simulator (TPOT is made of the one, TTFT of the other): fitted on
    absolute seconds, the long steps took the fit, and a 1-row decode step was modelled 36% short
    (9.0 ms against 14.1 measured, 2026-12-02), which was most of colocated TPOT's gap in
    pd-interference. Returns the cost and {"rms_s", "rms_rel_error", "max_rel_error", "num_points"}."""
    if len(points) < len(_FEATURES):
        raise ValueError(f"the fit needs at least {len(_FEATURES)} steps, got {len(points)}")
    design = np.array([[1.0, p.shape.num_tokens, p.shape.num_rows, p.shape.num_pairs, p.shape.num_context, p.shape.num_prefix]
                       for p in points])
    seconds = np.array([p.seconds for p in points])
    weight = 1.0 / seconds
    design, target = design * weight[:, None], np.ones_like(seconds)  # (model - s) / s = design w . coef - 1
    best: tuple[float, dict[int, float]] | None = None
    for size in range(len(_FEATURES), 0, -1):
        for columns in itertools.combinations(range(len(_FEATURES)), size):
            coef, *_ = np.linalg.lstsq(design[:, columns], target, rcond=None)
            if (coef < 0).any():
                continue
            residual = float(((design[:, columns] @ coef - target) ** 2).sum())
            if best is None or residual < best[0] - 1e-18:
                best = (residual, dict(zip(columns, coef.tolist())))
    assert best is not None, "some single feature always fits with a coefficient >= 0"
    c = {name: best[1].get(i, 0.0) for i, name in enumerate(_FEATURES)}
    cost = StepCost((CostLine(c["base_s"], c["token_s"], c["row_s"]),), c["pair_s"], c["context_s"], c["prefix_s"])
    predicted = np.array([cost.shape_s(p.shape) for p in points])
    quality = {
        "rms_s": float(np.sqrt(((predicted - seconds) ** 2).mean())),
        "rms_rel_error": float(np.sqrt((((predicted - seconds) / seconds) ** 2).mean())),
        "max_rel_error": float((np.abs(predicted - seconds) / seconds).max()),
        "num_points": len(points),
    }
    return cost, quality


# ---- the published GPU fit -----------------------------------------------------------------------
_MS = 1e-3
# DistServe, profiler-a100-80g.distserve.json, "facebook/opt-13b", tensor parallel 1 (milliseconds)
DISTSERVE_OPT13B_A100 = {
    "prefill": (18.10254647486372, 0.1019122572698738, 7.122264314252114e-06),
    "decoding_smallbs": (19.934702624895458, 0.0006269356524350583, 0.03850697740828398),
    "decoding_largebs": (7.1661889468253595, 0.0005798000403396046, 0.15831096191764046),
}
# Vidur, a100_dgx/send_recv.csv, one device per node (across nodes): (bytes, median ms)
VIDUR_A100_INTERNODE_SEND_RECV = ((2048, 0.024), (67108864, 8.586))
OPT13B_KV_BYTES_PER_TOKEN = 2 * 40 * 5120 * 2


def gpu_fit() -> CostFit:
    """OPT-13B on A100-80GB from DistServe's published profile, KV hand-off from Vidur's
    measured A100 inter-node send/recv (module docstring)."""
    a_p, b_p, c_p = DISTSERVE_OPT13B_A100["prefill"]
    a_s, ctx_s, row_small = DISTSERVE_OPT13B_A100["decoding_smallbs"]
    a_l, _ctx_l, row_large = DISTSERVE_OPT13B_A100["decoding_largebs"]
    (small_bytes, small_ms), (big_bytes, big_ms) = VIDUR_A100_INTERNODE_SEND_RECV
    bytes_per_s = (big_bytes - small_bytes) / ((big_ms - small_ms) * _MS)
    step = StepCost(
        (CostLine(a_p * _MS, (b_p - c_p) * _MS), CostLine(a_s * _MS, row_s=row_small * _MS),
         CostLine(a_l * _MS, row_s=row_large * _MS)),
        pair_s=2 * c_p * _MS, context_s=ctx_s * _MS,
    )
    return CostFit(
        name="gpu", step=step,
        handoff=HandoffCost(small_ms * _MS, OPT13B_KV_BYTES_PER_TOKEN, bytes_per_s),
        kv_capacity_tokens=60_000,
        source="OPT-13B on one A100-80GB: DistServe's profile (LLMServe/DistServe simdistserve/estimators/"
        "profile_data/profiler-a100-80g.distserve.json @4c68ed95); KV hand-off: Vidur's A100 inter-node "
        "NCCL send/recv (microsoft/vidur data/profiling/network/a100_dgx/send_recv.csv @e26eb8f7)",
        assumptions=(
            "a chunked step (prompt chunks and decoding rows in one pass) costs the max of DistServe's prefill "
            "and two decode lines plus attention",
            "a prompt chunk after k computed tokens pays DistServe's per-pair prefill cost for its n*k + n(n+1)/2 pairs",
            "no serving-path overhead",
            "KV capacity 60,000 tokens per replica (80 GB - 26 GB weights, 0.8 MB/token, ~10% free)",
        ),
        info={"kv_bytes_per_s": bytes_per_s},
    )


FITS_WITHOUT_MEASUREMENT = {"gpu": gpu_fit}
