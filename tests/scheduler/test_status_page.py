"""The status page as a person sees it: loaded in headless Chromium against a running scheduler.

Chromium runs the page's script (with a virtual-time budget, so its 2 s polling has happened by
the time the DOM is dumped), and the test reads the rendered tables: the replicas, a turn held
for a caller, and, with `?runtime=`, a runtime's run tree with subtree totals, read from a
stand-in runtime (with a tree and totals, or with only a flat list of runs, or not there).
The run gate: each replica's KV pool column and the runs waiting to be admitted say what /status
says, and the run tree shows each running run's working set and whether a replica holds it, as
/status/runs/{run_id} says. With STATUS_PAGE_SCREENSHOT=path that page is also saved as a PNG.
Skipped, saying why, where no Chromium is installed (Debian: `apt-get install -y chromium`).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import threading
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from support import (
    LoopbackServer,
    Ports,
    QuietHandler,
    Service,
    amend_config,
    free_port,
    running,
    sample,
    scrape,
    until,
    wait_until,
    write_config,
)
from test_prober import LLAMACPP_METRICS, LLAMACPP_SLOTS, _llamacpp
from test_scheduler_process import MODEL, EngineStandIn
from turns_stream import TurnsStream

from luftpause.bench.sim.flood_watch import headless_chromium
from luftpause.proto import pb, rpc

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None, reason="no headless Chromium here (Debian: apt-get install -y chromium)"
)


def _run(handle: str, parent: str | None, task: str, turns: int, tools: int, prompt: int, out: int) -> dict:
    return {
        "handle": handle,
        "status": "Running",
        "parent": parent,
        "task": task,
        "toolCalls": tools,
        "turns": turns,
        "promptTokens": prompt,
        "completionTokens": out,
    }


ROOT = _run("run-root", None, "Survey the rivers of Europe", 3, 2, 900, 120)
CHILD_1 = _run("run-volga", "run-root", "Measure the Volga", 2, 1, 400, 50)
CHILD_2 = _run("run-danube", "run-root", "Measure the Danube", 4, 3, 700, 80)
# The runtime's current shape: every run flat with its children's handles, and a tree whose
# nodes carry their subtree totals.
WITH_TREE = {
    "runs": [{**r, "children": []} for r in (ROOT, CHILD_1, CHILD_2)],
    "tree": [
        {
            **ROOT,
            "subtree": {"turns": 9, "toolCalls": 6, "promptTokens": 2000, "completionTokens": 250},
            "children": [{**CHILD_1, "children": []}, {**CHILD_2, "children": []}],
        }
    ],
}
# An older runtime: a flat list with parents and nothing else; the page sums the subtree itself.
FLAT = {"runs": [ROOT, CHILD_1, CHILD_2]}
# Runs the scheduler knows (see the gate test): one held on fake-a, one waiting for room.
GATED = {
    "runs": [
        _run("gate-r1", None, "Held on fake-a", 1, 0, 0, 0),
        _run("gate-r2", None, "Waiting for room", 0, 0, 0, 0),
        {**_run("gate-done", None, "Finished long ago", 1, 0, 10, 1), "status": "finished"},
    ]
}
# Finished runs listed before running ones, at the top and below.
MIXED = {
    "runs": [
        {**_run("run-root-done", None, "Old survey", 1, 0, 10, 1), "status": "finished"},
        _run("run-live", None, "Live survey", 1, 0, 10, 1),
        {**_run("run-done", "run-live", "Finished part", 1, 0, 10, 1), "status": "finished"},
        {**_run("run-waiting", "run-live", "Delete a file", 1, 0, 10, 1), "status": "AwaitingApproval"},
    ]
}


# What a runtime on a shared store it cannot read says of the runs it does not list.
NOT_LISTED = "the runs other runtimes drive are not listed: the run store ... cannot be reached: ..."


class _RuntimeStandIn(LoopbackServer):
    """Serves /tree/status and /flat/status with the CORS headers the runtime sends."""

    def __init__(self) -> None:
        class Handler(QuietHandler):
            def do_GET(self) -> None:  # noqa: N802 (the stdlib's name)
                doc = {
                    "/tree/status": WITH_TREE,
                    "/flat/status": FLAT,
                    "/mixed/status": MIXED,
                    "/gate/status": GATED,
                    "/partial/status": {**FLAT, "notListed": NOT_LISTED},
                }.get(self.path)
                body = json.dumps(doc).encode() if doc is not None else b"{}"
                headers = {"content-type": "application/json", "access-control-allow-origin": "*"}
                self.answer(200 if doc is not None else 404, body, headers)

        super().__init__(Handler)


class _Tables(HTMLParser):
    """The text of each cell of each <tbody id=...>, row by row, and its title (what a pointer
    over it shows), and the text of each element with an id."""

    def __init__(self) -> None:
        super().__init__()
        self.bodies: dict[str, list[list[str]]] = {}
        self.titles: dict[str, list[list[str]]] = {}
        self.texts: dict[str, str] = {}
        self._body: str | None = None
        self._cell: list[str] | None = None
        self._ids: list[tuple[str, str]] = []
        # Per (chart's svg id, line's class): the line's points and its last value.
        self.lines: dict[tuple[str, str], tuple[str, str]] = {}
        self._svg = ""
        self.visible: set[str] = set()

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "tbody" and a.get("id"):
            self._body = a["id"]
            self.bodies[self._body] = []
            self.titles[self._body] = []
        elif tag == "tr" and self._body is not None:
            self.bodies[self._body].append([])
            self.titles[self._body].append([])
        elif tag == "td" and self._body is not None:
            self._cell = []
            self.titles[self._body][-1].append(a.get("title") or "")
        if a.get("id") and "hidden" not in a:
            self.visible.add(a["id"] or "")
        if tag == "svg":
            self._svg = a.get("id") or ""
        elif tag == "polyline":
            self.lines[self._svg, a.get("class") or ""] = (a.get("points") or "", a.get("data-last") or "")
        if a.get("id"):
            self._ids.append((tag, a["id"] or ""))
            self.texts.setdefault(a["id"] or "", "")

    def handle_endtag(self, tag: str) -> None:
        if tag == "td" and self._cell is not None and self._body is not None:
            self.bodies[self._body][-1].append("".join(self._cell).strip())
            self._cell = None
        elif tag == "tbody":
            self._body = None
        if self._ids and self._ids[-1][0] == tag:
            self._ids.pop()

    def handle_data(self, data: str) -> None:
        if self._cell is not None:
            self._cell.append(data)
        for _, element in self._ids:
            self.texts[element] += data


def _render(url: str, profile: Path) -> _Tables:
    assert CHROMIUM is not None
    out = subprocess.run(
        [
            *headless_chromium(CHROMIUM, profile),
            "--virtual-time-budget=5000",
            "--dump-dom",
            url,
        ],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    tables = _Tables()
    tables.feed(out.stdout)
    return tables


def _screenshot(url: str, path: Path, profile: Path) -> None:
    """Saves `url` as a PNG tall enough to show the run tree below the scheduler's tables."""
    assert CHROMIUM is not None
    argv = [*headless_chromium(CHROMIUM, profile), "--hide-scrollbars", "--virtual-time-budget=5000"]
    out = subprocess.run(
        [*argv, "--window-size=1400,1300", f"--screenshot={path}", url],
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert out.returncode == 0 and path.exists(), out.stderr[-2000:]


def _allowing(path: Path, *origins: str, **scheduler: Any) -> Path:
    """The config at `path`, its [scheduler] letting the page read runtimes on these origins
    (with the other [scheduler] keys given)."""
    return amend_config(path, {"scheduler": {"runtime_origins": list(origins), **scheduler}})


@pytest.fixture(scope="module")
def nobody() -> str:
    """A runtime URL nobody answers at (its origin allowed to the page)."""
    return f"http://127.0.0.1:{free_port()}"


@pytest.fixture(scope="module")
def scheduler(
    tmp_path_factory: pytest.TempPathFactory, runtime: _RuntimeStandIn, nobody: str
) -> Iterator[tuple[Ports, Path]]:
    tmp = tmp_path_factory.mktemp("status-page")
    # Two replicas nobody answers for: the first probe finds them unhealthy, so a turn is held.
    ports = Ports(engines=[free_port(), free_port()])
    path = _allowing(write_config(tmp, ports), runtime.url, nobody, probe_period_s=0.25)
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp / "scheduler.log").start()
    with running(service):
        service.wait_http(f"http://127.0.0.1:{ports.status}/status")
        yield ports, tmp


