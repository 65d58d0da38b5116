"""Log levels for every luftpause command: one format, and per-request lines only at DEBUG.

Below DEBUG the loggers that write a line per HTTP request (the HTTP clients behind health
probes, the prober, loadgen and the sub-agents; uvicorn's access log) are held at WARNING, so
that a service's log says what changed, not every request it served. `luftpause --log-level
DEBUG ...` (or `luftpause up --log-level DEBUG`, which passes it on) shows them all.
"""

from __future__ import annotations

import logging

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
QUIET_UNLESS_DEBUG = ("httpx", "httpx2", "httpcore", "uvicorn.access")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def configure(level: str) -> None:
    logging.basicConfig(level=level, format=FORMAT)
    if level != "DEBUG":
        for name in QUIET_UNLESS_DEBUG:
            logging.getLogger(name).setLevel(logging.WARNING)


def access_log() -> bool:
    """Whether a uvicorn server should write its access lines (only when they would be shown)."""
    return logging.getLogger("uvicorn.access").isEnabledFor(logging.INFO)
