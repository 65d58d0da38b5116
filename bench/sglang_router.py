"""Starting the real SGLang router (the PyPI package `sglang-router`) in front of engines.

Benchmarks that compare luftpause with the router run the package as a process of its own,
`python -m sglang_router.launch_router`, with the flags `command` writes. It is an optional
dependency (`pip install -e '.[bench]'`); nothing in the test suite needs it installed.

What the router asks of a worker, as seen with sglang-router 0.3.2 against the fake engine: at
start it tries HTTP/2 without upgrade (the fake engine answers `PRI *` with 404 and the router
falls back to HTTP/1.1), then reads `GET /health`, `/server_info` and `/model_info`, and later
`GET /get_load`; it also tries to fetch a tokenizer named after the served model from the
Hugging Face hub, which fails without network (a warning) and changes nothing for HTTP workers.
It forwards `POST /v1/chat/completions` with `max_tokens` renamed `max_completion_tokens` and
SGLang's own fields added (`no_stop_trim`, `ignore_eos`, `skip_special_tokens`, `logprobs: false`,
`tool_choice: "auto"` when tools are offered, ...), and it does not forward `x-luftpause-*`
headers. It answers `DELETE /v1/runs/{id}` (loadgen's run end) itself with 404.

How its `cache_aware` policy places a request (0.3.2, HTTP workers): when the in-flight counts
are imbalanced (the busiest worker more than `balance_abs_threshold` requests over the idlest
and more than `balance_rel_threshold` times as many), to the idlest; otherwise to the worker
whose prefix tree of earlier request texts matches the largest share of this request's text, if
that share is over `cache_threshold`, and else to the worker with the fewest requests in flight
(the first one on a tie). Older releases, and the documentation the simulator's
`sglang-cache-aware` arm follows, send that last case to the worker with the smallest tree.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import sys
import time
from collections.abc import Callable, Sequence

import httpx

PACKAGE = "sglang-router"
MODULE = "sglang_router"
TESTED_VERSION = "0.3.2"
"""The release the fidelity harness was checked against (`pyproject.toml`'s `bench` extra)."""

# The router's own defaults, written out so that a release that changes them does not change
# what a benchmark measures without anyone noticing.
CACHE_THRESHOLD = 0.3
BALANCE_ABS_THRESHOLD = 64
BALANCE_REL_THRESHOLD = 1.5


def installed_version() -> str | None:
    """The installed `sglang-router`'s version, or None when it is not installed."""
    if importlib.util.find_spec(MODULE) is None:
        return None
    try:
        return importlib.metadata.version(PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def command(
    port: int,
    workers: Sequence[str],
    *,
    policy: str = "cache_aware",
    prometheus_port: int,
    host: str = "127.0.0.1",
    cache_threshold: float = CACHE_THRESHOLD,
    balance_abs_threshold: int = BALANCE_ABS_THRESHOLD,
    balance_rel_threshold: float = BALANCE_REL_THRESHOLD,
    log_level: str = "warn",
    python: str = sys.executable,
) -> list[str]:
    """The argv that starts the router on `host:port` in front of `workers` (base URLs)."""
    if not workers:
        raise ValueError("the router needs at least one worker URL")
    return [
        python,
        "-m",
        f"{MODULE}.launch_router",
        "--host",
        host,
        "--port",
        str(port),
        "--worker-urls",
        *workers,
        "--policy",
        policy,
        "--cache-threshold",
        repr(cache_threshold),
        "--balance-abs-threshold",
        str(balance_abs_threshold),
        "--balance-rel-threshold",
        repr(balance_rel_threshold),
        # Its metrics listener binds every interface on port 29000 unless told otherwise, which
        # would collide between runs and open a port to the network for nothing.
        "--prometheus-host",
        host,
        "--prometheus-port",
        str(prometheus_port),
        # It waits up to 180 s for streams in flight on SIGTERM by default; a benchmark stops it
        # only after its load has ended.
        "--shutdown-grace-period-secs",
        "3",
        "--log-level",
        log_level,
    ]


def workers_ready(url: str, workers: Sequence[str], timeout_s: float = 2.0) -> bool:
    """Whether the router at `url` lists every one of `workers` as healthy (`GET /workers`)."""
    try:
        reply = httpx.get(f"{url}/workers", timeout=timeout_s)
        listed = reply.json().get("workers", []) if reply.status_code == 200 else []
    except (httpx.HTTPError, ValueError, AttributeError):
        return False
    healthy = {w.get("url") for w in listed if isinstance(w, dict) and w.get("is_healthy")}
    return all(w in healthy for w in workers)


def wait_ready(
    url: str,
    workers: Sequence[str],
    timeout_s: float = 60.0,
    alive: Callable[[], bool] | None = None,
) -> None:
    """Waits until the router has taken all its workers; raises RuntimeError after `timeout_s`
    or as soon as `alive()` says the router process has gone."""
    deadline = time.monotonic() + timeout_s
    while not workers_ready(url, workers):
        if alive is not None and not alive():
            raise RuntimeError(f"the SGLang router at {url} exited before it took its workers")
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"the SGLang router at {url} did not take {len(workers)} workers in {timeout_s:.0f} s"
            )
        time.sleep(0.2)


def record_head(options: object, version: str) -> dict[str, object]:
    """What every record of a benchmark against the router starts with: its options and the
    router's package and version."""
    return {"options": vars(options), "sglang_router": {"package": PACKAGE, "version": version}}
