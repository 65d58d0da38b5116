"""The flood against real llama.cpp (`bench.real_flood`): the engines' command, where things run,
the luftpause arm's config, the counter arithmetic, medians, ratios and the report, the agents
driven through a stack of fake engines; and a few seconds of the real thing where llama-server
is found."""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from luftpause import config
from luftpause.bench import real_flood
from luftpause.bench.common import Processes, free_port, wait_healthy
from luftpause.loadgen.subagents import FloodSpec
from luftpause.scheduler import gate

# What the real binary's /metrics said after three turns (llama-server from tools/llamacpp.sh).
METRICS = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 1423
# HELP llamacpp:prompt_tokens_cached_total Number of prompt tokens reused from the cache
# TYPE llamacpp:prompt_tokens_cached_total counter
llamacpp:prompt_tokens_cached_total 4257
llamacpp:prompt_seconds_total 0.337155
llamacpp:tokens_predicted_total 101
llamacpp:prompt_tokens_seconds 4220.61
llamacpp:requests_processing 0
"""


def _args(**kw: Any) -> argparse.Namespace:
    args = real_flood._parser().parse_args([])
    for key, value in kw.items():
        setattr(args, key, value)
    return args


def test_the_engines_run_with_slots_one_thread_metrics_and_the_host_cache_as_the_arm_says() -> None:
    on = real_flood.engine_command(
        "llama-server", "m.gguf", 9001, slots=4, slot_context=4096, host_cache=True, max_tokens=32
    )
    off = real_flood.engine_command(
        "llama-server", "m.gguf", 9001, slots=4, slot_context=4096, host_cache=False, max_tokens=32
    )
    assert off == [*on, "--cache-ram", "0"]  # on is llama-server's default
    flags = dict(zip(on[1::2], on[2::2], strict=False))
    assert flags["--parallel"] == "4" and flags["--ctx-size"] == "16384"  # 4096 a slot
    assert flags["--threads"] == "1" and flags["--alias"] == real_flood.MODEL_NAME
    assert {"--metrics", "--slots", "--jinja"} <= set(on)


def test_the_engines_get_the_first_cpu_and_the_stack_the_second() -> None:
    two = real_flood.Cores.split({1, 0})
    assert two.engine_prefix() == ["taskset", "-c", "0"] and two.stack_prefix() == ["taskset", "-c", "1"]
    assert real_flood.Cores.split({7, 3, 5}) == real_flood.Cores(3, 5)
    one = real_flood.Cores.split({2})
    assert one.engine_prefix() == [] and one.stack_prefix() == []


def test_the_luftpause_arm_declares_llamacpp_replicas_with_their_slots_and_host_cache(tmp_path: Path) -> None:
    for host_cache in (True, False):
        path = real_flood.luftpause_config(
            tmp_path, [9101, 9102], grpc=9200, status=9201, dataplane=9202, host_cache=host_cache, slots=4
        )
        conf = config.load(path)
        assert (conf.dataplane.port, conf.dataplane.scheduler) == (9202, "127.0.0.1:9200")
        assert [r.url for r in conf.replicas] == ["http://127.0.0.1:9101", "http://127.0.0.1:9102"]
        for r in conf.replicas:
            assert (r.metrics, r.engine_priority, r.kv_slots, r.models) == (
                "llamacpp",
                "none",
                4,
                [real_flood.MODEL_NAME],
            )
            assert r.keeps_host_cache() is host_cache
            # With the host cache off the gate holds a run a slot; with it on, none.
            assert gate.mode(r) == ("off: host cache" if host_cache else "slots")


def test_the_gated_arm_holds_a_run_a_slot_and_runs_only_where_the_host_cache_is_on(tmp_path: Path) -> None:
    """The gate's other setting: the engines keep a host cache, the config says they do not."""
    arms = ["straight", "luftpause", real_flood.GATED]
    assert real_flood.arms_for(arms, "on") == arms
    assert real_flood.arms_for(arms, "off") == ["straight", "luftpause"]  # off, it is luftpause's stack
    rows = [
        _row(0, "on", "straight", 4, 20, 20),
        _row(0, "on", "luftpause", 5, 19, 16),
        _row(0, "on", real_flood.GATED, 8, 16, 10),
    ]
    ours, gated = (
        real_flood.ratios(rows, "straight", "on"),
        real_flood.ratios(rows, "straight", "on", real_flood.GATED),
    )
    assert (ours["arm"], ours["interactive_runs_per_min"]["median"]) == ("luftpause", 1.25)
    assert (
        gated["arm"],
        gated["interactive_runs_per_min"]["median"],
        gated["batch_runs_per_min"]["median"],
    ) == (
        real_flood.GATED,
        2.0,
        0.8,
    )
    summary = {"placement": "-", "medians": real_flood.medians(rows), "ratios": [ours, gated]}
    text = real_flood.report(_args(repeats=1), rows, summary)
    assert f"| on | {real_flood.GATED} | straight | 2.00 |" in text


