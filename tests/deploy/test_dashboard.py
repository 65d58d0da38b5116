"""compose.otel.yaml's Grafana dashboard and Prometheus scrape config, against a running stack.

Every query of deploy/grafana/luftpause.json is parsed (luftpause.bench.promql, and Prometheus's
own parser through `promtool check rules`) for the metrics it selects, and each of them must be a
series some target of deploy/prometheus/prometheus.yml exports: a real embedded stack
(`luftpause up`, with LUFTPAUSE_TOKEN set) serves turns of both classes and a sub-agent's tool call,
each target of the scrape config is read at the stack's own port with the token only where the
config sends one, and every panel must then show something. `promtool check config` accepts the
scrape config, and the resolved compose recipe agrees with it: the targets are services that
listen there, the engines' `replica` labels are the config's replicas, Prometheus gets the token
where its config reads it, Grafana mounts the dashboard where its provisioning looks, and the
collector passes spans to Jaeger on a port Jaeger takes them on.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import httpx2
import pytest
import yaml
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from support import (
    Ports,
    Service,
    call,
    free_port,
    start_up,
    stop_up,
    task_planning,
    wait_until,
    write_config,
)
from test_compose import _mounts, _published, needs_compose, resolve

from luftpause import config
from luftpause.bench import promql
from luftpause.bench.dashboard_plot import (
    DASHBOARD,
    SCRAPE_CONFIG,
    Panel,
    Query,
    Target,
    panels,
    scrape_all,
    scrape_targets,
)

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "dashboard-secret"
FILES = ("compose.yaml", "compose.otel.yaml")
# A vLLM engine a user adds to the engines job: the dashboard's engine panels read vLLM's names
# too (`sglang:... or vllm:...`), which the fake engine speaks with --metrics vllm.
VLLM = Target("engines", "fake-vllm:9003", (("replica", "fake-vllm"),), False)
# Histogram and counter samples belong to the family they end in; the family is what a
# /metrics page's HELP and TYPE lines name.
SUFFIXES = ("_bucket", "_sum", "_count", "_total")

# CI installs promtool (.ci/run: Debian's prometheus package), so there a missing one fails.
needs_promtool = pytest.mark.skipif(
    shutil.which("promtool") is None and not os.environ.get("CI"),
    reason="promtool not installed (apt-get install prometheus)",
)


def family(name: str) -> str:
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def missing_names(dashboard: list[Panel], scrape: promql.Scrape) -> list[str]:
    """Each metric a query names that no target exported, with the panel that wants it."""
    families = {family(n) for n, series in scrape.by_name.items() if series}
    missing = []
    for p in dashboard:
        for q in p.queries:
            for name in sorted(promql.metric_names(q.expr)):
                if not scrape.by_name.get(name):
                    known = "its family is exported" if family(name) in families else "no such family"
                    missing.append(f"{p.title!r}: {name} ({known}) in {q.expr}")
    return missing


def empty_panels(dashboard: list[Panel], scrapes: list[promql.Scrape]) -> list[str]:
    """The panels none of whose queries gives a series at the last scrape."""
    return [
        p.title
        for p in dashboard
        if not any(promql.evaluate(promql.parse(q.expr), scrapes, len(scrapes) - 1) for q in p.queries)
    ]


@dataclass
class Stack:
    ports: Ports
    urls: dict[str, str]
    scrapes: list[promql.Scrape]


def _turn(ports: Ports, service_class: str, run_id: str) -> None:
    reply = httpx.post(
        f"http://127.0.0.1:{ports.dataplane}/v1/chat/completions",
        json={"model": "fake-llama", "messages": [{"role": "user", "content": f"dashboard {run_id}"}]},
        headers={
            "authorization": f"Bearer {TOKEN}",
            "x-luftpause-class": service_class,
            "x-luftpause-run-id": run_id,
        },
        timeout=30,
    )
    assert reply.status_code == 200, reply.text


async def _sub_agent(ports: Ports) -> dict:
    http = httpx2.AsyncClient(headers={"authorization": f"Bearer {TOKEN}"}, timeout=60)
    url = f"http://127.0.0.1:{ports.runtime}/mcp"
    async with http, Client(streamable_http_client(url, http_client=http)) as client:
        spawned = await call(client, "spawn", task=task_planning(1, "dashboard"), tools=["lookup"])
        (run,) = (await call(client, "await", handles=[spawned["handle"]], timeout=60))["runs"]
    return run


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """`luftpause up` with LUFTPAUSE_TOKEN set, and a vLLM-flavoured fake engine beside it."""
    directory = tmp_path_factory.mktemp("dashboard")
    ports = Ports()
    vllm_port = free_port()
    vllm = Service(
        "fake-vllm",
        ["fake-engine", "--name", "fake-vllm", "--port", str(vllm_port), "--metrics", "vllm"],
        directory / "vllm.log",
    ).start()
    proc = start_up(write_config(directory, ports), directory / "up.log", env={"LUFTPAUSE_TOKEN": TOKEN})
    try:
        vllm.wait_http(f"http://127.0.0.1:{vllm_port}/health")
        urls = {
            "scheduler": f"http://127.0.0.1:{ports.status}",
            "dataplane": f"http://127.0.0.1:{ports.dataplane}",
            "runtime": f"http://127.0.0.1:{ports.runtime}",
            "fake-a": f"http://127.0.0.1:{ports.engines[0]}",
            "fake-b": f"http://127.0.0.1:{ports.engines[1]}",
            "fake-vllm": f"http://127.0.0.1:{vllm_port}",
        }
        yield Stack(ports, urls, [])
    finally:
        stop_up(proc)
        vllm.stop()


@pytest.fixture(scope="module")
def driven(stack: Stack) -> Stack:
    """The stack scraped once idle, then again after turns of both classes and a sub-agent's tool
    call (so that rates and quantiles have something to work on)."""
    targets = [*scrape_targets(), VLLM]
    first, failed = scrape_all(targets, stack.urls, 0.0, token=TOKEN)
    assert failed == {}
    for i in range(3):
        _turn(stack.ports, "interactive", f"interactive-{i}")
        _turn(stack.ports, "batch", f"batch-{i}")
    run = asyncio.run(_sub_agent(stack.ports))
    assert run["status"] == "finished", run

    def tool_call_counted() -> promql.Scrape | None:
        scrape, failed = scrape_all(targets, stack.urls, 30.0, token=TOKEN)
        assert failed == {}
        ok = promql.evaluate(promql.parse('luftpause_runtime_tool_calls_total{outcome="ok"}'), [scrape], 0)
        return scrape if sum(ok.values()) >= 1 else None

    stack.scrapes[:] = [first, wait_until(tool_call_counted, 30, what="the tool call in /metrics")]
    return stack


def test_the_dashboard_is_grafana_json_with_queries_on_the_provisioned_datasource() -> None:
    doc = json.loads(DASHBOARD.read_text())
    provisioned = yaml.safe_load(
        (ROOT / "deploy/grafana/provisioning/datasources/luftpause.yaml").read_text()
    )
    uids = {d["uid"]: d["type"] for d in provisioned["datasources"]}
    assert doc["uid"] == "luftpause" and doc["panels"]
    for p in doc["panels"]:
        assert p["targets"], p["title"]
        for t in p["targets"]:
            assert uids.get(t["datasource"]["uid"]) == t["datasource"]["type"] == "prometheus", p["title"]
    # The panels the issue asks for, each of them there.
    titles = " / ".join(p.title.lower() for p in panels())
    for wanted in ("held turns", "oldest held wait", "in flight against the limit", "engine's own queue",
                   "kv pool", "runs held", "first token", "held for admission", "runs by state",
                   "tool calls by outcome", "engine errors"):  # fmt: skip
        assert wanted in titles, wanted


def test_every_metric_the_dashboard_names_is_exported_and_every_panel_shows_data(
    driven: Stack,
) -> None:
    dashboard = panels()
    last = driven.scrapes[-1]
    assert missing_names(dashboard, last) == []
    assert empty_panels(dashboard, driven.scrapes) == []

    # What a user reads off the panels after three turns of each class and one sub-agent.
    def at_end(expr: str) -> dict[str, float]:
        vector = promql.evaluate(promql.parse(expr), driven.scrapes, len(driven.scrapes) - 1)
        return {promql.legend("{{class}}{{replica}}{{state}}{{outcome}}", k): v for k, v in vector.items()}

    for q in next(p for p in dashboard if "first token" in p.title).queries:
        assert set(at_end(q.expr)) == {"interactive", "batch"}, q.expr
        assert all(0 < v < 30 for v in at_end(q.expr).values())
    assert at_end("luftpause_runtime_runs")["finished"] == 1
    ok = at_end(next(q.expr for p in dashboard for q in p.queries if "tool_calls" in q.expr))["ok"]
    assert ok > 0
    queue = next(p for p in dashboard if "engine's own queue" in p.title).queries
    assert set(at_end(queue[0].expr)) == {"fake-a", "fake-b", "fake-vllm"}


def test_a_misspelt_metric_or_a_target_without_its_token_is_caught(driven: Stack) -> None:
    dashboard = panels()
    wrong = copy.deepcopy(dashboard)
    p = wrong[0]
    wrong[0] = Panel(p.title, p.unit, (Query(p.queries[0].expr.replace("held_turns", "held_turn"), ""),))
    (problem,) = missing_names(wrong, driven.scrapes[-1])
    assert "luftpause_scheduler_held_turn (no such family)" in problem
    suffixed = [Panel("t", "", (Query("rate(luftpause_runtime_runs_total[1m])", ""),))]
    assert "(its family is exported)" in missing_names(suffixed, driven.scrapes[-1])[0]
    # Without the credentials file the guarded services refuse the scrape.
    _, failed = scrape_all(scrape_targets(), driven.urls, 0.0, token=None)
    assert set(failed) == {"scheduler:5001", "runtime:7000"}
    assert all(why.startswith("401") for why in failed.values())


def _promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert shutil.which("promtool"), "promtool not installed (apt-get install prometheus)"
    return subprocess.run(["promtool", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


@needs_promtool
def test_promtool_accepts_the_scrape_config_with_the_token_file_beside_it(tmp_path: Path) -> None:
    shutil.copy(SCRAPE_CONFIG, tmp_path / "prometheus.yml")
    files = {
        job["authorization"]["credentials_file"]
        for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]
        if "authorization" in job
    }
    assert files == {"luftpause-token"}
    without = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert without.returncode != 0 and "luftpause-token" in without.stdout + without.stderr
    (tmp_path / "luftpause-token").write_text(TOKEN)
    done = _promtool("check", "config", "prometheus.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_prometheus_parses_every_dashboard_query(tmp_path: Path) -> None:
    rules = [
        {"record": f"dashboard:panel_{i}:{j}", "expr": q.expr}
        for i, p in enumerate(panels())
        for j, q in enumerate(p.queries)
    ]
    (tmp_path / "rules.yml").write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    done = _promtool("check", "rules", "rules.yml", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"{len(rules)} rules found" in done.stdout


# -- the compose recipe --------------------------------------------------------------------------


def _command_flags(words: list[str]) -> dict[str, str]:
    return dict(w.lstrip("-").split("=", 1) for w in words if w.startswith("--") and "=" in w)


def _shell_words(service: dict) -> list[str]:
    """A service's entrypoint and command as words, a `sh -c` script split as the shell would."""
    words = [str(w) for w in (service.get("entrypoint") or []) + (service.get("command") or [])]
    if words[:2] == ["/bin/sh", "-c"]:
        return shlex.split(words[2].replace("$$", "$"))
    return words


