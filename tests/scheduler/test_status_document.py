"""The status document and the status app, as views of a state built with `decide`."""

from __future__ import annotations

import httpx
from scheduler_pool import Pool, spec

from luftpause.scheduler import fairness
from luftpause.scheduler.events import PoolConfigured
from luftpause.scheduler.gate import (
    HOLD_MAX_S,
    HOLD_MIN_S,
    KV_HEADROOM,
    MIN_TOOL_SAMPLES,
    REPLY_RESERVE_DEFAULT,
    TOKENS_PER_BYTE,
)
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
    # t1 may be the one waiting; its engine took 12,000 prompt tokens, 9,000 of them from its cache.
    pool.probe("a", running=2, waiting=1, prompt_tokens=12000, cached_tokens=9000)
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
            "in_service": True,
            "ejection": {
                "ejected_for_s": None,
                "ejections": 0,
                "failures_in_a_row": 0,
                "interval_turns": 0,
                "interval_failures": 0,
            },
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
            "kv_tokens": None,
            "kv_source": None,
            "gate": "off: pool unknown",
            "kv_slots": None,
            "host_cache": False,
            "host_cache_source": "default",
            "kv_capacity": None,
            # r0 and r1 generate there; the gate is off, but a replica still holds its runs.
            "held_runs": 2,
            "held_kv_tokens": 2 * REPLY_RESERVE_DEFAULT,
            # Its engine's prompt-cache counters, and the share of its prompts its cache gave.
            "prompt_tokens": 12000,
            "cached_tokens": 9000,
            "prompt_cache_share": 0.75,
        },
        {
            "name": "b",
            "url": "http://b",
            "kind": "generative",
            "models": ["m", "n"],
            "healthy": False,
            "probed": True,
            "in_service": False,
            "ejection": {
                "ejected_for_s": None,
                "ejections": 0,
                "failures_in_a_row": 0,
                "interval_turns": 0,
                "interval_failures": 0,
            },
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
            "kv_tokens": None,
            "kv_source": None,
            "gate": "off: pool unknown",
            "kv_slots": None,
            "host_cache": False,
            "host_cache_source": "default",
            "kv_capacity": None,
            "held_runs": 0,
            "held_kv_tokens": 0,
            "prompt_tokens": None,
            "cached_tokens": None,
            "prompt_cache_share": None,
        },
        {
            "name": "hosted",
            "url": "http://hosted",
            "kind": "generative",
            "models": ["n"],
            "healthy": True,
            "probed": False,
            "in_service": True,
            "ejection": {
                "ejected_for_s": None,
                "ejections": 0,
                "failures_in_a_row": 0,
                "interval_turns": 0,
                "interval_failures": 0,
            },
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
            "kv_tokens": None,
            "kv_source": None,
            "gate": "off: pool unknown",
            "kv_slots": None,
            "host_cache": False,
            "host_cache_source": "default",
            "kv_capacity": None,
            "held_runs": 1,
            "held_kv_tokens": REPLY_RESERVE_DEFAULT,
            "prompt_tokens": None,
            "cached_tokens": None,
            "prompt_cache_share": None,
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
        "working_set": REPLY_RESERVE_DEFAULT,
        "held": True,
        "keep_s": None,
        "paused_on": None,  # generating
        "slot": None,  # a is no slot engine
    }
    assert run_document(pool.state, "nope", now=7.5) is None


def test_a_run_held_on_a_slot_engine_shows_the_slot_its_requests_name():
    pool = Pool(spec("llama", kv_slots=4))
    pool.arrive("t0", run_id="r0", caller="alice")
    pool.arrive("t1", run_id="r1", caller="alice")
    assert [run_document(pool.state, r, now=pool.now)["slot"] for r in ("r0", "r1")] == [0, 1]


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


