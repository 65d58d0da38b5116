"""The Grafana dashboard's panels drawn from a recorded flood, for the README: no Grafana needed.

compose.otel.yaml provisions Grafana with deploy/grafana/luftpause.json over Prometheus scraping
what deploy/prometheus/prometheus.yml names. Neither server runs here, so this plays both: it
starts a whole stack (`luftpause up --with-fakes`, two fake engines) on ports of its own, floods it
as bench/status_page.py does (`--batch` (16) streaming batch agents for the whole of `--seconds`
(75); from a tenth of the way in, two teams' interactive agents (`--interactive`, 4 each) for 40 %
of it, and `--sub-agents` (3) closed-loop agents over MCP spawning sub-agents, whose tool calls the
runtime counts), scrapes every target of the scrape config each second, mapped from its compose
service to the stack's own port and labelled as Prometheus labels it (`job`, `instance`, the
config's `replica`), and then evaluates each panel's own PromQL query over the scrapes
(bench/promql.py: rates, sums, `histogram_quantile` over the buckets) and draws the panels in the
dashboard's order with matplotlib. Prints a line of progress a second, then each panel's peak
per series.

Writes bench/results/dashboard-<UTC time>.json (the flood, the scrapes' series for every metric
the dashboard names, the peaks) and the .png beside it; `--from RECORD` draws the picture again from
a record without a flood.

    luftpause bench dashboard_plot [--seconds 75] [--batch 16] [--interactive 4] [--sub-agents 3] [--out bench/results]
    luftpause bench dashboard_plot --from bench/results/dashboard-<time>.json
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import yaml

from luftpause.bench import promql
from luftpause.bench.results import RESULTS_DIR, _revision

ROOT = Path(__file__).resolve().parents[1]
DASHBOARD = ROOT / "deploy" / "grafana" / "luftpause.json"
SCRAPE_CONFIG = ROOT / "deploy" / "prometheus" / "prometheus.yml"
TEAMS = ("team-search", "team-code")


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    title: str
    unit: str
    queries: tuple[Query, ...]


def panels(path: Path = DASHBOARD) -> list[Panel]:
    """The dashboard's panels in its order (top to bottom, left to right), each with its queries."""
    doc = json.loads(path.read_text())
    ordered = sorted(doc["panels"], key=lambda p: (p["gridPos"]["y"], p["gridPos"]["x"]))
    return [
        Panel(
            p["title"],
            p.get("fieldConfig", {}).get("defaults", {}).get("unit", ""),
            tuple(Query(t["expr"], t.get("legendFormat", "")) for t in p["targets"]),
        )
        for p in ordered
    ]


@dataclass(frozen=True)
class Target:
    """One scrape target of the scrape config: its job, its address (a compose service and port),
    the labels the config adds, and whether the scrape sends the bearer token."""

    job: str
    address: str
    labels: tuple[tuple[str, str], ...]
    authorized: bool
    path: str = "/metrics"

    @property
    def service(self) -> str:
        return self.address.rsplit(":", 1)[0]


def scrape_targets(path: Path = SCRAPE_CONFIG) -> list[Target]:
    doc = yaml.safe_load(path.read_text())
    return [
        Target(
            job["job_name"],
            address,
            tuple(sorted((static.get("labels") or {}).items())),
            "authorization" in job or "bearer_token_file" in job,
            job.get("metrics_path", "/metrics"),
        )
        for job in doc["scrape_configs"]
        for static in job.get("static_configs", [])
        for address in static["targets"]
    ]


def exposition_into(scrape: promql.Scrape, text: str, target: Target) -> None:
    """Adds one target's Prometheus text to `scrape` as Prometheus stores it: `job` and
    `instance` added, then the config's labels (a label the target exported itself under the
    same name becomes `exported_<name>`, as with honor_labels off)."""
    from prometheus_client.parser import text_string_to_metric_families

    added = {"job": target.job, "instance": target.address, **dict(target.labels)}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = {(f"exported_{k}" if k in added else k): v for k, v in s.labels.items()}
            scrape.add(s.name, {**labels, **added}, s.value)