def otel_problems(stack: dict) -> list[str]:
    """Everything in the resolved otel recipe that disagrees with the scrape config, the
    dashboard, Grafana's provisioning or the collector's config."""
    problems: list[str] = []
    services = stack["services"]
    for name in ("otel-collector", "jaeger", "prometheus", "grafana"):
        if name not in services:
            return [f"no service {name}"]
        image = services[name]["image"]
        if not re.search(r":v?\d+\.\d+\.\d+$", image):
            problems.append(f"{name}: image {image} is not pinned to a version")
        for spec in services[name].get("ports", []):
            if not str(spec).startswith("127.0.0.1:"):
                problems.append(f"{name}: publishes {spec} beyond this machine")

    # Prometheus: its config mounted where --config.file says, the token written beside it.
    prom = services["prometheus"]
    words = _shell_words(prom)
    flags = _command_flags(words)
    config_file = flags.get("config.file", "/etc/prometheus/prometheus.yml")
    if Path(_mounts(prom).get(config_file, "")).resolve() != SCRAPE_CONFIG:
        problems.append(f"prometheus: {config_file} is not deploy/prometheus/prometheus.yml")
    script = " ".join(words)
    for job in yaml.safe_load(SCRAPE_CONFIG.read_text())["scrape_configs"]:
        if "authorization" in job:
            where = str(Path(config_file).parent / job["authorization"]["credentials_file"])
            if not re.search(rf"\$\{{?LUFTPAUSE_TOKEN[^>]*> ?{re.escape(where)}", script):
                problems.append(f"prometheus: nothing writes LUFTPAUSE_TOKEN to {where} ({job['job_name']})")
    if "LUFTPAUSE_TOKEN" not in (prom.get("environment") or {}):
        problems.append("prometheus: LUFTPAUSE_TOKEN is not passed in")
    prom_port = int(flags.get("web.listen-address", ":9090").rsplit(":", 1)[1])

    # Every target a compose service publishing that port; the engines named as the config's replicas.
    replicas = {r.name: r for r in config.load(ROOT / "compose/luftpause.toml").replicas}
    for target in scrape_targets():
        host, port = target.service, int(target.address.rsplit(":", 1)[1])
        if host not in services:
            problems.append(f"target {target.address}: no service {host}")
        elif port not in _published(services[host]):
            problems.append(f"target {target.address}: {host} publishes {sorted(_published(services[host]))}")
        replica = dict(target.labels).get("replica")
        if target.job == "engines":
            r = replicas.get(replica or "")
            if r is None or r.url.rstrip("/") != f"http://{target.address}":
                problems.append(
                    f"target {target.address}: replica label {replica!r} is not the config's replica there"
                )
    scraped = {t.address for t in scrape_targets()}
    for r in replicas.values():
        if r.metrics != "none" and r.url.removeprefix("http://").rstrip("/") not in scraped:
            problems.append(f"replica {r.name}: its engine's /metrics is not scraped")

    # Grafana: the dashboard where its provider looks, the datasource on Prometheus's port.
    grafana = _mounts(services["grafana"])
    provisioning = {target: Path(source).resolve() for target, source in grafana.items()}
    providers = ROOT / "deploy/grafana/provisioning/dashboards"
    datasources = ROOT / "deploy/grafana/provisioning/datasources"
    if provisioning.get("/etc/grafana/provisioning/dashboards") != providers:
        problems.append("grafana: the dashboard provisioning is not mounted")
    if provisioning.get("/etc/grafana/provisioning/datasources") != datasources:
        problems.append("grafana: the datasource provisioning is not mounted")
    for provider in yaml.safe_load((providers / "luftpause.yaml").read_text())["providers"]:
        where = f"{provider['options']['path'].rstrip('/')}/{DASHBOARD.name}"
        if provisioning.get(where) != DASHBOARD:
            problems.append(
                f"grafana: {DASHBOARD.name} is not mounted at {where}, where provider {provider['name']} reads"
            )
    for source in yaml.safe_load((datasources / "luftpause.yaml").read_text())["datasources"]:
        url = httpx.URL(source["url"])
        if url.host not in services:
            problems.append(f"grafana: datasource {source['name']} at {url.host}, no such service")
        elif url.host == "prometheus" and url.port != prom_port:
            problems.append(
                f"grafana: datasource {source['name']} on port {url.port}, Prometheus on {prom_port}"
            )

    # The collector: its config mounted, spans in from our services, out to Jaeger's OTLP port.
    collector = services["otel-collector"]
    conf_path = _command_flags([str(w) for w in collector.get("command", [])]).get("config", "")
    conf = yaml.safe_load(Path(_mounts(collector).get(conf_path, "/nonexistent")).read_text())
    grpc_in = int(conf["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].rsplit(":", 1)[1])
    for name in ("scheduler", "dataplane", "runtime"):
        env = services[name].get("environment") or {}
        endpoint = httpx.URL(env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or "http://unset")
        if (endpoint.host, endpoint.port, env.get("OTEL_EXPORTER_OTLP_PROTOCOL")) != (
            "otel-collector",
            grpc_in,
            "grpc",
        ):
            problems.append(
                f"{name}: exports to {endpoint} over {env.get('OTEL_EXPORTER_OTLP_PROTOCOL')}, not the collector's gRPC port {grpc_in}"
            )
    exporters = [e for e in conf["service"]["pipelines"]["traces"]["exporters"] if e.startswith("otlp")]
    for e in exporters:
        host, _, port = conf["exporters"][e]["endpoint"].rpartition(":")
        if (
            host != "jaeger"
            or port != "4317"
            or "COLLECTOR_OTLP_ENABLED=true"
            not in [f"{k}={v}" for k, v in (services["jaeger"].get("environment") or {}).items()]
        ):
            problems.append(
                f"otel-collector: exporter {e} sends to {host}:{port}, not Jaeger's OTLP gRPC port"
            )
    if not exporters:
        problems.append("otel-collector: its traces go nowhere")
    return problems  # fmt: skip


@needs_compose
def test_the_resolved_recipe_agrees_with_the_scrape_config_the_dashboard_and_the_collector() -> None:
    assert otel_problems(resolve(FILES)) == []


@needs_compose
def test_a_target_on_the_wrong_port_or_a_dashboard_not_mounted_is_caught() -> None:
    base = resolve(FILES)

    def problems_after(change) -> list[str]:
        stack = copy.deepcopy(base)
        change(stack["services"])
        return otel_problems(stack)

    def move_runtime(s: dict) -> None:
        s["runtime"]["ports"] = ["127.0.0.1:7001:7001/tcp"]

    def drop_dashboard(s: dict) -> None:
        s["grafana"]["volumes"] = [v for v in s["grafana"]["volumes"] if "luftpause.json" not in str(v)]

    def forget_token(s: dict) -> None:
        s["prometheus"]["entrypoint"][2] = s["prometheus"]["entrypoint"][2].replace(
            "luftpause-token", "token"
        )

    def unpin(s: dict) -> None:
        s["grafana"]["image"] = "grafana/grafana:latest"

    assert any("target runtime:7000: runtime publishes [7001]" in p for p in problems_after(move_runtime))
    assert any("luftpause.json is not mounted" in p for p in problems_after(drop_dashboard))
    assert any("nothing writes LUFTPAUSE_TOKEN" in p for p in problems_after(forget_token))
    assert any("not pinned" in p for p in problems_after(unpin))
