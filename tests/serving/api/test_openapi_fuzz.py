"""Property-based requests from the API's own OpenAPI document (schemathesis, over ASGI, against
the tiny model): whatever a client sends, the answer is never a 5xx, and every 4xx is in OpenAI's
error shape."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from serving.api.pipeline import Frontend
from serving.api.routes import OpenAIServer
from serving.config import ServeConfig
from serving.deployments.local_backend import LocalBackend

MODEL = "tiny"
EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def app(engine, tiny_model_dir):
    # Small output caps keep each generated request short; the limits are what is under test.
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, api={"default_max_tokens": 8})
    return OpenAIServer(Frontend(engine.tokenizer, LocalBackend(engine), MODEL), config).build_app()


def test_the_document_describes_the_generation_endpoints(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = sorted(f"{op.ok().method.upper()} {op.ok().path}" for op in schema.get_all_operations())
    assert operations == ["GET /health", "GET /v1/models", "POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses"]


def test_no_request_gets_a_5xx_and_every_4xx_is_openai_shaped(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=EXAMPLES_PER_OPERATION, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict) and case.body.get("max_tokens") is None and "max_completion_tokens" not in case.body:
                case.body["max_tokens"] = 4
            response = case.call()
            statuses.setdefault(f"{case.method} {case.operation.path}", set()).add(response.status_code)
            if response.status_code >= 500 and not (case.operation.path == "/health" and response.status_code == 503):
                failures.append(f"{case.method} {case.path} {response.status_code}: {response.text[:200]} <- {case.body!r:.300}")
            elif 400 <= response.status_code < 500:
                body = response.json()
                error = body.get("error") if isinstance(body, dict) else None
                if not isinstance(error, dict) or set(error) < {"message", "type", "param", "code"}:
                    failures.append(f"{case.method} {case.path} {response.status_code} not OpenAI-shaped: {body!r:.200}")

        check()
    assert failures == []
    # The generator reached both sides of the generation endpoints: served, and refused.
    for path in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses"):
        assert 200 in statuses[path] and statuses[path] & {400, 422}, statuses
