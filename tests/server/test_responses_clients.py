"""Agent frameworks on the Responses API against a live `pagoda serve` on the tiny checkpoint that thinks:
the OpenAI Agents SDK's default model (OpenAIResponsesModel) runs an agent with one function tool to its
final answer, and LangChain's ChatOpenAI(use_responses_api=True) answers and calls a tool. A tiny model calls
no tool of its own accord: the first turn forces the call (tool_choice "required", which the SDK resets after
the call), so the loop is the SDK's own: call, tool output sent back, final answer."""

import asyncio
from typing import Literal

import pytest
from live_server import API_KEY
from thinking_checkpoint import ANSWER
from thinking_checkpoint import SERVED_NAME as MODEL

pytestmark = pytest.mark.server



@pytest.fixture(scope="module")
def server(thinking_server):
    return thinking_server


def test_an_agents_sdk_agent_calls_its_tool_and_finishes(server):
    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled
    from openai import AsyncOpenAI

    set_tracing_disabled(True)  # no trace export: nothing leaves the machine
    calls = []

    @function_tool
    def locate(city: Literal["Paris", "Tokyo"]) -> str:
        """Where to look for a landmark."""
        calls.append(city)
        return f"It is not in {city}."

    async def run():
        client = AsyncOpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        model = OpenAIResponsesModel(model=MODEL, openai_client=client)
        agent = Agent(name="guide", instructions="Find landmarks.", tools=[locate], model=model,
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=150))
        try:
            return await Runner.run(agent, "Where is the Golden Gate?", max_turns=4)
        finally:
            await client.close()

    result = asyncio.run(run())
    assert len(calls) == 1 and calls[0] in ("Paris", "Tokyo")
    assert result.final_output == ANSWER
    kinds = [item.type for item in result.new_items]
    assert kinds.count("tool_call_item") == 1 and kinds.count("tool_call_output_item") == 1
    assert kinds[-1] == "message_output_item" and "reasoning_item" in kinds
    assert len(result.raw_responses) == 2


def test_langchain_chat_openai_on_the_responses_api(server):
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=API_KEY, use_responses_api=True,
                     temperature=0, max_tokens=150, max_retries=0)
    answer = llm.invoke("Where is the Golden Gate?")
    assert answer.text == ANSWER

    @tool
    def locate(city: Literal["Paris", "Tokyo"]) -> str:
        """Where to look for a landmark."""
        return city

    call = llm.bind_tools([locate], tool_choice="required").invoke("Where is the Golden Gate?")
    assert [c["name"] for c in call.tool_calls] == ["locate"]
    assert call.tool_calls[0]["args"]["city"] in ("Paris", "Tokyo")
    streamed = "".join(chunk.text for chunk in llm.stream("Where is the Golden Gate?"))
    assert streamed == ANSWER
