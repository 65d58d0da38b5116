"""`luftpause up`: the whole stack on one machine, as supervised child processes.

Without a config file this is the embedded stack: two fake engines, the fake MCP tool server,
the scheduler, the dataplane and the runtime, all on loopback and the default ports. With
`--config FILE` it starts the three luftpause services against the engines the file names;
`--with-fakes` also starts a fake engine for every replica and a fake MCP server for every
upstream MCP server the file puts on this machine, which is how the tests run a whole stack on
ports of their own.

Each child is a `python -m luftpause <service>` process. Its health is polled and shown once at
start; a child that exits is reported, restarted after a pause that grows while it keeps dying,
and reported again when it is healthy. Ctrl-C (or SIGTERM) stops every child, then `up` exits.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

import httpx

from luftpause import config as cfg

READY_TIMEOUT_S = 60.0
POLL_S = 0.2
STOP_GRACE_S = 5.0
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)


@dataclass
class Child:
    """One supervised service: how to start it and how to tell it is healthy."""

    name: str
    args: list[str]
    health_url: str
    proc: subprocess.Popen | None = None
    restarts: int = 0
    started_at: float = 0.0
    log: list[str] = field(default_factory=list)

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", *self.args],
            stdin=subprocess.DEVNULL,
            # Children inherit stdout/stderr so their logs show up interleaved with ours.
            start_new_session=True,
        )
        self.started_at = time.monotonic()

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def healthy(self) -> bool:
        try:
            return httpx.get(self.health_url, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        if not self.proc:
            return
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _port(url: str) -> int:
    parts = urlsplit(url)
    return parts.port or (443 if parts.scheme == "https" else 80)


def _on_this_machine(url: str) -> bool:
    return urlsplit(url).hostname in ("127.0.0.1", "localhost", "::1")


def plan(conf: cfg.Config, config_path: str | None, state_dir: str | None, with_fakes: bool) -> list[Child]:
    """The children to start, in start order: fakes first, then scheduler, dataplane, runtime."""
    children: list[Child] = []
    with_config = ["--config", config_path] if config_path else []
    if with_fakes:
        for r in conf.replicas:
            if r.kind == "generative" and _on_this_machine(r.url):
                children.append(
                    Child(
                        r.name,
                        [
                            "fake-engine",
                            "--name",
                            r.name,
                            "--port",
                            str(_port(r.url)),
                            "--model",
                            r.models[0],
                        ],
                        f"{r.url.rstrip('/')}{r.health_path}",
                    )
                )
        for s in conf.runtime.mcp_servers:
            if s.url and _on_this_machine(s.url):
                base = f"{urlsplit(s.url).scheme}://{urlsplit(s.url).netloc}"
                children.append(Child(s.name, ["fake-mcp", "--port", str(_port(s.url))], f"{base}/health"))
    sched = conf.scheduler
    children.append(
        Child("scheduler", ["scheduler", *with_config], f"http://127.0.0.1:{sched.status_port}/status")
    )
    dp = conf.dataplane
    children.append(Child("dataplane", ["dataplane", *with_config], f"http://127.0.0.1:{dp.port}/health"))
    rt = conf.runtime
    runtime_args = ["runtime", *with_config]
    if state_dir:
        runtime_args += ["--state-dir", state_dir]
    children.append(Child("runtime", runtime_args, f"http://127.0.0.1:{rt.port}/status"))
    return children


class Supervisor:
    """Starts the children, restarts those that die, and stops them all on request."""

    def __init__(self, children: list[Child], out=sys.stdout) -> None:
        self.children = children
        self.out = out
        self.stopping = threading.Event()

    def say(self, line: str) -> None:
        print(f"[luftpause up] {line}", file=self.out, flush=True)

    def start_all(self) -> bool:
        for c in self.children:
            c.start()
            self.say(f"started {c.name} (pid {c.pid})")
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = list(self.children)
        while pending and not self.stopping.is_set():
            for c in list(pending):
                code = c.exit_code()
                if code is not None:
                    self.say(f"{c.name} exited with code {code} before it was healthy")
                    return False
                if c.healthy():
                    pending.remove(c)
                    self.say(
                        f"{c.name:<10} healthy  {c.health_url}  ({time.monotonic() - c.started_at:.1f} s)"
                    )
            if time.monotonic() > deadline:
                for c in pending:
                    self.say(f"{c.name} not healthy after {READY_TIMEOUT_S:.0f} s at {c.health_url}")
                return False
            self.stopping.wait(POLL_S)
        return not pending

    def watch(self) -> None:
        """Restarts children that exit, until `stopping` is set."""
        due: dict[str, float] = {}
        recovering: set[str] = set()
        while not self.stopping.wait(POLL_S):
            now = time.monotonic()
            for c in self.children:
                code = c.exit_code()
                if code is not None and c.name not in due:
                    pause = RESTART_BACKOFF_S[min(c.restarts, len(RESTART_BACKOFF_S) - 1)]
                    self.say(f"{c.name} (pid {c.pid}) exited with code {code}; restarting in {pause:.0f} s")
                    due[c.name] = now + pause
                elif c.name in due and now >= due[c.name]:
                    del due[c.name]
                    c.restarts += 1
                    c.start()
                    recovering.add(c.name)
                    self.say(f"restarted {c.name} (pid {c.pid}, restart #{c.restarts})")
                elif c.name in recovering and code is None and c.healthy():
                    recovering.discard(c.name)
                    self.say(f"{c.name} healthy again after restart #{c.restarts}")
                elif code is None and c.restarts and now - c.started_at > 60:
                    c.restarts = 0  # stayed up a minute: the next death starts the backoff over

    def stop_all(self) -> None:
        self.stopping.set()
        for c in reversed(self.children):
            c.stop()
        deadline = time.monotonic() + STOP_GRACE_S
        for c in reversed(self.children):
            c.wait_stopped(deadline)
        self.say("stopped all services")


def banner(conf: cfg.Config) -> str:
    dp, rt, sc = conf.dataplane, conf.runtime, conf.scheduler
    return "\n".join(
        [
            "",
            "luftpause is up:",
            f"  OpenAI-compatible proxy  http://localhost:{dp.port}/v1",
            f"  MCP runtime              http://localhost:{rt.port}/mcp   (runs: http://localhost:{rt.port}/status)",
            f"  scheduler status         http://localhost:{sc.status_port}/   (gRPC on {sc.grpc_port})",
            "",
            "Connect Claude Code:",
            f"  claude mcp add --transport http luftpause http://localhost:{rt.port}/mcp",
            "",
            "Ctrl-C stops everything.",
            "",
        ]
    )


def up(config_path: str | None = None, state_dir: str | None = None, with_fakes: bool | None = None) -> int:
    """Runs the stack until Ctrl-C or SIGTERM; returns the process exit code."""
    try:
        conf = cfg.load(config_path)
    except cfg.ConfigError as e:
        print(f"luftpause: {e}", file=sys.stderr)
        return 2
    if with_fakes is None:
        with_fakes = config_path is None
    if config_path is None and state_dir is None:
        state_dir = conf.runtime.state_dir
    sup = Supervisor(plan(conf, config_path, state_dir, with_fakes))

    def on_signal(signum: int, _frame: object) -> None:
        sup.stopping.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    try:
        if not sup.start_all():
            if sup.stopping.is_set():
                return 0
            sup.say("the stack did not come up; stopping")
            return 1
        print(banner(conf), flush=True)
        sup.watch()
        return 0
    finally:
        sup.stop_all()