def scrape_all(
    targets: list[Target], urls: dict[str, str], t: float, token: str | None = None, timeout_s: float = 5.0
) -> tuple[promql.Scrape, dict[str, str]]:
    """Every target read once: `urls` maps each compose service to where it listens here. Returns
    the scrape and, per target that did not answer 200, why."""
    scrape, failed = promql.Scrape(t), {}
    for target in targets:
        headers = {"authorization": f"Bearer {token}"} if token and target.authorized else {}
        try:
            answer = httpx.get(f"{urls[target.service]}{target.path}", headers=headers, timeout=timeout_s)
        except httpx.HTTPError as e:
            failed[target.address] = str(e) or type(e).__name__
            continue
        if answer.status_code != 200:
            failed[target.address] = f"{answer.status_code}: {answer.text[:200]}"
            continue
        exposition_into(scrape, answer.text, target)
    return scrape, failed


# -- the record --------------------------------------------------------------------------------------


def dashboard_names(dashboard: list[Panel]) -> set[str]:
    return {name for p in dashboard for q in p.queries for name in promql.metric_names(q.expr)}


def series_of(scrapes: list[promql.Scrape], names: set[str]) -> list[dict[str, Any]]:
    """The scrapes' samples of `names` as one entry per series, its values in scrape order."""
    keys = sorted({(n, k) for s in scrapes for n in names for k in s.by_name.get(n, {})}, key=str)
    return [
        {
            "name": n,
            "labels": dict(sorted(k)),
            "values": [s.by_name.get(n, {}).get(k) for s in scrapes],
        }
        for n, k in keys
    ]


def scrapes_of(record: dict[str, Any]) -> list[promql.Scrape]:
    scrapes = [promql.Scrape(t) for t in record["times"]]
    for entry in record["series"]:
        for scrape, value in zip(scrapes, entry["values"], strict=True):
            if value is not None:
                scrape.add(entry["name"], entry["labels"], value)
    return scrapes


def _number(v: float | None) -> float | str | None:
    """A value as JSON holds it: +Inf (an uncapped limit) as the string Prometheus writes."""
    if v is None or math.isfinite(v):
        return v if v is None else round(v, 6)
    return "+Inf" if v > 0 else "-Inf" if v < 0 else "NaN"


def write_record(path: Path, record: dict[str, Any]) -> None:
    """The record as JSON with one line per series, so that a diff of two stays readable."""
    head = {k: v for k, v in record.items() if k not in ("times", "series")}
    lines = json.dumps(head, indent=2)[:-2]
    lines += ',\n  "times": ' + json.dumps(record["times"]) + ',\n  "series": [\n'
    lines += ",\n".join(
        "    " + json.dumps({**e, "values": [_number(v) for v in e["values"]]}) for e in record["series"]
    )
    path.write_text(lines + "\n  ]\n}\n")


def read_record(path: Path) -> dict[str, Any]:
    record = json.loads(path.read_text())
    for entry in record["series"]:
        entry["values"] = [float(v) if isinstance(v, str) else v for v in entry["values"]]
    return record


def peaks(dashboard: list[Panel], scrapes: list[promql.Scrape]) -> dict[str, dict[str, float]]:
    """Each panel's highest value per series over the scrapes (finite values only)."""
    out: dict[str, dict[str, float]] = {}
    for p in dashboard:
        row: dict[str, float] = {}
        for q in p.queries:
            for labels, values in promql.series(q.expr, scrapes).items():
                finite = [v for v in values if v is not None and math.isfinite(v)]
                if finite:
                    row[promql.legend(q.legend, labels)] = round(max(finite), 4)
        out[p.title] = row
    return out


# -- the picture -------------------------------------------------------------------------------------

_UNITS = {"s": "seconds", "ops": "per second", "short": ""}
_NOT_IDENTITY = {promql.NAME, "job", "instance", "le"}