def test_the_cache_share_is_cached_over_cached_plus_prefilled_in_the_window() -> None:
    before = real_flood.parse_counters(METRICS)
    assert before == {"prompt_tokens": 1423.0, "cached_tokens": 4257.0, "prefill_s": 0.337155}
    after = {"prompt_tokens": 1423.0 + 500, "cached_tokens": 4257.0 + 1500, "prefill_s": 2.5}
    window = real_flood.counter_window(before, after)
    assert window == {
        "prompt_tokens": 2000,
        "prefilled_tokens": 500,
        "cached_tokens": 1500,
        "cache_share": 0.75,
        "prefill_s": 2.16,
    }
    assert real_flood.counter_window(before, before)["cache_share"] is None


def _row(
    repeat: int, host: str, arm: str, inter: float, batch: float, p50: float, counts: bool = True
) -> dict:
    real = {
        "interactive_runs_per_min": inter,
        "batch_runs_per_min": batch,
        "interactive_p50_s": p50,
        "interactive_p99_s": p50 * 2,
        "all_runs_per_min": inter + batch,
        "turns": int(10 * (inter + batch)),
        "cache_share": 0.5,
        "prefill_s": 10.0,
        "errors": 0,
        "cpu_busy": 0.5 if counts else 0.95,
    }
    return {
        "repeat": repeat,
        "host_cache": host,
        "arm": arm,
        "real": real,
        "counts": counts,
        "why_not": None if counts else "CPU saturated (CPUs 95% busy)",
    }


def test_ratios_take_the_repeats_where_both_count_and_the_verdict_reads_them() -> None:
    rows = [
        _row(0, "off", "straight", 4, 20, 20),
        _row(0, "off", "luftpause", 8, 18, 10),
        _row(1, "off", "straight", 5, 20, 20),
        _row(1, "off", "luftpause", 10, 20, 15),
        _row(2, "off", "straight", 5, 20, 20, counts=False),
        _row(2, "off", "luftpause", 1, 1, 99),
    ]
    r = real_flood.ratios(rows, "straight", "off")
    assert r["counted"] == 2 and not r["repeats"][2]["counts"]
    assert "straight: CPU saturated" in r["repeats"][2]["why_not"]
    assert r["interactive_runs_per_min"] == {"median": 2.0, "low": 2.0, "high": 2.0, "n": 2}
    assert r["interactive_p50_s"]["low"] == 0.5 and r["interactive_p50_s"]["high"] == 0.75
    assert r["batch_runs_per_min"]["median"] == 0.95
    assert r["verdict"].startswith(
        "interactive ahead in every counted repeat (2.00x), batch -5%; targets not met: "
    )
    assert "interactive_runs_per_min 2.0 (needs >= 3.0)" in r["verdict"]
    assert "batch_runs_per_min 0.95 (needs >= 1.3)" in r["verdict"]
    # With the host cache on the targets are about order at no cost.
    on = [_row(0, "on", "straight", 4, 20, 20), _row(0, "on", "luftpause", 6, 20, 12)]
    assert real_flood.ratios(on, "straight", "on")["verdict"].endswith("; targets met")
    slower = [_row(0, "on", "straight", 4, 20, 20), _row(0, "on", "luftpause", 6, 20, 15)]
    assert real_flood.ratios(slower, "straight", "on")["verdict"].endswith(
        "targets not met: interactive_p50_s 0.75 (needs <= 0.67)"
    )
    assert real_flood.ratios(rows, "sglang-router", "off")["verdict"] == "no verdict: no repeat counted"

    # A baseline that finished no interactive run gives no ratio: that repeat does not count.
    rows.append(_row(0, "off", "sglang-router", 0, 20, 20))
    r = real_flood.ratios(rows, "sglang-router", "off")
    assert r["counted"] == 0 and r["repeats"][0]["why_not"] == "sglang-router finished no interactive run"

    m = real_flood.medians(rows)["off"]
    assert m["straight"]["interactive_runs_per_min"] == {"median": 4.5, "low": 4, "high": 5, "n": 2}
    assert m["luftpause"]["interactive_runs_per_min"]["n"] == 3  # its third row counts on its own


