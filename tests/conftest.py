"""Shared fixtures: tiny random Llama-family models built on the fly, and the default model.

Also the suite's hygiene, so a test passes on a fresh machine whatever ran before it:

- `pytest_configure`: Ray's default temp root (`$RAY_TMPDIR/ray`) is a short directory of this
  session's own under the system temp dir, created here; token authentication is on for every
  Ray of the session (`RAY_AUTH_MODE=token`). Ray writes there even when a
  node gets `temp_dir=` (the address file of `ray.cluster_utils.Cluster`), and a fresh machine has
  none. Each fixture that starts Ray still passes its own `_temp_dir` as well, and a test that
  starts Ray in a subprocess gives it `RAY_TMPDIR` = `own_ray_tmpdir`.
- `_no_leaks` (module, autouse): after a module's fixtures are torn down, the environment, the
  working directory and Ray's connection are as they were before it; a leak fails the module's
  last test, naming what leaked.
- random order (pytest-randomly, its seed in the header): a module with integration tests keeps
  its file order; under CI a skip off tests/ci_skips.py's allow-list fails the run; the summary
  names the kernel paths this CPU left untested (tests/kernel_paths.py) and, after an interrupt,
  the test that was running.

Plain helpers (tiny-model builder, free ports, waiting, required tools) are in tests/helpers.py.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
import torch

from cluster.launcher import PROXY_MAX_RESPONSE_BYTES, PROXY_READY_CHECK_TIMEOUT_S
from serving.engine.modeling.loader import resolve_model_dir
from tests import kernel_paths
from tests.ci_skips import SkipGate
from tests.helpers import build_tiny_model, process_state, state_changes

pytest_plugins = ["pytester"]  # tests/test_helpers.py runs the suite's own plugins on small suites


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The built-in SmolLM2 converted to safetensors (converted once, then cached)."""
    return resolve_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def needs_vllm() -> None:
    """vLLM importable (`make test` runs its tests in .venv-vllm); elsewhere the test skips,
    saying why, and under CI (which must run them) it fails."""
    try:
        import vllm  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the vLLM engine's tests, but vLLM cannot be imported here: {exc}")
        pytest.skip(f"vLLM is not installed here ({exc}); `make test` runs these in .venv-vllm")


@pytest.fixture(scope="session")
def tokenizer_dir(request) -> Path:
    """Where tiny models take their tokenizer: `$KVRELAY_TEST_TOKENIZER_DIR` when set (a GPU machine
    that has the default model's tokenizer files but not its weights: load_tests/gpu_check.sh),
    else the default model's directory."""
    given = os.environ.get("KVRELAY_TEST_TOKENIZER_DIR")
    return Path(given) if given else request.getfixturevalue("default_model_dir")


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir) -> Path:
    """A 2-layer GQA Llama with untied embeddings."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-llama"), tokenizer_dir)


@pytest.fixture(scope="session")
def tiny_fallback_model_dir(tmp_path_factory, default_model_dir) -> Path:
    """Another tiny model (seed 7) with a chat template of its own and a shorter context (512):
    what graceful degradation falls back on, different enough that an answer shows who made it
    and whose template tokenized its prompt."""
    out = build_tiny_model(tmp_path_factory.mktemp("tiny-fallback"), default_model_dir, seed=7)
    (out / "chat_template.jinja").write_text(
        "{% for message in messages %}[{{ message['role'] }}] {{ message['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}[assistant] {% endif %}"
    )
    tokenizer_config = out / "tokenizer_config.json"
    if tokenizer_config.exists():  # a template there would win over the file
        tokenizer_config.write_text(json.dumps({k: v for k, v in json.loads(tokenizer_config.read_text()).items() if k != "chat_template"}))
    config = out / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "max_position_embeddings": 512}))
    return out


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Around pytest-randomly's shuffle (its wrapper is tryfirst too; a conftest registers after
    it, so this one is the outer: it sees the file order first and has the last word): a module
    with integration tests keeps its tests in file order (they share one cluster and may build on
    each other), in the place the shuffle gave the module; every other test runs in the random
    order. Without CUDA the gpu tests skip."""
    file_order = {item.nodeid: i for i, item in enumerate(items)}
    result = yield
    ordered = {item.module.__name__ for item in items if "integration" in item.keywords and getattr(item, "module", None)}
    for name in ordered:
        places = [i for i, item in enumerate(items) if getattr(item, "module", None) and item.module.__name__ == name]
        in_file_order = sorted((items[i] for i in places), key=lambda item: file_order[item.nodeid])
        for place, item in zip(places, in_file_order):
            items[place] = item
    if not torch.cuda.is_available():
        skip = pytest.mark.skip(reason="needs CUDA")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
    return result


