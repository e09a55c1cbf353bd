"""Client libraries nobody here wrote, against the default model served as `make serve` serves it,
disaggregated and colocated: the official `openai` SDK (structured outputs and tool calls),
`langchain-openai` (tool binding and `with_structured_output`), `instructor` (JSON schema and
tools modes) and a `pydantic-ai` agent that calls a tool and answers with its result.

One Ray and one Serve instance for the module, with two apps of SmolLM2-135M-Instruct:
    /disagg   prefill + decode pools
    /coloc    one Worker pool
What every library gets is guaranteed by constrained decoding, not by the model's skill: a
135M model does not choose tools well, so the checks are on shape and validity (every output
parses and validates against its schema), and greedy streamed and non-streamed tool calls are
the same calls. Schemas bound their strings and numbers: JSON allows a number of any length, and
a small model left a free number writes digits until max_tokens (finish_reason "length").
"""

from __future__ import annotations

import json
from typing import Literal

import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from load_tests.local_ray import free_port
from tests.helpers import streamed_tool_calls, tiny_app_config

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2-135m-instruct"
APPS = ["disagg", "coloc"]
MAX_TOKENS = 96


class City(BaseModel):
    name: str = Field(max_length=24)
    country: str = Field(max_length=24)
    population_millions: int = Field(ge=0, le=50)  # bounded: an unbounded JSON number is valid at any length


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather", "description": "The current weather in a city.",
        "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 24}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
            "required": ["city", "unit"], "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time", "description": "The local time in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


@pytest.fixture(scope="module")
def served(tmp_path_factory, default_model_dir):
    import ray
    from ray import serve

    from serving.deployments.app import build_app

    ray.init(num_cpus=8, include_dashboard=False, logging_level="WARNING", _temp_dir=str(tmp_path_factory.mktemp("ray")))
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    configs = {}
    for name in APPS:
        configs[name] = tiny_app_config(
            default_model_dir, name, served_model_name=MODEL, mode="disaggregated" if name == "disagg" else "colocated",
            engine={"dtype": "float32", "kv_cache_bytes": 96 * 2**20, "num_threads": 1},
        )
        serve.run(build_app(configs[name]), name=name, route_prefix=f"/{name}")
    yield {name: f"http://127.0.0.1:{port}/{name}" for name in APPS}
    from serving.deployments import kv_transfer

    for name in configs:
        kv_transfer.kill_all(name)
    serve.shutdown()
    ray.shutdown()


def sdk(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300)


# ---- the openai SDK ----------------------------------------------------------------------------
@pytest.mark.parametrize("app", APPS)
def test_openai_sdk_structured_outputs_parse_and_validate(served, app):
    client = sdk(served[app])
    parsed = client.chat.completions.parse(
        model=MODEL, messages=[{"role": "user", "content": "Describe Paris as JSON."}], response_format=City,
        temperature=0, max_tokens=MAX_TOKENS,
    )
    assert parsed.choices[0].finish_reason == "stop"
    assert isinstance(parsed.choices[0].message.parsed, City)

    schema = City.model_json_schema()
    sampled = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Name a big city."}], n=8, temperature=1.0, seed=7,
        max_tokens=MAX_TOKENS, response_format={"type": "json_schema", "json_schema": {"name": "city", "schema": schema, "strict": True}},
    )
    assert [c.finish_reason for c in sampled.choices] == ["stop"] * 8
    for choice in sampled.choices:
        jsonschema.validate(json.loads(choice.message.content), schema)

    # JSON mode has no schema to bound it: a prompt that says what to write (the model's own
    # choice of length is not what is tested), then the output is a JSON object.
    anything = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Reply with a JSON object with the keys name and age for Alice, 30."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=MAX_TOKENS,
    )
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].message.content), dict)


