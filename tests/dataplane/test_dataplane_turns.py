"""One turn through an in-process dataplane, against a fake scheduler and a scripted engine.

These pin the failure-semantics table row by row, plus the headers and what reaches the engine.
"""

import asyncio
import json

import httpx
from conftest import MODEL, Stack, answers_json, chunk, completion, streams
from support import free_port, until

BODY = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}


async def test_a_whole_reply_passes_through_and_the_turn_is_reported(stack: Stack):
    stack.engine.behaviour = answers_json(completion("hello"))
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{stack.url}/v1/chat/completions", json=BODY, headers={"x-luftpause-run-id": "run-7"}
        )
    assert r.status_code == 200
    assert r.json() == completion("hello")
    assert r.headers["x-luftpause-run-id"] == "run-7"
    assert r.headers["x-luftpause-replica"] == "fake-a"
    (admit,) = stack.scheduler.admits
    assert (admit.run_id, admit.model, admit.caller) == ("run-7", MODEL, "")
    await until(lambda: stack.scheduler.kinds(admit.turn_id) == ["started", "first_token", "completed"])
    done = stack.scheduler.events[-1].completed
    assert (done.finish_reason, done.prompt_tokens, done.completion_tokens) == ("stop", 7, 3)


async def test_the_engine_gets_the_body_bytes_unchanged_and_its_own_key_only(stack: Stack):
    stack.engine.behaviour = answers_json(completion())
    raw = (
        b'{"model":  "fake-llama", "messages": [{"role":"user","content":"h\\u00e9"}], "x_extra": [1, 2.50]}'
    )
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{stack.url}/v1/chat/completions",
            content=raw,
            headers={"authorization": "Bearer client-secret", "content-type": "application/json"},
        )
    assert r.status_code == 200
    ((sent_headers, sent_body),) = stack.engine.requests
    assert sent_body == raw
    assert sent_headers["authorization"] == "Bearer engine-secret"


async def test_a_stream_passes_through_and_first_token_is_reported_before_the_end(stack: Stack):
    first = chunk({"role": "assistant", "content": "He"})
    stack.engine.behaviour = streams([first], then="wait")
    async with httpx.AsyncClient() as client:
        async with client.stream(
            "POST", f"{stack.url}/v1/chat/completions", json={**BODY, "stream": True}
        ) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            run_id = r.headers["x-luftpause-run-id"]
            pieces = r.aiter_raw()
            assert await anext(pieces) == first
            turn_id = stack.scheduler.admits[0].turn_id
            await until(
                lambda: stack.scheduler.kinds(turn_id) == ["started", "first_token"], what="first token"
            )
            stack.engine.go_on.set()
            rest = b"".join([p async for p in pieces])
    assert rest == chunk({}, "stop") + b"data: [DONE]\n\n"
    assert len(run_id) == 32
    await until(lambda: stack.scheduler.kinds(turn_id) == ["started", "first_token", "completed"])
    # A streamed turn's start tells the scheduler nothing its first token does not: one message
    # carries both, so a turn costs the stream one message less.
    assert [("started", turn_id), ("first_token", turn_id)] in stack.scheduler.messages


async def test_unknown_model_is_a_404_without_an_engine_request(stack: Stack):
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{stack.url}/v1/chat/completions", json={**BODY, "model": "nope"})
    assert r.status_code == 404
    assert r.json() == {"error": {"message": "no Generative replica serves model 'nope'"}}
    assert r.headers["x-luftpause-run-id"]
    assert stack.engine.requests == []


async def test_bad_bodies_and_class_headers_are_400s_naming_the_problem(stack: Stack):
    async with httpx.AsyncClient() as client:
        url = f"{stack.url}/v1/chat/completions"
        not_json = await client.post(url, content=b"{oops", headers={"x-luftpause-run-id": "r1"})
        no_model = await client.post(url, json={"messages": []})
        bad_class = await client.post(url, json=BODY, headers={"x-luftpause-class": "urgent"})
    assert not_json.status_code == 400 and "JSON" in not_json.json()["error"]["message"]
    assert not_json.headers["x-luftpause-run-id"] == "r1"
    assert no_model.status_code == 400 and '"model"' in no_model.json()["error"]["message"]
    assert bad_class.status_code == 400
    assert "'interactive' or 'batch'" in bad_class.json()["error"]["message"]
    assert bad_class.headers["x-luftpause-run-id"]
    assert stack.scheduler.admits == []


