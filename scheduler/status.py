"""The scheduler's status: a JSON document and a small page, both views of the core's state.

`GET /status` answers what the pool is doing: each replica with our turns in flight against its
limit (see admission.py), how many of them may still wait in its engine's queue, the engine's own
running and waiting counts, the share of the engine's prompt tokens its prefix cache gave back
since it started, and for the run gate (gate.py) its KV pool, what held runs may take
of it and the runs it holds with their working sets; the turns held here by class and by caller
with the oldest wait, and of them the runs waiting to be admitted (no replica holds them yet);
the runs by phase, by class and by caller; the gate's constants, each model's learnt tokens per
byte and each caller's keep time; each dataplane connected (its name, Turns streams open, resyncs
and what the last one carried). `GET /status/runs/{run_id}` answers for one run, with its working
set, whether a replica holds it and what is left of its keep time. `GET /` is a page (status.html)
polling /status every 2 s; opened as `/?runtime=http://host:7000` it also shows that runtime's run
tree with each run's own work and its subtree's totals, fetched by the browser from the
runtime's own GET /status (which sends the CORS headers that allow it), running runs first and
with a filter, and for each running run its working set and whether a replica holds it (with its
keep time left), from GET /status/runs/{handle}; above the tables, a chart of held turns and the oldest held wait per class over
the last 3 minutes, which the host samples every second (`HeldHistory`, `held_history` in the
document). With `LUFTPAUSE_TOKEN` set the documents
(and /metrics) need the token: the page asks for it when it meets a 401, keeps it in the tab's
sessionStorage and sends it as an Authorization header, to the runtime too. Which runtimes the
page may read is the scheduler's to say, not the link's: the page's own origin and those of
`runtime_origins` (the runtime as the config names it, and `[scheduler] runtime_origins`), which
the page is served with (a `<meta>` it reads, and a `Content-Security-Policy` whose
`connect-src` names only them, so that the browser itself blocks any other); a `?runtime=`
naming another origin is shown refused, with the config key that allows it, and never fetched,
so a crafted link cannot make the page hand the token to whoever serves its URL. The server runs
on the host's event loop, so each answer is a consistent snapshot of one state.
"""

from __future__ import annotations

import html
import json
from collections import Counter, deque
from collections.abc import Callable, Sequence
from importlib import resources
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.responses import HTMLResponse, JSONResponse, Response
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException

from luftpause import config as _config
from luftpause.bearer import bearer_matches
from luftpause.config import TOKEN_ENV
from luftpause.errors import error_body
from luftpause.scheduler import admission, fairness, gate
from luftpause.scheduler.state import (
    RESERVED_CALLER,
    Kind,
    Phase,
    Replica,
    Run,
    ServiceClass,
    State,
    Turn,
    pinned_to,
)


def _held_summary(turns: list[Turn], now: float) -> dict[str, Any]:
    return {
        "count": len(turns),
        "oldest_wait_s": round(max(now - t.arrived_at for t in turns), 3) if turns else None,
    }


def _held_by_class(held: list[Turn], now: float) -> dict[str, dict[str, Any]]:
    return {str(c): _held_summary([t for t in held if t.service_class is c], now) for c in ServiceClass}


class HeldHistory:
    """The held turns of each class and the oldest one's wait, sampled every tick for the last
    `keep_s` seconds: what the page's chart draws, so that it shows the recent past as soon as it
    opens rather than only what it polled itself."""

    def __init__(self, keep_s: float = 180.0) -> None:
        self.keep_s = keep_s
        self._samples: deque[tuple[float, dict[str, dict[str, Any]]]] = deque()

    def sample(self, state: State, now: float) -> None:
        self._samples.append((now, _held_by_class(state.held(), now)))
        while self._samples and self._samples[0][0] < now - self.keep_s:
            self._samples.popleft()

    def document(self, now: float) -> list[dict[str, Any]]:
        """Oldest first: seconds before `now`, and per class the turns held and the oldest wait."""
        return [
            {
                "ago_s": round(now - at, 3),
                **{
                    c: {"held": held["count"], "oldest_wait_s": held["oldest_wait_s"] or 0.0}
                    for c, held in by_class.items()
                },
            }
            for at, by_class in self._samples
        ]


