"""The simulator: deterministic, each arm places turns as it says, and the CLI prints the agreed shapes."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from luftpause.bench.sim import arms as sim_arms
from luftpause.bench.sim.agents import Overheads
from luftpause.bench.sim.cli import main
from luftpause.bench.sim.run import ArmResult, simulate
from luftpause.bench.sim.scenarios import RUNTIME_OVERHEADS, SCENARIOS, Scenario
from luftpause.fake_engine.params import EngineParams

# A small flood: 14 agents on two replicas whose KV pools hold three turns each, so both queue.
SMALL_FLOOD = Scenario(
    "small-flood", batch_agents=12, interactive_agents=2, context_chars=8000, warmup_s=20, window_s=60
)
SMALL_POOL = EngineParams(kv_pool_tokens=8192)
QUIET = Scenario("quiet", batch_agents=2, interactive_agents=2, context_chars=2000, warmup_s=10, window_s=60)


def test_the_same_seed_gives_the_same_figures() -> None:
    first = simulate(SMALL_FLOOD, "luftpause", seed=7, params=SMALL_POOL)
    again = simulate(SMALL_FLOOD, "luftpause", seed=7, params=SMALL_POOL)
    assert {**first.as_dict(), "wall_s": 0} == {**again.as_dict(), "wall_s": 0}
    assert first.runs > 0 and first.interactive_runs_per_min > 0 and first.batch_runs_per_min > 0


def test_round_robin_moves_runs_and_the_cache_keeping_arms_do_not() -> None:
    results = {arm: simulate(QUIET, arm, seed=1) for arm in sim_arms.ARMS}
    assert results["router-round-robin"].runs_moved > 0
    for arm in ("sglang-cache-aware", "sglang-sticky", "luftpause"):
        assert results[arm].runs_moved == 0, arm
    # Keeping a run where its prefix is cached shows in the engines' hit rate.
    assert (
        results["sglang-cache-aware"].prefix_cache_hit_rate
        > results["router-round-robin"].prefix_cache_hit_rate
    )


def test_free_moving_runs_may_change_replica_under_load_and_strict_affinity_never() -> None:
    strict = simulate(SMALL_FLOOD, "luftpause", seed=3, params=SMALL_POOL)
    free = simulate(SMALL_FLOOD, "luftpause-free-moving", seed=3, params=SMALL_POOL)
    assert strict.runs_moved == 0
    assert free.runs_moved > 0


def test_the_luftpause_arm_runs_the_scheduler_core_and_holds_turns_the_engine_would_queue(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    held_for: list[float] = []
    decided: list[object] = []
    real_decide = sim_arms.decide

    def recording_decide(state, event):
        state, actions = real_decide(state, event)
        decided.append(event)
        held_for.extend(a.held_s for a in actions if isinstance(a, sim_arms.Place))
        return state, actions

    monkeypatch.setattr(sim_arms, "decide", recording_decide)
    simulate(SMALL_FLOOD, "luftpause", seed=1, params=SMALL_POOL)
    kinds = {type(e).__name__ for e in decided}
    assert kinds >= {
        "PoolConfigured",
        "ReplicaProbed",
        "Tick",
        "TurnArrived",
        "TurnStarted",
        "FirstToken",
        "TurnCompleted",
        "RunEnded",
    }
    assert max(held_for) > 0, "under a flood some turns wait in the scheduler"


def test_the_cli_prints_a_table_or_the_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    assert (
        main(["routing", "--seed", "2", "--arms", "router-round-robin,luftpause", "--json", "--no-record"])
        == 0
    )
    record = json.loads(capsys.readouterr().out)
    assert record["scenario"] == "routing" and record["seed"] == 2
    assert [a["name"] for a in record["arms"]] == ["router-round-robin", "luftpause"]
    for arm in record["arms"]:
        assert {
            "interactive_runs_per_min",
            "interactive_p50_s",
            "batch_runs_per_min",
            "prefix_cache_hit_rate",
        } <= set(arm)
        assert arm["interactive_runs_per_min"] > 0 and arm["batch_runs_per_min"] == 0
    assert main(["routing", "--arms", "sglang-sticky", "--no-record"]) == 0
    out = capsys.readouterr().out
    assert "| sglang-sticky |" in out and "interactive runs/min" in out


def test_an_unknown_arm_is_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["flood", "--arms", "magic", "--no-record"]) == 2
    assert "magic" in capsys.readouterr().err


def test_several_seeds_print_each_table_then_the_medians_and_the_ratios(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path
) -> None:
    from luftpause.bench import results as records
    from luftpause.bench.sim import cli

    monkeypatch.setitem(cli.SCENARIOS, "flood", SMALL_FLOOD)
    monkeypatch.setattr(records, "RESULTS_DIR", tmp_path)
    monkeypatch.setattr(records.write, "__defaults__", (tmp_path,))
    arms = "router-round-robin,sglang-cache-aware,luftpause,router-plus-engine-priority,run-gate-fixed"
    assert main(["flood", "--seeds", "1-2", "--arms", arms, "--batch", "10"]) == 0
    out = capsys.readouterr().out
    assert "seed 1 (virtual time" in out and "seed 2 (virtual time" in out
    assert "Simulated flood (--batch 10), seeds 1, 2: median (range) over the seeds" in out
    assert "| continuation prefix hit | prefill share | engine s/run | tokens evicted |" in out
    assert "| best class-blind router arm of each seed |" in out
    assert "| router-plus-engine-priority |" in out and "needs >= 1.4x" in out
    assert "| run-gate-fixed |" in out and "needs > 1x" in out
    assert "| luftpause's interactive + batch against |" in out
    assert "luftpause's continuation prefix hit:" in out and "needs >= 80%" in out
    assert "What bounds the ratio" in out
    written = sorted(p.suffix for p in tmp_path.iterdir())
    assert written[:2] == [".json", ".md"]
    record = json.loads(next(tmp_path.glob("*.json")).read_text())
    assert record["seeds"] == [1, 2] and record["knobs"] == {"batch_agents": 10}
    comparisons = record["summary"]["comparisons"]
    assert {c["against"] for c in comparisons if "against" in c} == {
        "best class-blind router arm of each seed",
        "router-plus-engine-priority",
        "run-gate-fixed",
    }
    assert {c["total_against"] for c in comparisons if "total_against" in c} == {
        "router-plus-engine-priority",
        "run-gate-fixed",
    }
    [hit] = [c for c in comparisons if "continuation_prefix_hit" in c]
    assert hit["target"] == 0.8 and len(hit["continuation_prefix_hit"]) == 2
    medians = record["summary"]["medians"]["luftpause"]
    assert {"continuation_prefix_hit", "prefill_share", "engine_s_per_run", "tokens_evicted"} <= set(medians)


def test_a_bad_seed_list_is_refused_with_what_to_write(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["flood", "--seeds", "one-five", "--no-record"])
    assert "write e.g. 1-5" in capsys.readouterr().err


def test_turns_read_whole_tell_the_scheduler_their_first_token_as_they_end(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[object] = []
    real_decide = sim_arms.decide

    def recording_decide(state, event):
        events.append(event)
        return real_decide(state, event)

    monkeypatch.setattr(sim_arms, "decide", recording_decide)
    sub_agents = replace(SMALL_FLOOD, streamed=False, overheads=RUNTIME_OVERHEADS)
    simulate(sub_agents, "luftpause", seed=1, params=SMALL_POOL)
    started = [e for e in events if type(e).__name__ == "TurnStarted"]
    assert started and not any(e.streamed for e in started)
    completed = {e.turn_id: e.at for e in events if type(e).__name__ == "TurnCompleted"}
    first = {e.turn_id: e.at for e in events if type(e).__name__ == "FirstToken"}
    assert set(first) == set(completed)
    assert all(first[t] == completed[t] for t in completed)


def test_the_runtime_overheads_lengthen_each_run_by_what_they_add() -> None:
    plain = simulate(QUIET, "luftpause", seed=1)
    slow = simulate(
        replace(QUIET, overheads=Overheads(turn_s=1.0, tool_s=1.0, run_s=1.0)), "luftpause", seed=1
    )
    # Every run makes at least one tool call, so each of its runs takes at least 2 s longer.
    assert slow.interactive_p50_s >= plain.interactive_p50_s + 2.0
    # Sub-agents stream their turns as the runtime does; what the runtime adds are its overheads.
    assert SCENARIOS["mcp-flood"] == replace(
        SCENARIOS["flood"], name="mcp-flood", overheads=RUNTIME_OVERHEADS
    )
    assert SCENARIOS["mcp-flood"].streamed


# flood, seed 1, as main gave it before the engine model counted anything and could preempt
# (interactive, batch runs/min). Counting must not change a step, so these stay put. The arms the
# run gate changes on purpose are not pinned; `luftpause-no-run-gate` (the same core on engines
# whose pool it is not told) is, with what `luftpause` gave before the gate: without the pool,
# the core decides as it did.
FLOOD_SEED_1 = {
    "router-round-robin": (6.3, 85.3),
    "sglang-cache-aware": (6.7, 84.0),
    "sglang-sticky": (6.7, 84.0),
    "luftpause-no-run-gate": (10.7, 80.7),
    "luftpause-no-load-metrics": (9.7, 81.7),
    "luftpause-no-load-metrics-uncapped": (6.7, 84.0),
    "router-plus-engine-priority": (10.3, 80.7),
    "flow-control": (8.3, 82.7),
}


@pytest.mark.parametrize("arm", sorted(FLOOD_SEED_1))
def test_the_engine_models_counters_leave_every_arms_flood_figures_as_they_were(arm: str) -> None:
    result = simulate(SCENARIOS["flood"], arm, seed=1)
    assert (result.interactive_runs_per_min, result.batch_runs_per_min) == FLOOD_SEED_1[arm]


def test_the_engine_models_eyes_see_the_flood_re_prefill_every_paused_run() -> None:
    result = simulate(SCENARIOS["flood"], "sglang-cache-aware", seed=1)
    # Each run's prefix is evicted during its 2 s tool call: no continuation turn finds its own.
    assert result.continuation_prefix_hit == 0.0
    assert result.tokens_evicted > 0
    assert result.prefill_share is not None and 0.1 < result.prefill_share < 0.5
    # Two engines busy nearly the whole window, over the runs that ended in it.
    assert result.engine_s_per_run == pytest.approx(2 * 180 / result.runs, rel=0.05)
    quiet = simulate(QUIET, "sglang-cache-aware", seed=1)
    # Nothing is evicted: all but the tool result the turn just appended is found.
    assert quiet.continuation_prefix_hit is not None and quiet.continuation_prefix_hit > 0.85
    assert quiet.tokens_evicted == 0


def test_knobs_change_the_named_scenario_and_go_into_the_title_and_the_record(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from luftpause.bench.sim import cli

    seen: list[tuple[Scenario, EngineParams | None]] = []

    def recording(scenario: Scenario, arm: str, seed: int, params: EngineParams | None = None):
        seen.append((scenario, params))
        return simulate(replace(scenario, warmup_s=5, window_s=20), arm, seed, params)

    monkeypatch.setattr(cli, "simulate", recording)
    argv = ["light", "--arms", "sglang-sticky", "--no-record", "--kv-pool-tokens", "16384", "--slots", "4"]
    argv += [
        "--tool-s",
        "0.5",
        "--tool-calls",
        "1",
        "--context-chars",
        "900",
        "--batch",
        "3",
        "--interactive",
        "2",
    ]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "Simulated light (--kv-pool-tokens 16384, --slots 4, --tool-s 0.5, --tool-calls 1, " in out
    [(scenario, params)] = seen
    assert scenario == replace(
        SCENARIOS["light"],
        tool_latency_s=0.5,
        max_tool_calls=1,
        context_chars=900,
        batch_agents=3,
        interactive_agents=2,
    )
    assert params == EngineParams(kv_pool_tokens=16384, slots=4)
    assert main([*argv, "--json"]) == 0
    record = json.loads(capsys.readouterr().out)
    assert record["knobs"] == {
        "kv_pool_tokens": 16384,
        "slots": 4,
        "tool_latency_s": 0.5,
        "max_tool_calls": 1,
        "context_chars": 900,
        "batch_agents": 3,
        "interactive_agents": 2,
    }
    # Without knobs the scenario is the named one and the engines the calibrated ones.
    seen.clear()
    assert main(["light", "--arms", "sglang-sticky", "--no-record"]) == 0
    assert seen == [(SCENARIOS["light"], None)]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--slots", "-1"], "slots must be at least 0"),
        (["--kv-pool-tokens", "0"], "the KV pool must be at least 1"),
        (["--tool-calls", "0"], "the most tool calls must be at least 1"),
        (["--tool-s", "-2"], "a tool call's latency must be at least 0"),
        (["--tool-s", "inf"], "must be a finite number"),
        (["--slow-tool-s", "-1"], "the slow tool's latency must be at least 0"),
        (["--context-chars", "many"], "a context must be a whole number"),
        (["--batch", "0", "--interactive", "0"], "no agents"),
    ],
)
def test_bad_knobs_are_refused_with_what_was_wrong(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        main(["flood", "--no-record", *argv])
    assert message in capsys.readouterr().err


def test_the_slow_tool_takes_its_own_time_and_the_other_tool_the_scenarios(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from luftpause.bench.sim import agents

    waits: list[tuple[str, float]] = []
    real = agents.AgentSpec.tool_s

    def recording(self: agents.AgentSpec, name: str) -> float:
        waits.append((name, real(self, name)))
        return waits[-1][1]

    monkeypatch.setattr(agents.AgentSpec, "tool_s", recording)
    simulate(replace(QUIET, slow_tool_s=7.0), "luftpause", seed=1)
    assert {name for name, _ in waits} == {"lookup", agents.SLOW_TOOL}, "both tools are called"
    assert {wait for name, wait in waits if name == agents.SLOW_TOOL} == {7.0}
    assert {wait for name, wait in waits if name == "lookup"} == {QUIET.tool_latency_s}


def test_with_a_slow_tool_beside_a_quick_one_runs_paused_on_the_quick_one_keep_their_prefix() -> None:
    # Runs that call a 10 s search beside a 2 s lookup: by all of its caller's pauses a paused run
    # lets go whatever it waits for; by its tool's, it keeps its place through a lookup.
    mixed = replace(SCENARIOS["flood"], slow_tool_s=10.0, warmup_s=30, window_s=90)
    by_tool = simulate(mixed, "luftpause", seed=1)
    by_caller = simulate(mixed, "luftpause-keep-by-caller", seed=1)
    assert by_tool.continuation_prefix_hit is not None and by_caller.continuation_prefix_hit is not None
    assert by_caller.continuation_prefix_hit < 0.05 < 0.15 < by_tool.continuation_prefix_hit
    assert by_tool.runs_moved < by_caller.runs_moved


def test_the_most_tool_calls_bounds_every_runs_calls() -> None:
    one = simulate(replace(QUIET, max_tool_calls=1), "sglang-sticky", seed=1)
    default = simulate(QUIET, "sglang-sticky", seed=1)
    # One call a run: two turns a run, fewer than the default's 1 to 3 calls; so more runs a minute.
    assert one.interactive_runs_per_min > default.interactive_runs_per_min


def _result(name: str, interactive: float, batch: float, hit: float | None = 0.0) -> ArmResult:
    return ArmResult(
        name, interactive, 20.0, batch, 30.0, 0.1, 1.0, 1.0, 0.1, 0, 100, 0, hit, 0.2, 1.3, 1000, 0, 0.1
    )


def test_the_verdicts_ask_each_peer_for_its_own_ratio_the_fixed_gate_to_be_beaten_and_the_cache_to_hold() -> (
    None
):
    from luftpause.bench.sim.cli import summary

    arms = [
        _result("sglang-cache-aware", 5.0, 80.0),
        _result("luftpause", 14.0, 80.0, hit=0.85),
        _result("router-plus-engine-priority", 10.0, 80.0),  # 1.4x: met
        _result("router-plus-engine-priority-preempt", 10.1, 80.0),  # just short of 1.4x
        _result("run-gate-fixed", 14.0, 80.0),  # a tie is not above it
    ]
    text, record = summary("flood", {1: arms, 2: arms})
    verdicts = {c["against"]: c["met"] for c in record["comparisons"] if "against" in c}
    assert verdicts["best class-blind router arm of each seed"] is True  # 2.8x
    assert verdicts["router-plus-engine-priority"] is True
    assert verdicts["router-plus-engine-priority-preempt"] is False
    assert verdicts["run-gate-fixed"] is False
    assert [c["met"] for c in record["comparisons"] if "continuation_prefix_hit" in c] == [True]
    totals = {c["total_against"]: c["met"] for c in record["comparisons"] if "total_against" in c}
    assert totals == {
        "router-plus-engine-priority": True,
        "router-plus-engine-priority-preempt": True,
        "run-gate-fixed": False,
    }
    assert "median 85.0% (met: needs >= 80%)" in text


def test_under_the_flood_the_run_gate_keeps_paused_runs_prefixes_and_does_less_work_per_run() -> None:
    gated = simulate(SCENARIOS["flood"], "luftpause", seed=1)
    ungated = simulate(SCENARIOS["flood"], "luftpause-no-run-gate", seed=1)
    # Without the gate every paused run comes back to a cold cache; with it, most find their prefix.
    assert ungated.continuation_prefix_hit < 0.05
    assert gated.continuation_prefix_hit >= 0.8
    assert gated.prefill_share < ungated.prefill_share / 1.5
    assert gated.tokens_evicted < ungated.tokens_evicted / 1.5
    assert gated.engine_s_per_run < ungated.engine_s_per_run
    # The work saved is runs served: more of them in all, and more interactive ones.
    assert gated.interactive_runs_per_min + gated.batch_runs_per_min > (
        ungated.interactive_runs_per_min + ungated.batch_runs_per_min
    )
    assert gated.interactive_runs_per_min > ungated.interactive_runs_per_min


def test_the_light_verdict_asks_luftpause_to_be_within_five_percent_of_the_best_arm_and_names_the_rest() -> (
    None
):
    from luftpause.bench.sim.cli import summary

    arms = [
        _result("sglang-cache-aware", 15.0, 90.0),
        _result("luftpause", 14.4, 90.0),  # 4 % below the best interactive: met
        _result("run-gate-fixed", 15.0, 80.0),  # 11 % below the best batch
    ]
    text, record = summary("light", {1: arms, 2: arms})
    verdicts = {c["tie"]: c for c in record["comparisons"]}
    assert verdicts["interactive"]["met"] and verdicts["interactive"]["outside"] == []
    assert verdicts["batch"]["met"] and verdicts["batch"]["outside"] == ["run-gate-fixed"]
    assert "luftpause is 4.0% below the best, sglang-cache-aware (met: within 5%)" in text
    slower = [_result("sglang-cache-aware", 15.0, 90.0), _result("luftpause", 14.0, 90.0)]
    _, record = summary("light", {1: slower})
    assert [c["met"] for c in record["comparisons"]] == [False, True]
