"""An OpenAI Agents SDK agent whose model turns go through luftpause.

The SDK's own tool loop runs unchanged: luftpause only needs the model to be a Chat Completions
model (`OpenAIChatCompletionsModel`; the proxy does not serve the Responses API) on an
`AsyncOpenAI` client whose base_url is the proxy and whose default headers carry the three
luftpause headers. One client per agent run, so every turn of the run carries the same run id,
and each tool call between two turns is an await the scheduler knows about. Against the
embedded stack (`luftpause up`):

    python examples/openai_agents_agent.py "How long is the Volga?"
"""

from __future__ import annotations

import argparse
import asyncio
import os
import uuid

from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, RunConfig, Runner, function_tool
from agents.items import ToolCallItem
from openai import AsyncOpenAI

FACTS = {"volga": "The Volga is 3,531 km long and flows into the Caspian Sea."}


@function_tool
def lookup(query: str) -> str:
    """Look a fact up in the encyclopedia; returns a short paragraph.

    Args:
        query: what to look up.
    """
    hits = [text for key, text in FACTS.items() if key in query.lower()]
    return " ".join(hits) or f"No entry for {query!r}; the Volga is Europe's longest river."


async def run_agent(base_url: str, model: str, task: str, caller: str) -> dict:
    """Runs one agent to its answer; returns its run id, the tools it called and the answer."""
    run_id = uuid.uuid4().hex
    client = AsyncOpenAI(
        base_url=base_url,
        # The proxy's bearer token when it has one; engines get their own keys, never this one.
        api_key=os.environ.get("LUFTPAUSE_TOKEN", "unused"),
        default_headers={
            "x-luftpause-run-id": run_id,  # the same on every turn of this run
            "x-luftpause-class": "interactive",  # a person waits for it; "batch" for background work
            "x-luftpause-caller": caller,  # whose turns these are, for fairness between callers
        },
    )
    agent = Agent(
        name="researcher",
        instructions="Answer with the help of the lookup tool.",
        tools=[lookup],
        model=OpenAIChatCompletionsModel(model=model, openai_client=client),
        model_settings=ModelSettings(max_tokens=256),
    )
    # The SDK's tracing exports to OpenAI's platform by default; nothing here should leave the machine.
    result = await Runner.run(agent, task, max_turns=10, run_config=RunConfig(tracing_disabled=True))
    tools = [item.raw_item.name for item in result.new_items if isinstance(item, ToolCallItem)]
    return {"run_id": run_id, "tool_calls": tools, "answer": result.final_output}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task", nargs="?", default="What is the longest river in Europe?")
    p.add_argument("--base-url", default="http://localhost:8080/v1")
    p.add_argument("--model", default="fake-llama")
    p.add_argument("--caller", default="example")
    args = p.parse_args()
    result = asyncio.run(run_agent(args.base_url, args.model, args.task, args.caller))
    print(f"run {result['run_id']}: called {', '.join(result['tool_calls']) or 'no tool'}")
    print(result["answer"])


if __name__ == "__main__":
    main()