async def test_class_and_caller_reach_the_scheduler(stack: Stack):
    stack.engine.behaviour = answers_json(completion())
    caller = "ü" * 100  # 200 bytes of UTF-8
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{stack.url}/v1/chat/completions",
            json=BODY,
            headers=[("x-luftpause-class", "batch"), ("x-luftpause-caller", caller.encode())],
        )
    assert r.status_code == 200
    (admit,) = stack.scheduler.admits
    assert admit.service_class == 1  # BATCH
    assert admit.caller == "ü" * 64


async def test_an_engine_refusal_goes_back_unchanged_and_the_turn_fails(stack: Stack):
    refusal = {"error": {"message": "rate limited", "type": "rate_limit"}}
    stack.engine.behaviour = answers_json(refusal, status=429, headers={"retry-after": "3"})
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{stack.url}/v1/chat/completions", json={**BODY, "stream": True})
    assert r.status_code == 429
    assert r.json() == refusal
    assert r.headers["retry-after"] == "3"
    assert r.headers["x-luftpause-replica"] == "fake-a" and r.headers["x-luftpause-run-id"]
    turn_id = stack.scheduler.admits[0].turn_id
    await until(lambda: stack.scheduler.kinds(turn_id) == ["started", "failed"])


async def test_an_engine_breaking_off_mid_stream_closes_the_connection_without_done(stack: Stack):
    sent = [chunk({"role": "assistant", "content": "a"}), chunk({"content": "b"})]
    stack.engine.behaviour = streams(sent, then="abort")
    received = b""
    async with httpx.AsyncClient() as client:
        async with client.stream(
            "POST", f"{stack.url}/v1/chat/completions", json={**BODY, "stream": True}
        ) as r:
            assert r.status_code == 200
            try:
                async for piece in r.aiter_raw():
                    received += piece
                broke = False
            except httpx.RemoteProtocolError:
                broke = True
    assert broke, "the client must see the reply break off, not end"
    assert received == b"".join(sent)
    turn_id = stack.scheduler.admits[0].turn_id
    await until(lambda: stack.scheduler.kinds(turn_id) == ["started", "first_token", "failed"])


async def test_a_client_leaving_mid_stream_closes_the_engine_request(stack: Stack):
    stack.engine.behaviour = streams([chunk({"content": "a"})], then="wait")
    async with httpx.AsyncClient() as client:
        async with client.stream(
            "POST", f"{stack.url}/v1/chat/completions", json={**BODY, "stream": True}
        ) as r:
            await anext(r.aiter_raw())
        # Leaving the block closes the connection mid-stream.
    await asyncio.wait_for(stack.engine.saw_disconnect.wait(), 5.0)
    turn_id = stack.scheduler.admits[0].turn_id
    await until(lambda: stack.scheduler.kinds(turn_id) == ["started", "first_token", "failed"])


async def test_a_client_leaving_while_held_abandons_the_turn_before_any_engine_request(stack: Stack):
    stack.scheduler.hold = True
    async with httpx.AsyncClient() as client:
        pending = asyncio.ensure_future(client.post(f"{stack.url}/v1/chat/completions", json=BODY))
        await until(lambda: stack.scheduler.admits, what="the admission")
        pending.cancel()
    turn_id = stack.scheduler.admits[0].turn_id
    await until(lambda: stack.scheduler.abandoned == [turn_id], what="the held turn to be abandoned")
    stack.scheduler.release()
    assert stack.engine.requests == []
    # Nothing started: the abandon is the only event of the turn.
    await until(lambda: stack.scheduler.kinds(turn_id) == ["abandoned"], what="the abandon to be reported")


