"""Schemathesis over the API's own OpenAPI document, shared by the ASGI run
(tests/serving/api/test_openapi_fuzz.py) and the one against the served app over HTTP
(tests/serving/deployments/test_app.py): whatever a client sends, never a 5xx, and every 4xx in
OpenAI's error shape."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

__all__ = ["fuzz", "openai_error_problem"]

ERROR_FIELDS = {"message": (str,), "type": (str,), "param": (str, type(None)), "code": (str, type(None))}


def openai_error_problem(body, also: frozenset[str] = frozenset()) -> str | None:
    """What keeps `body` from being exactly OpenAI's error shape, `{"error": {"message": str,
    "type": str, "param": str | None, "code": str | None}}` and nothing else (but the top-level
    keys `also`); None when it is."""
    if not isinstance(body, dict) or not {"error"} <= set(body) <= {"error", *also}:
        return f"keys {sorted(body) if isinstance(body, dict) else type(body).__name__}, not ['error']"
    error = body["error"]
    if not isinstance(error, dict) or set(error) != set(ERROR_FIELDS):
        return f"error keys {sorted(error) if isinstance(error, dict) else type(error).__name__}, not {sorted(ERROR_FIELDS)}"
    wrong = [name for name, kinds in ERROR_FIELDS.items() if not isinstance(error[name], kinds)]
    return f"wrong types of {wrong}" if wrong else None


def fuzz(schema, max_examples: int, **call_kwargs) -> tuple[list[str], dict[str, set[int]]]:
    """(failures, statuses seen per operation) of each operation's explicit examples (the request
    bodies the document shows clients: served, so the 200 side is always reached) and then
    `max_examples` derandomized generated cases per operation; `call_kwargs` go to `case.call` (a
    `base_url` for a served app).

    Generated cases alone reach a 200 by luck: hypothesis also draws strings from the constants
    of whatever modules are loaded, so the cases move with unrelated code and with test order."""
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}

    def send(case) -> None:
        if isinstance(case.body, dict) and case.body.get("max_tokens") is None and "max_completion_tokens" not in case.body:
            case.body["max_tokens"] = 4  # short generations: the limits are under test, not the model
        response = case.call(**call_kwargs)  # call_kwargs may carry a timeout (the HTTP run: a loaded machine is slow)
        statuses.setdefault(f"{case.method} {case.operation.path}", set()).add(response.status_code)
        if response.status_code >= 500 and not (case.operation.path == "/health" and response.status_code == 503):
            failures.append(f"{case.method} {case.path} {response.status_code}: {response.text[:200]} <- {case.body!r:.300}")
        elif 400 <= response.status_code < 500:
            body = response.json()
            # a 408 after some tokens also carries what was generated (serving/api/admission/deadlines.py)
            problem = openai_error_problem(body, frozenset({"partial"}) if response.status_code == 408 else frozenset())
            if problem:
                failures.append(f"{case.method} {case.path} {response.status_code} not OpenAI-shaped ({problem}): {body!r:.200}")

    def run(strategy, num_examples: int) -> None:
        settings(max_examples=num_examples, deadline=None, database=None, derandomize=True,
                 suppress_health_check=list(HealthCheck))(given(case=strategy)(send))()

    for result in schema.get_all_operations():
        operation = result.ok()
        for example in operation.get_strategies_from_examples():
            run(example, 1)
        run(operation.as_strategy(), max_examples)
    return failures, statuses
