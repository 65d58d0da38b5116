"""The three own-loop examples, each run against the embedded stack as its docstring says.

One stack for the module (`luftpause up --with-fakes` on ports of its own). Each example's agent
runs to an answer; the scheduler must then know exactly one new run, the example's own run id,
from the example's caller, and the dataplane must have completed at least one turn more than the
agent made tool calls (a turn before each tool round and one for the answer).
"""

from __future__ import annotations

import asyncio
import importlib.util
import inspect
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import Ports, start_up, stop_up, write_config

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
# Each example and the framework it needs (the `examples` extra, which dev includes).
CASES = [
    ("own_loop_agent.py", "openai"),
    ("openai_agents_agent.py", "agents"),
    ("langgraph_agent.py", "langgraph"),
]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Ports]:
    directory = tmp_path_factory.mktemp("examples")
    ports = Ports()
    proc = start_up(write_config(directory, ports), directory / "up.log")
    try:
        yield ports
    finally:
        stop_up(proc)


def _load(filename: str):
    spec = importlib.util.spec_from_file_location(filename.removesuffix(".py"), EXAMPLES / filename)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _completed_turns(ports: Ports) -> float:
    text = httpx.get(f"http://127.0.0.1:{ports.dataplane}/metrics").text
    counts = [
        sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "luftpause_dataplane_turns_total"
        and (sample.labels["route"], sample.labels["outcome"]) == ("chat", "completed")
    ]
    assert counts, "no completed-turns counter in the dataplane's /metrics"
    return sum(counts)  # over the classes


def _runs_known(ports: Ports) -> int:
    return httpx.get(f"http://127.0.0.1:{ports.status}/status").json()["runs"]["count"]


@pytest.mark.parametrize(("filename", "framework"), CASES, ids=[c[0] for c in CASES])
def test_the_example_keeps_one_run_id_across_its_turns_and_calls_a_tool(
    stack: Ports, filename: str, framework: str
) -> None:
    pytest.importorskip(framework, reason=f"{filename} needs pip install -e '.[examples]'")
    example = _load(filename)
    caller = f"test-{filename}"
    runs_before, turns_before = _runs_known(stack), _completed_turns(stack)

    result = example.run_agent(
        f"http://127.0.0.1:{stack.dataplane}/v1", "fake-llama", "How long is the Volga?", caller
    )
    if inspect.isawaitable(result):
        result = asyncio.run(result)

    assert result["answer"]
    assert result["tool_calls"] and set(result["tool_calls"]) == {"lookup"}
    assert _runs_known(stack) == runs_before + 1, "the agent's turns did not all join one run"
    run = httpx.get(f"http://127.0.0.1:{stack.status}/status/runs/{result['run_id']}")
    assert run.status_code == 200, run.text
    assert run.json()["caller"] == caller and run.json()["class"] == "interactive"
    assert _completed_turns(stack) - turns_before >= len(result["tool_calls"]) + 1
