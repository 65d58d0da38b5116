"""What can happen to the scheduler: the events `decide` consumes.

Each event is a frozen dataclass carrying the time it happened (`at`, seconds on the caller's
clock). The gRPC host makes them from the Turns stream and Resync; the prober
from health and metrics probes; the clock from its 1 s tick. The simulator makes the same ones
in virtual time. An event names things by id; it never carries a reference into the state.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from luftpause import defaults
from luftpause.lifecycle import pauses_run
from luftpause.scheduler.state import Kind, Phase, ServiceClass

if TYPE_CHECKING:  # only for `from_config`'s types: the core does not load the config (pydantic)
    from luftpause import config as _config


@dataclass(frozen=True, slots=True)
class ReplicaSpec:
    """One replica as configured: what `PoolConfigured` carries."""

    name: str
    url: str
    kind: Kind = Kind.GENERATIVE
    models: tuple[str, ...] = ()
    reports_load: bool = True
    load_from: tuple[str, ...] = ()
    lookahead: int = defaults.LOOKAHEAD
    # Tokens of KV memory its engine has, as configured (`kv_tokens`); None: as its probes read it,
    # or unknown (the run gate is then off for it: see `gate.py`).
    kv_tokens: int | None = None
    # The fewest runs of a size its pool must keep warm for the gate to hold them (gate.py).
    gate_min_runs: int = defaults.GATE_MIN_RUNS
    # Slots its engine keeps KV apart in, as configured (`kv_slots`); None: as its probes read it.
    kv_slots: int | None = None
    # Whether its engine keeps evicted prefixes in host memory (`Replica.keeps_host_cache`), and
    # whether the config said so (`host_cache_configured`: probes do not change it) or that is the
    # engine family's default until its probes say (SGLang's and vLLM's, prober.py).
    host_cache: bool = False
    host_cache_configured: bool = False
    # How long its first ejection lasts when its turns keep failing (outliers.py).
    ejection_base_s: float = defaults.OUTLIER_EJECTION_BASE_S

    @classmethod
    def from_config(cls, replica: _config.Replica) -> ReplicaSpec:
        return cls(
            name=replica.name,
            url=replica.url,
            kind=Kind(replica.kind),
            models=tuple(replica.models),
            reports_load=replica.metrics != "none",
            load_from=tuple(replica.load_from),
            lookahead=replica.lookahead,
            kv_tokens=replica.kv_tokens,
            gate_min_runs=replica.gate_min_runs,
            kv_slots=replica.kv_slots,
            host_cache=replica.keeps_host_cache(),
            host_cache_configured=replica.host_cache is not None,
            ejection_base_s=replica.ejection_base_s,
        )


@dataclass(frozen=True, slots=True)
class PoolConfigured:
    """The pool, in config order. The first event of every log; sent again, it replaces the pool."""

    replicas: tuple[ReplicaSpec, ...]
    at: float = 0.0

    @classmethod
    def from_config(cls, replicas: Iterable[_config.Replica], at: float = 0.0) -> PoolConfigured:
        return cls(tuple(ReplicaSpec.from_config(r) for r in replicas), at)


@dataclass(frozen=True, slots=True)
class ReplicaProbed:
    """A probe's answer. `running`/`waiting` are None when the replica reports no load or it could not be read.

    `sent_at` is when the load was asked for (None: at `at`); a turn placed after it cannot be in
    the reading.
    """

    name: str
    healthy: bool
    running: int | None
    waiting: int | None
    at: float
    sent_at: float | None = None
    # Tokens of KV memory the engine says it has (SGLang's max_total_num_tokens, vLLM's blocks
    # times block size, llama.cpp's slots times their context); None: not read by this probe,
    # and the last reading stands.
    kv_tokens: int | None = None
    # Requests the engine keeps KV for apart, one a slot (llama.cpp's total_slots); None: not
    # read, or an engine with one shared pool.
    kv_slots: int | None = None
    # Whether the engine keeps a host tier behind its KV (SGLang's HiCache, vLLM's KV offloading);
    # None: not read by this probe, or not said.
    host_cache: bool | None = None
    # The engine's prompt-cache counters since it started (prober.CACHE_METRICS): the prompt
    # tokens it took, cached ones included, and of those the ones its prefix cache gave back;
    # None, both: not on this probe's /metrics page. Shown only; no decision reads them.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TurnArrived:
    """An admission: a turn asks where to go. A retried admission reuses its turn id."""

    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    model: str
    kind: Kind
    at: float
    # Which dataplane admitted it, when several share the scheduler ("" for a single one).
    dataplane: str = ""
    # The request body's size in bytes (0: unknown) and its `max_tokens` (None: not set): what
    # the run gate estimates the turn's working set from before its usage is known (`gate.py`).
    request_bytes: int = 0
    max_tokens: int | None = None


@dataclass(frozen=True, slots=True)
class TurnStarted:
    """The dataplane sent the turn's request to its replica; `streamed`: its reply will stream,
    so its first token will be reported when the engine starts it."""

    turn_id: str
    run_id: str
    at: float
    streamed: bool = False


@dataclass(frozen=True, slots=True)
class FirstToken:
    """The replica's first token of the turn reached the dataplane."""

    turn_id: str
    run_id: str
    at: float


