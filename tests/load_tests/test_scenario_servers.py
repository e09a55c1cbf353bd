"""load_tests/scenario/servers.py: a server counts as ready when the path it is asked about
answers 200 (kvrelay's /health: every pool has a live replica, which its /v1/models does not say)."""

from __future__ import annotations

import http.server
import threading

import pytest

from load_tests.scenario.servers import ScenarioError, wait_ready


@pytest.fixture
def server():
    """A server whose /v1/models always answers 200 and whose /health answers 503 twice, then 200."""
    health = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            if self.path == "/health":
                health.append(self.path)
                status = 503 if len(health) <= 2 else 200
            else:
                status = 200 if self.path == "/v1/models" else 404
            self.send_response(status)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}", health
    httpd.shutdown()
    httpd.server_close()


def test_ready_waits_for_the_path_asked_about(server):
    base_url, health = server
    assert wait_ready(base_url, timeout_s=10.0) < 1.0 and health == []
    wait_ready(base_url, timeout_s=10.0, path="/health")
    assert len(health) == 3  # two 503s, then ready


def test_a_server_that_exits_before_it_is_ready_is_named(server):
    base_url, _ = server
    with pytest.raises(ScenarioError, match="exited before it was ready: gone"):
        wait_ready(base_url, timeout_s=10.0, path="/health", is_alive=lambda: False, describe=lambda: ": gone")
