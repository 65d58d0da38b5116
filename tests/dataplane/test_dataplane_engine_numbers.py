"""Numbers from an engine or a peer that no turn may trust: checked at the edge (luftpause/counts.py).

Real processes on loopback (`real_stack.py`): a scripted engine answers with a usage whose counts
are out of range (10^30, 1e30, -5, NaN, a string) or a tool-call id no message can carry; the
client still gets a well-formed answer, and the turn's slot is free at the scheduler within 5 s
(its /status shows nothing in flight; before the check, a count above int64 made the completion
report raise and the slot stayed taken until the 600 s turn timeout). A peer's resync whose run
says it has been idle NaN or inf seconds leaves /status/runs/{id} answering 200.
"""

from __future__ import annotations

import asyncio
import json
import uuid

import grpc.aio
import httpx
import pytest
from real_stack import TOKEN, RealStack
from support import wait_until

from luftpause.proto import DATAPLANE_KEY, pb, rpc

# What a settled slot may take at most after the client has its answer.
FREED_WITHIN_S = 5.0


def _body(tag: str, stream: bool, **extra: object) -> dict:
    return {
        "model": "plain-llama",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        "tag": tag,
        **extra,
    }


def _in_flight(stack: RealStack) -> int:
    return sum(r["in_flight"] for r in stack.status()["replicas"])


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
@pytest.mark.parametrize(
    "usage_raw",
    [
        '{"prompt_tokens": 5, "completion_tokens": 1000000000000000000000000000000}',
        '{"prompt_tokens": 5, "completion_tokens": 1e30}',
        '{"prompt_tokens": -5, "completion_tokens": -5}',
        '{"prompt_tokens": NaN, "completion_tokens": Infinity}',
        '{"prompt_tokens": "5", "completion_tokens": true}',
    ],
    ids=["10^30", "1e30", "negative", "nan", "not-numbers"],
)
def test_a_usage_out_of_range_frees_the_turns_slot_and_the_client_gets_its_answer(
    real_stack: RealStack, usage_raw: str, stream: bool
):
    tag = uuid.uuid4().hex[:12]
    run_id = f"usage-{tag}"
    with real_stack.client() as client:
        r = client.post(
            "/v1/chat/completions",
            json=_body(tag, stream, usage_raw=usage_raw),
            headers={"x-luftpause-run-id": run_id},
        )
    assert r.status_code == 200, r.text
    if stream:
        assert r.text.rstrip().endswith("data: [DONE]"), r.text
        # The engine's text reached the client whole.
        events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
        assert (
            "".join(e["choices"][0]["delta"].get("content") or "" for e in events if e["choices"]) == "hello"
        )
    else:
        assert r.json()["choices"][0]["message"]["content"] == "hello"
    wait_until(
        lambda: _in_flight(real_stack) == 0,
        timeout_s=FREED_WITHIN_S,
        what="the turn's slot to be free at the scheduler",
    )
    wait_until(lambda: real_stack.run_phase(run_id) == "idle", timeout_s=FREED_WITHIN_S, what="the run idle")


def test_a_tool_call_id_no_message_can_carry_ends_the_turn_failed_and_frees_its_slot(real_stack: RealStack):
    tag = uuid.uuid4().hex[:12]
    run_id = f"surrogate-{tag}"
    failed = real_stack.turns_counted("chat", "failed")
    with real_stack.client() as client:
        r = client.post(
            "/v1/chat/completions",
            # JSON's escape for a lone surrogate: valid JSON, but no protobuf string holds it.
            content=json.dumps(_body(tag, False, script="tool_calls")).replace(
                '"tag":', '"call_ids": ["\\ud800"], "tag":'
            ),
            headers={"x-luftpause-run-id": run_id, "content-type": "application/json"},
        )
    assert r.status_code == 200, r.text
    wait_until(
        lambda: _in_flight(real_stack) == 0,
        timeout_s=FREED_WITHIN_S,
        what="the turn's slot to be free at the scheduler",
    )
    assert real_stack.turns_counted("chat", "failed") == failed + 1
    assert real_stack.run_phase(run_id) == "idle"
    assert "could not be reported" in real_stack.dataplane_service.output()


@pytest.mark.parametrize("idle_s", [float("nan"), float("inf"), float("-inf"), -5.0])
def test_a_resync_with_an_idle_time_out_of_range_leaves_the_run_document_readable(
    real_stack: RealStack, idle_s: float
):
    run_id = f"resynced-{uuid.uuid4().hex[:12]}"
    # A dataplane of its own name: the real one's runs and turns are not touched.
    metadata = (("authorization", f"Bearer {TOKEN}"), (DATAPLANE_KEY, f"peer-{run_id}"))
    view = pb.ResyncRequest(runs=[pb.RunState(run_id=run_id, replica="plain", phase=pb.IDLE, idle_s=idle_s)])

    async def resync() -> None:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{real_stack.ports.grpc}") as channel:
            await rpc.SchedulerStub(channel).Resync(iter([view]), metadata=metadata, timeout=5)

    asyncio.run(resync())
    r = httpx.get(f"{real_stack.status_url}/runs/{run_id}", timeout=5)
    assert r.status_code == 200, r.text
    document = r.json()
    assert document["run_id"] == run_id
    assert 0.0 <= document["idle_s"] < 60.0
    assert httpx.get(real_stack.status_url, timeout=5).status_code == 200
