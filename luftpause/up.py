"""`luftpause up`: the whole stack on one machine, as supervised child processes.

Without a config file this is the embedded stack: two fake engines, the fake MCP tool server,
the scheduler, the dataplane and the runtime, all on loopback and the default ports. With
`--config FILE` it starts the three luftpause services against the engines the file names;
`--with-fakes` also starts a fake engine for every replica and a fake MCP server for every
upstream MCP server the file puts on this machine, which is how the tests run a whole stack on
ports of their own.

Before starting anything it checks that every port it is to listen on is free, and refuses to
start (naming the port and the process holding it) when one is not: a second `up` never runs
beside the first. Each child is a `python -m luftpause <service>` process in a process group of
its own, tied to `up` by the lifeline (lifeline.py); its output is shown line by line behind the
service's name. Its health is polled (with the bearer when `LUFTPAUSE_TOKEN` is set) and shown
once at start; a child that exits is reported, restarted after a pause that grows while it keeps
dying, and reported again when it is healthy. A child that dies `MAX_RESTARTS` times in a row
without staying up stops the stack, with its last lines of output. Ctrl-C, SIGTERM and SIGHUP
(the terminal closed) stop every child, then `up` exits.
"""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO
from urllib.parse import urlsplit

import httpx

from luftpause import config as cfg
from luftpause import lifeline, logs, tracing

READY_TIMEOUT_S = 60.0

POLL_S = 0.2
STOP_GRACE_S = 5.0
RESTART_BACKOFF_S = (1.0, 2.0, 5.0, 10.0)
# Deaths in a row (none after a minute up) after which `up` gives up on a child and stops.
MAX_RESTARTS = 5
STABLE_S = 60.0
# Lines of a child's output kept to say why it died.
TAIL_LINES = 20


def _is_object(line: str) -> bool:
    """Whether `line` is a JSON object (a service's line in the json log format)."""
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


def write_line(out: TextIO, lock: threading.Lock, line: str) -> None:
    """Writes `line` and its newline in one write, under the lock every writer to `out` takes.
    `print` writes the text and its end apart: where Python's output is unbuffered
    (`PYTHONUNBUFFERED`), another thread's line (`up`'s own log on stderr, the same file) could
    land between them and two json objects would share a line."""
    with lock:
        out.write(line + "\n")
        out.flush()


@dataclass
class Child:
    """One supervised service: how to start it, the ports it listens on, how to tell it is healthy."""

    name: str
    args: list[str]
    health_url: str
    binds: list[tuple[str, int]] = field(default_factory=list)
    # Whether its health probe carries the bearer token (the luftpause services, not the fakes).
    guarded: bool = False
    proc: subprocess.Popen | None = None
    relay: threading.Thread | None = None
    restarts: int = 0
    started_at: float = 0.0
    tail: collections.deque[str] = field(default_factory=lambda: collections.deque(maxlen=TAIL_LINES))

    def start(self, out: TextIO, out_lock: threading.Lock, log_level: str) -> None:
        self.tail.clear()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "luftpause", "--log-level", log_level, *self.args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            env=lifeline.child_env(),
            # Its own process group: the terminal's Ctrl-C and SIGHUP reach `up` only, which stops
            # the children in order, and a stop reaches whatever the child started.
            start_new_session=True,
            preexec_fn=lifeline.preexec,
        )
        self.started_at = time.monotonic()
        self.relay = threading.Thread(
            target=self._relay, args=(self.proc, out, out_lock), name=f"log:{self.name}", daemon=True
        )
        self.relay.start()

    def _relay(self, proc: subprocess.Popen, out: TextIO, out_lock: threading.Lock) -> None:
        """Copies the child's output to ours, each line behind the service's name; in the json
        log format each line as the object it is (a line that is not one, such as a crash's
        traceback, goes in one of the child's own)."""
        assert proc.stdout is not None
        as_json = os.environ.get(logs.FORMAT_ENV) == "json"
        for raw in proc.stdout:
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(line)
            shown = f"{self.name:<10}| {line}"
            if as_json:
                shown = line if line.startswith("{") and _is_object(line) else logs.json_line(self.name, line)
            write_line(out, out_lock, shown)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    def exit_code(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def healthy(self, token: str | None) -> bool:
        headers = {"authorization": f"Bearer {token}"} if token and self.guarded else None
        try:
            return httpx.get(self.health_url, headers=headers, timeout=1.0).status_code == 200
        except httpx.HTTPError:
            return False

    def last_output(self) -> str:
        """Its last lines, once the relay has read what it wrote before it exited."""
        if self.relay is not None:
            self.relay.join(timeout=2.0)
        return "\n".join(f"    {line}" for line in self.tail) or "    (it wrote nothing)"

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def wait_stopped(self, deadline: float) -> None:
        if not self.proc:
            return
        try:
            self.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # The whole group: whatever the child started goes with it.
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
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
                        binds=[("127.0.0.1", _port(r.url))],
                    )
                )
        for s in conf.runtime.mcp_servers:
            if s.url and _on_this_machine(s.url):
                base = f"{urlsplit(s.url).scheme}://{urlsplit(s.url).netloc}"
                children.append(
                    Child(
                        s.name,
                        ["fake-mcp", "--port", str(_port(s.url))],
                        f"{base}/health",
                        binds=[("127.0.0.1", _port(s.url))],
                    )
                )
    sched = conf.scheduler
    children.append(
        Child(
            "scheduler",
            ["scheduler", *with_config],
            f"http://127.0.0.1:{sched.status_port}/status",
            binds=[(sched.host, sched.grpc_port), (sched.host, sched.status_port)],
            guarded=True,
        )
    )
    dp = conf.dataplane
    children.append(
        Child(
            "dataplane",
            ["dataplane", *with_config],
            f"http://127.0.0.1:{dp.port}/health",
            binds=[(dp.host, dp.port)],
            guarded=True,
        )
    )
    rt = conf.runtime
    runtime_args = ["runtime", *with_config]
    if state_dir:
        runtime_args += ["--state-dir", state_dir]
    children.append(
        Child(
            "runtime",
            runtime_args,
            f"http://127.0.0.1:{rt.port}/status",
            binds=[(rt.host, rt.port)],
            guarded=True,
        )
    )
    return children


