"""Parking a paused run on llama.cpp, measured before it is built: save its slot to disk and
restore it at the run's next turn, against a recompute and against the engine's host cache.

When a run waits on a tool and its slot is wanted by another run, three things can bring its
prefix back at its next turn:

- `recompute`: nothing is kept; the engine prefills the whole prefix again (a GPU engine
  without a host tier, or llama.cpp with `--cache-ram 0`);
- `park`: the gateway saves the slot before handing it over (`POST /slots/0?action=save`, the
  engine writes the slot's KV to `--slot-save-path`) and restores it before the run's next turn
  (`action=restore`); the turn then prefills only what is new;
- `host-cache`: llama.cpp's own host-memory prompt cache (`--cache-ram`, on by default) keeps the
  evicted prompt and loads it back when the run's prompt comes again.

Each way runs on a llama-server of its own (one slot, one thread, pinned to the first CPU where
there are two, the benchmark's own model from `bench.llamacpp_model` or `--model`), interleaved
within each repeat, for prompts of several sizes. A trial: the run's prompt A (cold), another
prompt B of the same size takes the slot, then A comes back; `park` saves after A and restores
after B. Timed per trial: the client's wall time of each request, and the engine's own
`timings` (prompt_ms, save_ms, restore_ms). Two costs follow:

- the run's: what stands between its tool's answer and its next turn (recompute: the turn;
  park: restore + the turn; host cache: the turn);
- the engine's: the time the engine spends on it, which no other slot can use (park adds the
  save, done while the run waits on its tool).

Parking is worth building only where its costs are below both others. JSON, markdown and a PNG
(the run's cost by way and size) under bench/results/.

    luftpause bench slot_parking                           # 4 sizes x 5 repeats: 6 minutes on two busy cores
    luftpause bench slot_parking --tokens 1024 2048 --repeats 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from luftpause.bench import llamacpp_model, results
from luftpause.bench.common import Processes, free_port, spread, wait_healthy
from luftpause.bench.real_flood import Cores, engine_command, find_llama_server, model_path
from luftpause.loadgen.conversation import context_text

WAYS = ("recompute", "park", "host-cache")
REQUEST_TIMEOUT_S = 600.0


def prompt_of(seed: str, tokens: int, merges: list[tuple[str, str]]) -> str:
    """Filler text of about `tokens` of the model's tokens (its own tokenizer's count)."""
    chars = int(tokens * llamacpp_model.chars_per_token(context_text(seed, 4000), merges))
    return context_text(seed, chars)


class Engine:
    """One llama-server, spoken to as the benchmark needs: a completion on slot 0, its save/restore."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.client = httpx.Client(base_url=url, timeout=REQUEST_TIMEOUT_S)

    def complete(self, prompt: str) -> dict[str, Any]:
        started = time.perf_counter()
        answer = self.client.post(
            "/completion",
            json={"prompt": prompt, "n_predict": 1, "cache_prompt": True, "id_slot": 0, "temperature": 0},
        )
        answer.raise_for_status()
        body = answer.json()
        timings = body.get("timings") or {}
        return {
            "wall_ms": (time.perf_counter() - started) * 1000,
            "prompt_ms": timings.get("prompt_ms"),
            "prompt_n": timings.get("prompt_n"),
            "cached": body.get("tokens_cached"),
        }

    def slot(self, action: str, filename: str) -> dict[str, Any]:
        started = time.perf_counter()
        answer = self.client.post(f"/slots/0?action={action}", json={"filename": filename})
        answer.raise_for_status()
        body = answer.json()
        return {
            "wall_ms": (time.perf_counter() - started) * 1000,
            "engine_ms": (body.get("timings") or {}).get(f"{action}_ms"),
            "tokens": body.get("n_saved", body.get("n_restored")),
            "bytes": body.get("n_written", body.get("n_read")),
        }


def trial(way: str, engine: Engine, a: str, b: str, name: str) -> dict[str, Any]:
    """A cold, B takes the slot, A again; `park` saves A's slot before B and restores it after."""
    cold = engine.complete(a)
    save = engine.slot("save", name) if way == "park" else None
    engine.complete(b)
    restore = engine.slot("restore", name) if way == "park" else None
    back = engine.complete(a)
    run_ms = back["wall_ms"] + (restore["wall_ms"] if restore else 0.0)
    engine_ms = run_ms + (save["wall_ms"] if save else 0.0)
    return {
        "cold": cold,
        "save": save,
        "restore": restore,
        "back": back,
        "run_ms": run_ms,
        "engine_ms": engine_ms,
    }


