"""What the scheduler and dataplane show during the fidelity harness's `luftpause` window.

The admission issue asks that the status page, during a flood, show per replica the limit, our
turns in flight and the engine's own queue, and that an interactive turn's held time stay low.
This module gathers the evidence for one window of the real `luftpause` arm:

- `StatusSampler` reads the scheduler's GET /status every 2 s (the page's own period) on a
  thread; `summarise_samples` turns the samples into, per replica, the max and median of
  in_flight, limit, waiting_ours, others_waiting and the engine's `waiting`, and the most turns
  held by class;
- `histograms` reads the dataplane's GET /metrics text; `window_quantiles` takes the growth of
  the cumulative buckets of `luftpause_dataplane_admission_seconds` (held time) and
  `luftpause_dataplane_engine_first_token_seconds` (engine queue + prefill) between the window's
  start and end, per class, and estimates p50 and p99 from it with `quantile`, which interpolates
  linearly inside the bucket the rank falls in, as Prometheus' histogram_quantile does;
- `screenshot` renders the status page (GET /) in headless Chromium to a PNG, with the flags
  tests/scheduler/test_status_page.py uses, plus a virtual-time budget so that the page's first
  poll has filled its tables;
- `markdown` is the "Under the flood (luftpause arm)" part of the harness's report.
"""

from __future__ import annotations

import math
import shutil
import statistics
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

PERIOD_S = 2.0
HELD = "luftpause_dataplane_admission_seconds"
FIRST_TOKEN = "luftpause_dataplane_engine_first_token_seconds"
HISTOGRAMS = {"held": HELD, "engine_first_token": FIRST_TOKEN}
CLASSES = ("interactive", "batch")
QUANTILES = (0.5, 0.99)
# Per replica, the /status fields summarised; `limit` is None when the replica is uncapped and
# `waiting` None before its engine's load was first read: such samples are left out of that
# field's figures (and counted, so that a field with none is visibly empty, not zero).
REPLICA_FIELDS = ("in_flight", "limit", "waiting_ours", "others_waiting", "waiting")

# One histogram's buckets: (upper bound, cumulative count), ascending, +Inf last.
Buckets = list[tuple[float, float]]


# -- the dataplane's histograms --


def histograms(text: str) -> dict[str, dict[str, Buckets]]:
    """From a /metrics text: {metric: {class: buckets}} for the two histograms named in HISTOGRAMS,
    summed over their replicas."""
    wanted = set(HISTOGRAMS.values())
    summed: dict[str, dict[str, dict[float, float]]] = {name: {} for name in wanted}
    for family in text_string_to_metric_families(text):
        if family.name not in wanted:
            continue
        for sample in family.samples:
            if sample.name != f"{family.name}_bucket":
                continue
            per_le = summed[family.name].setdefault(sample.labels.get("class", ""), {})
            le = float(sample.labels["le"])
            per_le[le] = per_le.get(le, 0.0) + float(sample.value)
    return {
        name: {cls: sorted(per_le.items()) for cls, per_le in per_class.items()}
        for name, per_class in summed.items()
    }


def window_buckets(start: Buckets | None, end: Buckets) -> Buckets:
    """The observations made between two readings of one histogram: the cumulative counts'
    difference bucket by bucket (a histogram that did not exist at the start counts from 0)."""
    before = dict(start or [])
    return [(le, count - before.get(le, 0.0)) for le, count in end]


def quantile(q: float, buckets: Buckets) -> float | None:
    """The q-quantile of cumulative `buckets` as Prometheus' histogram_quantile estimates it.

    The rank q * total falls in the first bucket whose cumulative count reaches it; the estimate
    is interpolated linearly between that bucket's lower bound (the previous bucket's upper
    bound, 0 for the first) and its upper bound. A rank in the +Inf bucket answers the highest
    finite bound (all that is known is "at least that"). None when nothing was observed."""
    if not buckets or not math.isinf(buckets[-1][0]):
        raise ValueError("buckets need a +Inf bucket last")
    total = buckets[-1][1]
    if total <= 0:
        return None
    rank = q * total
    # The +Inf bucket holds every observation, so some bucket always reaches the rank.
    i = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    upper, count = buckets[i]
    if math.isinf(upper):
        return buckets[-2][0] if len(buckets) > 1 else None
    if i == 0 and upper <= 0:
        return upper
    lower, below = (0.0, 0.0) if i == 0 else buckets[i - 1]
    in_bucket = count - below
    return lower + (upper - lower) * ((rank - below) / in_bucket if in_bucket else 1.0)