async def test_an_unreachable_engine_is_a_502_naming_the_replica(stack: Stack):
    # The scheduler, restarted, places turns on a port nobody listens on.
    resyncs = len(stack.scheduler.resyncs)
    await stack.scheduler.stop()
    stack.scheduler.url = f"http://127.0.0.1:{free_port()}"
    await stack.scheduler.start(stack.scheduler.port)
    await until(lambda: len(stack.scheduler.resyncs) > resyncs, what="the dataplane to reconnect")
    async with httpx.AsyncClient() as client:
        r = await client.post(f"{stack.url}/v1/chat/completions", json=BODY, timeout=10)
    assert r.status_code == 502
    message = r.json()["error"]["message"]
    assert message.startswith("engine fake-a: ")
    assert r.headers["x-luftpause-run-id"] and r.headers["x-luftpause-replica"] == "fake-a"
    turn_id = stack.scheduler.admits[-1].turn_id
    await until(lambda: stack.scheduler.kinds(turn_id) == ["started", "failed"])


async def test_a_reply_in_tool_calls_reports_the_tools_it_called_by_name(stack: Stack):
    stack.engine.behaviour = answers_json(completion(None, tool_call_ids=("call_1", "call_2")))
    async with httpx.AsyncClient() as client:
        r = await client.post(
            f"{stack.url}/v1/chat/completions", json=BODY, headers={"x-luftpause-run-id": "r"}
        )
    assert r.status_code == 200
    turn_id = stack.scheduler.admits[-1].turn_id
    await until(lambda: "completed" in stack.scheduler.kinds(turn_id))
    done = next(
        e.completed for e in stack.scheduler.events if e.turn_id == turn_id and e.HasField("completed")
    )
    assert (list(done.tool_call_ids), list(done.tool_names)) == (["call_1", "call_2"], ["lookup"])


async def test_a_turn_held_through_a_scheduler_restart_is_admitted_again_after_a_resync(stack: Stack):
    stack.engine.behaviour = answers_json(completion(tool_call_ids=("call_1",)))
    async with httpx.AsyncClient() as client:
        first = await client.post(
            f"{stack.url}/v1/chat/completions", json=BODY, headers={"x-luftpause-run-id": "r"}
        )
        assert first.status_code == 200
        await until(lambda: "completed" in stack.scheduler.kinds(stack.scheduler.admits[0].turn_id))

        stack.scheduler.hold = True
        held = asyncio.ensure_future(
            client.post(
                f"{stack.url}/v1/chat/completions", json=BODY, headers={"x-luftpause-run-id": "r"}, timeout=20
            )
        )
        await until(lambda: len(stack.scheduler.admits) == 2, what="the second admission")
        turn_id = stack.scheduler.admits[1].turn_id
        await stack.scheduler.stop()  # the scheduler goes away with the turn held
        stack.scheduler.log.clear()
        stack.scheduler.hold = False
        await stack.scheduler.start(stack.scheduler.port)
        second = await held
    assert second.status_code == 200
    # The retried admission kept its turn id and came only after the resync.
    assert stack.scheduler.log[:2] == [("resync", ""), ("admit", turn_id)]
    resync = stack.scheduler.resyncs[-1]
    (run,) = resync.runs
    assert (run.run_id, run.replica, run.phase) == ("r", "fake-a", 2)  # PAUSED on its tool call
    assert list(resync.turns) == []


async def test_run_identity_from_echoed_tool_call_ids(stack: Stack):
    stack.engine.behaviour = answers_json(completion(None, tool_call_ids=("call_abc",)))
    async with httpx.AsyncClient() as client:
        first = await client.post(f"{stack.url}/v1/chat/completions", json=BODY)
        await until(lambda: "completed" in stack.scheduler.kinds(stack.scheduler.admits[0].turn_id))
        follow_up = {
            **BODY,
            "messages": [
                *BODY["messages"],
                completion(None, tool_call_ids=("call_abc",))["choices"][0]["message"],
                {"role": "tool", "tool_call_id": "call_abc", "content": "42"},
            ],
        }
        stack.engine.behaviour = answers_json(completion("done"))
        second = await client.post(f"{stack.url}/v1/chat/completions", json=follow_up)
        unrelated = await client.post(f"{stack.url}/v1/chat/completions", json=BODY)
    assert second.headers["x-luftpause-run-id"] == first.headers["x-luftpause-run-id"]
    assert unrelated.headers["x-luftpause-run-id"] != first.headers["x-luftpause-run-id"]