def run(args: argparse.Namespace) -> dict[str, Any]:
    binary = find_llama_server(args.llama_server)
    if binary is None:
        raise SystemExit(
            "no llama-server found: run tools/llamacpp.sh (builds one once) or pass --llama-server"
        )
    merges = llamacpp_model.learn_merges(llamacpp_model.corpus(), llamacpp_model.Dimensions().merges)
    work = Path(tempfile.mkdtemp(prefix="luftpause-slot-parking-"))
    model = model_path(args.model, work)
    cores = Cores.split(os.sched_getaffinity(0))
    procs = Processes(work)
    context = max(args.tokens) * 2 + 256
    engines: dict[str, Engine] = {}
    try:
        for way in WAYS:
            port = free_port()
            argv = engine_command(binary, str(model), port, slots=1, slot_context=context,
                                  host_cache=way == "host-cache", max_tokens=1)  # fmt: skip
            if way == "park":
                argv += ["--slot-save-path", str(work / "slots")]
                (work / "slots").mkdir()
            procs.start(way, [*cores.engine_prefix(), *argv])
            engines[way] = Engine(f"http://127.0.0.1:{port}")
        for way, engine in engines.items():
            wait_healthy(f"{engine.url}/health", procs, timeout_s=120)
            engine.complete(prompt_of(f"warm-{way}", 64, merges))
        trials: list[dict[str, Any]] = []
        for repeat in range(1, args.repeats + 1):
            for tokens in args.tokens:
                a = prompt_of(f"run-{repeat}-{tokens}", tokens, merges)
                b = prompt_of(f"other-{repeat}-{tokens}", tokens, merges)
                ways = WAYS if repeat % 2 else tuple(reversed(WAYS))
                for way in ways:
                    t = trial(way, engines[way], a, b, f"run-{repeat}-{tokens}.bin")
                    trials.append({"way": way, "tokens": tokens, "repeat": repeat, **t})
                    print(f"repeat {repeat} {tokens:>5} tokens {way:>10}: run {t['run_ms']:7.1f} ms, "
                          f"engine {t['engine_ms']:7.1f} ms, prefilled again {t['back']['prompt_n']}",
                          flush=True)  # fmt: skip
        return {"binary": binary, "model": str(model), "tokens": args.tokens, "repeats": args.repeats,
                "trials": trials, "summary": summarise(trials)}  # fmt: skip
    finally:
        procs.stop()
        results.tidy_logs("slot_parking", work, failed=False)


def summarise(trials: list[dict[str, Any]]) -> dict[str, Any]:
    """Per size and way: the medians (and spread) of the run's and the engine's cost, the save and
    restore times, the tokens prefilled on return; per size, park over recompute and host cache."""
    out: dict[str, Any] = {}
    for tokens in sorted({t["tokens"] for t in trials}):
        row: dict[str, Any] = {}
        for way in WAYS:
            mine = [t for t in trials if t["tokens"] == tokens and t["way"] == way]
            if not mine:
                continue
            row[way] = {
                "run_ms": spread([t["run_ms"] for t in mine]),
                "engine_ms": spread([t["engine_ms"] for t in mine]),
                "cold_ms": spread([t["cold"]["wall_ms"] for t in mine]),
                "prefilled_again": statistics.median(t["back"]["prompt_n"] or 0 for t in mine),
                "save_ms": spread([t["save"]["wall_ms"] for t in mine if t["save"]]),
                "restore_ms": spread([t["restore"]["wall_ms"] for t in mine if t["restore"]]),
                "saved_bytes": max((t["save"]["bytes"] or 0 for t in mine if t["save"]), default=None),
            }
        for cost in ("run_ms", "engine_ms"):
            park = row.get("park", {}).get(cost, {}).get("median")
            for other in ("recompute", "host-cache"):
                base = row.get(other, {}).get(cost, {}).get("median")
                row[f"park_over_{other}_{cost}"] = round(park / base, 3) if park and base else None
        out[str(tokens)] = row
    return out


def verdict(summary: dict[str, Any]) -> str:
    """Where parking costs less than a recompute, and where less than the host cache (both costs)."""

    def sizes(other: str) -> list[str]:
        return [
            size
            for size, row in summary.items()
            if all((row.get(f"park_over_{other}_{cost}") or 2) < 1 for cost in ("run_ms", "engine_ms"))
        ]

    def said(other: str, wins: list[str]) -> str:
        if not wins:
            return f"Parking costs more than {other} at every size measured."
        return f"Parking costs less than {other} at {', '.join(wins)} tokens."

    return f"{said('a recompute', sizes('recompute'))} {said('the host cache', sizes('host-cache'))}"


def table(record: dict[str, Any]) -> str:
    lines = [
        "| tokens | way | run's cost ms (median, low-high) | engine's cost ms | save ms | restore ms | prefilled again |",
        "|---:|---|---|---|---:|---:|---:|",
    ]
    for size, row in record["summary"].items():
        for way in WAYS:
            if way not in row:
                continue
            w = row[way]
            lines.append(
                f"| {size} | {way} | {_cells(w['run_ms'])} | {_cells(w['engine_ms'])} | "
                f"{results.cell(w['save_ms']['median'])} | {results.cell(w['restore_ms']['median'])} | "
                f"{results.cell(w['prefilled_again'])} |"
            )
    lines += [
        "",
        "| tokens | park / recompute (run, engine) | park / host cache (run, engine) |",
        "|---:|---|---|",
    ]
    for size, row in record["summary"].items():
        lines.append(
            f"| {size} | {results.cell(row['park_over_recompute_run_ms'])}, "
            f"{results.cell(row['park_over_recompute_engine_ms'])} | "
            f"{results.cell(row['park_over_host-cache_run_ms'])}, {results.cell(row['park_over_host-cache_engine_ms'])} |"
        )
    lines += ["", verdict(record["summary"])]
    return "\n".join(lines)


def _cells(s: dict[str, float | None]) -> str:
    return f"{results.cell(s['median'])} ({results.cell(s['low'])}-{results.cell(s['high'])})"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="luftpause bench slot_parking", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, nargs="+", default=[512, 1024, 2048, 3072], help="prompt sizes")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--model", help="a GGUF to serve instead of the benchmark's own small model")
    p.add_argument("--llama-server", help="the llama-server binary (default: tools/llamacpp.sh's)")
    p.add_argument("--no-record", action="store_true")
    args = p.parse_args(argv)
    record = run(args)
    text = table(record)
    print(text)
    if not args.no_record:
        bars = {
            f"{way} {size}": [
                t["run_ms"] for t in record["trials"] if t["way"] == way and str(t["tokens"]) == size
            ]
            for size in record["summary"]
            for way in WAYS
        }
        results.write_with_bars(
            "slot_parking", record, text, "a paused run's prefix brought back", "ms", bars
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
