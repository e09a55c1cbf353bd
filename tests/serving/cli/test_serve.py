"""`kvrelay serve` as `make serve` runs it, then `kvrelay chat` against it, then Ctrl-C."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from load_tests.local_ray import free_port
from tests.helpers import REPO

pytestmark = [pytest.mark.integration, pytest.mark.slow]

BIN = Path(sys.executable).parent


def test_serve_chat_and_stop(tmp_path, own_ray_tmpdir):
    port, dashboard_port = free_port(), free_port()
    log = tmp_path / "serve.log"
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVRELAY_") or k == "KVRELAY_CACHE_DIR"}
    env["KVRELAY_HTTP__PORT"] = str(port)
    env["RAY_TMPDIR"] = str(own_ray_tmpdir)
    with log.open("w") as out:
        proc = subprocess.Popen(
            # disaggregated whatever the cores (mode auto would pick colocated on CI's two): the
            # operations below act on the prefill and decode pools
            [BIN / "kvrelay", "serve", "--config", "deploy/local.yaml", "--set", f"ray.dashboard_port={dashboard_port}",
             "--set", "mode=disaggregated"],
            cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 300
        while "kvrelay: ready" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        text = log.read_text()
        assert f"OpenAI API      http://127.0.0.1:{port}/v1   (model: smollm2-135m-instruct)" in text
        assert "Ray dashboard   http://127.0.0.1:" in text

        body = {"messages": [{"role": "user", "content": "What is 2+2?"}], "max_tokens": 12, "temperature": 0}
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=120).json()
        content = reply["choices"][0]["message"]["content"]
        assert content and reply["usage"]["completion_tokens"] <= 12

        chat = subprocess.run(
            [BIN / "kvrelay", "chat", "What is 2+2?", "--url", f"http://127.0.0.1:{port}", "--max-tokens", "12", "--temperature", "0"],
            capture_output=True, text=True, timeout=120,
        )
        assert chat.returncode == 0, chat.stderr
        assert chat.stdout == content + "\n"
        assert "completion tokens]" in chat.stderr

        # Operations through the Ray dashboard's REST API (token authentication on).
        dashboard = ["--dashboard", f"http://127.0.0.1:{dashboard_port}"]
        status = subprocess.run([BIN / "kvrelay", "status", *dashboard, "--url", f"http://127.0.0.1:{port}"],
                                capture_output=True, text=True, timeout=60)
        assert status.returncode == 0, status.stderr
        lines = status.stdout.splitlines()
        assert lines[0] == "application kvrelay: RUNNING"
        assert lines[3].split()[:5] == ["prefill", "PrefillWorker", "HEALTHY", "1", "running"]
        assert lines[4].split()[:5] == ["decode", "DecodeWorker", "HEALTHY", "1", "running"]
        scaled = subprocess.run([BIN / "kvrelay", "scale", "ingress", "2", *dashboard], capture_output=True, text=True, timeout=60)
        assert scaled.returncode == 0 and scaled.stdout == "kvrelay: ingress -> 2 replicas requested\n", scaled.stderr

        def ingress_replicas():
            out = subprocess.run([BIN / "kvrelay", "status", *dashboard, "--url", "http://127.0.0.1:1"],
                                 capture_output=True, text=True, timeout=60).stdout
            row = next((line for line in out.splitlines() if line.startswith("ingress ")), "")
            return row.split()[:5]

        deadline = time.monotonic() + 180
        while ingress_replicas() != ["ingress", "OpenAIIngress", "HEALTHY", "2", "running"]:
            assert time.monotonic() < deadline, ingress_replicas()
            time.sleep(1)
        applied = subprocess.run([BIN / "kvrelay", "policy", "apply", "deploy/autoscaling/cluster.yaml", *dashboard],
                                 cwd=REPO, capture_output=True, text=True, timeout=60)
        assert applied.returncode == 0, applied.stderr
        deadline = time.monotonic() + 180
        while "[1..8]" not in subprocess.run([BIN / "kvrelay", "status", *dashboard], capture_output=True, text=True, timeout=60).stdout:
            assert time.monotonic() < deadline
            time.sleep(1)

        # A second `kvrelay serve` on the same port refuses clearly instead of half-starting.
        second = subprocess.run(
            [BIN / "kvrelay", "serve", "--config", "deploy/local.yaml"], cwd=REPO, env=env,
            capture_output=True, text=True, timeout=60,
        )
        assert second.returncode != 0
        assert f"127.0.0.1:{port} is already in use" in second.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=90)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    assert proc.returncode == 0, log.read_text()[-3000:]
    assert "kvrelay: stopping" in log.read_text()
    with socket.socket() as sock:  # the port is free again
        sock.bind(("127.0.0.1", port))
