"""Property-based requests from the API's own OpenAPI document (schemathesis, over ASGI, against
the tiny model; test_app.py runs the same against the served app over HTTP): whatever a client sends, the answer is never a 5xx, and every 4xx is in OpenAI's
error shape."""

from __future__ import annotations

import pytest
import schemathesis

from serving.config import ServeConfig
from tests.asgi import local_app
from tests.openapi_fuzz import fuzz

MODEL = "tiny"
EXAMPLES_PER_OPERATION = 40


@pytest.fixture(scope="module")
def app(engine, tiny_model_dir):
    # Small output caps keep each generated request short; the limits are what is under test.
    config = ServeConfig(model=str(tiny_model_dir), served_model_name=MODEL, api={"default_max_tokens": 8})
    return local_app(engine, config, MODEL)


def test_the_document_describes_the_generation_and_tokenization_endpoints(app):
    schema = schemathesis.openapi.from_asgi("/openapi.json", app)
    operations = sorted(f"{op.ok().method.upper()} {op.ok().path}" for op in schema.get_all_operations())
    assert operations == [
        "GET /health", "GET /v1/models", "POST /detokenize", "POST /tokenize", "POST /v1/chat/completions", "POST /v1/completions",
        "POST /v1/responses",
    ]


def test_no_request_gets_a_5xx_and_every_4xx_is_openai_shaped(app):
    failures, statuses = fuzz(schemathesis.openapi.from_asgi("/openapi.json", app), EXAMPLES_PER_OPERATION)
    assert failures == []
    # The generator reached both sides of the generation and tokenization endpoints: served, and refused.
    for path in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /tokenize", "POST /detokenize"):
        assert 200 in statuses[path] and statuses[path] & {400, 422}, statuses
