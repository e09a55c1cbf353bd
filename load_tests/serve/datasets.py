"""Workloads of `kvrelay bench serve`, as text so that any OpenAI-compatible server takes them.

    random         N requests; prompt and output lengths drawn from `LengthDist`s
    shared-prefix  G groups, each a prefix of P tokens; every request = its group's prefix + a
                   fresh suffix of S tokens (groups taken round robin, so each holds N/G)
    multi-turn     sessions of T turns; turn k is sent with turns 0..k-1 and their answers before
                   it, so a session's prompt grows by (user turn + answer) tokens per turn
    chat-burst     a steady stream of short chat requests (on the arrival process) plus, every
                   `burst_every_s` seconds, `burst_size` long prompts arriving together

Prompt text is random words drawn from a list of short common English words. BPE tokenizers
(Llama, SmolLM2, GPT) encode each such word, with its leading space, as one token, so a prompt of
n words is about n tokens (plus the chat template's own); the server's count comes back in
`usage.prompt_tokens` and is what the throughput figures use. `--endpoint completions` with
`token_ids_vocab` sends random token ids (exact lengths) instead of text.
"""

from __future__ import annotations

import math

import numpy as np

from load_tests.serve.client import RequestSpec
from load_tests.serve.params import DATASETS, LengthDist, parse_length

__all__ = [
    "DATASETS", "LengthDist", "arrival_times", "chat_burst", "multi_turn", "parse_length",
    "random_dataset", "random_text", "shared_prefix",
]


_WORDS = [
    "the", "of", "and", "to", "in", "is", "it", "you", "that", "he", "was", "for", "on", "are", "as",
    "with", "his", "they", "at", "be", "this", "have", "from", "or", "one", "had", "by", "word", "but",
    "not", "what", "all", "were", "we", "when", "your", "can", "said", "there", "use", "an", "each",
    "which", "she", "do", "how", "their", "if", "will", "up", "other", "about", "out", "many", "then",
    "them", "these", "so", "some", "her", "would", "make", "like", "him", "into", "time", "has", "look",
    "two", "more", "write", "go", "see", "number", "no", "way", "could", "people", "my", "than",
    "first", "water", "been", "call", "who", "oil", "its", "now", "find", "long", "down", "day", "did",
    "get", "come", "made", "may", "part", "over", "new", "sound", "take", "only", "little", "work",
    "know", "place", "year", "live", "me", "back", "give", "most", "very", "after", "thing", "our",
    "just", "name", "good", "sentence", "man", "think", "say", "great", "where", "help", "through",
    "much", "before", "line", "right", "too", "mean", "old", "any", "same", "tell", "boy", "follow",
    "came", "want", "show", "also", "around", "form", "three", "small", "set", "put", "end", "does",
    "another", "well", "large", "must", "big", "even", "such", "because", "turn", "here", "why", "ask",
    "went", "men", "read", "need", "land", "different", "home", "us", "move", "try", "kind", "hand",
    "picture", "again", "change", "off", "play", "spell", "air", "away", "animal", "house", "point",
    "page", "letter", "mother", "answer", "found", "study", "still", "learn", "should", "world", "high",
    "every", "near", "add", "food", "between", "own", "below", "country", "plant", "last", "school",
    "father", "keep", "tree", "never", "start", "city", "earth", "eye", "light", "thought", "head",
    "under", "story", "saw", "left", "few", "while", "along", "might", "close", "something", "seem",
    "next", "hard", "open", "example", "begin", "life", "always", "those", "both", "paper", "together",
    "got", "group", "often", "run", "important", "until", "children", "side", "feet", "car", "mile",
    "night", "walk", "white", "sea",
]


def random_text(rng: np.random.Generator, num_tokens: int) -> str:
    return " ".join(rng.choice(_WORDS, num_tokens).tolist())


