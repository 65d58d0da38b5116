"""Logging for every luftpause command: one level and format, and per-request lines only at DEBUG.

Below DEBUG the loggers that write a line per HTTP request (the HTTP clients behind health
probes, the prober, loadgen and the sub-agents; uvicorn's access log) are held at WARNING, so
that a service's log says what changed, not every request it served. `luftpause --log-level
DEBUG ...` (or `luftpause up --log-level DEBUG`, which passes it on) shows them all.

Two formats: `text` (the default), a line for a person, and `json` (`luftpause --log-format json`,
`LUFTPAUSE_LOG_FORMAT=json`, or `[logging] format = "json"` in the config), one JSON object a
line for a collector (Loki, Elasticsearch, Cloud Logging): `time` (UTC, ISO 8601), `level`,
`service` (as its spans name it: `luftpause-dataplane`), `logger`, `message`, and where the line
speaks of a run or a turn its `run_id` and `turn_id` and, when tracing is on, the `trace_id` and
`span_id` of that turn's or run's span, so that a log line and its trace find each other. What a
line is about comes from `about(...)`, set where a turn or a run's loop is handled (the
dataplane's `run_turn`, the runtime's `spans.running`), and else from the current span. The
format chosen is put in the environment, so that the processes a command starts (`up`'s
services, the dataplane's workers) write the same.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from contextvars import ContextVar
from types import MappingProxyType
from typing import Any

LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")
FORMATS = ("text", "json")
FORMAT_ENV = "LUFTPAUSE_LOG_FORMAT"
QUIET_UNLESS_DEBUG = ("httpx", "httpx2", "httpcore", "uvicorn.access")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

# What the log lines of this task are about: run_id, turn_id, and the span of that turn or run.
_ABOUT: ContextVar[Mapping[str, Any]] = ContextVar("luftpause_log_about", default=MappingProxyType({}))


@contextlib.contextmanager
def about(**fields: Any) -> Iterator[None]:
    """Lines logged inside are about these (run_id=..., turn_id=..., span=...); None is left out."""
    token = _ABOUT.set({**_ABOUT.get(), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _ABOUT.reset(token)


def _span_ids(span: Any) -> dict[str, str]:
    context = span.get_span_context()
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", "span_id": f"{context.span_id:016x}"}


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time, level, service, logger, message, and what the line is about."""

    def __init__(self, service: str) -> None:
        super().__init__()
        self.service = service

    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "service": self.service,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = dict(_ABOUT.get())
        span = fields.pop("span", None)
        line.update({k: str(v) for k, v in fields.items()})
        if span is None:
            from opentelemetry import trace  # the API only: no SDK is loaded by this

            span = trace.get_current_span()
        line.update(_span_ids(span))
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False)


def chosen_format(given: str | None = None) -> str:
    """`given`, else LUFTPAUSE_LOG_FORMAT, else "text"; ValueError naming a format not in FORMATS."""
    chosen = (given or os.environ.get(FORMAT_ENV) or "text").strip().lower()
    if chosen not in FORMATS:
        raise ValueError(
            f"log format {chosen!r} is not one of {', '.join(FORMATS)} (--log-format, {FORMAT_ENV})"
        )
    return chosen


def configure(level: str, log_format: str = "text", service: str = "luftpause") -> None:
    """Sets the root logger's level and format (again, where called twice) for `service`, and
    puts the format in the environment for the processes this one starts."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(service) if log_format == "json" else logging.Formatter(FORMAT))
    logging.basicConfig(level=level, handlers=[handler], force=True)
    os.environ[FORMAT_ENV] = log_format
    if level != "DEBUG":
        for name in QUIET_UNLESS_DEBUG:
            logging.getLogger(name).setLevel(logging.WARNING)


def json_line(service: str, message: str, level: str = "INFO") -> str:
    """A line of `service` in the json format that no logger wrote (`up`'s own, a child's stray output)."""
    record = logging.LogRecord(service, getattr(logging, level), "", 0, message, None, None)
    return JsonFormatter(service).format(record)


def access_log() -> bool:
    """Whether a uvicorn server should write its access lines (only when they would be shown)."""
    return logging.getLogger("uvicorn.access").isEnabledFor(logging.INFO)


class NowAndThen:
    """Says when a warning of some kind is due again: the first time, then once per period."""

    def __init__(self, period_s: float) -> None:
        self._period_s = period_s
        self._last: dict[tuple[str, str], float] = {}

    def due(self, key: tuple[str, str]) -> bool:
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last < self._period_s:
            return False
        self._last[key] = now
        return True