def per_replica(state: State) -> tuple[dict[str, int], dict[str, int]]:
    """Per replica name: our turns in flight there (reservations' placeholders not among them),
    and the reservations set aside there. The status document and the metrics both count so."""
    in_flight: dict[str, int] = {}
    for t in state.placed():
        assert t.replica is not None
        in_flight[t.replica] = in_flight.get(t.replica, 0) + 1
    reserved: dict[str, int] = {}
    for reservation in state.reservations.values():
        reserved[reservation.replica] = reserved.get(reservation.replica, 0) + 1
    return in_flight, reserved


def is_held(run: Run) -> bool:
    """Whether a replica holds `run` (see gate.py): `state.pinned_to`, the rule the core's indexes
    (`State.held_kv`, `State.held_runs`) count by, read here for the status document and the metrics."""
    return pinned_to(run) is not None


def waiting_for_room(state: State, held: list[Turn]) -> dict[ServiceClass, list[Turn]]:
    """Per class, the held generative turns (of `held`, the state's held turns) of runs that no
    replica holds: runs waiting to be admitted, placed only where the gate finds them room. The
    status document and the metrics both count so."""
    waiting: dict[ServiceClass, list[Turn]] = {c: [] for c in ServiceClass}
    for t in held:
        if t.kind is Kind.GENERATIVE and t.run_id:
            run = state.runs.get(t.run_id)
            if run is None or not is_held(run):
                waiting[t.service_class].append(t)
    return waiting


def runs_of(turns: list[Turn]) -> int:
    """How many runs `turns` belong to: a run waiting for room counts once, whatever its turns."""
    return len({t.run_id for t in turns})


def _waiting_summary(turns: list[Turn], now: float) -> dict[str, Any]:
    summary = _held_summary(turns, now)
    return {
        "runs": runs_of(turns),
        "turns": summary["count"],
        "oldest_wait_s": summary["oldest_wait_s"],
    }


def _kv_source(replica: Replica) -> str | None:
    if replica.kv_tokens is None:
        return None
    return "config" if replica.kv_configured else "engine"


def prompt_cache_share(replica: Replica) -> float | None:
    """Of the prompt tokens `replica`'s engine took since it started, the share its prefix cache
    gave back (cached / all, 0 to 1), as its last /metrics page said; None where that page has no
    such counters (prober.CACHE_METRICS) or the engine took no prompt yet."""
    if replica.prompt_tokens is None or replica.cached_tokens is None or replica.prompt_tokens <= 0:
        return None
    return round(min(replica.cached_tokens / replica.prompt_tokens, 1.0), 4)


def keep_s(run: Run, now: float) -> float | None:
    """Seconds left of a paused run's keep time on its replica; None when it has none (generating,
    let go, idle, or on a replica whose pool is unknown)."""
    if run.hold_until is None:
        return None
    return round(max(run.hold_until - now, 0.0), 3)


def _fairness_document(state: State, now: float) -> dict[str, Any]:
    return {
        # Within a class the caller with the least attained service goes first (fairness.py):
        # per caller, the engine tokens its turns asked for, decayed at this half-life.
        "half_life_s": fairness.HALF_LIFE_S,
        "attained_tokens": {
            caller: round(fairness.attained_tokens(key, now))
            for caller, key in sorted(state.attained.items())
            if caller != RESERVED_CALLER
        },
    }


