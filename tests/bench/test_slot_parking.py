"""Parking a paused run on llama.cpp (`bench.slot_parking`): the medians and ratios from trials, the
verdict either way, the report; and a short run against the real llama-server where one is found
(a restored slot must leave next to nothing to prefill again)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from luftpause.bench import slot_parking


def _trial(
    way: str, tokens: int, back_ms: float, save_ms: float = 0.0, restore_ms: float = 0.0
) -> dict[str, Any]:
    park = way == "park"
    save = (
        {"wall_ms": save_ms, "engine_ms": save_ms, "tokens": tokens, "bytes": tokens * 9216} if park else None
    )
    restore = (
        {"wall_ms": restore_ms, "engine_ms": restore_ms, "tokens": tokens, "bytes": tokens * 9216}
        if park
        else None
    )
    back = {"wall_ms": back_ms, "prompt_ms": back_ms, "prompt_n": 1 if park else tokens, "cached": 0}
    run_ms = back_ms + restore_ms
    return {"way": way, "tokens": tokens, "repeat": 1, "cold": back, "save": save, "restore": restore,
            "back": back, "run_ms": run_ms, "engine_ms": run_ms + save_ms}  # fmt: skip


def test_parking_is_said_to_win_over_each_other_way_only_where_both_its_costs_are_lower() -> None:
    trials = [
        # 1024 tokens: parking's restore plus a token beats both.
        _trial("recompute", 1024, 200.0), _trial("host-cache", 1024, 60.0),
        _trial("park", 1024, 5.0, save_ms=10.0, restore_ms=20.0),
        # 256 tokens: the host cache is cheaper than parking's round trips.
        _trial("recompute", 256, 50.0), _trial("host-cache", 256, 12.0),
        _trial("park", 256, 5.0, save_ms=10.0, restore_ms=15.0),
    ]  # fmt: skip
    summary = slot_parking.summarise(trials)
    assert summary["1024"]["park_over_recompute_run_ms"] == round(25 / 200, 3)
    assert summary["1024"]["park_over_host-cache_engine_ms"] == round(35 / 60, 3)
    assert summary["256"]["park_over_host-cache_run_ms"] == round(20 / 12, 3)
    assert summary["1024"]["park"]["prefilled_again"] == 1
    assert slot_parking.verdict(summary) == (
        "Parking costs less than a recompute at 256, 1024 tokens. "
        "Parking costs less than the host cache at 1024 tokens."
    )
    summary = slot_parking.summarise([t for t in trials if t["tokens"] == 256])
    assert slot_parking.verdict(summary).endswith(
        "Parking costs more than the host cache at every size measured."
    )


def test_the_report_has_a_row_per_size_and_way_and_the_ratios() -> None:
    trials = [_trial("recompute", 512, 100.0), _trial("host-cache", 512, 30.0),
              _trial("park", 512, 4.0, save_ms=8.0, restore_ms=9.0)]  # fmt: skip
    text = slot_parking.table({"summary": slot_parking.summarise(trials)})
    assert "| 512 | park | 13 (13-13) | 21 (21-21) | 8 | 9 | 1 |" in text
    assert "| 512 | 0.13, 0.21 | 0.433, 0.7 |" in text


def test_a_short_run_against_the_real_llama_server(tmp_path: Path) -> None:
    if slot_parking.find_llama_server() is None:
        pytest.skip(
            "no llama-server ($LLAMA_SERVER, PATH or tools/llamacpp.sh's cache): tools/llamacpp.sh builds one"
        )
    done = subprocess.run(
        [sys.executable, "-m", "luftpause", "bench", "slot_parking", "--tokens", "256", "--repeats", "1",
         "--no-record"],
        capture_output=True, text=True, timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = {line.split(" | ")[1]: line for line in done.stdout.splitlines() if line.startswith("| 256 | ")}
    assert set(rows) >= set(slot_parking.WAYS)
    # Restored from disk, the run's prompt is prefilled again only past what the slot held.
    assert int(rows["park"].rstrip(" |").rsplit(" | ", 1)[1]) <= 8
    assert int(rows["recompute"].rstrip(" |").rsplit(" | ", 1)[1]) >= 200