_RUNNING: dict[str, str | None] = {"nodeid": None, "interrupted": None}


def pytest_runtest_logstart(nodeid, location):
    _RUNNING["nodeid"] = nodeid


def pytest_runtest_logfinish(nodeid, location):
    _RUNNING["nodeid"] = None


def pytest_keyboard_interrupt(excinfo):
    _RUNNING["interrupted"] = _RUNNING["nodeid"]


def pytest_terminal_summary(terminalreporter):
    """The kernel paths this CPU let the tests run (tests/kernel_paths.py), and on an interrupt
    (.ci/run's time bound sends SIGINT) the test that was running, on a line `make test` repeats."""
    line = kernel_paths.summary_line()
    if line:
        terminalreporter.write_line(line)
    if _RUNNING["interrupted"]:
        terminalreporter.write_line(f"INTERRUPTED {_RUNNING['interrupted']} (running when the run was stopped)")


@pytest.fixture(autouse=True, scope="module")
def _torch_threads_per_module():
    """torch's thread count is the process's: an in-process engine built with num_threads=1 (the
    API tests' engines) left every later module of the run on one thread, and the engine tests
    after them ran up to 1.5x slower in the suite than alone (the bf16 placement check: 62 s
    against 42). Each module ends by putting back the count it started with."""
    before = torch.get_num_threads()
    yield
    if torch.get_num_threads() != before:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def tokenizer(default_model_dir):
    """The default model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model_dir))


# ---- hygiene ---------------------------------------------------------------------------------
_SESSION_ENV: dict[str, str | None] = {}  # the values pytest_configure replaced, put back at the end


def pytest_configure(config):
    """Before any test module is imported (one that touches Ray's C++ side fixes its auth mode for
    the process), the session's Ray settings:

    - its temp root (`$RAY_TMPDIR/ray`): a new, short directory directly under the system temp dir,
      not under an inherited RAY_TMPDIR (CI's is a path nothing created, /tmp/kvrelay-ci.XXXXXX/
      raytmp): Ray's socket paths live under it and AF_UNIX paths stop at 107 bytes;
    - token authentication on and usage stats off, what a local ray.init() would set for good, so
      every Ray of the session (local, simulated cluster, subprocess) runs the same way whatever
      order the modules run in: Ray's C++ side keeps the mode it first saw;
    - Serve's proxy on gRPC to the ingress, 30 s for a proxy to start and any response size it
      reads, as `kvrelay serve` runs it (cluster/launcher.py): Ray's 5 s is not enough while the
      vLLM venv builds beside the suite (`serve.start` then fails on the proxy its controller
      killed), and its 4 MiB made a larger response a 500.
    """
    config.pluginmanager.register(SkipGate(ci=bool(os.environ.get("CI"))), "kvrelay-ci-skips")
    root = Path(tempfile.mkdtemp(prefix="kvt-"))
    (root / "ray").mkdir()
    config.kvrelay_ray_root = root
    # Serve's proxy reaches the ingress over gRPC, as in a Ray kvrelay starts (ray.grpc_transport)
    env = {"RAY_TMPDIR": str(root), "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "RAY_SERVE_PROXY_USE_GRPC": "1",
           "RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S": str(PROXY_READY_CHECK_TIMEOUT_S),
           "RAY_SERVE_REPLICA_GRPC_MAX_MESSAGE_LENGTH": str(PROXY_MAX_RESPONSE_BYTES)}
    for key, value in env.items():
        _SESSION_ENV[key] = os.environ.get(key)
        os.environ[key] = value


def pytest_unconfigure(config):
    for key, value in _SESSION_ENV.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    root = getattr(config, "kvrelay_ray_root", None)
    if root is not None:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="session")
def _ray_temp_root(pytestconfig) -> Path:
    return pytestconfig.kvrelay_ray_root / "ray"


@pytest.fixture
def own_ray_tmpdir(_ray_temp_root) -> Path:
    """A `RAY_TMPDIR` of this test's own (its `ray` root created), for a Ray it starts in a subprocess."""
    path = Path(tempfile.mkdtemp(prefix="t-", dir=_ray_temp_root.parent))
    (path / "ray").mkdir()
    return path


@pytest.fixture(scope="module", autouse=True)
def _no_leaks(_ray_temp_root):
    before = process_state()
    yield
    changes = state_changes(before, process_state())
    if "Ray connected" in "".join(changes):  # a fixture failed before its teardown: the next module's ray.init must not fail too
        import ray

        ray.shutdown()
    assert not changes, "this module's tests or fixtures left process state behind: " + "; ".join(changes)