def window_quantiles(
    start: dict[str, dict[str, Buckets]], end: dict[str, dict[str, Buckets]]
) -> dict[str, dict[str, Any]]:
    """Per class and histogram (by HISTOGRAMS' short names): the turns observed in the window,
    p50 and p99 in seconds, and how many fell past the top finite bucket (whose quantiles are
    then only lower bounds)."""
    out: dict[str, dict[str, Any]] = {}
    for cls in CLASSES:
        out[cls] = {}
        for short, metric in HISTOGRAMS.items():
            ends = end.get(metric, {}).get(cls)
            if not ends:
                out[cls][short] = {"count": 0, "p50_s": None, "p99_s": None, "beyond_top_bucket": 0}
                continue
            grown = window_buckets(start.get(metric, {}).get(cls), ends)
            top = grown[-2][1] if len(grown) > 1 else 0.0
            out[cls][short] = {
                "count": int(grown[-1][1]),
                **{f"p{round(q * 100)}_s": _round(quantile(q, grown)) for q in QUANTILES},
                "beyond_top_bucket": int(grown[-1][1] - top),
                "top_bucket_s": grown[-2][0] if len(grown) > 1 else None,
            }
    return out


def scrape(url: str) -> dict[str, dict[str, Buckets]]:
    return histograms(httpx.get(url, timeout=5).text)


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


# -- the scheduler's /status, sampled --


def sample(doc: dict[str, Any], at: float) -> dict[str, Any]:
    """The parts of one /status document the summary needs, taken `at` seconds into the window."""
    return {
        "at_s": round(at, 2),
        "replicas": {r["name"]: {f: r.get(f) for f in REPLICA_FIELDS} for r in doc.get("replicas", [])},
        "held": {
            cls: {
                "count": h.get("count", 0),
                "oldest_wait_s": h.get("oldest_wait_s"),
            }
            for cls, h in doc.get("held", {}).get("by_class", {}).items()
        },
    }


def _max_median(values: list[float | None]) -> dict[str, Any]:
    known = [v for v in values if v is not None]
    if not known:
        return {"max": None, "median": None, "samples": 0}
    return {"max": max(known), "median": statistics.median(known), "samples": len(known)}