def _gate_document(state: State) -> dict[str, Any]:
    return {
        # Share of each pool held runs may not take, and the longest a paused run keeps its place.
        "kv_headroom": gate.KV_HEADROOM,
        "hold_max_s": gate.HOLD_MAX_S,
        # Per model, the tokens its requests carry per byte as learnt from usage (models not
        # listed use the default).
        "tokens_per_byte_default": gate.TOKENS_PER_BYTE,
        "tokens_per_byte": {m: round(v, 4) for m, v in sorted(state.tokens_per_byte.items())},
        # Per caller with pauses on tools seen, how long its paused runs keep their place (0: they
        # let go at once); callers not listed keep hold_max_s.
        "keep_s": {
            caller: round(gate.hold_for(samples), 3)
            for caller, samples in sorted(state.pause_samples.items())
        },
        # Per caller, per tool it has paused on at least min_tool_samples times: how long a run
        # paused on that tool keeps its place; other tools keep the caller's keep_s.
        "min_tool_samples": gate.MIN_TOOL_SAMPLES,
        "keep_s_by_tool": {
            caller: {
                tool: round(gate.hold_for(own), 3)
                for tool, _ in sorted(tools)
                if (own := gate.own_pauses(tools, tool)) is not None
            }
            for caller, tools in sorted(state.tool_pauses.items())
        },
    }


def _ejection_document(replica: Replica, now: float) -> dict[str, Any]:
    """Where a replica stands with outlier ejection (outliers.py): how long it is still out
    (None: in rotation), its ejections so far, its failures in a row, and the turns counted in
    the current interval with the failed among them."""
    record = replica.outlier
    until = record.ejected_until
    return {
        "ejected_for_s": round(max(until - now, 0.0), 3) if until is not None else None,
        "ejections": record.ejections,
        "failures_in_a_row": record.consecutive,
        "interval_turns": record.turns,
        "interval_failures": record.failures,
    }


def _replica_document(
    state: State, r: Replica, in_flight: dict[str, int], reserved: dict[str, int], now: float
) -> dict[str, Any]:
    """One replica's entry in the /status document (`in_flight` and `reserved`: `per_replica`)."""
    return {
        "name": r.name,
        "url": r.url,
        "kind": str(r.kind),
        "models": sorted(r.models),
        "healthy": r.healthy,
        "probed": r.probed,
        # Healthy and not ejected: turns may go there.
        "in_service": r.in_service,
        "ejection": _ejection_document(r, now),
        "in_flight": in_flight.get(r.name, 0),
        # The most of our turns it may hold now (admission.limit).
        "limit": admission.limit(r, in_flight.get(r.name, 0), state.waiting_interactive(r.name)),
        "lookahead": r.lookahead,
        # Our turns there that its engine is not yet known to have started, and of those
        # the interactive ones (each class may have a lookahead of them there).
        "waiting_ours": state.waiting_ours(r.name),
        "waiting_interactive": state.waiting_interactive(r.name),
        # Other clients' requests its last reading showed queued ahead of ours.
        "others_waiting": r.others_waiting,
        "running": r.running,
        "waiting": r.waiting,
        "paused_interactive": state.paused_interactive(r.name),
        # Room set aside for dataplanes while nothing is held (counted in waiting_ours).
        "reserved": reserved.get(r.name, 0),
        # The run gate (gate.py): the KV pool in tokens and where it was read (None: unknown,
        # and the gate is off here), what held runs may take of it, and the runs it holds.
        "kv_tokens": r.kv_tokens,
        "kv_source": _kv_source(r),
        # "slots", "tokens", or "off: <why>" (gate.mode); slots as the engine or config says.
        "gate": gate.mode(r),
        "kv_slots": r.kv_slots,
        # Whether its engine keeps a host tier, and who said so: "config", "engine" (its probes
        # read it) or "default" (the engine family's: llama.cpp on, the others off).
        "host_cache": r.host_cache,
        "host_cache_source": r.host_cache_source,
        "kv_capacity": gate.capacity(r),
        "held_runs": state.held_runs.get(r.name, 0),
        "held_kv_tokens": state.held_kv.get(r.name, 0),
        # The engine's prompt-cache counters since it started (None: not on its /metrics
        # page): prompt tokens taken, cached ones included, those its cache gave back, and
        # the share they make. Shown only: no decision reads them.
        "prompt_tokens": r.prompt_tokens,
        "cached_tokens": r.cached_tokens,
        "prompt_cache_share": prompt_cache_share(r),
    }