async def test_ending_a_run_reports_it_and_forgets_its_tool_call_ids(stack: Stack):
    stack.engine.behaviour = answers_json(completion(None, tool_call_ids=("call_z",)))
    async with httpx.AsyncClient() as client:
        first = await client.post(f"{stack.url}/v1/chat/completions", json=BODY)
        run_id = first.headers["x-luftpause-run-id"]
        await until(lambda: "completed" in stack.scheduler.kinds(stack.scheduler.admits[0].turn_id))
        ended = await client.delete(f"{stack.url}/v1/runs/{run_id}")
        assert ended.status_code == 204
        await until(
            lambda: any(e.run_id == run_id and e.HasField("run_ended") for e in stack.scheduler.events)
        )
        echo = {**BODY, "messages": [{"role": "tool", "tool_call_id": "call_z", "content": "x"}]}
        again = await client.post(f"{stack.url}/v1/chat/completions", json=echo)
    assert again.headers["x-luftpause-run-id"] != run_id


async def test_a_turn_still_held_when_the_dataplane_stops_gets_a_503(stack: Stack):
    stack.scheduler.hold = True
    async with httpx.AsyncClient() as client:
        pending = asyncio.ensure_future(client.post(f"{stack.url}/v1/chat/completions", json=BODY))
        await until(lambda: stack.scheduler.admits, what="the admission")
        server, _ = stack.dataplane_server
        server.should_exit = True
        r = await asyncio.wait_for(pending, 10.0)
    assert r.status_code == 503
    assert r.json() == {"error": {"message": "the dataplane is stopping; send the turn again"}}
    assert r.headers["x-luftpause-run-id"]
    await until(lambda: stack.scheduler.abandoned == [stack.scheduler.admits[0].turn_id])


async def test_models_health_and_unknown_routes(stack: Stack):
    async with httpx.AsyncClient() as client:
        models = await client.get(f"{stack.url}/v1/models")
        health = await client.get(f"{stack.url}/health")
        missing = await client.get(f"{stack.url}/v1/nothing")
    assert models.json() == {
        "object": "list",
        "data": [{"id": MODEL, "object": "model", "created": 0, "owned_by": "luftpause"}],
    }
    assert health.status_code == 200 and health.json()["status"] == "ok"
    assert missing.status_code == 404 and "message" in missing.json()["error"]
    assert json.loads(missing.content)  # a JSON error body, not HTML


async def test_the_admission_carries_the_bodys_size_and_reply_limit(stack: Stack):
    stack.engine.behaviour = answers_json(completion())
    bodies = [
        json.dumps({**BODY, "max_tokens": 256}).encode(),
        # OpenAI's newer name, which engines take over max_tokens when both are sent.
        json.dumps({**BODY, "max_tokens": 256, "max_completion_tokens": 512}).encode(),
        json.dumps(BODY).encode(),
        # Not a count the scheduler can use: as if none was set.
        json.dumps({**BODY, "max_tokens": -1}).encode(),
        json.dumps({**BODY, "max_tokens": 12.5}).encode(),
        json.dumps(
            {**BODY, "max_tokens": True, "messages": [{"role": "user", "content": "h\u00e9 " * 50}]}
        ).encode(),
    ]
    async with httpx.AsyncClient() as client:
        for raw in bodies:
            r = await client.post(
                f"{stack.url}/v1/chat/completions", content=raw, headers={"content-type": "application/json"}
            )
            assert r.status_code == 200
    sizes = [(a.request_bytes, a.max_tokens) for a in stack.scheduler.admits]
    assert sizes == [(len(b), m) for b, m in zip(bodies, [256, 512, 0, 0, 0, 0], strict=True)]


async def test_a_labelled_decision_is_admitted_with_its_bodys_size_and_one_token(stack: Stack):
    stack.engine.behaviour = answers_json(completion("urgent"))
    raw = json.dumps({"model": MODEL, "input": "the server is down", "labels": ["urgent", "chat"]}).encode()
    async with httpx.AsyncClient() as client:
        await client.post(f"{stack.url}/v1/decide", content=raw, headers={"content-type": "application/json"})
    (admit,) = stack.scheduler.admits
    assert (admit.request_bytes, admit.max_tokens) == (len(raw), 1)
