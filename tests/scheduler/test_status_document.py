"""The status document and the status app, as views of a state built with `decide`."""

from __future__ import annotations

import httpx
from scheduler_pool import Pool, spec

from luftpause.scheduler.status import HeldHistory, build_app, run_document, status_document


def _busy_pool() -> Pool:
    pool = Pool(
        spec("a", lookahead=1),
        spec("b", "m", "n"),
        spec("hosted", "n", reports_load=False, lookahead=0),
    )
    pool.probe("b", healthy=False)
    pool.arrive("t0", run_id="r0", caller="alice")  # placed on a, and started
    pool.first_token("t0")
    pool.arrive("t1", run_id="r1", caller="alice")  # placed on a, not yet started: a is full
    pool.probe("a", running=2, waiting=1)  # t1 may be the one waiting
    pool.arrive("t2", run_id="r2", caller="alice", cls="batch")  # held
    pool.arrive("h1", run_id="r4", caller="bob", model="n")  # placed on hosted
    pool.wait(4)
    pool.arrive("t3", run_id="r3", caller="bob")  # held
    pool.wait(1)
    return pool


def test_replicas_show_in_flight_against_their_limit_in_config_order():
    doc = status_document(_busy_pool().state, now=5.0)
    assert doc["replicas"] == [
        {
            "name": "a",
            "url": "http://a",
            "kind": "generative",
            "models": ["m"],
            "healthy": True,
            "probed": True,
            "in_flight": 2,
            # What it holds: its interactive lookahead of one is taken.
            "limit": 2,
            "lookahead": 1,
            "waiting_ours": 1,
            "waiting_interactive": 1,
            "others_waiting": 0,
            "running": 2,
            "waiting": 1,
            "paused_interactive": 0,
            "reserved": 0,
        },
        {
            "name": "b",
            "url": "http://b",
            "kind": "generative",
            "models": ["m", "n"],
            "healthy": False,
            "probed": True,
            "in_flight": 0,
            "limit": 2,
            "lookahead": 2,
            "waiting_ours": 0,
            "waiting_interactive": 0,
            "others_waiting": 0,
            "running": None,
            "waiting": None,
            "paused_interactive": 0,
            "reserved": 0,
        },
        {
            "name": "hosted",
            "url": "http://hosted",
            "kind": "generative",
            "models": ["n"],
            "healthy": True,
            "probed": False,
            "in_flight": 1,
            "limit": None,
            "lookahead": 0,
            "waiting_ours": 0,
            "waiting_interactive": 0,
            "others_waiting": 0,
            "running": None,
            "waiting": None,
            "paused_interactive": 0,
            "reserved": 0,
        },
    ]


def test_a_replica_limit_grows_as_its_engine_starts_our_turns_and_shrinks_for_others_queued():
    pool = Pool(spec("a", lookahead=2))
    for t in ("t1", "t2", "t3"):
        pool.arrive(t)
    entry = status_document(pool.state, now=0.0)["replicas"][0]
    assert (entry["in_flight"], entry["waiting_ours"], entry["limit"]) == (2, 2, 2)
    pool.first_token("t1", "t2", "t3")  # t3 went out when t1 started
    entry = status_document(pool.state, now=0.0)["replicas"][0]
    assert (entry["in_flight"], entry["waiting_ours"], entry["limit"]) == (3, 0, 5)
    pool.probe("a", running=5, waiting=1)  # none of ours waits: someone else's request does
    entry = status_document(pool.state, now=0.0)["replicas"][0]
    assert (entry["others_waiting"], entry["limit"]) == (1, 4)


def test_held_turns_by_class_and_caller_with_the_oldest_wait():
    held = status_document(_busy_pool().state, now=5.0)["held"]
    assert held == {
        "count": 2,
        "oldest_wait_s": 5.0,
        "by_class": {
            "interactive": {"count": 1, "oldest_wait_s": 1.0},
            "batch": {"count": 1, "oldest_wait_s": 5.0},
        },
        "by_caller": {
            "alice": {"count": 1, "oldest_wait_s": 5.0},
            "bob": {"count": 1, "oldest_wait_s": 1.0},
        },
    }


def test_runs_by_phase_class_and_caller():
    pool = _busy_pool()
    pool.complete("t1", tool_calls=True)  # r1 paused; t3 (interactive) goes first
    doc = status_document(pool.state, now=pool.now)
    assert doc["runs"] == {
        "count": 5,
        "by_phase": {"generating": 3, "paused": 1, "idle": 1},
        "by_class": {
            "interactive": {"generating": 3, "paused": 1, "idle": 0},
            "batch": {"generating": 0, "paused": 0, "idle": 1},
        },
        "by_caller": {"alice": 3, "bob": 2},
    }
    # r1 will be back on a; t3, not yet started, fills a's lookahead of one, so t2 still waits.
    a = doc["replicas"][0]
    assert (a["paused_interactive"], a["waiting_ours"], doc["held"]["by_class"]["batch"]["count"]) == (
        1,
        1,
        1,
    )


def test_one_run():
    pool = _busy_pool()
    assert run_document(pool.state, "r1", now=7.5) == {
        "run_id": "r1",
        "replica": "a",
        "phase": "generating",
        "class": "interactive",
        "caller": "alice",
        "idle_s": 7.5,
    }
    assert run_document(pool.state, "nope", now=7.5) is None


async def test_the_app_serves_the_document_a_run_a_404_and_the_page():
    pool = _busy_pool()
    app = build_app(lambda: pool.state, lambda: 5.0)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://status") as client:
        status = await client.get("/status")
        assert status.status_code == 200
        assert status.json()["held"]["count"] == 2
        run = await client.get("/status/runs/r3")
        assert run.json()["phase"] == "idle"
        missing = await client.get("/status/runs/nope")
        assert missing.status_code == 404
        assert "nope" in missing.json()["error"]["message"]
        assert (await client.get("/elsewhere")).json() == {"error": {"message": "Not Found"}}
        page = await client.get("/")
        assert page.headers["content-type"].startswith("text/html")
        assert "const PERIOD_MS = 2000;" in page.text
        assert "setInterval(refresh, PERIOD_MS)" in page.text


def test_the_held_history_keeps_each_class_for_the_last_minutes_oldest_first():
    pool = Pool(spec("a", lookahead=1))
    pool.probe("a", healthy=False)  # every turn is held
    history = HeldHistory(keep_s=180.0)
    pool.arrive("t0", run_id="r0", caller="alice")
    history.sample(pool.state, pool.now)
    pool.wait(100)
    pool.arrive("t1", run_id="r1", caller="bob", cls="batch")
    history.sample(pool.state, pool.now)
    pool.wait(100)
    history.sample(pool.state, pool.now)
    samples = history.document(pool.now)
    # The first sample, 200 s ago, is gone; the two left say what was held then and how long the oldest had waited.
    assert [s["ago_s"] for s in samples] == [100.0, 0.0]
    assert samples[0]["interactive"] == {"held": 1, "oldest_wait_s": 100.0}
    assert samples[0]["batch"] == {"held": 1, "oldest_wait_s": 0.0}
    assert samples[1]["interactive"] == {"held": 1, "oldest_wait_s": 200.0}
    assert samples[1]["batch"] == {"held": 1, "oldest_wait_s": 100.0}
