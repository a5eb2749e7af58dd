"""An agent whose tool sleeps keeps its KV while background chats press on the tiers: the
`openai-agents` SDK over the Responses API, with and without the `retention` hint. Each
step reuses the context of the step before it (at most one chunk recomputed), though the
background chats drop chunks meanwhile."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from typing import Annotated

import httpx
import pytest
from pydantic import Field

from tests.app_fixtures import server_on

pytestmark = pytest.mark.timeout(600)

MODEL = "smollm2-135m-instruct"
CHUNK = 32
TOOL_S = 1.5  # how long the tool sleeps: background chats run meanwhile
STEPS = 3
Short = Annotated[str, Field(max_length=24)]  # the small model's strings end in time


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # Tiers a few chats overfill: the background chats' chunks are dropped while the agent
    # waits for its tool.
    env = {
        "PENSIEVE_GPU_CACHE_CHUNKS": "40",
        "PENSIEVE_CPU_CACHE_CHUNKS": "16",
        "PENSIEVE_TURNS_PER_MINUTE": "1000",
    }
    with server_on("sqlite", tmp_path_factory.mktemp("pressure"), env) as srv:
        yield srv
    assert "Traceback" not in srv.log_tail(100_000)


@pytest.fixture(scope="module")
def key(server):
    return server.user("agent")


def dropped(server) -> float:
    text = httpx.get(server.url + "/metrics").text
    return float(re.search(r"^pensieve:dropped_tokens_total (\S+)$", text, re.M).group(1))


def background(server, key: str, stop: threading.Event, sent: list[int]) -> None:
    """New chats of about 300 tokens each, one after another, until told to stop."""
    words = "the quick brown fox jumps over the lazy dog and keeps running far away "
    with httpx.Client(base_url=server.url + "/v1", headers={"Authorization": f"Bearer {key}"},
                      timeout=120) as client:  # fmt: skip
        n = 0
        while not stop.is_set():
            n += 1
            body = {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"Chat {n}: " + words * 20}],
                "max_tokens": 8,
                "temperature": 0,
            }
            assert client.post("/chat/completions", json=body).status_code == 200
            sent.append(n)


@pytest.mark.parametrize("hint", [None, {"ttl_s": 60}])
def test_agent_steps_reuse_their_context_under_pressure(server, key, hint):
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
    calls: list[float] = []

    @function_tool
    def run_tests(pattern: Short) -> str:
        """Run the project's tests that match a pattern (takes a while)."""
        time.sleep(TOOL_S)  # the background chats run meanwhile
        calls.append(time.monotonic())
        return "12 passed, 1 failed: test_batch_size"

    def after(context, results) -> ToolsToFinalOutputResult:
        done = len(calls) >= STEPS
        return ToolsToFinalOutputResult(is_final_output=done, final_output="done" if done else None)

    client = AsyncOpenAI(base_url=server.url + "/v1", api_key=key, max_retries=0)
    settings = ModelSettings(
        temperature=0,
        max_tokens=100,
        tool_choice="required",
        parallel_tool_calls=False,
        extra_body=None if hint is None else {"retention": hint},
    )
    agent = Agent(
        name="tester",
        instructions="Run the tests until they pass. Call one tool at a time. " * 4,
        tools=[run_tests],
        model=OpenAIResponsesModel(model=MODEL, openai_client=client),
        model_settings=settings,
        reset_tool_choice=False,
        tool_use_behavior=after,
    )
    stop, sent = threading.Event(), []
    noise = threading.Thread(target=background, args=(server, key, stop, sent))
    before = dropped(server)
    noise.start()
    try:
        result = asyncio.run(
            Runner.run(agent, "Make the tests pass.", max_turns=STEPS + 2,
                       auto_previous_response_id=True)
        )  # fmt: skip
    finally:
        stop.set()
        noise.join(timeout=120)
    assert result.final_output == "done" and len(calls) == STEPS
    assert len(sent) >= 2 * STEPS and dropped(server) > before  # the pressure was real
    steps = result.raw_responses
    assert len(steps) == STEPS
    for prev, step in zip(steps, steps[1:], strict=False):
        context = prev.usage.input_tokens + prev.usage.output_tokens
        assert step.usage.input_tokens_details.cached_tokens >= context - CHUNK, (hint, context)
