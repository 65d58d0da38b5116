"""The round-robin proxy of the fidelity runs: each turn to the next engine, bodies unchanged."""

from __future__ import annotations

import json

import httpx

from luftpause.bench.sim.round_robin_proxy import create_app


async def test_turns_go_to_each_engine_in_turn_unchanged_and_run_ends_are_accepted() -> None:
    seen: list[tuple[str, dict]] = []

    def engine(request: httpx.Request) -> httpx.Response:
        seen.append((request.url.host, json.loads(request.content)))

        async def body():  # a streamed body, as an engine's over the network
            yield json.dumps({"system_fingerprint": request.url.host}).encode()

        return httpx.Response(200, headers={"content-type": "application/json"}, content=body())

    app = create_app(["http://a", "http://b"], transport=httpx.MockTransport(engine))
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://proxy") as client:
        replies = [
            await client.post("/v1/chat/completions", json={"model": "m", "messages": [], "n": i})
            for i in range(4)
        ]
        gone = await client.delete("/v1/runs/abc")
    assert [r.json()["system_fingerprint"] for r in replies] == ["a", "b", "a", "b"]
    assert [body["n"] for _, body in seen] == [0, 1, 2, 3]
    assert gone.status_code == 204