@pytest.fixture(scope="module")
def runtime() -> Iterator[_RuntimeStandIn]:
    stand_in = _RuntimeStandIn()
    yield stand_in
    stand_in.close()


def test_the_page_shows_the_replicas_and_a_turn_held_for_its_caller(scheduler, tmp_path: Path):
    ports, _ = scheduler
    import httpx

    wait_until(
        lambda: all(
            r["probed"] and not r["healthy"]
            for r in httpx.get(f"http://127.0.0.1:{ports.status}/status").json()["replicas"]
        ),
        what="both replicas probed unhealthy",
    )
    stream_open = threading.Event()

    def admission() -> Iterator[pb.DataplaneBatch]:
        request = pb.AdmitRequest(turn_id="page-t1", run_id="page-r1", model="fake-llama", caller="page-team")
        yield pb.DataplaneBatch(items=[pb.DataplaneItem(admit=request)])
        stream_open.wait(60)  # the dataplane stays, so the turn stays held

    with grpc.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel:
        admit = rpc.SchedulerStub(channel).Turns(admission(), timeout=60)
        try:
            wait_until(
                lambda: (
                    [
                        s["interactive"]["held"]
                        for s in httpx.get(f"http://127.0.0.1:{ports.status}/status").json()["held_history"]
                    ][-2:]
                    == [1, 1]
                ),
                what="the turn held in two of the scheduler's samples",
            )
            page = _render(f"http://127.0.0.1:{ports.status}/", tmp_path / "profile")
        finally:
            stream_open.set()
            admit.cancel()

    replicas = {r[0]: r for r in page.bodies["replicas"]}
    assert set(replicas) == {"fake-a", "fake-b"}
    assert replicas["fake-a"][1:4] == ["generative", "fake-llama", "unhealthy"]
    assert replicas["fake-a"][4:6] == ["0 / 2", "0 (0 interactive), 2 a class"], (
        "in flight / limit, ours waiting in the engine"
    )
    held = {r[0]: r[1] for r in page.bodies["held"]}
    assert held["all"] == "1" and held["class interactive"] == "1" and held["caller page-team"] == "1"
    # The chart: one point a second of the scheduler's samples, the held interactive turn on the
    # last two; nothing batch.
    points, last = page.lines["chart-held", "interactive"]
    assert len(points.split()) >= 2 and last == "1"
    assert page.lines["chart-held", "batch"][1] == "0"
    assert float(page.lines["chart-wait", "interactive"][1]) > 0
    assert page.texts["chart-now"].startswith("interactive: 1 held, oldest ")
    # Neither replica's pool is known (nobody answers for them): the gate is off on both, and the
    # held turn's run is new, so it waits to be admitted.
    assert replicas["fake-a"][9] == "gate off · 0 runs"
    assert page.texts["waiting-for-room"].startswith("Runs waiting to be admitted: interactive 1 (oldest ")
    assert page.texts["waiting-for-room"].endswith(", batch 0")
    assert page.texts["error"] == ""
    assert "updated" in page.texts["updated"]
    assert page.bodies["runtime-runs"] == [], "no runtime asked for, none shown"