def status_document(state: State, now: float) -> dict[str, Any]:
    """The /status document for `state`, with waits measured up to `now` (on the events' clock)."""
    in_flight, reserved = per_replica(state)
    replicas = [_replica_document(state, r, in_flight, reserved, now) for r in state.replicas_in_order()]

    held = sorted(state.held(), key=lambda t: t.seq)
    waiting = waiting_for_room(state, held)
    by_caller: dict[str, list[Turn]] = {}
    for t in held:
        by_caller.setdefault(t.caller, []).append(t)

    runs = list(state.runs.values())
    by_class = {
        str(c): {str(p): sum(1 for r in runs if r.service_class is c and r.phase is p) for p in Phase}
        for c in ServiceClass
    }
    return {
        "replicas": replicas,
        "held": {
            **_held_summary(held, now),
            "by_class": _held_by_class(held, now),
            "by_caller": {caller: _held_summary(ts, now) for caller, ts in sorted(by_caller.items())},
        },
        # Runs waiting to be admitted: their turns are held and no replica holds them yet.
        "waiting_for_room": {
            **_waiting_summary([t for ts in waiting.values() for t in ts], now),
            "by_class": {str(c): _waiting_summary(ts, now) for c, ts in waiting.items()},
        },
        "runs": {
            "count": len(runs),
            "by_phase": {str(p): sum(1 for r in runs if r.phase is p) for p in Phase},
            "by_class": by_class,
            # Runs per caller: how fairness sees who is asking (x-luftpause-caller; "" is anonymous).
            "by_caller": dict(sorted(Counter(r.caller for r in runs).items())),
        },
        "gate": _gate_document(state),
        "fairness": _fairness_document(state, now),
    }


def run_document(state: State, run_id: str, now: float) -> dict[str, Any] | None:
    """One run's view, or None when the scheduler does not know it."""
    run = state.runs.get(run_id)
    if run is None:
        return None
    return {
        "run_id": run.run_id,
        "replica": run.replica,
        "phase": str(run.phase),
        "class": str(run.service_class),
        "caller": run.caller,
        "idle_s": round(max(now - run.last_activity, 0.0), 3),
        # The KV tokens it needs to stay warm (see gate.py); whether a replica holds it (pinned
        # there) or it is let go, and the seconds left of its keep time while paused.
        "working_set": run.working_set,
        "held": is_held(run),
        "keep_s": keep_s(run, now),
        # While paused on tools: their names (gate.tool_key), "" where the reply named none.
        "paused_on": run.tool if run.phase is Phase.PAUSED else None,
        # On a slot engine the gate holds it on, the slot its KV stays in (its requests name it).
        "slot": run.slot if is_held(run) else None,
    }


# The config key that names the runtimes the page may read besides its own origin (the page says it).
RUNTIME_ORIGINS_KEY = "[scheduler] runtime_origins"
_LOOPBACK_BINDS = ("", "0.0.0.0", "::", "127.0.0.1", "localhost", "::1")


