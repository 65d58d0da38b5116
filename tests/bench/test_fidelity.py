"""The fidelity harness's arithmetic and the router's command line, without starting anything."""

from __future__ import annotations

from luftpause.bench import sglang_router
from luftpause.bench.cpu import CpuSnapshot, cpu_use
from luftpause.bench.sim.fidelity import engine_params, ratios, timing_env, verdict
from luftpause.fake_engine.params import params_from_env


def _row(repeat: int, arm: str, real: float, sim: float, counts: bool = True) -> dict:
    return {
        "repeat": repeat,
        "arm": arm,
        "real": {"interactive_runs_per_min": real, "batch_runs_per_min": 60.0},
        "sim": {"interactive_runs_per_min": sim, "batch_runs_per_min": 60.0},
        "counts": counts,
        "why_not": None if counts else "CPU saturated (CPUs 95% busy)",
    }


def test_verdict_needs_the_same_side_of_one_and_twenty_percent() -> None:
    assert verdict(1.10, 1.00)["direction"] is False  # 1.0 is neither gain nor loss
    assert verdict(1.10, 1.14)["agrees"] is True
    assert verdict(1.40, 1.14)["agrees"] is False  # 23 % over the simulated ratio
    assert verdict(1.40, 1.14)["direction"] is True
    assert verdict(0.90, 1.14)["agrees"] is False
    assert verdict(0.95, 0.90)["agrees"] is True
    assert verdict(None, 1.1)["agrees"] is None


def test_ratios_take_the_median_of_counted_repeats_only() -> None:
    rows = [
        _row(0, "router-round-robin", 10.0, 10.0),
        _row(0, "luftpause", 12.0, 11.0),
        _row(1, "router-round-robin", 10.0, 10.0),
        _row(1, "luftpause", 30.0, 11.0, counts=False),  # saturated: its 3.0 must not count
        _row(2, "router-round-robin", 8.0, 10.0),
        _row(2, "luftpause", 10.0, 12.0),
    ]
    summary = ratios(rows, "router-round-robin", repeats=3)
    assert summary["counted"] == 2
    assert [e["counts"] for e in summary["repeats"]] == [True, False, True]
    assert "luftpause: CPU saturated" in summary["repeats"][1]["why_not"]
    assert summary["interactive_real"] == {"median": 1.225, "low": 1.2, "high": 1.25, "n": 2}
    assert summary["interactive_sim"] == {"median": 1.15, "low": 1.1, "high": 1.2, "n": 2}
    assert summary["verdict"]["agrees"] is True


def test_a_router_arm_without_interactive_runs_gives_no_ratio() -> None:
    rows = [_row(0, "sglang-cache-aware", 0.0, 10.0), _row(0, "luftpause", 12.0, 11.0)]
    summary = ratios(rows, "sglang-cache-aware", repeats=1)
    assert summary["counted"] == 0
    assert summary["verdict"]["agrees"] is None


def test_one_single_threaded_process_at_a_full_core_saturates_the_window() -> None:
    before = CpuSnapshot(at=0.0, cpus=(0.0, 0.0), cgroup_s=None, processes={"dataplane": 0.0, "router": 0.0})
    after = CpuSnapshot(
        at=10.0, cpus=(500.0, 2000.0), cgroup_s=None, processes={"dataplane": 9.5, "router": 15.0}
    )
    use = cpu_use(before, after, single_threaded={"dataplane"})
    assert use["cpu_busy"] == 0.25
    assert use["process_cores"] == {"dataplane": 0.95, "router": 1.5}
    assert use["saturated"] and use["saturation"] == "dataplane at 95% of a core"  # not the router
    calm = cpu_use(before, after, single_threaded=set())
    assert not calm["saturated"]


def test_router_command_names_the_workers_policy_and_a_local_metrics_port() -> None:
    argv = sglang_router.command(
        8100, ["http://127.0.0.1:1", "http://127.0.0.1:2"], prometheus_port=8101, python="py"
    )
    assert argv[:3] == ["py", "-m", "sglang_router.launch_router"]
    at = argv.index("--worker-urls")
    assert argv[at + 1 : at + 3] == ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    assert argv[argv.index("--policy") + 1] == "cache_aware"
    assert argv[argv.index("--port") + 1] == "8100"
    assert argv[argv.index("--prometheus-host") + 1] == "127.0.0.1"
    assert argv[argv.index("--prometheus-port") + 1] == "8101"
    assert argv[argv.index("--cache-threshold") + 1] == "0.3"
    assert argv[argv.index("--balance-abs-threshold") + 1] == "64"
    assert argv[argv.index("--balance-rel-threshold") + 1] == "1.5"


def test_the_real_engines_get_the_simulated_engines_parameters() -> None:
    params = engine_params(16384)
    assert params.priority_scheduling and params.kv_pool_tokens == 16384
    assert timing_env(params) == "kv_pool_tokens=16384,priority_scheduling=true"
    assert params_from_env(timing_env(params)) == params
