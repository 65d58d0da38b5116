"""A throwaway PostgreSQL server: initdb into a temporary folder and postgres on a free loopback
port, as an unprivileged user, for the run store's tests (tests/conftest.py) and `luftpause bench
store`. Debian's `postgresql` package keeps its programs under /usr/lib/postgresql/<version>/bin,
off PATH; the newest there is used. PostgreSQL refuses to run as root, so as root it runs as
`nobody`. Nothing here is a mock: it is the server the PostgreSQL store talks to in production.
"""

from __future__ import annotations

import itertools
import os
import pwd
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from luftpause.bench.common import free_port

START_TIMEOUT_S = 30.0

POSTGRES_BIN_GLOB = "/usr/lib/postgresql/*/bin"
# Who runs the test server when the tests run as root (PostgreSQL refuses to run as root).
POSTGRES_USER = "nobody"


class PostgresUnavailable(RuntimeError):
    """No PostgreSQL server can be started here; the message says why (the tests skip with it)."""


def postgres_bin() -> Path:
    """The newest installed PostgreSQL's bin folder (Debian's layout: not on PATH)."""
    found = sorted(Path("/").glob(POSTGRES_BIN_GLOB.lstrip("/")), key=lambda p: int(p.parent.name))
    found = [p for p in found if (p / "initdb").exists() and (p / "postgres").exists()]
    if not found:
        raise PostgresUnavailable(
            f"no PostgreSQL under {POSTGRES_BIN_GLOB} (Debian's `postgresql` package; .ci/run installs it)"
        )
    return found[-1]


@dataclass
class PostgresServer:
    """A PostgreSQL server in a temporary folder on a free loopback port, run as an unprivileged
    user (`POSTGRES_USER` when the tests run as root); `url(db)` is a database's URL. `stop` and
    `start` again keep its data and port (a database that goes down and comes back)."""

    root: Path
    port: int
    bin_dir: Path
    as_user: dict[str, Any]
    proc: subprocess.Popen | None = None
    databases: itertools.count = field(default_factory=lambda: itertools.count(1))

    def url(self, database: str = "postgres") -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def new_database(self) -> str:
        """A fresh, empty database's URL."""
        import psycopg

        name = f"test_{next(self.databases)}"
        with psycopg.connect(self.url(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        return self.url(name)

    def start(self) -> None:
        """Starts postgres and waits until it takes connections (PostgresUnavailable if it exits)."""
        import psycopg

        log = (self.root / "postgres.log").open("ab")
        self.proc = proc = subprocess.Popen(
            [
                str(self.bin_dir / "postgres"),
                "-D",
                str(self.root / "data"),
                "-p",
                str(self.port),
                "-k",
                str(self.root),
                "-c",
                "listen_addresses=127.0.0.1",
                "-c",
                "max_connections=300",
            ],  # fmt: skip
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.root,
            start_new_session=True,
            **self.as_user,
        )

        def ready() -> bool:
            if proc.poll() is not None:
                raise PostgresUnavailable(
                    f"postgres exited: {(self.root / 'postgres.log').read_text()[-500:]}"
                )
            try:
                psycopg.connect(self.url(), connect_timeout=1).close()
            except psycopg.OperationalError:
                return False
            return True

        deadline = time.monotonic() + START_TIMEOUT_S
        while not ready():
            if time.monotonic() > deadline:
                self.stop()
                raise PostgresUnavailable(
                    f"postgres took more than {START_TIMEOUT_S:g} s to take connections"
                )
            time.sleep(0.1)

    def stop(self) -> None:
        """Stops postgres (a fast shutdown: clients are disconnected), keeping its data."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()

    def remove(self) -> None:
        self.stop()
        shutil.rmtree(self.root, ignore_errors=True)


def start_postgres() -> PostgresServer:
    """initdb into a temporary folder and a postgres started on a free port, waited for until it
    takes connections; PostgresUnavailable saying why when it cannot be."""
    bin_dir = postgres_bin()
    as_user: dict[str, Any] = {}
    if os.geteuid() == 0:
        try:
            entry = pwd.getpwnam(POSTGRES_USER)
        except KeyError:
            raise PostgresUnavailable(
                f"running as root and there is no user {POSTGRES_USER!r} to run PostgreSQL as"
            ) from None
        as_user = {"user": entry.pw_uid, "group": entry.pw_gid}
    # Not under pytest's tmp_path: its parents are root's alone, and the server's user must get in.
    root = Path(tempfile.mkdtemp(prefix="luftpause-pg-"))
    if as_user:
        os.chown(root, as_user["user"], as_user["group"])
    initdb = subprocess.run(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(root / "data"),
            "-U",
            "postgres",
            "--auth=trust",
            "-E",
            "UTF8",
            "--no-sync",
        ],
        capture_output=True,
        text=True,
        cwd=root,
        **as_user,
    )
    if initdb.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        raise PostgresUnavailable(f"initdb failed: {initdb.stderr.strip()[-500:]}")
    server = PostgresServer(root, free_port(), bin_dir, as_user)
    try:
        server.start()
    except PostgresUnavailable:
        server.remove()
        raise
    return server
