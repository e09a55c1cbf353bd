"""Speculative decoding on the decode side of the prefill/decode split: a speculating engine that
imports a prefill engine's KV proposes and accepts from its first decode step on, with the tokens
a non-speculating engine decodes after the same import, and every block given back.

    prefill engine (no speculation) ── export_kv ──▶ KVPayload ──▶ decode engine, speculating
                                                              └──▶ decode engine, plain (the reference)

The proposer is test_speculative's oracle (right for the first j = len(tokens) % (k + 1) of its k
tokens), so the counts of proposed and accepted tokens are known exactly (oracle_counts).
"""

from __future__ import annotations

from serving.engine import SamplingParams
from serving.engine.kv.payload import KVPayload
from tests.serving.engine.test_engine import make_engine, random_prompts, tokens_of
from tests.serving.engine.test_speculative import SPEC, spec_engine

MAX_TOKENS = 30
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


def prefill_and_export(model_dir, prompts: list[list[int]]) -> tuple[list[KVPayload], list[list[int]]]:
    """What a prefill worker hands over: each prompt's KV and its first token."""
    prefill = make_engine(model_dir)
    for i, prompt in enumerate(prompts):
        prefill.add_request(f"r{i}", params=SamplingParams(temperature=0.0, max_tokens=1), prompt_token_ids=prompt,
                            hold_kv=True)
    firsts: dict[str, list[int]] = {}
    while prefill.has_unfinished_requests():
        firsts.update({o.request_id: o.outputs[0].token_ids for o in prefill.step() if o.finished})
    return [prefill.export_kv(f"r{i}") for i in range(len(prompts))], [firsts[f"r{i}"] for i in range(len(prompts))]


def decode_after_import(engine, prompts, payloads, firsts) -> list[list[int]]:
    """Each request's whole output (the prefill's first token, then this engine's), decoded in one batch."""
    for i, (prompt, payload, first) in enumerate(zip(prompts, payloads, firsts)):
        engine.add_request(f"r{i}", params=GREEDY, prompt_token_ids=prompt, kv_payload=payload,
                           prior_output_token_ids=first)
    outputs = {f"r{i}": list(first) for i, first in enumerate(firsts)}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs[out.request_id] += out.outputs[0].token_ids
    assert not engine.take_failures()
    return [outputs[f"r{i}"] for i in range(len(prompts))]


def oracle_counts(prompt_len: int, num_generated: int, k: int, max_tokens: int = MAX_TOKENS) -> tuple[int, int, int]:
    """(proposed, accepted, verify steps) of one sequence under the oracle from when it has
    `num_generated` tokens until `max_tokens`: each step proposes min(k, what fits before
    max_tokens less the model's own token), of which the first (prompt + generated) % (that + 1)
    are right; a step with no room for a proposal decodes one token."""
    proposed = accepted = steps = 0
    n = num_generated
    while n < max_tokens:
        room = min(k, max_tokens - n - 1)
        if room <= 0:
            n += 1
            continue
        right = (prompt_len + n) % (room + 1)  # the oracle asked for `room` tokens cycles over room + 1
        proposed, accepted, steps, n = proposed + room, accepted + right, steps + 1, n + right + 1
    return proposed, accepted, steps


def test_a_speculating_decode_engine_continues_an_imported_request_as_a_plain_one_does(tiny_model_dir):
    prompts = random_prompts([75, 41], seed=23)
    expected = tokens_of(make_engine(tiny_model_dir).generate(prompts, GREEDY))
    payloads, firsts = prefill_and_export(tiny_model_dir, prompts)

    plain = make_engine(tiny_model_dir)
    assert decode_after_import(plain, prompts, payloads, firsts) == expected
    spec = spec_engine(tiny_model_dir, truths=(prompts, expected))
    assert decode_after_import(spec, prompts, payloads, firsts) == expected

    # The first decode step computes the imported first token's KV and samples the second; the
    # proposals start after it, at two tokens generated.
    k = SPEC["num_speculative_tokens"]
    counts = [oracle_counts(len(prompt), 2, k) for prompt in prompts]
    stats = spec.stats()
    assert counts == [(44, 16, 12), (39, 18, 10)]
    assert (stats.spec_method, stats.spec_proposed_tokens, stats.spec_accepted_tokens, stats.spec_verify_steps) == (
        "oracle", 44 + 39, 16 + 18, 12 + 10)
    assert plain.stats().spec_verify_steps == 0
    # Computed here: each first decode step's row (the imported first token), then per verify
    # step the sequence's last token and its proposals; never a prompt token. Plain: a row per token.
    assert stats.num_computed_tokens == 2 + (12 + 10) + (44 + 39) == 107
    assert plain.stats().num_computed_tokens == 2 * (MAX_TOKENS - 1)
    # Every block given back (rejected proposals' included).
    assert stats.num_free_blocks == stats.num_blocks and plain.stats().num_free_blocks == plain.stats().num_blocks
