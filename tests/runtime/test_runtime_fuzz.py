"""The MCP tools fuzzed with hypothesis: any arguments get an answer, never a crash or a hang.

A real runtime (its own process; the fake engine stands in for the dataplane, fake-mcp for the
tools). For each tool it lists, hypothesis sends argument objects built from the tool's own
input schema, right and wrong: its properties with values of any JSON type, some left out,
unknown ones added. Each call must come back within its timeout as a result or a tool error
(or a JSON-RPC error for arguments the schema refuses), and the runtime must still answer
afterwards. Bounded and derandomized: the same 25 cases a tool on every run.
"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from mcp import Client
from mcp.shared.exceptions import MCPError
from test_runtime_e2e import Runtime, backends, make_runtime  # noqa: F401 (backends: the fixture)

CASES_PER_TOOL = 25

_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**40), 2**40)
    | st.floats(allow_nan=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


@pytest.fixture(scope="module")
def fuzzed_runtime(tmp_path_factory, backends):  # noqa: F811
    rt = make_runtime(tmp_path_factory.mktemp("fuzz"), backends).start()
    try:
        yield rt
    finally:
        rt.service.stop()


async def _tools(url: str) -> list:
    async with Client(url) as client:
        return (await client.list_tools()).tools


def _arguments(schema: dict) -> st.SearchStrategy[dict]:
    names = sorted((schema or {}).get("properties", {}))
    known = st.fixed_dictionaries({}, optional={name: _json for name in names})
    extra = st.dictionaries(st.text(min_size=1, max_size=8), _json, max_size=2)
    return st.builds(lambda a, b: {**b, **a}, known, extra)


async def _call(url: str, name: str, arguments: dict) -> str:
    async with Client(url) as client:
        try:
            result = await asyncio.wait_for(client.call_tool(name, arguments), 30)
        except MCPError as e:
            return f"refused: {e}"
    return "error" if result.is_error else "ok"


def _fuzzer(url: str, name: str, schema: dict, outcomes: dict[str, set[str]]):
    @settings(max_examples=CASES_PER_TOOL, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))  # fmt: skip
    @given(arguments=_arguments(schema))
    def fuzz(arguments: dict) -> None:
        outcomes.setdefault(name, set()).add(asyncio.run(_call(url, name, arguments)))

    return fuzz


def test_every_tool_answers_any_arguments(fuzzed_runtime: Runtime):
    tools = asyncio.run(_tools(fuzzed_runtime.url))
    assert {t.name for t in tools} >= {"spawn", "await", "status", "cancel"}
    outcomes: dict[str, set[str]] = {}
    for tool in tools:
        if tool.name == "await":
            continue  # waits for as long as it is told to: covered below with a bounded timeout
        _fuzzer(fuzzed_runtime.url, tool.name, tool.input_schema, outcomes)()
    assert len(outcomes) == len(tools) - 1
    # Waiting is bounded by the timeout it is given; nothing else about it may break it.
    result = asyncio.run(_call(fuzzed_runtime.url, "await", {"handles": ["nope"], "timeout": 0.1, "x": [1]}))
    assert result in ("ok", "error") or result.startswith("refused")
    assert httpx.get(f"http://127.0.0.1:{fuzzed_runtime.port}/status", timeout=5).status_code == 200
