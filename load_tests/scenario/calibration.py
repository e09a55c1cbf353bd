"""Scenario loads set from this machine's measured rates, so a scenario means the same anywhere.

The machine changes between runs (an AVX2-only EPYC, an AVX-512 EPYC, a Xeon with AMX: prefill
rates 4-10x apart). A fixed request rate that loads one machine to 90% leaves another idle, and
then `pd-interference` measures nothing. So the scenario first measures, in-process, what one
replica does on one core (`measure_rates`: the engine as served, one thread, the scenario's dtype),
then derives its load from a stated utilisation of the colocated baseline (`calibrate_*`):

    one replica, one core:      prefill  P tok/s (a probe_len-token prompt), and the time T(L) of
                                         one LONG_PROBE_LEN-token prompt: with the probe's, it fits
                                         t(n) = a n + b n^2 (attention grows with the square)
                                decode   S(b) s per step at batch b  ->  S(b)/b s per token

    pd-interference (2 cores colocated, one Worker each):
        long prompts            one burst = LONG_PREFILL_S of one core's prefill:
                                  burst_len  = min(the n with t(n) = LONG_PREFILL_S, the context's room)
                                  burst_size = ceil(LONG_PREFILL_S / t(burst_len)) (1 when it fits)
        work, core-seconds      chat  w_c = in/P + out * S(b)/b        burst  w_b = size * (t(len) + out * S(b)/b)
        load                    UTILISATION of the 2 cores, BURST_SHARE of it long prompts:
                                  chat rate   = UTILISATION * 2 * (1 - BURST_SHARE) / w_c
                                  burst every = w_b / (UTILISATION * 2 * BURST_SHARE)
                                  requests    = chat rate * DURATION_S

    prefix-routing (2 prefill replicas, a core each): every request's prompt uncached costs
        (prefix + suffix)/P; the rate puts the pool at UTILISATION when nothing is cached (pow2
        at its worst), so what the router saves shows as queueing it avoids.

Everything measured and derived goes into the scenario's JSON under `calibration`.

Why the long probe: a prompt's prefill is linear in its length only while attention is small
against the matrix products. Where those are fast (AMX: a 1024-token prompt at 1,859 tokens/s) the
burst the linear rule sized was 7,438 tokens, whose prefill took several times the 4 s it was
counted at, and every pd-interference run there was overloaded: long prompts waited 37-67 s
(2026-11-29).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

from load_tests.roofline import torch_threads

__all__ = [
    "MachineRates", "measure_rates", "calibrate_pd", "calibrate_prefix", "UTILISATION", "BURST_SHARE",
    "LONG_PREFILL_S", "DURATION_S",
]

UTILISATION = 0.6  # of the colocated baseline's two cores
BURST_SHARE = 0.4  # of that load, the long prompts' part
LONG_PREFILL_S = 4.0  # one burst's prefill on one core
DURATION_S = 90.0  # of the chat stream
DECODE_BATCH = 4  # the decode batch the per-token cost is taken at (chat streams in flight per replica)
LONG_PROBE_LEN = 4096  # the second prefill probe (module docstring)


@dataclass(frozen=True)
class MachineRates:
    prefill_tokens_per_s: float  # one replica, one thread: a probe_len-token prompt
    decode_step_s: dict[int, float]  # batch size -> seconds per decode step, one thread
    probe_len: int
    dtype: str
    long_probe: tuple[int, float] | None = None  # (tokens, seconds) of one longer prompt's prefill

    def decode_s_per_token(self, batch: int = DECODE_BATCH) -> float:
        return self.decode_step_s[batch] / batch

    def _prefill_terms(self) -> tuple[float, float]:
        """(a, b) of t(n) = a n + b n^2 through both probes; b = 0 (linear) without the long one,
        or if it was not slower per token."""
        a = 1.0 / self.prefill_tokens_per_s
        if self.long_probe is None:
            return a, 0.0
        length, seconds = self.long_probe
        assert length > self.probe_len, (length, self.probe_len)
        b = (seconds / length - a) / (length - self.probe_len)
        return (a, 0.0) if b <= 0 else (a - b * self.probe_len, b)

    def prefill_s(self, tokens: float) -> float:
        """One prompt's prefill on one core, seconds."""
        a, b = self._prefill_terms()
        return a * tokens + b * tokens * tokens

    def tokens_prefilled_in(self, seconds: float) -> float:
        """The prompt length whose prefill takes `seconds` (the inverse of prefill_s)."""
        a, b = self._prefill_terms()
        return seconds / a if b == 0 else (math.sqrt(a * a + 4 * b * seconds) - a) / (2 * b)

    def to_json(self) -> dict:
        out = {"prefill_tokens_per_s": round(self.prefill_tokens_per_s, 1),
               "decode_step_ms": {str(b): round(s * 1000, 2) for b, s in self.decode_step_s.items()},
               "probe_len": self.probe_len, "dtype": self.dtype, "threads": 1}
        if self.long_probe is not None:
            out["long_probe"] = {"tokens": self.long_probe[0], "prefill_s": round(self.long_probe[1], 3)}
        return out


