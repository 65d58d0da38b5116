"""How busy the CPUs and each process were over a window: the benchmarks' check that the real
processes kept up, so that a repeat run on a saturated machine is named and not counted.

A window is two snapshots (`snapshot`): the CPUs' jiffies (/proc/stat, per CPU, since a
container may see every CPU of its host but run on two), the container's cgroup usage, and each
process's own CPU time; `cpu_use` says what was used between them and whether that means
saturation (`SATURATED`).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# A share of the CPUs, the CPU quota or a single-threaded process's core above this is saturation.
SATURATED = 0.90
# A window closes this long before the load's deadline, while every process is still there to be
# read (a process that has exited and been reaped has no /proc entry left).
WINDOW_MARGIN_S = 0.5


def cpu_jiffies(cpus: set[int]) -> tuple[float, float]:
    """(busy, total) jiffies since boot of the CPUs in `cpus`, from /proc/stat's per-CPU lines.

    Per CPU and not the first line, because a container may see every CPU of its host there
    while it may run on two of them."""
    busy = total = 0.0
    for line in Path("/proc/stat").read_text().splitlines():
        name, *values = line.split()
        if not name.startswith("cpu") or name == "cpu" or int(name[3:]) not in cpus:
            continue
        # user nice system idle iowait irq softirq steal (guest time is already in user).
        fields = [float(v) for v in values[:8]]
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0.0)
        busy += sum(fields) - idle
        total += sum(fields)
    return busy, total


def _cgroup_quota_cores() -> float | None:
    """The container's CPU quota in cores (cgroup v2 cpu.max), or None when it has none."""
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else float(quota) / float(period)


def _cgroup_usage_s() -> float | None:
    """The container's CPU time so far in seconds (cgroup v2 cpu.stat), or None without one."""
    try:
        for line in Path("/sys/fs/cgroup/cpu.stat").read_text().splitlines():
            key, value = line.split()
            if key == "usage_usec":
                return float(value) / 1e6
    except (OSError, ValueError):
        pass
    return None


def _process_cpu_s(pid: int) -> float | None:
    """utime + stime of a live process in seconds, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text[text.rindex(")") + 2 :].split()  # the name may hold spaces and parentheses
    return (float(fields[11]) + float(fields[12])) / os.sysconf("SC_CLK_TCK")


@dataclass
class CpuSnapshot:
    at: float
    cpus: tuple[float, float]
    cgroup_s: float | None
    processes: dict[str, float | None]


def snapshot(pids: dict[str, int], cpus: set[int] | None = None) -> CpuSnapshot:
    """Now: the jiffies of `cpus` (default: those this process may run on), the cgroup's usage,
    and the CPU time of each process in `pids` (by name)."""
    return CpuSnapshot(
        at=time.monotonic(),
        cpus=cpu_jiffies(os.sched_getaffinity(0) if cpus is None else cpus),
        cgroup_s=_cgroup_usage_s(),
        processes={name: _process_cpu_s(pid) for name, pid in pids.items()},
    )


def cpu_use(before: CpuSnapshot, after: CpuSnapshot, single_threaded: set[str]) -> dict[str, Any]:
    """What the window used: the CPUs' busy share, the quota's, each process's cores, and
    whether (and why) that means the real processes were not keeping up."""
    wall = max(after.at - before.at, 1e-9)
    busy = (after.cpus[0] - before.cpus[0]) / max(after.cpus[1] - before.cpus[1], 1.0)
    quota = _cgroup_quota_cores()
    quota_share = None
    if quota and before.cgroup_s is not None and after.cgroup_s is not None:
        quota_share = (after.cgroup_s - before.cgroup_s) / (wall * quota)
    cores = {
        name: round((end - start) / wall, 2)
        for name, start in before.processes.items()
        if start is not None and (end := after.processes.get(name)) is not None
    }
    reasons = []
    if busy > SATURATED:
        reasons.append(f"CPUs {busy:.0%} busy")
    if quota_share is not None and quota_share > SATURATED:
        reasons.append(f"CPU quota {quota_share:.0%} used")
    reasons += [
        f"{name} at {used:.0%} of a core"
        for name, used in sorted(cores.items())
        if name in single_threaded and used > SATURATED
    ]
    return {
        "cpu_busy": round(busy, 3),
        "cpu_quota_used": None if quota_share is None else round(quota_share, 3),
        "process_cores": cores,
        "saturated": bool(reasons),
        "saturation": "; ".join(reasons) or None,
    }