def test_with_a_runtime_the_page_shows_its_run_tree_and_subtree_totals(scheduler, runtime, tmp_path: Path):
    ports, _ = scheduler
    page = _render(f"http://127.0.0.1:{ports.status}/?runtime={runtime.url}/tree", tmp_path / "profile")
    rows = page.bodies["runtime-runs"]
    assert [r[0].replace("\u2003", " ").strip() for r in rows] == ["run-root", "└ run-volga", "└ run-danube"]
    root = rows[0]
    assert root[1:3] == ["Running", "Survey the rivers of Europe"]
    assert root[3:6] == ["3", "2", "900 / 120"], "the root's own work"
    assert root[6:9] == ["9", "6", "2000 / 250"], "the subtree totals the runtime sent"
    assert page.texts["runtime-error"] == ""
    assert {r[0] for r in page.bodies["replicas"]} == {"fake-a", "fake-b"}


def test_runs_are_listed_running_first_and_the_filter_keeps_matching_runs_with_their_parents(
    scheduler, runtime, tmp_path: Path
):
    ports, _ = scheduler
    base = f"http://127.0.0.1:{ports.status}/?runtime={runtime.url}/mixed"
    rows = _render(base, tmp_path / "profile").bodies["runtime-runs"]
    names = [r[0].replace("\u2003", " ").strip() for r in rows]
    assert names == ["run-live", "└ run-waiting", "└ run-done", "run-root-done"]
    page = _render(f"{base}&filter=approval", tmp_path / "profile")
    names = [r[0].replace("\u2003", " ").strip() for r in page.bodies["runtime-runs"]]
    assert names == ["run-live", "└ run-waiting"], "the match and the run above it"
    assert page.texts["runtime-count"] == "2 of 4 shown"