def measure_rates(model_dir: Path, dtype: str, *, probe_len: int = 1024, long_probe_len: int = LONG_PROBE_LEN,
                  batches: tuple[int, ...] = (1, DECODE_BATCH), decode_steps: int = 32, chat_len: int = 128) -> MachineRates:
    """One thread, as a served replica runs: prefill of a probe_len and a long_probe_len prompt,
    and decode steps at each batch size (timed as the difference of generating 1 + decode_steps
    tokens and 1)."""
    import torch

    from serving.engine import EngineConfig, LLMEngine, SamplingParams

    with torch_threads(1):
        engine = LLMEngine(EngineConfig(
            model=str(model_dir), dtype=dtype, kv_cache_bytes=512 * 2**20, enable_prefix_caching=False,
        ))
        vocab = engine.spec.vocab_size
        gen = torch.Generator().manual_seed(0)

        def prompts(n: int, length: int) -> list[list[int]]:
            return [torch.randint(100, vocab, (length,), generator=gen).tolist() for _ in range(n)]

        def timed(batch: list[list[int]], max_tokens: int) -> float:
            params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
            started = time.perf_counter()
            engine.generate(batch, params)
            return time.perf_counter() - started

        timed(prompts(1, 64), 4)  # warm-up: kernels, allocator
        prefill_s = min(timed(prompts(1, probe_len), 1) for _ in range(2))
        long_len = min(long_probe_len, engine.max_model_len - 1)  # a short context: no second probe
        long_probe = (long_len, min(timed(prompts(1, long_len), 1) for _ in range(2))) if long_len > probe_len else None
        steps = {}
        for b in batches:
            first = min(timed(prompts(b, chat_len), 1) for _ in range(2))
            whole = min(timed(prompts(b, chat_len), 1 + decode_steps) for _ in range(2))
            steps[b] = max(whole - first, 1e-6) / decode_steps
    return MachineRates(probe_len / prefill_s, steps, probe_len, dtype, long_probe=long_probe)


def _mean_len(spec: str) -> float:
    low, _, high = spec.partition("-")
    return (float(low) + float(high or low)) / 2


def calibrate_pd(w, rates: MachineRates, *, max_model_len: int) -> tuple[object, dict]:
    """pd-interference's workload `w` (a BenchParams) with its load set from `rates`."""
    out_len = _mean_len(w.output_len)
    long_tokens = round(rates.tokens_prefilled_in(LONG_PREFILL_S))
    room = max_model_len - w.burst_output_len - 16  # the chat template's tokens
    burst_len = min(long_tokens, room)
    burst_size = 1 if burst_len == long_tokens else math.ceil(LONG_PREFILL_S / rates.prefill_s(burst_len))
    per_token = rates.decode_s_per_token()
    chat_work = _mean_len(w.input_len) / rates.prefill_tokens_per_s + out_len * per_token
    burst_work = burst_size * (rates.prefill_s(burst_len) + w.burst_output_len * per_token)
    capacity = UTILISATION * 2.0
    chat_rate = capacity * (1.0 - BURST_SHARE) / chat_work
    burst_every = burst_work / (capacity * BURST_SHARE)
    calibrated = dataclasses.replace(
        w, request_rates=(round(chat_rate, 3),), num_prompts=max(8, round(chat_rate * DURATION_S)),
        burst_len=burst_len, burst_size=burst_size, burst_every_s=round(burst_every, 2),
    )
    return calibrated, {
        "rates": rates.to_json(), "utilisation": UTILISATION, "burst_share": BURST_SHARE,
        "long_prefill_s": LONG_PREFILL_S, "duration_s": DURATION_S, "decode_batch": DECODE_BATCH,
        "chat_work_core_s": round(chat_work, 4), "burst_work_core_s": round(burst_work, 3),
        "request_rate": calibrated.request_rates[0], "num_prompts": calibrated.num_prompts,
        "burst_len": burst_len, "burst_size": burst_size, "burst_every_s": calibrated.burst_every_s,
    }


def calibrate_prefix(w, rates: MachineRates, *, num_replicas: int = 2) -> tuple[object, dict]:
    """prefix-routing's workload `w` with the rate that loads the prefill pool to UTILISATION when
    no prompt is cached."""
    uncached_work = (w.prefix_len + w.suffix_len) / rates.prefill_tokens_per_s
    rate = UTILISATION * num_replicas / uncached_work
    calibrated = dataclasses.replace(w, request_rates=(round(rate, 3),))
    return calibrated, {
        "rates": rates.to_json(), "utilisation": UTILISATION, "num_prefill_replicas": num_replicas,
        "uncached_work_core_s": round(uncached_work, 4), "request_rate": calibrated.request_rates[0],
    }
