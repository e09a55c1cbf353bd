"""Workloads of the prefill/decode simulator: a stream of requests (Poisson arrivals, uniform
prompt and output lengths) with, in some mixes, bursts of long prompts; and the exact workload of
a measured `kvrelay bench scenario pd-interference` run, replayed from its JSON.

The mixes (`MIXES`) are choices, not data: lengths stay within 2048 tokens of context so both
cost fits can serve them (OPT-13B's window is 2048).

    chat          prompts 64-512, outputs 64-256
    chat-bursts   chat, and 5% of the requests long prompts (1536-1920 -> 32-64) arriving in
                  bursts of one per two replicas of the pool (as pd-interference: one long
                  prompt at a time on two cores)
    long-prompt   prompts 1024-1920, outputs 32-128 (summarisation, RAG)
    long-output   prompts 64-256, outputs 256-1024 (generation)

`generate` draws the lengths and unit-rate arrival times from the seed alone and divides the
times by the rate, so runs of one mix at different rates hold the same requests in the same
order (a search over the rate sees the rate, not a new draw).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from load_tests.pd.sim import SimRequest

__all__ = ["Lengths", "Mix", "MIXES", "generate", "scenario_requests"]


@dataclass(frozen=True)
class Lengths:
    low: int
    high: int

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def draw(self, rng: np.random.Generator, n: int) -> list[int]:
        return rng.integers(self.low, self.high + 1, n).tolist()


@dataclass(frozen=True)
class Mix:
    name: str
    prompt: Lengths
    output: Lengths
    long_share: float = 0.0  # of the requests: long prompts, in bursts
    long_prompt: Lengths | None = None
    long_output: Lengths | None = None
    burst_per_replica: float = 0.5  # long prompts per burst, per replica of the pool

    def mean_prompt(self) -> float:
        mean = self.prompt.mean * (1 - self.long_share)
        return mean + (self.long_prompt.mean * self.long_share if self.long_prompt else 0.0)

    def mean_output(self) -> float:
        mean = self.output.mean * (1 - self.long_share)
        return mean + (self.long_output.mean * self.long_share if self.long_output else 0.0)


MIXES = {
    "chat": Mix("chat", Lengths(64, 512), Lengths(64, 256)),
    "chat-bursts": Mix("chat-bursts", Lengths(64, 512), Lengths(64, 256), long_share=0.05,
                       long_prompt=Lengths(1536, 1920), long_output=Lengths(32, 64)),
    "long-prompt": Mix("long-prompt", Lengths(1024, 1920), Lengths(32, 128)),
    "long-output": Mix("long-output", Lengths(64, 256), Lengths(256, 1024)),
}


def generate(mix: Mix, num_requests: int, rate_per_s: float, *, num_replicas: int, seed: int = 0) -> list[SimRequest]:
    """`num_requests` of `mix` at `rate_per_s` in all: the stream's requests Poisson, the long
    prompts in bursts of ceil(burst_per_replica * num_replicas) evenly spaced over the stream."""
    rng = np.random.default_rng([seed, 4])
    num_long = round(num_requests * mix.long_share) if mix.long_prompt else 0
    num_chat = num_requests - num_long
    chat_rate = rate_per_s * (1 - mix.long_share) if num_long else rate_per_s
    gaps = rng.exponential(1.0, num_chat)
    times = (np.cumsum(gaps) - gaps[0]) / chat_rate  # the first request at t = 0
    prompts, outputs = mix.prompt.draw(rng, num_chat), mix.output.draw(rng, num_chat)
    requests = [(float(t), p, o, "chat") for t, p, o in zip(times, prompts, outputs)]
    if num_long:
        size = max(1, math.ceil(mix.burst_per_replica * num_replicas))
        num_bursts = max(1, round(num_long / size))
        every_s = size / (rate_per_s * mix.long_share)
        long_prompts, long_outputs = mix.long_prompt.draw(rng, num_long), mix.long_output.draw(rng, num_long)
        for i in range(num_long):
            burst = min(i // size, num_bursts - 1)
            requests.append(((burst + 0.5) * every_s, long_prompts[i], long_outputs[i], "long"))
    requests.sort(key=lambda r: r[0])
    return [SimRequest(i, t, p, o, kind) for i, (t, p, o, kind) in enumerate(requests)]


def scenario_requests(report: dict | str | Path, run: str) -> list[SimRequest]:
    """The requests of one run ("disaggregated/burst", ...) of a pd-interference JSON: each at
    its scheduled send time, with the prompt and output tokens the server reported."""
    if not isinstance(report, dict):
        report = json.loads(Path(report).read_text())
    records = report["raw"]["runs"][run]["records"]
    return [SimRequest(r["request_id"], r["scheduled_s"], r["num_prompt_tokens"], r["num_output_tokens"], r["kind"])
            for r in sorted(records, key=lambda r: r["scheduled_s"]) if r["is_success"]]