def test_the_report_has_every_row_the_medians_and_the_ratios(tmp_path: Path) -> None:
    rows = [
        _row(0, host, arm, 5 + i, 20, 12) for host in ("on", "off") for i, arm in enumerate(real_flood.ARMS)
    ]
    rows.append(_row(1, "off", "luftpause", 9, 20, 11, counts=False))
    summary = {
        "placement": "engines on CPU 0, the rest on CPU 1",
        "medians": real_flood.medians(rows),
        "ratios": [real_flood.ratios(rows, b, h) for h in ("on", "off") for b in real_flood.BASELINES],
    }
    text = real_flood.report(_args(repeats=2), rows, summary)
    assert text.count("\n| 1 | ") == 8 and "| 2 | off | luftpause |" in text
    assert "| off | luftpause | 8.00 | 12.00 | 24.00 | 20.00 | 280.00 | 0.50 | 1 |" in text
    assert "| on | luftpause | sglang-router | 1.14 |" in text  # luftpause's 8 interactive runs/min over 7
    assert "Not counted: repeat 2 off luftpause: CPU saturated" in text
    rows.append(_row(1, "off", "straight", 0, 20, 11))
    rows[-2]["counts"] = True
    summary["ratios"] = [real_flood.ratios(rows, "straight", "off")]
    text = real_flood.report(_args(repeats=2), rows, summary)
    assert "Not counted: repeat 2 off against straight: straight finished no interactive run." in text
    png = real_flood.plot(tmp_path / "x.png", rows)
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_only_the_straight_arm_pins_runs_and_only_luftpause_hears_their_end() -> None:
    procs = Processes(Path("."))
    urls = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    args = _args(batch=3, interactive=0)
    for arm in real_flood.ARMS:
        front = None if arm == "straight" else "http://127.0.0.1:3"
        load = real_flood.specs(arm, real_flood.ArmStack(arm, procs, urls, urls, front), args, "1")
        assert set(load) == {"batch"}  # a class without agents runs none
        spec = load["batch"]
        assert spec.pin_urls == (tuple(urls) if arm == "straight" else ())
        assert spec.end_runs is (arm == "luftpause")
        assert (spec.tool_calls, spec.max_tokens, spec.stream, spec.context_chars) == ((1, 3), 32, True, 8000)
        assert spec.model == real_flood.MODEL_NAME and spec.caller == "flood-batch"


