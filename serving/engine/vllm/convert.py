"""kvrelay's types as vLLM's and back: SamplingParams out (deltas, structured outputs), logprobs
in (the sampled token's and the top alternatives, prompt logprobs with their ranks).

    SamplingParams   vllm.SamplingParams with deltas out (output_kind DELTA); `guided` ->
                     StructuredOutputsParams; top_k 0 -> vLLM's 0 (off); greedy with n > 1
                     (which vLLM refuses) asked once, its choices copied (VLLMEngine.generate)
    logprobs         vLLM's {token id: Logprob} per position -> TokenLogprob
"""

from __future__ import annotations

import json
import logging

from serving.engine.outputs import TokenLogprob
from serving.engine.params import SamplingParams

__all__ = ["is_greedy", "logprobs", "prompt_logprobs", "vllm_sampling_params"]

logger = logging.getLogger(__name__)


def vllm_sampling_params(params: SamplingParams, kv_transfer_params: dict | None = None):
    """kvrelay's SamplingParams as vLLM's, deltas out. Greedy with n > 1 (which vLLM refuses) is
    asked of vLLM once: its choices are all the same (VLLMEngine.generate copies it). A hand-off
    rides in `kv_transfer_params` (vllm_connector.HandoffSpec)."""
    from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
    from vllm.sampling_params import SamplingParams as VSamplingParams

    structured = None
    guided = params.guided
    if guided is not None:
        structured = {
            # compact JSON, as kvrelay's grammars give (params.GuidedSpec)
            "json_schema": lambda v: StructuredOutputsParams(json=v, disable_any_whitespace=True),
            "json_object": lambda v: StructuredOutputsParams(json_object=True, disable_any_whitespace=True),
            "regex": lambda v: StructuredOutputsParams(regex=v),
            "choice": lambda v: StructuredOutputsParams(choice=json.loads(v)),
            "grammar": lambda v: StructuredOutputsParams(grammar=v),
        }[guided.kind](guided.value)
    return VSamplingParams(
        n=1 if is_greedy(params) else params.n, max_tokens=params.max_tokens, min_tokens=params.min_tokens, temperature=params.temperature,
        top_p=params.top_p, top_k=max(params.top_k, 0), min_p=params.min_p,
        repetition_penalty=params.repetition_penalty, presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty, logit_bias=dict(params.logit_bias) if params.logit_bias else None,
        seed=params.seed, logprobs=params.logprobs, prompt_logprobs=params.prompt_logprobs,
        stop=list(params.stop) or None, stop_token_ids=list(params.stop_token_ids) or None,
        include_stop_str_in_output=params.include_stop_str_in_output, ignore_eos=params.ignore_eos,
        skip_special_tokens=params.skip_special_tokens, detokenize=params.detokenize,
        structured_outputs=structured, output_kind=RequestOutputKind.DELTA,
        extra_args={"kv_transfer_params": kv_transfer_params} if kv_transfer_params else None,
    )


# vLLM samples greedily below this temperature (and refuses n > 1 there)
_GREEDY_TEMPERATURE = 1e-5


def is_greedy(params: SamplingParams) -> bool:
    return params.temperature < _GREEDY_TEMPERATURE


def _token_logprob(token_id: int, entry, k: int, *, with_rank: bool = False) -> TokenLogprob:
    """One of vLLM's {token id: Logprob} as kvrelay's TokenLogprob: the token's logprob (its rank
    too, when asked) and the `k` most likely by rank (the token is in vLLM's dict whatever its rank)."""
    chosen = entry.get(token_id)
    top = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None and 0 < lp.rank <= k), key=lambda x: x[1].rank)
    logprob = chosen.logprob if chosen is not None else float("-inf")
    rank = chosen.rank if with_rank and chosen is not None else None
    return TokenLogprob(token_id, logprob, [(t, lp.logprob) for t, lp in top], rank)


def prompt_logprobs(prompt: list[int], entries, k: int | None) -> list[TokenLogprob] | None:
    """vLLM's prompt logprobs (None for the first token, then one entry each) as kvrelay's: the
    logprob of prompt token i + 1 at index i, with its rank and the top `k`."""
    if entries is None or k is None:
        return None
    return [_token_logprob(t, entry, k, with_rank=True) for t, entry in zip(prompt[1:], entries[1:])]


def logprobs(token_ids, entries, k: int) -> list[TokenLogprob] | None:
    """vLLM's per-token logprobs as kvrelay's: each sampled token's, and the top `k`."""
    if entries is None:
        return None
    return [_token_logprob(t, entry, k) for t, entry in zip(token_ids, entries)]
