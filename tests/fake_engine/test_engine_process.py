"""The fake engine as a real process: `luftpause fake-engine`, the official openai client, disconnects."""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from support import Service, free_port, running, wait_until

LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look a fact up.",
        "parameters": {"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]},
    },
}


def start_engine(log_dir: Path, name: str, slots: int, timing: str = "") -> tuple[Service, str]:
    port = free_port()
    engine = Service(
        name,
        ["fake-engine", "--name", name, "--port", str(port), "--slots", str(slots)],
        log_dir / f"{name}.log",
    )
    engine.start(env={"LUFTPAUSE_FAKE_ENGINE_TIMING": timing})
    url = f"http://127.0.0.1:{port}"
    engine.wait_http(url + "/health")
    return engine, url


@pytest.fixture(scope="module")
def engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # Short, quick replies: these tests check the wire, not the calibrated timing.
    engine, url = start_engine(
        tmp_path_factory.mktemp("engine"), "fake-p", slots=8, timing="reply_tokens=32,decode_base_s=0.002"
    )
    with running(engine):
        yield url


@pytest.fixture(scope="module")
def slow_engine_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    # One slot and 20 s replies: a request stays in flight until its client leaves.
    engine, url = start_engine(
        tmp_path_factory.mktemp("slow"),
        "fake-slow",
        slots=1,
        timing="decode_base_s=0.1,reply_tokens=200",
    )
    with running(engine):
        yield url


def load(url: str) -> tuple[float, float]:
    text = httpx.get(url + "/metrics", timeout=5).text
    values = {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples}
    return values["sglang:num_running_reqs"], values["sglang:num_queue_reqs"]


def test_the_openai_client_streams_text_with_usage(engine_url: str) -> None:
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key="unused")
    stream = client.chat.completions.create(
        model="fake-llama",
        messages=[{"role": "user", "content": "Say something."}],
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and all(c.system_fingerprint == "fake-p" for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 32


def test_an_agent_loop_with_the_openai_client_gets_its_planned_tool_calls(engine_url: str) -> None:
    client = openai.OpenAI(base_url=engine_url + "/v1", api_key="unused")

    def agent(question: str, stream: bool) -> list[str]:
        """Runs the loop to its text answer; returns the tool names called on the way."""
        messages: list[dict] = [{"role": "user", "content": question}]
        called: list[str] = []
        for _ in range(6):
            if stream:
                with client.chat.completions.stream(
                    model="fake-llama", messages=messages, tools=[LOOKUP]
                ) as s:
                    completion = s.get_final_completion()
            else:
                completion = client.chat.completions.create(
                    model="fake-llama", messages=messages, tools=[LOOKUP]
                )
            assert completion.system_fingerprint == "fake-p"
            choice = completion.choices[0]
            if choice.finish_reason != "tool_calls":
                assert choice.finish_reason == "stop" and choice.message.content
                return called
            (call,) = choice.message.tool_calls or []
            assert json.loads(call.function.arguments) == {"query": question}
            called.append(call.function.name)
            messages.append(choice.message.model_dump(exclude_none=True))
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "42"})
        raise AssertionError("no text answer after six turns")

    counts = [len(agent(f"Question {i}", stream=i % 2 == 0)) for i in range(4)]
    assert all(1 <= n <= 3 for n in counts)
    # The same conversation, streamed or not, makes the same number of calls.
    assert [len(agent(f"Question {i}", stream=i % 2 == 1)) for i in range(4)] == counts


def test_a_client_leaving_mid_stream_frees_its_slot(slow_engine_url: str) -> None:
    request = {"model": "fake-llama", "messages": [{"role": "user", "content": "long"}], "stream": True}
    with httpx.Client(base_url=slow_engine_url, timeout=10) as c:
        with c.stream("POST", "/v1/chat/completions", json=request) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept: dropping the iterator would close the stream
            assert next(lines).startswith("data: ")
            assert load(slow_engine_url) == (1, 0)
    wait_until(lambda: load(slow_engine_url) == (0, 0), timeout_s=5, what="the slot to be freed")


def test_clients_leaving_before_their_answer_free_the_slot_and_the_queue(slow_engine_url: str) -> None:
    request = {"model": "fake-llama", "messages": [{"role": "user", "content": "long"}]}
    with httpx.Client(base_url=slow_engine_url, timeout=10) as holder:
        with holder.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            # A second, non-streamed request queues behind the first; its client gives up.
            with ThreadPoolExecutor(1) as pool:
                queued = pool.submit(
                    httpx.post, slow_engine_url + "/v1/chat/completions", json=request, timeout=2
                )
                wait_until(lambda: load(slow_engine_url) == (1, 1), timeout_s=3, what="the request to queue")
                with pytest.raises(httpx.ReadTimeout):
                    queued.result()
            wait_until(lambda: load(slow_engine_url) == (1, 0), timeout_s=5, what="the queue to empty")
    wait_until(lambda: load(slow_engine_url) == (0, 0), timeout_s=5, what="the slot to be freed")
    # And one that gives up while running frees the slot too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(slow_engine_url + "/v1/chat/completions", json=request, timeout=1.0)
    wait_until(lambda: load(slow_engine_url) == (0, 0), timeout_s=5, what="the slot to be freed")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_the_engine_exits_cleanly_on_a_signal(tmp_path: Path, sig: int) -> None:
    engine, url = start_engine(tmp_path, "fake-stop", slots=1)
    with running(engine):
        engine.kill(sig)
        # uvicorn shuts down gracefully, then re-raises the signal: exit 0 or "ended by that signal",
        # never a crash (1) or the SIGKILL that `kill` falls back to after ten seconds.
        assert engine.proc is not None and engine.proc.returncode in (0, -sig), engine.output()[-2000:]
