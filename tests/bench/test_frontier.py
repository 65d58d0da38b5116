"""`luftpause bench frontier`: each point of its curves is the setting it names, and is judged as `bench sim` judges."""

from __future__ import annotations

import pytest

from luftpause.bench.sim import frontier
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.peers import RUN_GATE_FIXED_CAP, RunGateFixed
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.run import ArmResult, simulate
from luftpause.bench.sim.scenarios import Scenario
from luftpause.fake_engine.params import EngineParams

# Two calibrated replicas with 13 runs each: a pool declared at 1.2x holds all of them (more than
# the engine keeps warm), one at 0.9x about ten.
SMALL = Scenario("flood", batch_agents=24, interactive_agents=2, context_chars=8000, warmup_s=20, window_s=60)
SMALL_POOL = EngineParams(kv_pool_tokens=8192)


def test_a_declared_pool_is_what_the_core_counts_and_no_probe_overrides_it() -> None:
    clock = VirtualClock()
    replicas = [SimReplica(name, SMALL_POOL, clock) for name in ("fake-a", "fake-b")]
    arm = frontier.declared_pool(0.8)(replicas, clock)
    clock.run_until(10.0)  # several probes later
    for name in ("fake-a", "fake-b"):
        assert arm.state.replicas[name].kv_tokens == int(0.8 * 8192)
    # At 1x the arm is luftpause as it runs, its pool read from the engine.
    assert frontier.declared_pool(1.0).name == "luftpause"


def test_the_declared_pool_changes_what_the_gate_holds_and_so_what_is_served() -> None:
    tight = simulate(SMALL, "tight", 1, arm=frontier.declared_pool(0.9))
    loose = simulate(SMALL, "loose", 1, arm=frontier.declared_pool(1.2))
    assert tight.name == "tight" and loose.name == "loose"
    # Holding fewer runs keeps more of each paused prefix warm, and the engines evict less.
    assert tight.continuation_prefix_hit is not None and loose.continuation_prefix_hit is not None
    assert tight.continuation_prefix_hit > loose.continuation_prefix_hit + 0.3
    assert tight.tokens_evicted < loose.tokens_evicted
    assert (tight.interactive_runs_per_min, tight.batch_runs_per_min) != (
        loose.interactive_runs_per_min,
        loose.batch_runs_per_min,
    )


def test_a_fixed_cap_is_the_peer_at_that_cap() -> None:
    assert frontier.fixed_cap(RUN_GATE_FIXED_CAP) is RunGateFixed
    twelve = frontier.fixed_cap(12)
    assert issubclass(twelve, RunGateFixed) and twelve.cap == 12 and twelve.name == "run-gate-fixed-12"
    assert RunGateFixed.cap == RUN_GATE_FIXED_CAP  # the peer itself is left as it was


def _result(name: str, interactive: float, batch: float) -> ArmResult:
    return ArmResult(
        name, interactive, None, batch, None, None, None, None, 0.0, 0, 0, 0, None, None, None, 0, 0, 0.0
    )


def test_a_point_meets_the_targets_only_where_every_one_holds() -> None:
    blind = [_result("sglang-cache-aware", 7.0, 84.0)]
    peers = {
        "router-plus-engine-priority": [_result("router-plus-engine-priority", 11.0, 80.0)],
        "run-gate-fixed": [_result("run-gate-fixed", 17.0, 79.0)],
    }
    curves = {
        # Twice the class-blind interactive, batch 4 % lower, more in all than every peer.
        ("luftpause", "pool 1x"): [_result("luftpause", 17.5, 80.6)],
        # Batch 8 % lower: misses the class-blind target, and is below the fixed cap in all.
        ("luftpause", "pool 0.8x"): [_result("luftpause-pool-0.8x", 18.0, 77.0)],
    }
    points = {p.setting: p for p in frontier.judge("flood", curves, peers, blind)}
    good, bad = points["pool 1x"], points["pool 0.8x"]
    assert good.meets_class_blind and good.meets_peers and good.above_peers
    assert good.ratio == pytest.approx(2.5) and good.total_ratio == pytest.approx(98.1 / 96.0)
    assert not bad.meets_class_blind and bad.batch_change == pytest.approx(77 / 84 - 1)
    assert bad.above_peers is False and bad.total_ratio == pytest.approx(95.0 / 96.0)
    text = frontier.report("flood", [1], list(points.values()), {})
    assert "Points of either curve meeting every target at once: luftpause pool 1x." in text


def test_a_point_is_never_judged_against_itself() -> None:
    blind = [_result("sglang-cache-aware", 7.0, 84.0)]
    fixed = [_result("run-gate-fixed", 17.0, 79.0)]
    points = frontier.judge("flood", {("run-gate-fixed", "cap 11"): fixed}, {"run-gate-fixed": fixed}, blind)
    assert "run-gate-fixed" not in points[0].peer_ratios


def test_the_command_draws_both_curves_and_names_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    assert frontier.main(["--seeds", "1", "--no-record", "--batch", "4", "--interactive", "1"]) == 0
    out = capsys.readouterr().out
    for scale in frontier.POOL_SCALES:
        assert f"| luftpause | pool {scale:g}x |" in out
    for cap in frontier.CAPS:
        assert f"| run-gate-fixed | cap {cap} |" in out
    assert "| peer on other engines | router-plus-engine-priority-host-tier |" in out
    assert "The most runs in all on either curve:" in out


def test_slot_engines_are_refused_with_why(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        frontier.main(["--scenario", "real-flood", "--no-record"])
    assert "one run a slot" in capsys.readouterr().err