def _gated_pool() -> Pool:
    """Replica a with a configured pool of 10000 tokens (9000 for held runs), b down: r1 and r2
    are held on a, r1 paused on a tool, and r3 (6000 tokens) waits for room."""
    pool = Pool(spec("a", kv_tokens=10000, gate_min_runs=1), spec("b"))
    pool.probe("b", healthy=False)
    pool.arrive("t1", run_id="r1", caller="alice", request_bytes=4000, max_tokens=1000)  # 1000 + 1000
    pool.arrive("t2", run_id="r2", caller="alice", request_bytes=8000, max_tokens=2000)  # 2000 + 2000
    pool.arrive("t3", run_id="r3", caller="bob", cls="batch", request_bytes=20000, max_tokens=1000)
    pool.first_token("t1", "t2")
    pool.wait(2)
    pool.complete("t1", tool_calls=True, prompt_tokens=1200, completion_tokens=100)  # 1200 + 100 + 1000
    pool.wait(1)
    return pool


def _gate_fields(replica: dict) -> dict:
    keys = ("kv_tokens", "kv_source", "gate", "kv_capacity", "held_runs", "held_kv_tokens")
    return {k: replica[k] for k in keys}


def test_each_replica_shows_its_kv_pool_where_it_was_read_and_the_runs_it_holds():
    pool = _gated_pool()
    a, b = status_document(pool.state, pool.now)["replicas"]
    assert _gate_fields(a) == {
        "kv_tokens": 10000,
        "kv_source": "config",
        "gate": "tokens",
        "kv_capacity": int(10000 * (1 - KV_HEADROOM)),
        "held_runs": 2,
        "held_kv_tokens": 2300 + 4000,
    }
    assert _gate_fields(b) == {
        "kv_tokens": None,
        "kv_source": None,
        "gate": "off: pool unknown",
        "kv_capacity": None,
        "held_runs": 0,
        "held_kv_tokens": 0,
    }
    pool.probe("b", kv_tokens=50000)  # its engine says what it has
    b = status_document(pool.state, pool.now)["replicas"][1]
    assert (b["kv_tokens"], b["kv_source"], b["gate"], b["kv_capacity"]) == (50000, "engine", "tokens", 45000)


def test_runs_waiting_to_be_admitted_by_class_with_the_oldest_wait():
    pool = _gated_pool()
    waiting = status_document(pool.state, pool.now)["waiting_for_room"]
    assert waiting == {
        "runs": 1,
        "turns": 1,
        "oldest_wait_s": 3.0,
        "by_class": {
            "interactive": {"runs": 0, "turns": 0, "oldest_wait_s": None},
            "batch": {"runs": 1, "turns": 1, "oldest_wait_s": 3.0},
        },
    }
    # r1's keep time runs out: it is let go, and its next turn comes back as a new run's would,
    # waiting for room beside r3: a holds r2's 4000 tokens, and neither r3's 6000 nor r1's
    # 7000 now fits beside them.
    pool.wait(HOLD_MAX_S)
    pool.tick()
    pool.arrive("t4", run_id="r1", caller="alice", request_bytes=20000, max_tokens=1000)
    pool.arrive("t5", run_id="r2", caller="alice")  # r2 is held on a: its turn does not wait for room
    pool.wait(1)
    doc = status_document(pool.state, pool.now)
    assert doc["held"]["count"] == 2 and pool.held() == ["t3", "t4"]
    assert doc["waiting_for_room"]["by_class"] == {
        "interactive": {"runs": 1, "turns": 1, "oldest_wait_s": 1.0},
        "batch": {"runs": 1, "turns": 1, "oldest_wait_s": 4.0 + HOLD_MAX_S},
    }
    assert _gate_fields(doc["replicas"][0])["held_runs"] == 1