@pytest.mark.parametrize("app", APPS)
@pytest.mark.parametrize("choice", ["named", "required"])
def test_openai_sdk_forced_tool_calls_are_valid_and_stream_the_same(served, app, choice):
    client = sdk(served[app])
    tool_choice = {"type": "function", "function": {"name": "get_weather"}} if choice == "named" else "required"
    # One call: with parallel calls allowed, `required` lets a small model add calls until
    # max_tokens (tests/serving/api/test_tool_routes.py covers parallel calls on the tiny model).
    kwargs = dict(model=MODEL, messages=ASK, tools=[WEATHER, TIME], tool_choice=tool_choice, temperature=0, max_tokens=MAX_TOKENS,
                  parallel_tool_calls=False)
    whole = client.chat.completions.create(**kwargs)
    message = whole.choices[0].message
    assert whole.choices[0].finish_reason == "tool_calls" and message.content is None
    assert len(message.tool_calls) == 1
    by_name = {"get_weather": WEATHER, "get_time": TIME}
    for call in message.tool_calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    if choice == "named":
        assert [c.function.name for c in message.tool_calls] == ["get_weather"]
    streamed, reasons = streamed_tool_calls(client.chat.completions.create(**kwargs, stream=True))
    assert streamed == [(c.function.name, c.function.arguments) for c in message.tool_calls]
    assert reasons == ["tool_calls"]


# ---- langchain-openai --------------------------------------------------------------------------
@pytest.mark.parametrize("app", APPS)
def test_langchain_binds_tools_and_returns_structured_output(served, app):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    class WeatherArgs(BaseModel):
        city: str = Field(max_length=24)

    @tool(args_schema=WeatherArgs)
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return f"18 C in {city}"

    llm = ChatOpenAI(model=MODEL, base_url=f"{served[app]}/v1", api_key="unused", temperature=0, max_tokens=MAX_TOKENS, max_retries=0)
    reply = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert get_weather.invoke(call["args"]) == f"18 C in {call['args']['city']}"
    for method in ("json_schema", "function_calling"):
        city = llm.with_structured_output(City, method=method).invoke("Describe Paris.")
        assert isinstance(city, City), method


# ---- instructor --------------------------------------------------------------------------------
@pytest.mark.parametrize("app", APPS)
def test_instructor_extracts_in_json_schema_and_tools_modes(served, app):
    import instructor

    for mode in (instructor.Mode.JSON_SCHEMA, instructor.Mode.TOOLS):
        client = instructor.from_openai(sdk(served[app]), mode=mode)
        city = client.chat.completions.create(
            model=MODEL, response_model=City, max_retries=0, temperature=0, max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": "Paris is the capital of France; about 2.1 million people live there."}],
        )
        assert isinstance(city, City), mode


# ---- pydantic-ai -------------------------------------------------------------------------------
class Answer(BaseModel):
    code: Literal["4217", "unknown"]


@pytest.mark.parametrize("app", APPS)
def test_pydantic_ai_agent_calls_a_tool_and_answers_from_its_result(served, app):
    from pydantic_ai import Agent
    from pydantic_ai.capabilities import AbstractCapability
    from pydantic_ai.messages import ToolCallPart, ToolReturnPart
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    class ToolFirst(AbstractCapability):
        """The documented way to force a tool on the first step only: the first request must call
        `get_code`, the next must give the final answer (a small model would skip either)."""

        def get_model_settings(self):
            return lambda ctx: {"tool_choice": ["get_code"] if ctx.run_step <= 1 else ["final_result"]}

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=f"{served[app]}/v1", api_key="unused"))
    agent = Agent(model, output_type=Answer, capabilities=[ToolFirst()], model_settings={"temperature": 0, "max_tokens": MAX_TOKENS})
    calls = []

    @agent.tool_plain
    def get_code() -> str:
        """The secret code."""
        calls.append(1)
        return "4217"

    result = agent.run_sync("What is the secret code? Call get_code, then answer with it.")
    assert calls == [1]
    parts = [p for m in result.all_messages() for p in m.parts]
    assert [p.tool_name for p in parts if isinstance(p, ToolCallPart)] == ["get_code", "final_result"]
    assert [p.content for p in parts if isinstance(p, ToolReturnPart) and p.tool_name == "get_code"] == ["4217"]
    assert isinstance(result.output, Answer)
