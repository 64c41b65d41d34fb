"""Real agent frameworks as clients of a real server: the OpenAI Agents SDK (an `Agent` with a
`function_tool`, through its Chat Completions model and its Responses model) and LangChain's
`ChatOpenAI(...).bind_tools(...)`, each completing a round trip (call, tool result, final
answer) on the tiny model with Qwen2.5's tool markup and on the default model through the
generic format. The first turn's call is forced by the grammar (`tool_choice`), so the
round trip does not depend on what a small model prefers; the tool turns itself off once
it has answered, so the second turn is the answer: for the SDK an `output_type` (JSON under
the grammar, which ends even on a random model), for LangChain text."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any, Literal

import pytest

from tests.entrypoints.conftest import Served, ServerLoop, serving_model

pytestmark = pytest.mark.slow  # starts engine processes

# An enum, so that the tiny random model's forced arguments end (a free string may not)
City = Literal["Paris", "Oslo", "Lima"]


@pytest.fixture(scope="module", params=["hermes", "generic"])
def agent_served(
    request: pytest.FixtureRequest,
    server_loop: ServerLoop,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Served]:
    with serving_model(server_loop, tmp_path_factory, request.param) as served:
        yield served


@pytest.fixture(autouse=True)
def no_agents_tracing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SDK would export its traces to api.openai.com: off (tests stay on 127.0.0.1)."""
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")
    from agents import set_tracing_disabled

    set_tracing_disabled(True)


@pytest.mark.parametrize("api", ["chat_completions", "responses"])
def test_openai_agents_sdk_round_trip(agent_served: Served, api: str) -> None:
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        RunContextWrapper,
        Runner,
        function_tool,
    )
    from agents.items import ToolCallItem, ToolCallOutputItem
    from pydantic import BaseModel

    class Forecast(BaseModel):  # the final answer: JSON under the grammar, so it ends
        city: City
        sunny: bool

    calls: list[str] = []

    def still_unanswered(context: RunContextWrapper[Any], agent: Any) -> bool:
        return not calls  # the tool turns itself off once it has answered

    @function_tool(is_enabled=still_unanswered)
    def get_forecast(city: City) -> str:
        """The weather forecast of a city.

        Args:
            city: the city's name.
        """
        calls.append(city)
        return f"Sunny in {city}, 24 C."

    client = agent_served.async_openai()
    model_class = OpenAIChatCompletionsModel if api == "chat_completions" else OpenAIResponsesModel
    agent = Agent(
        name="forecaster",
        instructions="You answer questions about the weather.",
        model=model_class(model=agent_served.model, openai_client=client),
        model_settings=ModelSettings(tool_choice="get_forecast", temperature=0.0, max_tokens=160),
        tools=[get_forecast],
        output_type=Forecast,
    )

    result = asyncio.run(Runner.run(agent, "What is the weather in Paris?", max_turns=4))

    assert 1 == len(calls)
    kinds = [type(item) for item in result.new_items]
    assert ToolCallItem in kinds
    assert ToolCallOutputItem in kinds
    assert isinstance(result.final_output, Forecast)


def test_langchain_bind_tools_round_trip(agent_served: Served) -> None:
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_forecast(city: City) -> str:
        """The weather forecast of a city."""
        return f"Sunny in {city}, 24 C."

    llm = ChatOpenAI(
        model=agent_served.model,
        base_url=f"{agent_served.base_url}/v1",
        api_key="x",  # type: ignore[arg-type]
        temperature=0.0,
        max_tokens=160,  # type: ignore[call-arg]
        max_retries=0,
    )
    question = HumanMessage("What is the weather in Oslo?")

    called = llm.bind_tools([get_forecast], tool_choice="get_forecast").invoke([question])
    assert called.tool_calls, called
    call = called.tool_calls[0]
    assert "get_forecast" == call["name"]
    assert isinstance(call["args"].get("city"), str)
    result = get_forecast.invoke(call["args"])
    answer = llm.bind_tools([get_forecast], tool_choice="none").invoke(
        [question, called, ToolMessage(result, tool_call_id=call["id"])]
    )

    assert isinstance(answer.content, str)
    assert answer.content
    assert not answer.tool_calls
    json.dumps(call["args"])  # plain JSON values
