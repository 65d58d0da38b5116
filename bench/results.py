"""Where a benchmark's records go: one JSON file and one markdown table per run under bench/results/."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

RESULTS_DIR = Path(__file__).resolve().parent / "results"


def _revision() -> str:
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=RESULTS_DIR.parent,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def write(scenario: str, record: dict[str, Any], table: str, out_dir: Path = RESULTS_DIR) -> Path:
    """Writes `<scenario>-<UTC time>.json` and `.md`; returns the JSON path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    full = {
        "scenario": scenario,
        "at": stamp,
        "revision": _revision(),
        "machine": {"cpus": _cpus(), "python": platform.python_version()},
        **record,
    }
    path = out_dir / f"{scenario}-{stamp}.json"
    path.write_text(json.dumps(full, indent=2) + "\n")
    path.with_suffix(".md").write_text(table + "\n")
    return path


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def cell(value: float | None) -> str:
    """A figure as a markdown table shows it: "-" for none, else the shortest form."""
    return "-" if value is None else f"{value:g}"


def bars_png(path: Path, title: str, unit: str, rows: dict[str, list[float]]) -> Path | None:
    """A PNG of one horizontal bar per row: the median of its values, a whisker from the lowest to
    the highest, each value a dot; None (and no file) without matplotlib (the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import statistics

    labels = [label for label, values in rows.items() if values]
    med = [statistics.median(rows[label]) for label in labels]
    err = [
        [m - min(rows[label]) for m, label in zip(med, labels, strict=True)],
        [max(rows[label]) - m for m, label in zip(med, labels, strict=True)],
    ]
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(labels) + 1.6))
    colours = ["#d9480f" if "luftpause" in label else "#868e96" for label in labels]
    ax.barh(labels, med, xerr=err, color=colours, capsize=3)
    for y, label in enumerate(labels):
        ax.plot(rows[label], [y] * len(rows[label]), "k.", markersize=4)
        ax.text(med[y], y - 0.3, f" {med[y]:.3g}", va="center", ha="left", fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(unit)
    ax.grid(axis="x", alpha=0.3)
    ax.set_title(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def write_with_bars(
    scenario: str,
    record: dict[str, Any],
    table: str,
    title: str,
    unit: str,
    bars: dict[str, list[float]],
    stream: Any = None,
) -> Path:
    """`write`, then `bars_png` beside the record, and a line saying where both went (to
    `stream`, default stdout); returns the JSON path."""
    path = write(scenario, record, table)
    png = bars_png(path.with_suffix(".png"), title, unit, bars)
    print(f"record: {path}" + (f"\nplot: {png}" if png else ""), file=stream)
    return path


def tidy_logs(name: str, logs: Path, failed: bool) -> None:
    """Removes a run's log folder, or keeps it and says where when a run failed."""
    if failed:
        print(f"{name}: a run failed; its processes' logs are in {logs}", file=sys.stderr)
    else:
        shutil.rmtree(logs, ignore_errors=True)