def test_with_a_token_the_page_asks_for_it_and_never_needs_it_in_the_url(tmp_path: Path):
    ports = Ports(engines=[free_port()])
    path = write_config(tmp_path, ports)
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log")
    service.start(env={"LUFTPAUSE_TOKEN": "s3cret"})
    with running(service):
        service.wait_http(f"http://127.0.0.1:{ports.status}/")
        asked = _render(f"http://127.0.0.1:{ports.status}/", tmp_path / "profile")
        # An old link with ?token= still works; the token leaves the address for sessionStorage.
        given = _render(f"http://127.0.0.1:{ports.status}/?token=s3cret", tmp_path / "profile2")
    assert "GET /status answered 401" in asked.texts["error"]
    assert "token-form" in asked.visible
    assert given.texts["error"] == "" and "token-form" not in given.visible
    assert {r[0] for r in given.bodies["replicas"]} == {"fake-a"}


def test_a_runtime_without_a_tree_gets_its_subtree_summed_from_the_flat_list(
    scheduler, runtime, tmp_path: Path
):
    ports, _ = scheduler
    page = _render(f"http://127.0.0.1:{ports.status}/?runtime={runtime.url}/flat", tmp_path / "profile")
    rows = page.bodies["runtime-runs"]
    assert [r[0].replace("\u2003", " ").strip() for r in rows] == ["run-root", "└ run-volga", "└ run-danube"]
    assert rows[0][6:9] == ["9", "6", "2000 / 250"]
    assert rows[1][6:9] == ["2", "1", "400 / 50"]


def test_a_runtime_that_lists_only_its_own_runs_says_why_beside_them(scheduler, runtime, tmp_path: Path):
    ports, _ = scheduler
    listing = _render(f"http://127.0.0.1:{ports.status}/?runtime={runtime.url}/partial", tmp_path / "profile")
    whole = _render(f"http://127.0.0.1:{ports.status}/?runtime={runtime.url}/flat", tmp_path / "profile2")
    assert [r[0].replace("\u2003", " ").strip() for r in listing.bodies["runtime-runs"]][0] == "run-root"
    assert listing.texts["runtime-not-listed"] == NOT_LISTED and listing.texts["runtime-error"] == ""
    assert whole.texts["runtime-not-listed"] == ""


