"""An agent that keeps its own loop, pointed at luftpause with the official `openai` client.

It sends the three luftpause headers on every turn, runs the tools the model asks for itself
(here a stand-in `lookup` that answers from a dictionary), and sends the results back as the
next turn of the same run, until the model answers without a tool call. Against the embedded
stack (`luftpause up`):

    python examples/own_loop_agent.py "What is the longest river in Europe?"

It prints one line per turn: the replica that served it (the fake engines put their name in
`system_fingerprint`) and what the model asked for, then the answer.
"""

from __future__ import annotations

import argparse
import json
import os
import uuid

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "lookup",
            "description": "Look a fact up in the encyclopedia; returns a short paragraph.",
            "parameters": {
                "type": "object",
                "properties": {"query": {"type": "string", "description": "what to look up"}},
                "required": ["query"],
            },
        },
    }
]

FACTS = {"volga": "The Volga is 3,531 km long and flows into the Caspian Sea."}


def lookup(query: str) -> str:
    hits = [text for key, text in FACTS.items() if key in query.lower()]
    return " ".join(hits) or f"No entry for {query!r}; the Volga is Europe's longest river."


def run_agent(base_url: str, model: str, task: str, caller: str, max_turns: int = 10) -> dict:
    """Runs one agent to its answer; returns the run id, the replicas per turn, the tools called and the answer."""
    # The proxy's bearer token when it has one; engines get their own keys, never this one.
    client = OpenAI(base_url=base_url, api_key=os.environ.get("LUFTPAUSE_TOKEN", "unused"))
    run_id = uuid.uuid4().hex
    headers = {"x-luftpause-run-id": run_id, "x-luftpause-class": "interactive", "x-luftpause-caller": caller}
    messages: list[dict] = [{"role": "user", "content": task}]
    replicas: list[str] = []
    tools: list[str] = []
    for _ in range(max_turns):
        raw = client.chat.completions.with_raw_response.create(
            model=model, messages=messages, tools=TOOLS, max_tokens=256, extra_headers=headers
        )
        reply = raw.parse()
        replicas.append(reply.system_fingerprint or raw.headers.get("x-luftpause-replica", "?"))
        message = reply.choices[0].message
        calls = message.tool_calls or []
        print(
            f"turn {len(replicas)} on {replicas[-1]}: "
            + (", ".join(c.function.name for c in calls) or "answer")
        )
        if not calls:
            return {"run_id": run_id, "replicas": replicas, "tool_calls": tools, "answer": message.content}
        messages.append(message.model_dump(exclude_none=True))
        for call in calls:
            tools.append(call.function.name)
            args = json.loads(call.function.arguments or "{}")
            messages.append(
                {"role": "tool", "tool_call_id": call.id, "content": lookup(args.get("query", ""))}
            )
    raise RuntimeError(f"no answer after {max_turns} turns")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("task", nargs="?", default="What is the longest river in Europe?")
    p.add_argument("--base-url", default="http://localhost:8080/v1")
    p.add_argument("--model", default="fake-llama")
    p.add_argument("--caller", default="example")
    args = p.parse_args()
    result = run_agent(args.base_url, args.model, args.task, args.caller)
    print(f"\nrun {result['run_id']}: {result['answer']}")


if __name__ == "__main__":
    main()
