"""A run tree is as deep as `[runtime] max_depth` allows, and GET /status shows a deeper one whole.

Real processes on loopback: a fake engine standing in for the dataplane, the fake MCP server and
`luftpause runtime`, driven by the official `mcp` client. A chain of spawns, each the child of
the last, is refused past the limit with a tool error naming it and its key. A journal written
before the limit existed may hold a deeper tree (600 runs, each the child of the one before):
the runtime restores it and its GET /status answers 200 with every run in it, in a document
that Python's own JSON parser reads (its tree nests at most 64 levels in one entry).
"""

import json
import time

import httpx
from mcp import Client
from support import call, task_planning
from test_runtime_e2e import backends, make_runtime  # noqa: F401 (backends: the fixture)

DEFAULT_MAX_DEPTH = 16
DEEP = 600


async def test_a_spawn_deeper_than_max_depth_is_refused_naming_the_limit(tmp_path, backends):  # noqa: F811
    rt = make_runtime(tmp_path, backends).start()
    try:
        async with Client(rt.url, mode="legacy") as client:
            parent = None
            for _ in range(DEFAULT_MAX_DEPTH):
                extra = {"parent": parent} if parent else {}
                parent = (await call(client, "spawn", task=task_planning(1, "deep"), maxTokens=16, **extra))[
                    "handle"
                ]
            refused = await client.call_tool("spawn", {"task": "one too deep", "parent": parent})
            assert refused.is_error, "the 17th run of a chain was spawned"
            text = refused.content[0].text
            assert f"run {parent} is 16 runs deep" in text and "[runtime] max_depth = 16" in text, text
            # A run nearer the root still takes children.
            (deepest,) = (await call(client, "status", handle=parent))["runs"]
            assert (await call(client, "spawn", task="beside", parent=deepest["parent"], maxTokens=16))[
                "handle"
            ]
    finally:
        rt.service.stop()


def _chain(now: float) -> list[dict]:
    """The journal of a finished chain DEEP runs deep, as the runtime writes it."""
    records = []
    for i in range(DEEP):
        handle = f"run-deep-{i:04d}"
        spec = {"task": f"level {i}", "model": "fake-llama", "serviceClass": "interactive", "system": None,
                "maxToolCalls": 8, "tools": None, "maxTokens": 16, "parallelToolCalls": False,
                "parent": f"run-deep-{i - 1:04d}" if i else None, "budgetTokens": None,
                "budgetToolCalls": None, "budgetSeconds": None, "approveTools": None}  # fmt: skip
        records.append(
            {"v": 1, "type": "spawned", "run": handle, "at": now - 30, "spec": spec, "caller": None}
        )
        records.append({"v": 1, "type": "finished", "run": handle, "at": now - 20, "status": "finished",
                        "result": f"answer {i}", "error": None, "toolCalls": 1, "turns": 2,
                        "promptTokens": 10, "completionTokens": 5})  # fmt: skip
    return records


def _nesting(nodes: list[dict]) -> int:
    """How many levels deep the tree's entries nest (walked with a stack)."""
    deepest, stack = 0, [(n, 1) for n in nodes]
    while stack:
        node, level = stack.pop()
        deepest = max(deepest, level)
        stack.extend((c, level + 1) for c in node["children"])
    return deepest


async def test_a_journaled_tree_600_deep_restores_and_status_answers(tmp_path, backends):  # noqa: F811
    rt = make_runtime(tmp_path, backends)
    rt.state_dir.mkdir()
    rt.journal.write_text("".join(json.dumps(r) + "\n" for r in _chain(time.time())))
    rt.start()
    try:
        async with httpx.AsyncClient() as http:
            answer = await http.get(f"http://127.0.0.1:{rt.port}/status", timeout=10)
        assert answer.status_code == 200, answer.text[:500]
        document = json.loads(answer.text)  # Python's parser: a tree nested 600 deep fails it
        assert len(document["runs"]) == DEEP
        shown, stack = [], list(document["tree"])
        while stack:
            node = stack.pop()
            shown.append(node["handle"])
            stack.extend(node["children"])
        assert sorted(shown) == [f"run-deep-{i:04d}" for i in range(DEEP)], "every run once in the tree"
        assert _nesting(document["tree"]) <= 64
        root = next(n for n in document["tree"] if n["handle"] == "run-deep-0000")
        assert root["subtree"]["turns"] == 2 * DEEP and root["subtree"]["promptTokens"] == 10 * DEEP
        entry = next(n for n in document["tree"] if n["handle"] == "run-deep-0064")
        assert entry["parent"] == "run-deep-0063", "a cut entry names the run it hangs under"
        async with Client(rt.url, mode="legacy") as client:
            (deepest,) = (await call(client, "status", handle=f"run-deep-{DEEP - 1:04d}"))["runs"]
            assert (deepest["status"], deepest["result"]) == ("finished", f"answer {DEEP - 1}")
    finally:
        rt.service.stop()
