"""A LangGraph tool-calling agent whose model turns go through luftpause.

The usual two-node graph (the model, then `ToolNode` while the model asks for tools) with a
`ChatOpenAI` whose base_url is the proxy and whose default headers carry the three luftpause
headers. One model object per agent run, so every turn of the run carries the same run id, and
each tool call between two turns is an await the scheduler knows about. Against the embedded stack
(`luftpause up`):

    python examples/langgraph_agent.py "How long is the Volga?"
"""

from __future__ import annotations

import argparse
import os
import uuid

from langchain_core.messages import AIMessage, ToolMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from langgraph.graph import START, MessagesState, StateGraph
from langgraph.prebuilt import ToolNode, tools_condition

FACTS = {"volga": "The Volga is 3,531 km long and flows into the Caspian Sea."}


@tool
def lookup(query: str) -> str:
    """Look a fact up in the encyclopedia; returns a short paragraph."""
    hits = [text for key, text in FACTS.items() if key in query.lower()]
    return " ".join(hits) or f"No entry for {query!r}; the Volga is Europe's longest river."


def run_agent(base_url: str, model: str, task: str, caller: str) -> dict:
    """Runs one agent to its answer; returns its run id, the tools it called and the answer."""
    run_id = uuid.uuid4().hex
    llm = ChatOpenAI(
        base_url=base_url,
        # The proxy's bearer token when it has one; engines get their own keys, never this one.
        api_key=os.environ.get("LUFTPAUSE_TOKEN", "unused"),
        model=model,
        max_tokens=256,
        default_headers={
            "x-luftpause-run-id": run_id,  # the same on every turn of this run
            "x-luftpause-class": "interactive",  # a person waits for it; "batch" for background work
            "x-luftpause-caller": caller,  # whose turns these are, for fairness between callers
        },
    )
    model_with_tools = llm.bind_tools([lookup])

    def call_model(state: MessagesState) -> dict:
        return {"messages": [model_with_tools.invoke(state["messages"])]}

    graph = StateGraph(MessagesState)
    graph.add_node("model", call_model)
    graph.add_node("tools", ToolNode([lookup]))
    graph.add_edge(START, "model")
    graph.add_conditional_edges("model", tools_condition)  # to "tools" while it asks for one, else done
    graph.add_edge("tools", "model")
    agent = graph.compile()
    # Each tool round is two graph steps (model, tools); 20 steps allow 9 tool rounds and an answer.
    state = agent.invoke({"messages": [("user", task)]}, {"recursion_limit": 20})
    messages = state["messages"]
    tools = [m.name for m in messages if isinstance(m, ToolMessage)]
    answer = next(m.content for m in reversed(messages) if isinstance(m, AIMessage) and not m.tool_calls)
    return {"run_id": run_id, "tool_calls": tools, "answer": answer}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task", nargs="?", default="What is the longest river in Europe?")
    p.add_argument("--base-url", default="http://localhost:8080/v1")
    p.add_argument("--model", default="fake-llama")
    p.add_argument("--caller", default="example")
    args = p.parse_args()
    result = run_agent(args.base_url, args.model, args.task, args.caller)
    print(f"run {result['run_id']}: called {', '.join(result['tool_calls']) or 'no tool'}")
    print(result["answer"])


if __name__ == "__main__":
    main()