def test_a_runtime_that_cannot_be_read_is_named_and_the_scheduler_still_shows(
    scheduler, nobody: str, tmp_path: Path
):
    ports, _ = scheduler
    page = _render(f"http://127.0.0.1:{ports.status}/?runtime={nobody}", tmp_path / "profile")
    assert page.texts["runtime-error"].startswith(f"runtime at {nobody} not readable")
    assert {r[0] for r in page.bodies["replicas"]} == {"fake-a", "fake-b"}


async def test_the_kv_pool_column_and_the_run_view_show_what_the_gate_holds_and_who_waits(
    runtime, tmp_path: Path
):
    """fake-a (an engine stand-in with a configured pool of room for one run) holds gate-r1;
    gate-r2 waits for room; fake-b nobody answers for, its pool unknown: gate off."""
    engine = EngineStandIn()
    ports = Ports(engines=[engine.port, free_port()])
    path = write_config(tmp_path, ports)
    text = _allowing(path, runtime.url, probe_period_s=0.25).read_text()
    # Only fake-a's pool is configured.
    path.write_text(
        text.replace(
            f'url = "http://127.0.0.1:{engine.port}"\n',
            f'url = "http://127.0.0.1:{engine.port}"\nkv_tokens = 6000\ngate_min_runs = 1\n',
            1,
        )
    )
    service = Service("scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log").start()
    url = f"http://127.0.0.1:{ports.status}"
    try:
        with running(service):
            service.wait_http(f"{url}/status")
            await until(
                lambda: (
                    [r["healthy"] for r in httpx.get(f"{url}/status").json()["replicas"]] == [True, False]
                ),
                what="fake-a healthy, fake-b not",
            )
            async with (
                grpc.aio.insecure_channel(f"127.0.0.1:{ports.grpc}") as channel,
                TurnsStream(channel) as turns,
            ):
                first = await turns.admit(
                    pb.AdmitRequest(turn_id="gate-t1", run_id="gate-r1", model=MODEL, request_bytes=2000)
                )
                assert first.outcome == pb.AdmitReply.PLACED
                second = await turns.admit_later(
                    pb.AdmitRequest(turn_id="gate-t2", run_id="gate-r2", model=MODEL, max_tokens=1500)
                )
                await until(
                    lambda: httpx.get(f"{url}/status").json()["held"]["count"] == 1, what="gate-t2 held"
                )
                page = await asyncio.to_thread(
                    _render, f"{url}/?runtime={runtime.url}/gate", tmp_path / "profile"
                )
                shot = os.environ.get("STATUS_PAGE_SCREENSHOT")
                if shot:
                    await asyncio.to_thread(
                        _screenshot,
                        f"{url}/?runtime={runtime.url}/gate",
                        Path(shot),
                        tmp_path / "shot-profile",
                    )
                async with httpx.AsyncClient(base_url=url) as client:
                    doc = (await client.get("/status")).json()
                    runs = {r: (await client.get(f"/status/runs/{r}")).json() for r in ("gate-r1", "gate-r2")}
                second.cancel()
    finally:
        engine.close()

    a, b = doc["replicas"]
    assert (a["kv_source"], a["gate"], a["held_runs"], b["gate"]) == (
        "config",
        "tokens",
        1,
        "off: pool unknown",
    )
    replicas = {r[0]: r for r in page.bodies["replicas"]}
    assert replicas["fake-a"][9] == f"{a['held_kv_tokens']} / {a['kv_capacity']} · 1 run"
    assert replicas["fake-b"][9] == "gate off · 0 runs"
    waiting = doc["waiting_for_room"]["by_class"]["interactive"]
    assert waiting["runs"] == 1
    assert page.texts["waiting-for-room"].startswith("Runs waiting to be admitted: interactive 1 (oldest ")
    assert page.texts["gate"].startswith("Run gate: a new run is placed only where it fits")
    assert page.texts["error"] == "" and page.texts["runtime-error"] == ""
    rows = {r[0]: r for r in page.bodies["runtime-runs"]}
    assert runs["gate-r1"]["held"] and not runs["gate-r2"]["held"]
    assert rows["gate-r1"][9:11] == [str(runs["gate-r1"]["working_set"]), "held"]
    assert rows["gate-r2"][9:11] == [str(runs["gate-r2"]["working_set"]), "not held"]
    assert rows["gate-done"][9:11] == ["–", "–"], "the scheduler is not asked about finished runs"


