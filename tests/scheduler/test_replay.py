"""Replaying a recorded event log reproduces every decision, in this process and in another one."""

from __future__ import annotations

import dataclasses
import os
import pickle
import random
import subprocess
import sys
from collections import Counter
from pathlib import Path

from scheduler_pool import Pool, spec

from luftpause.scheduler.actions import Place
from luftpause.scheduler.core import replay
from luftpause.scheduler.events import (
    FirstToken,
    ReplicaProbed,
    Resynced,
    ResyncedRun,
    ResyncedTurn,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, Phase, ServiceClass, TurnStatus


def _busy_log(seed: int, steps: int = 400) -> tuple[list, list, Counter]:
    """A log of a busy pool driven at random (every choice made from sorted lists), its actions, and
    how many turns each kind of event confirmed as started."""
    rng = random.Random(seed)
    pool = Pool(
        spec("a"),
        spec("b", lookahead=1),
        spec("c", "m", "other", lookahead=0),
        spec("cls", "m", kind=Kind.SINGLE_PASS),
    )
    actions: list = []
    confirmed_by: Counter = Counter()
    runs = [f"run-{i}" for i in range(12)]
    callers = ["alice", "bob", ""]
    for step in range(steps):
        pool.wait(700.0 if rng.random() < 0.01 else rng.choice([0.0, 0.0, 0.5, 1.0, 5.0]))
        placed = sorted(t.turn_id for t in pool.state.turns.values() if t.status is TurnStatus.PLACED)
        held = pool.held()
        before = {t.turn_id for t in pool.state.placed() if t.confirmed}
        decided = len(actions)
        roll = rng.random()
        if roll < 0.4:
            actions += pool.arrive(
                f"turn-{step}",
                run_id=rng.choice(runs),
                cls=rng.choice(["interactive", "batch"]),
                caller=rng.choice(callers),
                model=rng.choice(["m", "m", "other", "unknown"]),
                kind=Kind.SINGLE_PASS if rng.random() < 0.1 else Kind.GENERATIVE,
            )
        elif roll < 0.58 and placed:
            actions += pool.complete(rng.choice(placed), tool_calls=rng.random() < 0.5)
        elif roll < 0.61 and placed:  # a report repeated
            turn = pool.state.turns[rng.choice(placed)]
            actions += pool.feed(TurnStarted(turn.turn_id, turn.run_id, pool.now, rng.random() < 0.5))
        elif roll < 0.65 and placed:
            turn = pool.state.turns[rng.choice(placed)]
            actions += pool.feed(FirstToken(turn.turn_id, turn.run_id, pool.now))
        elif roll < 0.7 and placed:
            actions += pool.fail(rng.choice(placed))
        elif roll < 0.75 and held:
            actions += pool.abandon(rng.choice(held))
        elif roll < 0.9:
            name = rng.choice(["a", "b", "c", "cls"])
            sent_at = rng.choice([None, pool.now - 1.0])
            healthy, running, waiting = rng.random() < 0.85, rng.randint(1, 3), rng.choice([0, 0, 1, 1, 2])
            # The engine's prompt-cache counters, growing (drawn from the step, not the rng: the
            # log stays the one it was before they were carried).
            cache = (100 * step, 60 * step) if healthy and step % 3 else (None, None)
            actions += pool.probe(name, healthy, running, waiting, sent_at, None, None, *cache)
        elif roll < 0.95:
            actions += pool.tick()
        elif roll < 0.98:
            actions += pool.end_run(rng.choice(runs))
        else:
            actions += pool.feed(
                Resynced(
                    runs=(
                        ResyncedRun(
                            rng.choice(runs), "b", Phase.PAUSED, ServiceClass.INTERACTIVE, "bob", 12.0
                        ),
                    ),
                    turns=tuple(
                        ResyncedTurn(t, pool.state.turns[t].run_id, "a", ServiceClass.BATCH, "alice", "m")
                        for t in placed[:2]
                    ),
                    at=pool.now,
                )
            )
        after = {t.turn_id for t in pool.state.placed() if t.confirmed}
        confirmed_by[type(pool.log[-1]).__name__] += len(after - before)
        # The dataplane reports each request sent as it goes out, its reply streamed or not.
        for action in actions[decided:]:
            turn = pool.state.turns.get(action.turn_id) if isinstance(action, Place) else None
            if turn is not None and turn.status is TurnStatus.PLACED:
                actions += pool.start(turn.turn_id, streamed=rng.random() < 0.5)
    return pool.log, actions, confirmed_by


def test_replaying_a_log_reproduces_every_action_and_the_final_state():
    log, actions, confirmed_by = _busy_log(seed=7)
    # The log really exercises placement, and every way a turn is taken for started.
    assert sum(isinstance(a, Place) for a in actions) > 50
    assert all(confirmed_by[kind] > 0 for kind in ("FirstToken", "ReplicaProbed", "TurnCompleted"))
    first_state, first = replay(log)
    second_state, second = replay(log)
    assert first == actions
    assert second == actions
    assert first_state == second_state


def test_replay_does_not_depend_on_the_process_hash_seed(tmp_path: Path):
    log, actions, _ = _busy_log(seed=11, steps=250)
    (tmp_path / "log.pickle").write_bytes(pickle.dumps(log))
    script = (
        "import pickle, sys; from luftpause.scheduler.core import replay; "
        "state, actions = replay(pickle.load(open(sys.argv[1], 'rb'))); "
        "sys.stdout.buffer.write(pickle.dumps((state, actions)))"
    )
    for seed in ("1", "2"):
        out = subprocess.run(
            [sys.executable, "-c", script, str(tmp_path / "log.pickle")],
            capture_output=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
            timeout=60,
        ).stdout
        state, replayed = pickle.loads(out)
        assert replayed == actions
        assert state == replay(log)[0]


def test_the_engines_prompt_cache_counters_change_no_decision():
    # They are carried into the state to be shown (/status, /metrics), and read by no decision:
    # the same log without them decides the same, and the states differ in them alone.
    log, actions, _ = _busy_log(seed=5, steps=300)
    probes = [e for e in log if isinstance(e, ReplicaProbed) and e.prompt_tokens is not None]
    assert len(probes) > 20
    bare = [
        dataclasses.replace(e, prompt_tokens=None, cached_tokens=None) if isinstance(e, ReplicaProbed) else e
        for e in log
    ]
    state, with_counters = replay(log)
    bare_state, without = replay(bare)
    assert with_counters == without == actions
    last = {e.name: (e.prompt_tokens, e.cached_tokens) for e in probes}
    assert {n: (r.prompt_tokens, r.cached_tokens) for n, r in state.replicas.items() if n in last} == last
    assert all(r.prompt_tokens is None for r in bare_state.replicas.values())
    unshown = {n: r._replace(prompt_tokens=None, cached_tokens=None) for n, r in state.replicas.items()}
    assert state._replace(replicas=bare_state.replicas) == bare_state
    assert unshown == dict(bare_state.replicas)