def test_a_run_shows_its_working_set_and_keep_time_while_held_and_none_once_let_go():
    pool = _gated_pool()
    r1 = run_document(pool.state, "r1", now=pool.now)
    assert r1 is not None
    assert (r1["phase"], r1["working_set"], r1["held"]) == ("paused", 2300, True)
    assert r1["keep_s"] == HOLD_MAX_S - 1, "paused 1 s ago, with no pause of alice's seen yet"
    r2 = run_document(pool.state, "r2", now=pool.now)
    assert r2 is not None and (r2["working_set"], r2["held"], r2["keep_s"]) == (4000, True, None)
    r3 = run_document(pool.state, "r3", now=pool.now)
    assert r3 is not None
    assert (r3["replica"], r3["working_set"], r3["held"], r3["keep_s"]) == (None, 5000 + 1000, False, None)
    pool.wait(HOLD_MAX_S)
    pool.tick()
    r1 = run_document(pool.state, "r1", now=pool.now)
    assert r1 is not None
    assert (r1["phase"], r1["replica"], r1["held"], r1["keep_s"]) == ("paused", None, False, None)


def test_the_gate_section_shows_its_constants_what_each_model_taught_and_each_callers_keep_time():
    pool = _gated_pool()
    assert status_document(pool.state, pool.now)["gate"] == {
        "kv_headroom": KV_HEADROOM,
        "hold_max_s": HOLD_MAX_S,
        "tokens_per_byte_default": TOKENS_PER_BYTE,
        "tokens_per_byte": {"m": 1200 / 4000},
        "keep_s": {},
        "min_tool_samples": MIN_TOOL_SAMPLES,
        "keep_s_by_tool": {},
    }
    # r1 comes back after a pause of 1 s on its tool: alice's runs now keep their place a little
    # longer than that.
    pool.arrive("t4", run_id="r1", caller="alice")
    gate_doc = status_document(pool.state, pool.now)["gate"]
    assert list(gate_doc["keep_s"]) == ["alice"] and 1.0 < gate_doc["keep_s"]["alice"] < HOLD_MAX_S
    assert gate_doc["keep_s_by_tool"] == {}, "r1's reply named no tool"
    # Paused on a named tool as often as asked, that tool has a keep time of its own, and a run
    # paused on it shows what it waits for.
    turn = "t4"
    for n in range(MIN_TOOL_SAMPLES):
        pool.complete(turn, tool_calls=True, tools=("grep",))
        pool.wait(0.2)
        turn = f"t4-{n}"
        pool.arrive(turn, run_id="r1", caller="alice")
    pool.complete(turn, tool_calls=True, tools=("grep",))
    assert status_document(pool.state, pool.now)["gate"]["keep_s_by_tool"] == {"alice": {"grep": HOLD_MIN_S}}
    assert run_document(pool.state, "r1", now=pool.now)["paused_on"] == "grep"


def test_each_callers_attained_service_is_shown_decayed_and_a_caller_still_waiting_has_none():
    pool = _gated_pool()  # alice's two runs placed, asking 2000 and 4000 tokens, 3 s ago
    fairness_doc = status_document(pool.state, pool.now)["fairness"]
    assert fairness_doc["half_life_s"] == fairness.HALF_LIFE_S
    decayed = 6000 * 2 ** (-3 / fairness.HALF_LIFE_S)
    assert fairness_doc["attained_tokens"] == {"alice": round(decayed)}


def test_a_replicas_prompt_cache_share_is_what_its_engine_counted_since_it_started():
    pool = Pool(spec("a"), spec("b"))
    pool.probe("a", running=0, waiting=0, prompt_tokens=0, cached_tokens=0)
    a = status_document(pool.state, pool.now)["replicas"][0]
    assert (a["prompt_tokens"], a["cached_tokens"], a["prompt_cache_share"]) == (0, 0, None)  # no prompt yet
    pool.probe("a", running=1, waiting=0, prompt_tokens=3000, cached_tokens=1000)
    pool.probe("a", running=1, waiting=0)  # a page without the counters: the last reading stands
    # Reconfigured, the replica keeps what its engine said.
    pool.feed(PoolConfigured((spec("a", lookahead=3), spec("b")), pool.now))
    a, b = status_document(pool.state, pool.now)["replicas"]
    assert (a["prompt_tokens"], a["cached_tokens"], a["prompt_cache_share"]) == (3000, 1000, 0.3333)
    assert (b["prompt_tokens"], b["cached_tokens"], b["prompt_cache_share"]) == (None, None, None)