def test_over_mcp_the_runtime_spawns_the_floods_model_and_each_class_is_a_sub_agent_flood(
    tmp_path: Path,
) -> None:
    path = real_flood.runtime_config(tmp_path, port=9300, front_url="http://127.0.0.1:9202", fake_mcp=9301)
    runtime = config.load(path).runtime
    assert (runtime.port, runtime.dataplane, runtime.default_model) == (
        9300,
        "http://127.0.0.1:9202",
        real_flood.MODEL_NAME,
    )
    assert [(m.name, m.url) for m in runtime.mcp_servers] == [("fake-mcp", "http://127.0.0.1:9301/mcp")]
    urls = ["http://127.0.0.1:1"]
    s = real_flood.ArmStack("luftpause", Processes(tmp_path), urls, urls, "http://127.0.0.1:3", set(),
                            "http://127.0.0.1:4/mcp")  # fmt: skip
    load = real_flood.specs("luftpause", s, _args(batch=3, interactive=1, agents="mcp"), "7")
    assert {cls: (spec.url, spec.agents, spec.service_class) for cls, spec in load.items()} == {
        "interactive": ("http://127.0.0.1:4/mcp", 1, "interactive"),
        "batch": ("http://127.0.0.1:4/mcp", 3, "batch"),
    }
    assert all(
        isinstance(spec, FloodSpec) and spec.seed == "7" and spec.max_tokens == 32 for spec in load.values()
    )


def test_over_mcp_only_the_arms_with_a_front_are_offered(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        real_flood.main(["--agents", "mcp", "--arms", "straight,luftpause"])
    assert (
        "arms must be among sglang-router, luftpause, luftpause-gated (with --agents mcp)"
        in capsys.readouterr().err
    )


def test_the_agents_are_driven_through_a_stack_with_progress_counters_and_the_cpu_check(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The straight arm over two fake engines (no llama.cpp counters there: zero prompt tokens)."""
    procs = Processes(tmp_path)
    ports = [free_port(), free_port()]
    try:
        for i, port in enumerate(ports):
            procs.start(
                f"fake-{i}",
                [sys.executable, "-m", "luftpause", "--log-level", "WARNING", "fake-engine",
                 "--name", f"fake-{i}", "--port", str(port)],
            )  # fmt: skip
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        for url in urls:
            wait_healthy(f"{url}/health", procs)
        s = real_flood.ArmStack("straight", procs, urls, urls, None)
        args = _args(
            batch=3, interactive=2, warmup_s=0.5, window_s=3.0, tool_latency_s=0.1, context_chars=600
        )
        load = real_flood.specs("straight", s, args, "1")
        load = {cls: replace(spec, model=config.DEFAULT_MODEL) for cls, spec in load.items()}
        real_flood.PROGRESS_EVERY_S, saved = 1.0, real_flood.PROGRESS_EVERY_S
        try:
            real = asyncio.run(real_flood.drive(s, load, args, real_flood.Cores(None, None), "test"))
        finally:
            real_flood.PROGRESS_EVERY_S = saved
    finally:
        procs.stop()
    assert real["errors"] == 0 and real["turns"] > 0
    assert real["all_runs_per_min"] == round(
        (real["summaries"]["batch"]["runs"] + real["summaries"]["interactive"]["runs"]) / (3.0 / 60), 2
    )
    assert real["prompt_tokens"] == 0 and real["cache_share"] is None
    assert "agents" in real["process_cores"] and isinstance(real["saturated"], bool)
    assert "real_flood test [" in capsys.readouterr().err  # the progress lines


def test_a_few_seconds_against_real_llama_server() -> None:
    if real_flood.find_llama_server() is None:
        pytest.skip(
            "no llama-server ($LLAMA_SERVER, PATH or tools/llamacpp.sh's cache): tools/llamacpp.sh builds one"
        )
    done = subprocess.run(
        [
            sys.executable, "-m", "luftpause", "bench", "real_flood", "--repeats", "1", "--warmup-s", "1",
            "--window-s", "5", "--host-cache", "off", "--arms", "straight,luftpause", "--batch", "2",
            "--interactive", "1", "--tool-latency-s", "0.5", "--context-chars", "2000", "--no-record",
        ],
        capture_output=True,
        text=True,
        timeout=110,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| 1 | off | ")]
    assert [row.split(" | ")[2] for row in rows] == ["straight", "luftpause"]
    for row in rows:
        cells = row.split(" | ")
        assert int(cells[7]) > 0 and cells[10] == "0"  # turns served, no errors
        assert cells[8].endswith("%")  # the engines' counters were read
