"""The requests of `kvrelay bench soak`: a seeded mix of what real clients send and how they leave.

Each request draws its features independently from one seeded generator, so the same seed and
count give the same requests in the same order (a failing run can be replayed):

    feature          share (default)   what it exercises
    stream           stream_fraction   SSE path, the first token before the KV hand-off
    n > 1            n_fraction        several choices, prefilled on the decode pool
    stop strings     stop_fraction     stop strings spanning tokens and the hand-off
    shared prefix    prefix_fraction   one of `num_prefix_groups` long system prompts: prefix cache
    long prompt      long_fraction     `long_prompt_len` words: chunked prefill, big KV transfers
    completions      completions_fraction   /v1/completions instead of /v1/chat/completions
    sampling         sampled_fraction  temperature 0.8 instead of greedy
    client abort     abort_fraction    the client leaves at one of the points below

    abort point          how the client leaves
    before_first_token   closes the connection `abort_after_s` after sending (streamed; the
                         ingress answers headers with the first token, so it is still waiting);
                         if the first token comes earlier, it leaves right then
    hand_off             right after the first content chunk: the prefill worker has answered and
                         the decode worker is claiming the KV (streamed)
    mid_stream           after `abort_after_chunks` content chunks (streamed)
    non_stream           a non-streamed request abandoned `abort_after_s` after sending

Prompt text is random common words (load_tests/serve/datasets.py: about one token each).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import numpy as np

from load_tests.serve.datasets import random_text

__all__ = ["AbortPoint", "SoakRequest", "WorkloadMix", "build_workload", "STOP_STRINGS"]

# Frequent in English text, so greedy answers do hit them; "\n" ends many chat answers.
STOP_STRINGS = (".", ",", "\n", " the", " and", "!")


class AbortPoint(enum.Enum):
    NONE = "none"
    BEFORE_FIRST_TOKEN = "before_first_token"
    HAND_OFF = "hand_off"
    MID_STREAM = "mid_stream"
    NON_STREAM = "non_stream"

    @property
    def is_streamed(self) -> bool:
        return self in (AbortPoint.BEFORE_FIRST_TOKEN, AbortPoint.HAND_OFF, AbortPoint.MID_STREAM)


@dataclass(frozen=True)
class WorkloadMix:
    """The shares and sizes of the mix; every share is drawn per request, independently."""

    stream_fraction: float = 0.5
    n_fraction: float = 0.1
    max_n: int = 3
    stop_fraction: float = 0.2
    prefix_fraction: float = 0.3
    num_prefix_groups: int = 8
    prefix_len: int = 256  # words of a shared system prompt
    long_fraction: float = 0.1
    long_prompt_len: tuple[int, int] = (1024, 1536)  # words, inclusive
    prompt_len: tuple[int, int] = (16, 128)  # words of an ordinary prompt (or a prefix's suffix)
    max_tokens: tuple[int, int] = (8, 64)
    completions_fraction: float = 0.2
    sampled_fraction: float = 0.3
    abort_fraction: float = 0.1
    # Among aborted requests: before_first_token, hand_off, mid_stream, non_stream.
    abort_weights: tuple[float, float, float, float] = (0.3, 0.3, 0.3, 0.1)
    max_abort_after_s: float = 1.0  # before_first_token / non_stream: uniform in [0, this]


@dataclass(frozen=True)
class SoakRequest:
    request_id: int
    path: str  # "/v1/chat/completions" or "/v1/completions"
    body: dict
    features: tuple[str, ...]  # "stream", "n>1", "stop", "shared_prefix", "long", "completions", "sampled"
    abort: AbortPoint = AbortPoint.NONE
    abort_after_s: float = 0.0  # before_first_token, non_stream
    abort_after_chunks: int = 0  # mid_stream

    @property
    def is_streamed(self) -> bool:
        return bool(self.body.get("stream"))

    @property
    def n(self) -> int:
        return int(self.body.get("n", 1))

    @property
    def stop(self) -> tuple[str, ...]:
        return tuple(self.body.get("stop") or ())

    def to_json(self) -> dict:
        return {
            "request_id": self.request_id, "path": self.path, "features": list(self.features),
            "abort": self.abort.value, "abort_after_s": self.abort_after_s, "abort_after_chunks": self.abort_after_chunks,
            "n": self.n, "max_tokens": self.body["max_tokens"], "stop": list(self.stop),
        }


def _between(rng: np.random.Generator, bounds: tuple[int, int]) -> int:
    return int(rng.integers(bounds[0], bounds[1] + 1))


def build_workload(num_requests: int, mix: WorkloadMix, *, model: str, seed: int = 0) -> list[SoakRequest]:
    """`num_requests` requests, the same ones for the same (mix, seed)."""
    rng = np.random.default_rng([seed, 14])
    prefixes = [random_text(rng, mix.prefix_len) for _ in range(mix.num_prefix_groups)]
    requests = []
    for i in range(num_requests):
        features: list[str] = []
        abort = AbortPoint.NONE
        if rng.random() < mix.abort_fraction:
            points = (AbortPoint.BEFORE_FIRST_TOKEN, AbortPoint.HAND_OFF, AbortPoint.MID_STREAM, AbortPoint.NON_STREAM)
            weights = np.asarray(mix.abort_weights, dtype=float)
            abort = points[int(rng.choice(len(points), p=weights / weights.sum()))]
            is_streamed = abort.is_streamed
        else:
            is_streamed = bool(rng.random() < mix.stream_fraction)
        is_completions = bool(rng.random() < mix.completions_fraction)
        max_tokens = _between(rng, mix.max_tokens)
        if abort is AbortPoint.MID_STREAM:
            max_tokens = max(max_tokens, 4)  # room to leave after 2 .. max_tokens - 1 chunks
        body: dict = {"model": model, "max_tokens": max_tokens, "stream": is_streamed}
        if is_streamed:
            features.append("stream")
            body["stream_options"] = {"include_usage": True}
        if rng.random() < mix.n_fraction:
            body["n"] = int(rng.integers(2, mix.max_n + 1))
            features.append("n>1")
        if rng.random() < mix.stop_fraction:
            body["stop"] = [str(s) for s in rng.choice(STOP_STRINGS, int(rng.integers(1, 3)), replace=False)]
            features.append("stop")
        if rng.random() < mix.sampled_fraction:
            body["temperature"] = 0.8
            features.append("sampled")
        else:
            body["temperature"] = 0.0
        prefix = None
        if rng.random() < mix.long_fraction:
            text = random_text(rng, _between(rng, mix.long_prompt_len))
            features.append("long")
        else:
            text = random_text(rng, _between(rng, mix.prompt_len))
        if rng.random() < mix.prefix_fraction:
            prefix = prefixes[int(rng.integers(len(prefixes)))]
            features.append("shared_prefix")
        if is_completions:
            features.append("completions")
            body["prompt"] = text if prefix is None else f"{prefix}\n{text}"
            path = "/v1/completions"
        else:
            body["messages"] = ([{"role": "system", "content": prefix}] if prefix else []) + [{"role": "user", "content": text}]
            path = "/v1/chat/completions"
        abort_after_s = float(rng.uniform(0.0, mix.max_abort_after_s))
        abort_after_chunks = int(rng.integers(2, max_tokens)) if abort is AbortPoint.MID_STREAM else 0
        requests.append(SoakRequest(
            i, path, body, tuple(features), abort,
            abort_after_s if abort in (AbortPoint.BEFORE_FIRST_TOKEN, AbortPoint.NON_STREAM) else 0.0,
            abort_after_chunks,
        ))
    return requests