def test_a_llamacpp_replica_shows_the_slots_its_engine_has_and_its_prompt_cache_share(tmp_path: Path):
    """fake-a is a llama-server double with four slots that took 12,000 prompt tokens, 9,000
    of them from its cache; fake-b, a llama.cpp replica too, nobody answers for. The scheduler
    reads fake-a's slots and counters by its probes alone, and the page, /status and /metrics
    say them; fake-b's gate is off by llama.cpp's default host cache, and the page says so."""
    answers = {
        "/health": (200, {"status": "ok"}),
        "/metrics": LLAMACPP_METRICS,
        "/slots": (200, LLAMACPP_SLOTS),
    }
    with _llamacpp(answers) as engine:
        ports = Ports(engines=[int(engine.rsplit(":", 1)[1]), free_port()])
        path = write_config(tmp_path, ports)
        text = amend_config(path, "[scheduler]\nprobe_period_s = 0.25").read_text()
        # fake-a speaks llama.cpp's metrics, with its host cache off so that the gate counts slots;
        # fake-b is a llama.cpp replica whose config says nothing of its host cache.
        fake_b = f'url = "http://127.0.0.1:{ports.engines[1]}"\n'
        path.write_text(
            text.replace(
                f'url = "{engine}"\n', f'url = "{engine}"\nmetrics = "llamacpp"\nhost_cache = false\n', 1
            ).replace(fake_b, f'{fake_b}metrics = "llamacpp"\n', 1)
        )
        service = Service(
            "scheduler", ["scheduler", "--config", str(path)], tmp_path / "scheduler.log"
        ).start()
        url = f"http://127.0.0.1:{ports.status}"
        with running(service):
            service.wait_http(f"{url}/status")
            wait_until(
                lambda: httpx.get(f"{url}/status").json()["replicas"][0]["kv_slots"] == 4,
                what="fake-a's slots read from its /slots",
            )
            page = _render(f"{url}/", tmp_path / "profile")
            doc = httpx.get(f"{url}/status").json()
            metrics = scrape(url)

    a, b = doc["replicas"]
    assert (a["gate"], a["kv_slots"], a["kv_tokens"], a["kv_source"]) == ("slots", 4, 8192, "engine")
    assert (a["prompt_tokens"], a["cached_tokens"], a["prompt_cache_share"]) == (12000, 9000, 0.75)
    assert (b["prompt_tokens"], b["prompt_cache_share"]) == (None, None)
    replicas = {r[0]: r for r in page.bodies["replicas"]}
    titles = {r[0]: t for r, t in zip(page.bodies["replicas"], page.titles["replicas"], strict=True)}
    assert replicas["fake-a"][9:11] == ["0 / 4 slots · 0 runs", "75 %"]
    assert (b["gate"], b["host_cache"], b["host_cache_source"]) == ("off: host cache", True, "default")
    assert replicas["fake-b"][9] == "gate off · 0 runs"
    assert (
        titles["fake-b"][9]
        == "off: host cache (llama.cpp's default: set host_cache = false for --cache-ram 0)"
    )
    assert titles["fake-a"][10] == "9000 of 12000 prompt tokens from the engine's cache since it started"
    assert replicas["fake-b"][10] == "–"
    assert titles["fake-b"][10] == "no prompt-cache counters on its engine's /metrics"
    assert sample(metrics, "luftpause_scheduler_replica_prompt_tokens_total", replica="fake-a") == 12000
    assert sample(metrics, "luftpause_scheduler_replica_cached_prompt_tokens_total", replica="fake-a") == 9000
    assert (
        "luftpause_scheduler_replica_prompt_tokens_total",
        frozenset({("replica", "fake-b")}),
    ) not in metrics
