"""Where a benchmark's records go: one JSON file and one markdown table per run under bench/results/."""

from __future__ import annotations

import json
import platform
import subprocess
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