def runtime_origins(config: _config.Config) -> list[str]:
    """The origins whose GET /status the page may read besides its own: the runtime as `config`
    names it (by each loopback name when it binds a wildcard or loopback address, as it is then
    reached from this machine) and `[scheduler] runtime_origins`."""
    host, port = config.runtime.host, config.runtime.port
    if host in _LOOPBACK_BINDS:
        own = [f"http://localhost:{port}", f"http://127.0.0.1:{port}", f"http://[::1]:{port}"]
    else:
        own = [f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"]
    return list(dict.fromkeys([*own, *config.scheduler.runtime_origins]))


def _page(template: str, origins: Sequence[str]) -> str:
    """status.html with the origins it may read runtimes from, in the `<meta>` its script reads."""
    meta = f'<meta name="luftpause-runtime-origins" content="{html.escape(json.dumps(list(origins)))}">'
    return template.replace("<!-- runtime-origins -->", meta, 1)


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse(error_body(message), status_code=status)


def _bearer_check(token: str | None) -> Callable[[Request], None]:
    """The dependency that lets a request to a document or /metrics through only with `token` as
    its bearer (401 otherwise), or every request when there is no token."""
    secret = token.encode() if token else None

    def authorized(request: Request) -> None:
        if secret is None:
            return
        header = request.headers.get("authorization")
        if not bearer_matches(header.encode("latin-1") if header else None, secret):
            raise HTTPException(
                401, f"missing or wrong bearer token (see {TOKEN_ENV}); the page at / asks for it"
            )

    return authorized


def _serve_metrics(app: FastAPI, render: Callable[[], bytes], authorized: Callable[[Request], None]) -> None:
    """GET /metrics on `app`: the Prometheus exposition text `render` makes, behind `authorized`."""

    @app.get("/metrics", dependencies=[Depends(authorized)])
    async def prometheus() -> Response:
        return Response(render(), media_type=CONTENT_TYPE_LATEST)


def build_app(
    current: Callable[[], State],
    clock: Callable[[], float],
    token: str | None = None,
    dataplanes: Callable[[], list[dict[str, Any]]] | None = None,
    metrics: Callable[[], bytes] | None = None,
    history: HeldHistory | None = None,
    runtime_origins: Sequence[str] = (),
) -> FastAPI:
    """The status app; `current` returns the host's state now, `clock` the time on the events'
    clock, `dataplanes` what the host knows of the dataplanes connected to it (`dataplanes` in
    the document: each one's open Turns streams, its resyncs and what the last one carried),
    `metrics` the Prometheus exposition text served at /metrics (metrics.py), `history` the held
    turns sampled over the last minutes (`held_history` in the document, for the page's chart),
    `runtime_origins` those the page may read a runtime from besides its own (`runtime_origins()`).

    With `token`, the documents and /metrics need it as a bearer (401 otherwise); the page itself
    holds no data and stays open, and asks for the token when it meets a 401.
    """
    app = FastAPI(title="luftpause scheduler status", docs_url=None, redoc_url=None, openapi_url=None)
    page = _page(resources.files("luftpause.scheduler").joinpath("status.html").read_text(), runtime_origins)
    # The browser connects nowhere else from the page, whatever its script is told.
    policy = {"content-security-policy": " ".join(["connect-src 'self'", *runtime_origins])}

    authorized = _bearer_check(token)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        # Unknown paths and wrong methods answer in the house error shape too.
        return _error(exc.status_code, str(exc.detail))

    @app.get("/status", dependencies=[Depends(authorized)])
    async def status() -> JSONResponse:
        now = clock()
        doc = status_document(current(), now)
        if dataplanes is not None:
            doc["dataplanes"] = dataplanes()
        if history is not None:
            doc["held_history"] = history.document(now)
        return JSONResponse(doc)

    @app.get("/status/runs/{run_id}", dependencies=[Depends(authorized)])
    async def run(run_id: str) -> JSONResponse:
        doc = run_document(current(), run_id, clock())
        if doc is None:
            return _error(
                404, f"no run '{run_id}' is known to the scheduler (it never ran, ended, or went idle)"
            )
        return JSONResponse(doc)

    if metrics is not None:
        _serve_metrics(app, metrics, authorized)

    @app.get("/", response_class=HTMLResponse)
    async def index() -> HTMLResponse:
        return HTMLResponse(page, headers=policy)

    return app
