"""Agent frameworks against the server, as their users run them: the `openai-agents` SDK
(over the Responses API, chained by previous_response_id) and LangChain's ChatOpenAI
(over Chat Completions: bind_tools and with_structured_output)."""

from __future__ import annotations

import asyncio
from typing import Annotated

import pytest
from pydantic import BaseModel, Field

from tests.app_fixtures import TINY, server_on

pytestmark = pytest.mark.timeout(300)

MODEL = "smollm2-135m-instruct"
CHUNK = 32
Short = Annotated[str, Field(max_length=24)]  # the small model's strings end in time


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    env = {**TINY, "PENSIEVE_GPU_CACHE_CHUNKS": "64", "PENSIEVE_TURNS_PER_MINUTE": "1000"}
    with server_on("sqlite", tmp_path_factory.mktemp("frameworks"), env) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


@pytest.fixture(scope="module")
def key(server):
    return server.user("agent")


def test_openai_agents_sdk_runs_a_tool_loop_on_the_kept_context(server, key):
    from agents import (
        Agent,
        ModelSettings,
        OpenAIResponsesModel,
        Runner,
        ToolsToFinalOutputResult,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    set_tracing_disabled(True)
    calls: list[str] = []

    @function_tool
    def search_docs(query: Short) -> str:
        """Search the documentation for a query."""
        calls.append("search_docs")
        return f"The docs say: {query} is configured in settings.py."

    @function_tool
    def read_file(path: Short) -> str:
        """Read a file of the project."""
        calls.append("read_file")
        return "max_batch_tokens = 2048"

    @function_tool
    def run_tests(pattern: Short) -> str:
        """Run the tests that match a pattern."""
        calls.append("run_tests")
        return "12 passed"

    def after_four(context, results) -> ToolsToFinalOutputResult:
        # The small model is made to call a tool every step; the loop ends after four.
        done = len(calls) >= 4
        return ToolsToFinalOutputResult(is_final_output=done, final_output="done" if done else None)

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    agent = Agent(
        name="maintainer",
        instructions="Use the tools to find the batch size setting. Call one tool at a time.",
        tools=[search_docs, read_file, run_tests],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=ModelSettings(
            temperature=0, max_tokens=100, tool_choice="required", parallel_tool_calls=False
        ),
        reset_tool_choice=False,
        tool_use_behavior=after_four,
    )
    result = asyncio.run(
        Runner.run(
            agent, "Where is the batch size set?", max_turns=6, auto_previous_response_id=True
        )
    )
    assert result.final_output == "done" and len(calls) == 4
    steps = result.raw_responses
    assert len(steps) == 4
    for before, after in zip(steps, steps[1:], strict=False):
        context = before.usage.input_tokens + before.usage.output_tokens
        # every step after the first reuses the KV of the steps before it
        assert after.usage.input_tokens_details.cached_tokens >= context - CHUNK


def test_langchain_bind_tools_and_structured_output(server, key):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        return "14 C"

    llm = ChatOpenAI(
        model=MODEL, base_url=server.url + "/v1", api_key=key, temperature=0, max_tokens=60,
        max_retries=0,
    )  # fmt: skip
    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("Weather in Oslo?")
    [call] = msg.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)

    class Person(BaseModel):
        name: str = Field(max_length=20)
        age: int = Field(ge=0, le=120)

    person = llm.with_structured_output(Person).invoke("Invent a person.")
    assert isinstance(person, Person)