def draw(record: dict[str, Any], path: Path, dashboard: list[Panel] | None = None) -> Path | None:
    """The dashboard's panels over the record's scrapes as one PNG; None without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    dashboard = dashboard or panels()
    scrapes = scrapes_of(record)
    times = [s.t for s in scrapes]
    rows = math.ceil(len(dashboard) / 2)
    fig, axes = plt.subplots(rows, 2, figsize=(15, 3.6 * rows + 1.0), squeeze=False)
    flood = record.get("flood", {})
    wave = flood.get("interactive_wave_s")
    palette = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, dashboard, strict=False):
        drawn = 0
        # One colour per thing a series is of (a replica, a class), whichever query drew it: a
        # replica's in-flight line and its limit share it, told apart by the line's style.
        colours: dict[frozenset[tuple[str, str]], str] = {}
        for qi, q in enumerate(panel.queries):
            style = ("-", "--", ":")[qi % 3]
            lines = sorted(
                promql.series(q.expr, scrapes).items(), key=lambda kv: promql.legend(q.legend, kv[0])
            )
            for labels, values in lines:
                key = frozenset((k, v) for k, v in labels if k not in _NOT_IDENTITY)
                colour = colours.setdefault(key, palette[len(colours) % len(palette)])
                ys = [v if v is not None and math.isfinite(v) else math.nan for v in values]
                ax.plot(
                    times,
                    ys,
                    style,
                    color=colour,
                    linewidth=1.6,
                    label=promql.legend(q.legend, labels) or promql.legend("", labels),
                )
                drawn += 1
        if wave:
            ax.axvspan(wave[0], wave[1], color="#fff3bf", zorder=0)
        ax.set_title(panel.title, fontsize=10, loc="left")
        ax.set_ylabel(_UNITS.get(panel.unit, panel.unit), fontsize=8)
        ax.set_ylim(bottom=0)
        ax.tick_params(labelsize=8)
        ax.grid(alpha=0.3)
        ax.set_xlim(0, times[-1] if times else 1)
        if drawn:
            ax.legend(
                fontsize=7, ncol=min(drawn, 6), loc="upper left", bbox_to_anchor=(0, -0.1), frameon=False
            )
        else:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="grey")
    for ax in axes.flat[len(dashboard) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"The luftpause dashboard (deploy/grafana/luftpause.json), its queries over {len(scrapes)} scrapes "
        "a second apart (x: seconds since the flood began)\n"
        f"{flood.get('batch')} batch agents throughout; in the shaded wave {flood.get('interactive')} "
        f"interactive agents of each of two teams; {flood.get('sub_agents')} sub-agent loops over MCP",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0, 1, 0.975))
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


# -- the flood ---------------------------------------------------------------------------------------


def _progress(t: float, scrape: promql.Scrape) -> str:
    def get(expr: str) -> dict[str, float]:
        vector = promql.evaluate(promql.parse(expr), [scrape], 0)
        return {
            next((v for k, v in sorted(labels) if k in ("class", "replica")), ""): value
            for labels, value in vector.items()
        }

    held = get("sum by (class) (luftpause_scheduler_held_turns)")
    flying = get("luftpause_scheduler_in_flight_turns")
    limit = get("luftpause_scheduler_admission_limit")
    waiting = get("sum by (replica) (sglang:num_queue_reqs)")
    calls = sum(get("sum(luftpause_runtime_tool_calls_total)").values())
    replicas = "  ".join(
        f"{r} {flying[r]:.0f}/{'-' if math.isinf(limit.get(r, math.inf)) else f'{limit[r]:.0f}'} "
        f"(engine waiting {waiting.get(r, 0):.0f})"
        for r in sorted(flying)
    )
    return (
        f"{t:5.1f}s  held interactive {held.get('interactive', 0):.0f} batch {held.get('batch', 0):.0f}"
        f"  in flight {replicas}  tool calls {calls:.0f}"
    )


def _loadgen(cli: tuple[str, ...], *args: str) -> subprocess.Popen:
    return subprocess.Popen([*cli, "loadgen", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def flood(args: argparse.Namespace, dashboard: list[Panel]) -> dict[str, Any]:
    from luftpause.bench.soak import LoadedStack

    targets = scrape_targets()
    wave_at, wave_s = round(args.seconds * 0.1, 1), round(args.seconds * 0.4, 1)
    scrapes: list[promql.Scrape] = []
    missed: dict[str, int] = {}
    with LoadedStack("luftpause-dashboard-") as stack:
        p = stack.ports
        urls = {
            "scheduler": f"http://127.0.0.1:{p['status']}",
            "dataplane": stack.dataplane,
            "runtime": f"http://127.0.0.1:{p['runtime']}",
            "fake-a": f"http://127.0.0.1:{p['a']}",
            "fake-b": f"http://127.0.0.1:{p['b']}",
        }
        cli = stack.CLI
        common = ("--url", stack.dataplane, "--stream")
        loads = [
            _loadgen(cli, *common, "--agents", str(args.batch), "--duration-s", str(args.seconds),
                     "--class", "batch", "--caller", "nightly-evals", "--seed", "nightly"),
        ]  # fmt: skip
        started = time.monotonic()
        waved = False
        while (t := time.monotonic() - started) < args.seconds + args.drain_s:
            if not waved and t >= wave_at:
                waved = True
                loads += [
                    _loadgen(cli, *common, "--agents", str(args.interactive), "--duration-s", str(wave_s),
                             "--class", "interactive", "--caller", team, "--seed", team)
                    for team in TEAMS
                ]  # fmt: skip
                loads.append(
                    _loadgen(cli, "--runtime", stack.mcp, "--spawn-agents", str(args.sub_agents),
                             "--duration-s", str(args.seconds * 0.5), "--class", "interactive",
                             "--seed", "sub-agents")
                )  # fmt: skip
            scrape, failed = scrape_all(targets, urls, round(t, 2))
            for address in failed:
                missed[address] = missed.get(address, 0) + 1
            scrapes.append(scrape)
            print("\r" + _progress(t, scrape), end="", file=sys.stderr, flush=True)
            time.sleep(max(0.0, 1.0 - (time.monotonic() - started - t)))
        print(file=sys.stderr)
        for load in loads:
            try:
                load.wait(timeout=60)
            except subprocess.TimeoutExpired:
                load.kill()
    return {
        "scenario": "dashboard",
        "at": time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()),
        "revision": _revision(),
        "machine": {"cpus": _cpus(), "python": platform.python_version()},
        "flood": {
            "seconds": args.seconds,
            "batch": args.batch,
            "interactive": args.interactive,
            "sub_agents": args.sub_agents,
            "interactive_wave_s": [wave_at, round(wave_at + wave_s, 1)],
        },
        "targets": [{"job": t.job, "address": t.address, "labels": dict(t.labels)} for t in targets],
        "missed_scrapes": missed,
        "peaks": peaks(dashboard, scrapes),
        "times": [s.t for s in scrapes],
        "series": series_of(scrapes, dashboard_names(dashboard)),
    }


def _cpus() -> int:
    import os

    return os.cpu_count() or 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="luftpause bench dashboard_plot", description=__doc__)
    parser.add_argument("--seconds", type=int, default=75, help="how long the batch flood runs")
    parser.add_argument("--drain-s", type=int, default=5, help="scraping on after the flood ends")
    parser.add_argument("--batch", type=int, default=16, help="batch agents for the whole time")
    parser.add_argument("--interactive", type=int, default=4, help="interactive agents of each team")
    parser.add_argument("--sub-agents", type=int, default=3, help="closed-loop sub-agent spawners over MCP")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR)
    parser.add_argument("--from", dest="record", type=Path, help="draw again from this record, no flood")
    args = parser.parse_args(argv)

    dashboard = panels()
    if args.record:
        record, path = read_record(args.record), args.record
        record["peaks"] = peaks(dashboard, scrapes_of(record))  # the dashboard as it is now
    else:
        record = flood(args, dashboard)
        args.out.mkdir(parents=True, exist_ok=True)
        path = args.out / f"dashboard-{record['at']}.json"
        write_record(path, record)
        print(path)
    for title, row in record["peaks"].items():
        print(f"{title}: " + (", ".join(f"{k} {v:g}" for k, v in row.items()) or "no data"))
    if record.get("missed_scrapes"):
        print(f"scrapes that failed: {record['missed_scrapes']}", file=sys.stderr)
    png = draw(record, path.with_suffix(".png"), dashboard)
    if png is None:
        print("dashboard_plot: no picture without matplotlib (pip install -e '.[bench]')", file=sys.stderr)
        return 1
    print(png)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
