"""The scheduler process: the status port's socket, the gRPC server, the prober and a 1 s clock
around one `SchedulerHost`, started together and stopped together on SIGTERM or SIGINT.
`serve(config)` is what `luftpause scheduler` runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import Iterator

import grpc

from luftpause import config as _config
from luftpause import http_server, tracing
from luftpause.bearer import token_from_env
from luftpause.hosts import HostGuard, allowed_hosts
from luftpause.proto import rpc
from luftpause.scheduler.grpc_auth import grpc_server
from luftpause.scheduler.host import SchedulerHost, SchedulerService
from luftpause.scheduler.metrics import SchedulerCollector, registry_of
from luftpause.scheduler.prober import run_prober
from luftpause.scheduler.status import build_app, runtime_origins

log = logging.getLogger("luftpause.scheduler")

TICK_PERIOD_S = 1.0


class _StatusServer(http_server.Server):
    """The status port, bounded as every HTTP port is (luftpause/http_server.py, `[scheduler]`)."""

    # The process handles SIGTERM/SIGINT itself (see `_main`) and then stops this server.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _listen(host: str, port: int) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    # uvicorn's own backlog: a burst of connections waits in the kernel's queue rather than
    # having its handshakes dropped (and retried a second later).
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def _ticks(host: SchedulerHost) -> None:
    while True:
        await asyncio.sleep(TICK_PERIOD_S)
        host.tick()


def _grpc_server(
    settings: _config.SchedulerSettings, host: SchedulerHost, token: str | None, status_socket: socket.socket
) -> grpc.aio.Server:
    """The gRPC server serving `host`, bound to its port (not started); the process exits, closing
    `status_socket`, when the port cannot be had."""
    server = grpc_server(token, settings.grpc_max_connections, settings.header_timeout_s)
    rpc.add_SchedulerServicer_to_server(SchedulerService(host), server)
    try:
        bound = server.add_insecure_port(f"{settings.host}:{settings.grpc_port}")
    except RuntimeError:
        bound = 0
    if bound == 0:
        status_socket.close()
        raise SystemExit(f"luftpause scheduler: cannot listen on {settings.host}:{settings.grpc_port} (gRPC)")
    return server


def _status_server(config: _config.Config, host: SchedulerHost, token: str | None) -> _StatusServer:
    """The status port's server: the status document and page, and the metrics, of `host`."""
    settings = config.scheduler
    return _StatusServer(
        http_server.uvicorn_config(
            HostGuard(
                build_app(
                    lambda: host.state,
                    host.clock,
                    token,
                    host.dataplane_documents,
                    registry_of(
                        SchedulerCollector(lambda: host.state, host.clock, host.counts, host.streams_open)
                    ),
                    host.held_history,
                    runtime_origins(config),
                ),
                allowed_hosts(config),
            ),
            settings,
            "scheduler",
            log_level="warning",
            access_log=False,
            lifespan="off",
        ),
        settings,
        "scheduler",
    )


async def _main(config: _config.Config) -> None:
    settings = config.scheduler
    host = SchedulerHost(config)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    try:
        status_socket = _listen(settings.host, settings.status_port)
    except OSError as e:
        raise SystemExit(
            f"luftpause scheduler: cannot listen on {settings.host}:{settings.status_port}: {e.strerror}"
        ) from None

    token = token_from_env(f"the scheduler's gRPC port takes calls from anyone who can reach {settings.host}")
    server = _grpc_server(settings, host, token, status_socket)
    await server.start()

    status = _status_server(config, host, token)
    tasks = [
        asyncio.create_task(status.serve(sockets=[status_socket]), name="status"),
        asyncio.create_task(
            run_prober(config.replicas, settings.probe_period_s, host.feed, host.clock), name="prober"
        ),
        asyncio.create_task(_ticks(host), name="clock"),
    ]
    log.info(
        "gRPC on %s:%d, status on http://%s:%d/, %d replicas: %s",
        settings.host,
        settings.grpc_port,
        settings.host,
        settings.status_port,
        len(config.replicas),
        ", ".join(r.name for r in config.replicas),
    )

    stopped = asyncio.create_task(stop.wait())
    done, _ = await asyncio.wait([stopped, *tasks], return_when=asyncio.FIRST_COMPLETED)
    failed = [t for t in done if t is not stopped]
    for task in failed:
        log.error("the %s task stopped unexpectedly", task.get_name(), exc_info=task.exception())

    log.info("stopping")
    status.should_exit = True
    # Open Turns streams are cancelled here; their held turns leave the queue as abandoned.
    await server.stop(grace=1.0)
    for task in tasks[1:]:
        task.cancel()
    stopped.cancel()
    await asyncio.gather(*tasks, stopped, return_exceptions=True)
    if failed:
        raise SystemExit(1)


def serve(config: _config.Config) -> None:
    """Runs the scheduler in the foreground until SIGTERM or SIGINT."""
    tracing.setup("luftpause-scheduler")
    asyncio.run(_main(config))
