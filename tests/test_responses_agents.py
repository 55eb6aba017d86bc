"""A real agent framework end to end: the OpenAI Agents SDK runs a short tool-using agent against a live
``llama-cache serve`` (the embedded default model) over ``/v1/responses``.

A 135M model does not choose tools reliably, so the agent forces a call (``tool_choice: "required"``,
which the SDK resets to ``auto`` once the tool ran). Every model call after the first is served mostly
from the prompt cache, only the new turn evaluated, whether the SDK chains them with
``previous_response_id`` or sends the whole history again (its items name the stored response that
made them, whose tokens the prompt continues from).
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
from openai import AsyncOpenAI

from llama_cache.server import ServerConfig
from tests.live_server import LiveServer

pytestmark = [pytest.mark.model, pytest.mark.slow]


@pytest.fixture(scope="module")
def server() -> Iterator[LiveServer]:
    set_tracing_disabled(True)  # nothing is sent anywhere but our server
    live = LiveServer(ServerConfig(n_ctx=2048, parallel=1, max_queue=4))
    yield live
    live.stop()


@pytest.mark.parametrize("chained", [True, False], ids=["previous_response_id", "whole-history"])
def test_a_tool_using_agent_runs_on_the_cache(server: LiveServer, chained: bool) -> None:
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"Sunny and 21 degrees in {city}."

    async def run() -> list[object]:
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
        try:
            agent = Agent(
                name="weather", instructions="You answer questions about the weather. Use the tools.",
                tools=[get_weather], model=OpenAIResponsesModel(model="smollm2", openai_client=client),
                model_settings=ModelSettings(tool_choice="required", max_tokens=60, temperature=0))
            result = await Runner.run(agent, "What is the weather in Paris?", max_turns=3,
                                      auto_previous_response_id=chained)
            return list(result.raw_responses)
        finally:
            await client.close()

    responses = asyncio.run(run())
    assert calls, "the agent did not call its tool"
    assert len(responses) >= 2
    for previous, step in zip(responses, responses[1:]):
        assert step.usage.input_tokens > previous.usage.input_tokens
        # The previous step's prompt and answer came from the cache, the answer as the model wrote it:
        # only the new turn was evaluated.
        assert step.usage.input_tokens_details.cached_tokens >= (previous.usage.input_tokens
                                                                 + previous.usage.output_tokens - 1)
