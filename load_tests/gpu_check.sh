#!/usr/bin/env bash
# The engine's CUDA checks, for a lent GPU machine (device tool), in one call:
#   tests/serving/engine/test_cuda.py, then `kvrelay bench engine --lora` on CUDA with a random-weight
#   model of the default model's shape (the weights do not travel; its config and tokenizer do).
# Needs .gpu/tok: the converted default model's directory without model.safetensors; and .whl: the
# wheels of pydantic, pydantic-core, annotated-types and typing-inspection for Python 3.12 (the
# machine's python3 has torch with CUDA, transformers, peft, safetensors and pytest, not pydantic):
#   device run: bash load_tests/gpu_check.sh   carry: .gpu .whl
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD:/tmp/site KVRELAY_TEST_TOKENIZER_DIR=$PWD/.gpu/tok KVRELAY_CACHE_DIR=/tmp/kvrelay-cache
OUT=${OUT:-/tmp/gpu-out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
printf '[pytest]\nmarkers =\n    gpu: needs CUDA\n    slow: slow\n    integration: ray\n' > /tmp/gpu-pytest.ini
timeout 240 python3 -m pytest -c /tmp/gpu-pytest.ini --rootdir="$PWD" -p no:cacheprovider -q -ra \
    tests/serving/engine/test_cuda.py 2>&1 | tee "$OUT/pytest.log" | tail -40
python3 - <<'PY'
import torch
from transformers import AutoConfig, AutoModelForCausalLM
import shutil, pathlib
config = AutoConfig.from_pretrained(".gpu/tok")
torch.manual_seed(0)
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
out = pathlib.Path("/tmp/smollm2-shape")
model.save_pretrained(out)
for f in pathlib.Path(".gpu/tok").iterdir():
    if not (out / f.name).exists():
        shutil.copy(f, out / f.name)
print("random-weight model of the default model's shape in", out)
PY
timeout 150 python3 -c "
import json, sys
from load_tests.engine import lora as b
r = b.run(b.LoRAParams(model='/tmp/smollm2-shape', dtype='bfloat16', device='cuda', output_len=64, repeats=3), command='gpu_check')
json.dump(r, open('$OUT/lora-cuda.json', 'w'), indent=1)
" 2>&1 | tail -12
