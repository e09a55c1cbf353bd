"""Schemathesis over the API's own OpenAPI document, shared by the ASGI run
(tests/serving/api/test_openapi_fuzz.py) and the one against the served app over HTTP
(tests/serving/deployments/test_app.py): whatever a client sends, never a 5xx, and every 4xx in
OpenAI's error shape."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

__all__ = ["fuzz"]


def fuzz(schema, max_examples: int, **call_kwargs) -> tuple[list[str], dict[str, set[int]]]:
    """(failures, statuses seen per operation) of `max_examples` derandomized cases per operation;
    `call_kwargs` go to `case.call` (a `base_url` for a served app)."""
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()

        @settings(max_examples=max_examples, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
        @given(case=operation.as_strategy())
        def check(case):
            if isinstance(case.body, dict) and case.body.get("max_tokens") is None and "max_completion_tokens" not in case.body:
                case.body["max_tokens"] = 4  # short generations: the limits are under test, not the model
            response = case.call(**call_kwargs)  # call_kwargs may carry a timeout (the HTTP run: a loaded machine is slow)
            statuses.setdefault(f"{case.method} {case.operation.path}", set()).add(response.status_code)
            if response.status_code >= 500 and not (case.operation.path == "/health" and response.status_code == 503):
                failures.append(f"{case.method} {case.path} {response.status_code}: {response.text[:200]} <- {case.body!r:.300}")
            elif 400 <= response.status_code < 500:
                body = response.json()
                error = body.get("error") if isinstance(body, dict) else None
                if not isinstance(error, dict) or set(error) < {"message", "type", "param", "code"}:
                    failures.append(f"{case.method} {case.path} {response.status_code} not OpenAI-shaped: {body!r:.200}")

        check()
    return failures, statuses