def _user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def random_dataset(
    num_prompts: int, input_len: LengthDist, output_len: LengthDist, *, seed: int = 0,
    token_ids_vocab: int | None = None,
) -> list[RequestSpec]:
    rng = np.random.default_rng([seed, 1])
    inputs, outputs = input_len.sample(rng, num_prompts), output_len.sample(rng, num_prompts)
    specs = []
    for i, (n_in, n_out) in enumerate(zip(inputs, outputs)):
        if token_ids_vocab:  # ids from 100 up stay clear of the special tokens at the bottom
            specs.append(RequestSpec(i, n_out, prompt=rng.integers(100, token_ids_vocab, n_in).tolist(),
                                     approx_prompt_tokens=n_in, kind="random"))
        else:
            specs.append(RequestSpec(i, n_out, messages=_user(random_text(rng, n_in)), approx_prompt_tokens=n_in,
                                     kind="random"))
    return specs


def shared_prefix(
    num_prompts: int, num_groups: int, prefix_len: int, suffix_len: int, output_len: LengthDist, *, seed: int = 0,
) -> list[RequestSpec]:
    rng = np.random.default_rng([seed, 2])
    prefixes = [random_text(rng, prefix_len) for _ in range(num_groups)]
    outputs = output_len.sample(rng, num_prompts)
    return [
        RequestSpec(
            i, outputs[i], messages=_user(f"{prefixes[i % num_groups]} {random_text(rng, suffix_len)}"),
            approx_prompt_tokens=prefix_len + suffix_len, kind=f"group{i % num_groups}",
        )
        for i in range(num_prompts)
    ]


def multi_turn(
    num_sessions: int, num_turns: int, turn_len: LengthDist, output_len: LengthDist, *, seed: int = 0,
) -> list[RequestSpec]:
    """Turns in round-robin order over sessions (turn 0 of every session, then turn 1, ...), so
    sessions interleave; the load generator holds a turn until its session's previous answer is in."""
    rng = np.random.default_rng([seed, 3])
    specs = []
    approx = [0] * num_sessions
    for turn in range(num_turns):
        for session in range(num_sessions):
            n_in, n_out = turn_len.sample(rng, 1)[0], output_len.sample(rng, 1)[0]
            approx[session] += n_in
            specs.append(RequestSpec(
                len(specs), n_out, messages=_user(random_text(rng, n_in)), approx_prompt_tokens=approx[session],
                session_id=session, turn=turn, kind="turn",
            ))
            approx[session] += n_out  # the answer joins the next turn's prompt
    return specs


def chat_burst(
    num_prompts: int, chat_len: LengthDist, output_len: LengthDist, *, request_rate: float, burst_every_s: float,
    burst_size: int, burst_len: int, burst_output_len: int, seed: int = 0,
) -> list[RequestSpec]:
    """The chat requests have no arrival time (the arrival process gives them one); the long
    prompts arrive at burst_every_s, 2 x burst_every_s, ... while the stream lasts
    (num_prompts / request_rate seconds)."""
    rng = np.random.default_rng([seed, 4])
    specs = random_dataset(num_prompts, chat_len, output_len, seed=seed)
    for spec in specs:
        spec.kind = "chat"
    stream_s = num_prompts / request_rate
    at = burst_every_s
    while at < stream_s:
        for _ in range(burst_size):
            specs.append(RequestSpec(
                len(specs), burst_output_len, messages=_user(random_text(rng, burst_len)),
                approx_prompt_tokens=burst_len, arrival_s=at, kind="long",
            ))
        at += burst_every_s
    return specs


def arrival_times(num: int, request_rate: float, burstiness: float = 1.0, *, seed: int = 0) -> list[float]:
    """Send times from 0: the first request at 0, then gamma-distributed gaps with mean
    1/request_rate and shape `burstiness` (1: Poisson; < 1 burstier; > 1 more even, as in vLLM's
    benchmark). An infinite rate sends everything at 0."""
    if num == 0:
        return []
    if math.isinf(request_rate):
        return [0.0] * num
    assert request_rate > 0 and burstiness > 0, (request_rate, burstiness)
    rng = np.random.default_rng([seed, 5])
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=num - 1)
    return [0.0, *np.cumsum(gaps).tolist()]
