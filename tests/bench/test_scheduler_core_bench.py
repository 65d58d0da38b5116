"""`luftpause bench scheduler_core`'s pieces: the saturated workload it drives the core with, and
its count of instructions a decision under callgrind where valgrind is found."""

from __future__ import annotations

import shutil

import pytest

from luftpause.bench import scheduler_core as bench


def test_the_workload_keeps_the_pool_saturated_and_the_held_count_where_it_was() -> None:
    row = bench.measure(held=200, events=2_000, runs=60, callers=12, slots=4)
    # Every replica runs its slots and holds its lookahead waiting; the rest stay held throughout.
    assert row["held"] == 200 and row["runs"] == 60
    assert row["in_flight"] > 4 * len(bench.REPLICAS)
    assert 2_000 <= row["decisions"] < 2_010 and row["decisions_per_s"] > 0


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_instructions_a_decision_are_counted_from_two_callgrind_runs() -> None:
    count = bench.instructions_per_decision(held=100, runs=60, callers=12, slots=4, events=(300, 900))
    # Tens to hundreds of thousands of instructions a decision (about 210,000 at 10,000 held
    # turns on 7 December): a count that included the setup, or none, would be far off.
    assert 50_000 < count < 1_000_000


def test_without_valgrind_the_instructions_are_refused_with_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(bench.shutil, "which", lambda name: None)
    with pytest.raises(SystemExit, match="valgrind is not on PATH"):
        bench.count_instructions(100, 300, 60, 12, 4)
