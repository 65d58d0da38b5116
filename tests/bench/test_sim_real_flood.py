"""The simulated twin of the real llama.cpp flood (`bench sim real-flood`), at a tiny size: its
arms run end to end, luftpause's replicas are configured as llama.cpp runs, and the CLI prints
the real bench's figures."""

from __future__ import annotations

from dataclasses import replace

import pytest

from luftpause.bench.sim import cli, peers
from luftpause.bench.sim.arms import ARMS, Luftpause
from luftpause.bench.sim.clock import VirtualClock
from luftpause.bench.sim.replica import SimReplica
from luftpause.bench.sim.run import simulate
from luftpause.bench.sim.scenarios import REAL_FLOOD_ARMS, SCENARIOS
from luftpause.fake_engine.params import LLAMACPP_ONE_CORE, EngineParams
from luftpause.scheduler import gate

TINY = replace(SCENARIOS["real-flood"], batch_agents=3, interactive_agents=1, warmup_s=5.0, window_s=40.0)


@pytest.mark.parametrize("arm", REAL_FLOOD_ARMS)
def test_every_arm_of_the_real_flood_serves_turns_and_ends_runs(arm: str) -> None:
    result = simulate(TINY, arm, seed=1)
    assert result.turns > 0 and result.runs > 0
    assert result.interactive_runs_per_min > 0
    if arm in ("straight", "sglang-cache-aware"):
        assert result.runs_moved == 0, arm  # pinned by hash, or by prefix
    # The slots keep each run's prefix: most prompt tokens come from the cache.
    assert result.prefix_cache_hit_rate > 0.3


def test_the_host_cache_knob_and_the_runs_shape() -> None:
    full = replace(TINY, batch_agents=16, interactive_agents=4)
    on = simulate(full, "straight", seed=2)
    off = simulate(full, "straight", seed=2, params=replace(LLAMACPP_ONE_CORE, host_cache_tokens=0))
    # Ten runs to a replica of four slots: without a host tier a paused run's slot is taken.
    assert on.prefix_cache_hit_rate > off.prefix_cache_hit_rate + 0.2
    # Each run is 2 to 4 turns (1 to 3 tool calls, then the answer).
    assert 2 * on.runs <= on.turns + 4 * (full.batch_agents + full.interactive_agents)


@pytest.mark.parametrize("host", [True, False])
def test_luftpause_configures_slot_replicas_as_the_real_flood_does(host: bool) -> None:
    params = replace(LLAMACPP_ONE_CORE, host_cache_tokens=LLAMACPP_ONE_CORE.host_cache_tokens if host else 0)
    clock = VirtualClock()
    arm = Luftpause([SimReplica("a", params, clock)], clock)
    replica = arm.state.replicas["a"]
    assert (replica.kv_slots, replica.host_cache) == (4, host)
    assert arm.engine_priority == "none"  # llama.cpp has no priority queue
    # On the calibrated SGLang engines nothing changes.
    sglang = Luftpause([SimReplica("b", replace(EngineParams(), priority_scheduling=True), clock)], clock)
    assert (sglang.state.replicas["b"].kv_slots, sglang.state.replicas["b"].host_cache) == (None, False)
    assert sglang.engine_priority == "sglang"


def test_the_host_tier_peer_turns_on_a_host_tier_and_nothing_else() -> None:
    base = EngineParams()
    tiered = peers.PEERS["router-plus-engine-priority-host-tier"].engines(base)
    assert tiered.host_cache_tokens == 2 * base.kv_pool_tokens and tiered.host_restore_per_token_s > 0
    assert replace(tiered, host_cache_tokens=0, host_restore_per_token_s=0.0) == base


def test_the_cli_prints_the_real_benchs_figures(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["real-flood", "--seeds", "1-2", "--batch", "2", "--interactive", "1", "--no-record"]
    assert cli.main([*argv, "--host-cache", "off"]) == 0
    out = capsys.readouterr().out
    assert "in the real bench's figures" in out and "| luftpause |" in out and "| straight |" in out
    assert "luftpause over each baseline" in out and "sglang-cache-aware" in out
    assert "--host-cache-tokens 0" in out


def test_the_host_cache_flag_is_for_llamacpp_scenarios_only() -> None:
    with pytest.raises(SystemExit):
        cli.main(["flood", "--host-cache", "on", "--no-record"])


def test_the_gated_arm_holds_a_run_a_slot_where_the_engines_keep_a_host_tier() -> None:
    clock = VirtualClock()
    replicas = [SimReplica("a", LLAMACPP_ONE_CORE, clock)]
    default, gated = Luftpause(replicas, clock), ARMS["luftpause-gated"](replicas, clock)
    assert gate.mode(default.state.replicas["a"]) == "off: host cache"
    assert gate.mode(gated.state.replicas["a"]) == "slots"
    # Ten runs to a replica of four slots: the gated arm keeps each held run's slot for it, so
    # the engines evict less and interactive runs, first at the gate, end more often.
    full = replace(TINY, batch_agents=16, interactive_agents=4)
    off, on = simulate(full, "luftpause", seed=1), simulate(full, "luftpause-gated", seed=1)
    assert on.tokens_evicted < off.tokens_evicted
    assert on.interactive_runs_per_min > off.interactive_runs_per_min


def test_on_shared_pool_engines_with_a_host_tier_luftpause_learns_it_from_their_probes() -> None:
    clock = VirtualClock()
    replicas = [SimReplica("a", peers.with_host_tier(EngineParams()), clock)]
    default, gated = Luftpause(replicas, clock), ARMS["luftpause-gated"](replicas, clock)
    # Configured with nothing said, as a user would leave it; the engine's first probe says it.
    assert default.state.replicas["a"].host_cache_source == "default"
    clock.run_until(clock.now + 1.0)
    tiered = default.state.replicas["a"]
    assert (tiered.host_cache, tiered.host_cache_source, gate.mode(tiered)) == (
        True,
        "engine",
        "off: host cache",
    )
    # The gated arm's config says there is none, and the engine's word does not change that.
    assert (gated.state.replicas["a"].host_cache_source, gate.mode(gated.state.replicas["a"])) == (
        "config",
        "tokens",
    )