@dataclass(frozen=True, slots=True)
class TurnCompleted:
    """The turn ended normally. Ending in tool calls pauses its run: it will come back."""

    turn_id: str
    run_id: str
    finish_reason: str
    prompt_tokens: int
    completion_tokens: int
    tool_call_ids: tuple[str, ...]
    at: float
    # The names of the tools the reply called, where the reply named them ("" for one that did
    # not): what the run is paused on, whose pauses set how long it keeps its place (gate.py).
    tool_names: tuple[str, ...] = ()

    @property
    def paused_on_tool(self) -> bool:
        return pauses_run(self.finish_reason, self.tool_call_ids)


@dataclass(frozen=True, slots=True)
class TurnFailed:
    """The turn ended in an error (engine unreachable, refused, broke mid-stream, client left mid-stream).

    `replica_fault`: the replica's doing, which counts toward ejecting it (outliers.py)."""

    turn_id: str
    run_id: str
    error: str
    at: float
    replica_fault: bool = False


@dataclass(frozen=True, slots=True)
class TurnAbandoned:
    """The client gave up on the turn: it left while the turn was held (or its dataplane's
    stream ended), or just as the turn was placed, before the engine request went out."""

    turn_id: str
    run_id: str
    at: float


@dataclass(frozen=True, slots=True)
class RunEnded:
    """The run is over (the runtime or an agent said so): forget it now instead of after 30 idle minutes."""

    run_id: str
    at: float


@dataclass(frozen=True, slots=True)
class Tick:
    """The clock: drives the expiry of turns never reported done and of runs gone quiet."""

    at: float


@dataclass(frozen=True, slots=True)
class ResyncedRun:
    """A run as the dataplane remembers it."""

    run_id: str
    replica: str | None
    phase: Phase
    service_class: ServiceClass
    caller: str
    idle_s: float = 0.0
    # Its latest completed turn's usage and reply limit (None: no limit), 0 and 0 when none was
    # reported; and the tools that reply called, by name.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int | None = None
    tool_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class ResyncedTurn:
    """A turn the dataplane has in flight on a replica."""

    turn_id: str
    run_id: str
    replica: str
    service_class: ServiceClass
    caller: str
    model: str
    kind: Kind = Kind.GENERATIVE


@dataclass(frozen=True, slots=True)
class Resynced:
    """One dataplane's view of runs and in-flight turns, which replaces what the scheduler holds
    from that dataplane: the turns it placed for it, and the runs whose latest turn came through
    it. What other dataplanes sharing the scheduler sent stays, but for a run named here whose
    latest turn came through another dataplane more recently than this view says."""

    runs: tuple[ResyncedRun, ...]
    turns: tuple[ResyncedTurn, ...]
    at: float
    dataplane: str = ""


@dataclass(frozen=True, slots=True)
class ReservationsWanted:
    """A dataplane takes reservations (see `core.reserve`): it opened a Turns stream and asked."""

    dataplane: str
    at: float


@dataclass(frozen=True, slots=True)
class ReservationUsed:
    """A dataplane sent `turn` to the replica of its reservation without asking: the turn is
    placed there as of `at`. `replica` is the reservation's, so the turn is counted where it
    went even if the reservation had been dropped meanwhile."""

    reservation_id: str
    replica: str
    turn: TurnArrived
    at: float


@dataclass(frozen=True, slots=True)
class ReservationReturned:
    """A dataplane gave a reservation back unused."""

    reservation_id: str
    at: float


@dataclass(frozen=True, slots=True)
class DataplaneLeft:
    """A dataplane's Turns stream ended: its reservations are void, and it gets no more until it asks again."""

    dataplane: str
    at: float


Event = (
    PoolConfigured
    | ReplicaProbed
    | TurnArrived
    | TurnStarted
    | FirstToken
    | TurnCompleted
    | TurnFailed
    | TurnAbandoned
    | RunEnded
    | Tick
    | Resynced
    | ReservationsWanted
    | ReservationUsed
    | ReservationReturned
    | DataplaneLeft
)
