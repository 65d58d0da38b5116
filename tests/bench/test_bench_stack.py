"""The sub-agent benchmarks' stack: the config it writes is one luftpause accepts, wired as described."""

from __future__ import annotations

from pathlib import Path

from luftpause import config
from luftpause.bench import results, stack


def test_the_stack_config_points_the_runtime_at_its_front_and_declares_the_classifier(tmp_path: Path) -> None:
    path = stack._config(
        tmp_path, "sglang", [9101, 9102], 9200, 9201, 9202, 9203, "http://127.0.0.1:9300", 9400, 9500
    )
    conf = config.load(path)
    assert conf.runtime.dataplane == "http://127.0.0.1:9300"  # the router's, in a router arm
    assert [m.url for m in conf.runtime.mcp_servers] == ["http://127.0.0.1:9400/mcp"]
    kinds = {r.name: (r.kind, r.engine_priority, r.models) for r in conf.replicas}
    assert kinds == {
        "fake-a": ("generative", "sglang", [config.DEFAULT_MODEL]),
        "fake-b": ("generative", "sglang", [config.DEFAULT_MODEL]),
        "classifier": ("single-pass", "none", [stack.SINGLE_PASS_MODEL]),
    }


def test_engines_read_with_vllm_metrics_are_told_no_priorities(tmp_path: Path) -> None:
    path = stack._config(
        tmp_path, "vllm", [9101], 9200, 9201, 9202, 9203, "http://127.0.0.1:9202", 9400, None
    )
    (replica,) = config.load(path).replicas
    assert (replica.metrics, replica.engine_priority) == ("vllm", "none")


def test_the_bar_chart_is_written_with_a_bar_per_row_that_has_values(tmp_path: Path) -> None:
    png = results.bars_png(
        tmp_path / "x.png", "title", "s", {"luftpause": [1.0, 2.0], "router": [1.5], "none": []}
    )
    assert png is not None and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
