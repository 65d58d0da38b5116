"""Several dataplane processes behind one port: `[dataplane] workers` (or `--workers N`).

One Python process carries every turn's HTTP, SSE and gRPC work on one core. With N workers,
this process binds the port once and starts N dataplane processes that all accept on that one
listening socket (the kernel hands each new connection to one of them; a kept-alive connection
stays with the worker that took it). It starts nothing else and serves nothing itself.

Each worker keeps its own Turns stream to the scheduler under a name of its own (the
dataplane's name and `/<k>`: `scheduler_client.dataplane_name`, the same after a restart), so
that its resync replaces only what came
through it; the scheduler puts a turn without a run header in its run whichever worker carried
the run's last turn (scheduler/run_identity.py), once the worker that carried the reply has
reported its tool calls, a moment after its client had it: a next turn sent through another
worker within that moment starts a run of its own. A caller is named by its request's headers, so
it is one caller across workers. `/metrics` is the dataplane's as a whole, whichever worker
answers: each worker keeps its numbers in files in a private temporary directory this process
makes before starting them and removes when they have stopped (PROMETHEUS_MULTIPROC_DIR,
dataplane/metrics.py); a dead worker's gauges leave the sum, its counts stay. What stays per
worker: `/health` and `[dataplane] max_connections` (a limit per worker).

A worker that dies is started again after `RESTART_S`; one that dies `MAX_DEATHS` times within
`DEATH_WINDOW_S` stops them all, with its exit code. SIGTERM, SIGINT and SIGHUP stop every
worker (each lets its turns in flight finish, as a single dataplane does); each worker also
stops should this process die without that (`lifeline`).
"""

from __future__ import annotations

import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque

from prometheus_client import multiprocess

from luftpause import config as lp_config
from luftpause import lifeline
from luftpause.dataplane.metrics import MULTIPROC_DIR_ENV

log = logging.getLogger(__name__)

RESTART_S = 1.0
MAX_DEATHS = 5
DEATH_WINDOW_S = 60.0
# How often the workers are looked at; a dead one is noticed within this.
WATCH_PERIOD_S = 0.2
STOP_GRACE_S = 10.0
LISTEN_BACKLOG = 2048


def listen(settings: lp_config.DataplaneSettings) -> socket.socket:
    """The one listening socket the workers share; SystemExit naming the port when it is taken."""
    family = socket.AF_INET6 if ":" in settings.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((settings.host, settings.port))
    except OSError as e:
        sock.close()
        raise SystemExit(
            f"luftpause dataplane: cannot listen on {settings.host}:{settings.port}: {e.strerror}"
        ) from None
    sock.listen(LISTEN_BACKLOG)
    sock.set_inheritable(True)
    return sock


class _Worker:
    def __init__(self, k: int, argv: list[str], fd: int, metrics_dir: str) -> None:
        self.k, self.argv, self.fd, self.metrics_dir = k, argv, fd, metrics_dir
        self.proc: subprocess.Popen[bytes] | None = None
        self.deaths: deque[float] = deque()
        self.restart_at: float | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [*self.argv, "--worker", str(self.k), "--listen-fd", str(self.fd)],
            pass_fds=(self.fd,),
            stdin=subprocess.DEVNULL,
            env={**lifeline.child_env(), MULTIPROC_DIR_ENV: self.metrics_dir},
            preexec_fn=lifeline.preexec,
        )
        self.restart_at = None

    def died(self) -> None:
        """Its gauges (turns in flight, its scheduler link) leave the dataplane's; its counts stay."""
        assert self.proc is not None
        multiprocess.mark_process_dead(self.proc.pid, self.metrics_dir)  # type: ignore[no-untyped-call]


def serve_workers(config: lp_config.Config, argv: list[str]) -> None:
    """Runs `config.dataplane.workers` dataplanes on one port until a signal stops them.

    `argv`: the command that starts one dataplane with this config (`luftpause ... dataplane
    --config FILE`); each worker gets `--worker K --listen-fd FD` added."""
    settings = config.dataplane
    sock = listen(settings)
    # The workers' metrics, one dataplane's: fresh for each start, private (mode 0700).
    metrics_dir = tempfile.mkdtemp(prefix="luftpause-dataplane-metrics-")
    try:
        failed = _serve(settings, argv, sock, metrics_dir)
    finally:
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
    if failed:
        raise SystemExit(failed)


def _serve(
    settings: lp_config.DataplaneSettings, argv: list[str], sock: socket.socket, metrics_dir: str
) -> int:
    """Runs the workers until a signal (0) or one dying too often (its exit code, or 1)."""
    workers = [_Worker(k, argv, sock.fileno(), metrics_dir) for k in range(settings.workers)]
    stopping: list[int] = []

    def on_signal(signum: int, _frame: object) -> None:
        stopping.append(signum)

    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, on_signal)
    failed = 0
    try:
        for worker in workers:
            worker.start()
        log.info("dataplane on http://%s:%d in %d workers, scheduler at %s",
                 settings.host, settings.port, len(workers), settings.scheduler)  # fmt: skip
        while not stopping and not failed:
            now = time.monotonic()
            for worker in workers:
                assert worker.proc is not None
                code = worker.proc.poll()
                if code is None:
                    continue
                if worker.restart_at is None:
                    worker.died()
                    worker.deaths.append(now)
                    while worker.deaths and now - worker.deaths[0] > DEATH_WINDOW_S:
                        worker.deaths.popleft()
                    if len(worker.deaths) >= MAX_DEATHS:
                        log.error("dataplane worker %d died %d times within %.0f s (last exit code %s); stopping",
                                  worker.k, len(worker.deaths), DEATH_WINDOW_S, code)  # fmt: skip
                        failed = code or 1
                        break
                    log.warning("dataplane worker %d exited (code %s); starting it again in %.0f s",
                                worker.k, code, RESTART_S)  # fmt: skip
                    worker.restart_at = now + RESTART_S
                elif now >= worker.restart_at:
                    worker.start()
            time.sleep(WATCH_PERIOD_S)
    finally:
        _stop(workers)
    return failed


def _stop(workers: list[_Worker]) -> None:
    running = [w.proc for w in workers if w.proc is not None and w.proc.poll() is None]
    for proc in running:
        proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    for proc in running:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def worker_argv(config_path: str | None, log_level: str) -> list[str]:
    """The command line of one dataplane worker with this config file and log level."""
    argv = [sys.executable, "-m", "luftpause", "--log-level", log_level, "dataplane"]
    if config_path:
        argv += ["--config", os.fspath(config_path)]
    return argv