# -- ports already taken ----------------------------------------------------------------------------


def port_taken(host: str, port: int) -> bool:
    """Whether a service could not listen on host:port now (bound as the services bind)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


def _listening_inodes(port: int) -> set[str]:
    """Linux: the socket inodes listening on `port`, from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            # local address is HEX_IP:HEX_PORT; state 0A is LISTEN
            if len(fields) > 9 and fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(fields[9])
    return inodes


def _pids_by_proc(port: int) -> list[int]:
    inodes = {f"socket:[{i}]" for i in _listening_inodes(port)}
    if not inodes:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (entry / "fd").iterdir()):
                pids.append(int(entry.name))
        except OSError:
            continue  # gone, or another user's: not ours to see
    return sorted(pids)


def _pids_by_lsof(port: int) -> list[int]:
    lsof = shutil.which("lsof")
    if lsof is None:
        return []
    try:
        done = subprocess.run(
            [lsof, "-nP", "-t", f"-iTCP:{port}", "-sTCP:LISTEN"], capture_output=True, text=True, timeout=5
        )
    except (OSError, subprocess.TimeoutExpired):
        return []
    return sorted({int(p) for p in done.stdout.split() if p.isdigit()})


def _command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        pass
    try:
        done = subprocess.run(
            ["ps", "-o", "command=", "-p", str(pid)], capture_output=True, text=True, timeout=5
        )
        return done.stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return ""


def holder_of(port: int) -> str:
    """Who listens on `port`, as `pid N (command)`, or a sentence saying it cannot be told."""
    pids = _pids_by_proc(port) if Path("/proc/net/tcp").exists() else _pids_by_lsof(port)
    if not pids:
        return "a process this user cannot see"
    return ", ".join(f"pid {pid} ({_command_of(pid) or 'command unknown'})" for pid in pids)


def busy_ports(children: list[Child]) -> list[str]:
    """One line per port a child is to listen on that is taken already, naming who holds it."""
    return [
        f"port {port} ({c.name}, {host}) is already in use by {holder_of(port)}"
        for c in children
        for host, port in c.binds
        if port_taken(host, port)
    ]


# -- supervising ------------------------------------------------------------------------------------