def summarise_samples(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Per replica, max and median of each REPLICA_FIELDS field over the samples; per class, the
    most turns held at once and the longest wait seen."""
    names = sorted({name for s in samples for name in s["replicas"]})
    replicas = {
        name: {
            f: _max_median([s["replicas"][name].get(f) for s in samples if name in s["replicas"]])
            for f in REPLICA_FIELDS
        }
        for name in names
    }
    held = {}
    for cls in CLASSES:
        counts = [s["held"][cls]["count"] for s in samples if cls in s["held"]]
        waits = [s["held"][cls]["oldest_wait_s"] for s in samples if cls in s["held"]]
        known_waits = [w for w in waits if w is not None]
        held[cls] = {
            "max_count": max(counts) if counts else None,
            "max_oldest_wait_s": max(known_waits) if known_waits else None,
        }
    return {"samples": len(samples), "replicas": replicas, "held": held}


class StatusSampler:
    """Reads GET /status every PERIOD_S on a thread until stopped; a read that fails is counted,
    not fatal (the flood goes on, and the summary says how many samples it rests on)."""

    def __init__(self, url: str, period_s: float = PERIOD_S) -> None:
        self.url = url
        self.period_s = period_s
        self.samples: list[dict[str, Any]] = []
        self.failed = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="status-sampler", daemon=True)

    def start(self) -> StatusSampler:
        self._started = time.monotonic()
        self._thread.start()
        return self

    def _loop(self) -> None:
        with httpx.Client(timeout=self.period_s) as client:
            next_at = self._started
            while not self._stop.is_set():
                try:
                    doc = client.get(self.url).json()
                    self.samples.append(sample(doc, time.monotonic() - self._started))
                except (httpx.HTTPError, ValueError):
                    self.failed += 1
                # On a fixed grid, so that a slow answer does not stretch the period.
                next_at += self.period_s
                self._stop.wait(max(next_at - time.monotonic(), 0.0))

    def stop(self) -> dict[str, Any]:
        self._stop.set()
        self._thread.join(timeout=10)
        return {**summarise_samples(self.samples), "failed_reads": self.failed, "period_s": self.period_s}


# -- the status page, rendered --


def chromium() -> str | None:
    return next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)


def headless_chromium(browser: str, profile: Path) -> list[str]:
    """Chromium in headless mode as a container or CI runs it: no sandbox, no GPU, no shared
    memory, nothing fetched from the network on its own, a profile of its own."""
    return [
        browser,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--no-first-run",
        f"--user-data-dir={profile}",
    ]


def screenshot(
    url: str, path: Path, profile: Path, timeout_s: float = 60.0, virtual_time_ms: int = 3000
) -> str | None:
    """Renders `url` to the PNG `path` once `virtual_time_ms` of the page's timers have run;
    None when it worked, else why not (no Chromium, or it failed: the run goes on without a
    picture)."""
    browser = chromium()
    if browser is None:
        return "no headless Chromium here (Debian: apt-get install -y chromium)"
    argv = [
        *headless_chromium(browser, profile),
        "--hide-scrollbars",
        # The page fills its tables from its first fetch of /status after load; virtual time
        # lets that happen before the picture is taken.
        f"--virtual-time-budget={virtual_time_ms}",
        "--window-size=1280,900",
        f"--screenshot={path}",
        url,
    ]
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"Chromium took over {timeout_s:g} s"
    if out.returncode != 0 or not path.exists():
        return f"Chromium exited with {out.returncode}: {out.stderr.strip()[-300:]}"
    return None


# -- the report --


def _s(value: float | None) -> str:
    return "-" if value is None else f"{value:.3g} s"


def _mm(figure: dict[str, Any]) -> str:
    if figure["max"] is None:
        return "-"
    return f"{figure['max']:g} / {figure['median']:g}"


def _q(figure: dict[str, Any], key: str) -> str:
    # A rank past the top finite bucket answers that bucket's bound: say it is a lower bound.
    beyond = figure["beyond_top_bucket"] and figure[key] == figure.get("top_bucket_s")
    return (">= " if beyond else "") + _s(figure[key])


def markdown(label: str, flood: dict[str, Any]) -> list[str]:
    """The "Under the flood" lines for one luftpause window's `flood` record."""
    status, quantiles = flood["status"], flood["quantiles"]
    lines = [
        f"Under the flood (luftpause arm), {label}: the scheduler's GET /status sampled every "
        f"{status['period_s']:g} s over the window ({status['samples']} samples"
        + (f", {status['failed_reads']} reads failed" if status["failed_reads"] else "")
        + "), max / median",
        "",
        "| replica | in flight | limit | ours waiting in engine | others waiting | engine waiting |",
        "|---|---|---|---|---|---|",
    ]
    for name, r in status["replicas"].items():
        lines.append(
            f"| {name} | {_mm(r['in_flight'])} | {_mm(r['limit'])} | {_mm(r['waiting_ours'])} | "
            f"{_mm(r['others_waiting'])} | {_mm(r['waiting'])} |"
        )
    held = status["held"]
    lines += [
        "",
        "Most turns held at once: "
        + ", ".join(
            f"{cls} {'-' if h['max_count'] is None else h['max_count']} "
            f"(longest wait seen {_s(h['max_oldest_wait_s'])})"
            for cls, h in held.items()
        )
        + ".",
        "",
        "From the dataplane's /metrics: the histograms' growth over the window; p50 and p99 are "
        "interpolated linearly inside a bucket, as Prometheus' histogram_quantile does",
        "",
        "| class | turns | held p50 | held p99 | engine queue + prefill p50 | engine queue + prefill p99 |",
        "|---|---|---|---|---|---|",
    ]
    for cls, q in quantiles.items():
        h, e = q["held"], q["engine_first_token"]
        lines.append(
            f"| {cls} | {h['count']} | {_q(h, 'p50_s')} | {_q(h, 'p99_s')} | "
            f"{_q(e, 'p50_s')} | {_q(e, 'p99_s')} |"
        )
    shot = flood.get("screenshot")
    lines += [
        "",
        f"Status page midway: {shot}" if shot else f"No status page picture: {flood.get('screenshot_error')}",
    ]
    return lines
