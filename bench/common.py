"""What the benchmarks (and the tests) share: a free port, child processes and waiting for them to
answer, and the spread of repeats.

Every benchmark and test starts its services on loopback ports picked free, so that several
can run at once and beside a stack that is up on the usual ports.
"""

from __future__ import annotations

import fcntl
import os
import signal
import socket
import statistics
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import httpx

# The ports `free_port` has handed out in this process, and the most tries for one not among them.
_handed_out: set[int] = set()
_handing_out = threading.Lock()
FREE_PORT_TRIES = 1000

PORT_CLAIMS = Path(
    os.environ.get("LUFTPAUSE_PORT_CLAIMS") or Path(tempfile.gettempdir()) / f"luftpause-ports-{os.getuid()}"
)
"""The folder where every process of this user claims the ports `free_port` hands it (a file a
port, and a lock file): the test workers, the stacks they start and the benchmarks each pick ports
while nothing listens on them yet, so the kernel may give one to two processes."""

PORT_CLAIM_S = 300.0
"""How long a port handed to one process is refused to the others: longer than any stack takes
from picking its ports to listening on them; after that, a port in use is refused by its bind."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now, and that no process of this user
    has been handed in the last `PORT_CLAIM_S` (nor this one ever). A stack picks its ports one
    after another before any of them listens, and the kernel may give a port just closed to the
    next bind: two services of one stack were given the same port (a scheduler's gRPC and a fake
    engine's, which then could not both listen), and two test workers could be."""
    with _handing_out:
        for _ in range(FREE_PORT_TRIES):
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out and _claim(port):
                _handed_out.add(port)
                return port
    raise RuntimeError(
        f"no loopback port that no process has been handed already, in {FREE_PORT_TRIES} tries "
        f"(claims in {PORT_CLAIMS})"
    )


def _claim(port: int) -> bool:
    """Claims `port` for this process in `PORT_CLAIMS`, unless another claimed it in the last
    `PORT_CLAIM_S`; the check and the claim are one step under the folder's lock."""
    PORT_CLAIMS.mkdir(parents=True, exist_ok=True)
    with (PORT_CLAIMS / "lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        claim = PORT_CLAIMS / str(port)
        try:
            if time.time() - claim.stat().st_mtime < PORT_CLAIM_S:
                return False
        except FileNotFoundError:
            pass
        claim.write_text(f"{os.getpid()}\n")
        return True


class Processes:
    """Child processes of a benchmark, each logging to `<logs>/<name>.log` in a session of its own;
    `stop` ends them (SIGTERM, then SIGKILL after 15 s) in the reverse order of their start."""

    def __init__(self, logs: Path) -> None:
        self.logs = logs
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
        with (self.logs / f"{name}.log").open("wb") as out:
            proc = subprocess.Popen(
                args,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **(env or {})},
                start_new_session=True,
            )
        self.procs[name] = proc
        return proc

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                tail = (self.logs / f"{name}.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"{name} exited with {proc.returncode}:\n{tail}")

    def stop(self) -> None:
        for proc in reversed(list(self.procs.values())):
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs.clear()


def wait_healthy(url: str, procs: Processes, timeout_s: float = 60.0) -> None:
    """Until `url` answers 200; fails at once with its log's tail if one of `procs` has exited."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        procs.check_alive()
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")


def spread(values: list[float]) -> dict[str, float | None]:
    """The median and range of repeats (and how many), as records keep them."""
    if not values:
        return {"median": None, "low": None, "high": None, "n": 0}
    return {
        "median": round(statistics.median(values), 3),
        "low": round(min(values), 3),
        "high": round(max(values), 3),
        "n": len(values),
    }


def spread_cell(s: dict[str, float | None]) -> str:
    """A `spread` as a table cell: median (low-high), the median alone for one value."""
    if s["median"] is None:
        return "-"
    if s.get("n") == 1:
        return f"{s['median']:.2f}"
    return f"{s['median']:.2f} ({s['low']:.2f}-{s['high']:.2f})"