class Supervisor:
    """Starts the children, restarts those that die, and stops them all on request."""

    def __init__(
        self,
        children: list[Child],
        out: TextIO = sys.stdout,
        log_level: str = "INFO",
        token: str | None = None,
    ) -> None:
        self.children = children
        self.out = out
        self.log_level = log_level
        self.token = token
        self.stopping = threading.Event()
        # Set when a child kept dying: `up` then stops with an error.
        self.gave_up = threading.Event()
        self._out_lock = threading.Lock()

    def say(self, line: str) -> None:
        self.show(f"[luftpause up] {line}")

    def show(self, text: str) -> None:
        if os.environ.get(logs.FORMAT_ENV) == "json":
            text = logs.json_line("luftpause-up", text.removeprefix("[luftpause up] "))
        write_line(self.out, self._out_lock, text)

    def _start(self, c: Child) -> None:
        c.start(self.out, self._out_lock, self.log_level)

    def start_all(self) -> bool:
        for c in self.children:
            self._start(c)
            self.say(f"started {c.name} (pid {c.pid})")
        deadline = time.monotonic() + READY_TIMEOUT_S
        pending = list(self.children)
        while pending and not self.stopping.is_set():
            for c in list(pending):
                code = c.exit_code()
                if code is not None:
                    self.say(
                        f"{c.name} exited with code {code} before it was healthy; its last output:\n"
                        f"{c.last_output()}"
                    )
                    return False
                if c.healthy(self.token):
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
        """Restarts children that exit, until `stopping` is set or one keeps dying."""
        due: dict[str, float] = {}
        recovering: set[str] = set()
        while not self.stopping.wait(POLL_S):
            now = time.monotonic()
            for c in self.children:
                code = c.exit_code()
                if code is not None and c.name not in due:
                    if c.restarts >= MAX_RESTARTS:
                        self.say(
                            f"{c.name} (pid {c.pid}) exited with code {code}, its {c.restarts + 1}th death in a "
                            f"row without staying up {STABLE_S:.0f} s; giving up. Its last output:\n"
                            f"{c.last_output()}"
                        )
                        self.gave_up.set()
                        self.stopping.set()
                        return
                    pause = RESTART_BACKOFF_S[min(c.restarts, len(RESTART_BACKOFF_S) - 1)]
                    self.say(f"{c.name} (pid {c.pid}) exited with code {code}; restarting in {pause:.0f} s")
                    due[c.name] = now + pause
                elif c.name in due and now >= due[c.name]:
                    del due[c.name]
                    c.restarts += 1
                    self._start(c)
                    recovering.add(c.name)
                    self.say(f"restarted {c.name} (pid {c.pid}, restart #{c.restarts})")
                elif c.name in recovering and code is None and c.healthy(self.token):
                    recovering.discard(c.name)
                    self.say(f"{c.name} healthy again after restart #{c.restarts}")
                elif code is None and c.restarts and now - c.started_at > STABLE_S:
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


def up(
    config_path: str | None = None,
    state_dir: str | None = None,
    with_fakes: bool | None = None,
    log_level: str = "INFO",
) -> int:
    """Runs the stack until Ctrl-C, SIGTERM or SIGHUP; returns the process exit code."""
    try:
        conf = cfg.load(config_path)
    except cfg.ConfigError as e:
        print(f"luftpause: {e}", file=sys.stderr)
        return 2
    try:
        tracing.settings()  # every service reads the same variables: refuse them once, here
    except tracing.SettingsError as e:
        print(f"luftpause up: cannot start, nothing was started: tracing: {e}", file=sys.stderr)
        return 2
    if with_fakes is None:
        with_fakes = config_path is None
    if config_path is None and state_dir is None:
        state_dir = conf.runtime.state_dir
    children = plan(conf, config_path, state_dir, with_fakes)
    busy = busy_ports(children)
    if busy:
        print(
            "luftpause up: cannot start, nothing was started:\n"
            + "\n".join(f"  {line}" for line in busy)
            + "\nStop that process (is another `luftpause up` running?) or give these services other "
            "ports in a config file (--config).",
            file=sys.stderr,
            flush=True,
        )
        return 1
    sup = Supervisor(children, log_level=log_level, token=os.environ.get(cfg.TOKEN_ENV) or None)

    def on_signal(signum: int, _frame: object) -> None:
        sup.stopping.set()

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    try:
        if not sup.start_all():
            if sup.stopping.is_set():
                return 0
            sup.say("the stack did not come up; stopping")
            return 1
        sup.show(banner(conf))
        sup.watch()
        return 1 if sup.gave_up.is_set() else 0
    finally:
        sup.stop_all()
