"""What the scheduler knows: the replicas of the pool, the runs it has seen, the turns it holds or placed.

Everything here is immutable. `State` is a handful of persistent maps (`immutables.Map`, a HAMT)
and sorted sets (`ordered.SortedSet`, a B-tree), so `decide` returns a new state that shares all
but the changed paths with the old one, and a recorded state can be kept, compared or replayed
against without copying. Runs, turns and the state are named tuples: cheap to make, which matters
at tens of thousands of decisions a second.

Times are plain floats in seconds on whatever clock the events carry (the host's monotonic
clock in production, a virtual clock in the simulator); nothing here reads a clock.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, NamedTuple

from immutables import Map

from luftpause import lifecycle
from luftpause.defaults import GATE_MIN_RUNS, LOOKAHEAD, OUTLIER_EJECTION_BASE_S
from luftpause.errors import KIND_LABELS
from luftpause.lifecycle import Phase as Phase  # re-exported: the scheduler imports it from here
from luftpause.scheduler.ordered import EMPTY, SortedSet
from luftpause.scheduler.outliers import FRESH, Outlier


class ServiceClass(StrEnum):
    """What kind of work a turn is. Interactive goes first; batch leaves room for paused interactive runs."""

    INTERACTIVE = lifecycle.INTERACTIVE
    BATCH = lifecycle.BATCH


class Kind(StrEnum):
    """What kind of model a replica serves and a turn asks for (the config's spelling)."""

    GENERATIVE = "generative"
    SINGLE_PASS = "single-pass"

    @property
    def label(self) -> str:
        """The name used in messages clients see, e.g. "no Generative replica serves model ..."."""
        return KIND_LABELS[self.value]


class TurnStatus(StrEnum):
    HELD = "held"  # waiting in the scheduler; its dataplane waits for the placement
    PLACED = "placed"  # on a replica, counted in flight there until reported done


class Replica(NamedTuple):
    """One endpoint of the pool as configured, with what the last probe said about it.

    A named tuple, as `Run` and `Turn` are: every completed turn replaces its replica (its
    outlier record counts the turn), and `_replace` copies a tuple where `dataclasses.replace`
    walks the fields by name and calls a frozen `__init__` (2.1 µs against 9.9 µs here; the
    core made 7.3 % fewer instructions a decision for it, docs/measuring.md)."""

    name: str
    url: str
    kind: Kind
    models: frozenset[str]
    # False for engines that report no load (metrics "none"): no probe says what waits there.
    reports_load: bool = True
    # How many of our turns may wait in its engine's own queue; 0: no limit (see admission.py).
    lookahead: int = LOOKAHEAD
    # For a router: the replicas whose engines do its work. Its running and waiting are then the
    # sums of theirs as last probed, never read from the router itself.
    load_from: tuple[str, ...] = ()
    # A replica nobody probed yet counts as healthy so that the stack serves at once; the first
    # probe that fails takes it out of rotation.
    healthy: bool = True
    probed: bool = False
    running: int | None = None
    waiting: int | None = None
    # Of `waiting`, the requests that were not ours (another client of the same engine), and when
    # that load was asked for: our turns there wait behind them, so they count against the
    # lookahead until one of ours sent after the reading starts (the queue ahead of it is gone).
    others_waiting: int = 0
    read_at: float | None = None
    # Tokens of KV memory its engine has (see gate.py): the config's `kv_tokens` when set
    # (`kv_configured`: probes do not change it), else as the engine last said; None: unknown,
    # and the run gate is off for this replica.
    kv_tokens: int | None = None
    kv_configured: bool = False
    # The fewest runs of a size its pool must keep warm for the gate to hold them (gate.py).
    gate_min_runs: int = GATE_MIN_RUNS
    # Slots its engine keeps each request's KV apart in (llama.cpp's; see gate.py): the config's
    # `kv_slots` when set (`slots_configured`), else as the engine last said; None: a shared pool.
    kv_slots: int | None = None
    slots_configured: bool = False
    # Whether its engine keeps evicted prefixes in host memory: the gate then holds no runs here.
    # Where that was said (`host_cache_source`): "config", "engine" (its probes read it), or
    # "default" (the engine family's, until a probe says: llama.cpp on, the others off).
    host_cache: bool = False
    host_cache_source: str = "default"
    # Its engine's prompt-cache counters as last read (ReplicaProbed): prompt tokens taken since
    # it started, and of those the ones its prefix cache gave back; None: never read. Shown in
    # /status and the scheduler's /metrics; no decision reads them.
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    # How its turns have been ending, and its ejections (outliers.py), and how long its first lasts.
    outlier: Outlier = FRESH
    ejection_base_s: float = OUTLIER_EJECTION_BASE_S

    @property
    def in_service(self) -> bool:
        """Whether turns may go to it: its last probe found it healthy, and it is not ejected."""
        return self.healthy and self.outlier.ejected_until is None


class Run(NamedTuple):
    """An agent's run as the scheduler sees it: where it last ran and whether it will come back there."""

    run_id: str
    service_class: ServiceClass
    caller: str
    phase: Phase = Phase.IDLE
    replica: str | None = None  # the replica of its last placed turn
    last_activity: float = 0.0
    # For an interactive run paused on a tool: until when batch keeps room for it on its replica
    # (see admission.keep_paused_for); None once that has passed, or when it is not paused.
    kept_until: float | None = None
    # The dataplane its latest turn came through ("" for a single unnamed one): a resync from
    # that dataplane speaks for the run (see core.resync).
    dataplane: str = ""
    # The KV tokens it needs to stay warm on its replica (see gate.py): its last reported prompt
    # and reply plus the next reply's reservation; for a run not yet reported, an estimate.
    working_set: int = 0
    # For a run paused on a tool with no turn back yet, on a replica whose pool is known: when it
    # lets go of its place there (`gate.hold_for`); None otherwise. Let go, it keeps no replica.
    hold_until: float | None = None
    # On a slot engine the gate holds it on (gate.names_slots), the slot its replica keeps its KV
    # in, named in each of its turns' requests (llama.cpp's `id_slot`); None elsewhere.
    slot: int | None = None
    # For a run paused on tools: what it is paused on (`gate.tool_key`: the names of the tools its
    # last reply called), whose pauses set its keep time; "" otherwise, or where none was named.
    tool: str = ""

    # The run's transitions, as new records. Each is written out field by field here, once:
    # `_replace` would say the same in a third of the lines at twice the cost a decision, and
    # these run for every turn.

    def came_back(
        self, service_class: ServiceClass, caller: str, at: float, dataplane: str, working_set: int
    ) -> Run:
        """A turn of the run arrived: the class and caller are per turn, the run carries the latest.
        It is back, so its place no longer runs out."""
        return Run(
            self.run_id, service_class, caller, self.phase, self.replica, at, self.kept_until, dataplane,
            working_set, None, self.slot, self.tool,
        )  # fmt: skip

    def placed_on(self, replica: str, at: float, slot: int | None = None) -> Run:
        """One of its turns was placed on `replica` (in `slot` of it): generating there, no room
        kept for it."""
        return Run(
            self.run_id, self.service_class, self.caller, Phase.GENERATING, replica, at, None, self.dataplane,
            self.working_set, None, slot, "",
        )  # fmt: skip

    def turn_ended(
        self,
        phase: Phase,
        last_activity: float,
        kept_until: float | None,
        hold_until: float | None,
        tool: str,
    ) -> Run:
        """A turn of it ended, leaving it in `phase` (paused on `tool` where that is PAUSED)."""
        return Run(
            self.run_id, self.service_class, self.caller, phase, self.replica, last_activity, kept_until,
            self.dataplane, self.working_set, hold_until, self.slot, tool,
        )  # fmt: skip

    def let_go(self) -> Run:
        """Its keep time ran out while paused: no replica holds it, and its next turn is placed as a
        new run's would be."""
        return Run(
            self.run_id, self.service_class, self.caller, self.phase, None, self.last_activity, None,
            self.dataplane, self.working_set, None, None, self.tool,
        )  # fmt: skip

    def sized(self, working_set: int) -> Run:
        """Its working set as its latest usage (or estimate) says."""
        return Run(
            self.run_id, self.service_class, self.caller, self.phase, self.replica, self.last_activity,
            self.kept_until, self.dataplane, working_set, self.hold_until, self.slot, self.tool,
        )  # fmt: skip


def pinned_to(run: Run | None) -> str | None:
    """The replica `run` must go back to, and that holds it for the run gate (gate.py): its last
    replica while it is generating or paused there; None for a run that is idle, or that let go
    of its place when its keep time ran out (paused with no replica)."""
    return run.replica if run is not None and run.phase is not Phase.IDLE else None


class Turn(NamedTuple):
    """One model call of a run: held until placed, then counted on its replica until reported done."""

    turn_id: str
    run_id: str
    service_class: ServiceClass
    caller: str
    model: str
    kind: Kind
    arrived_at: float
    # Arrival order, for draining held turns first come first served among equals; times may tie.
    seq: int
    status: TurnStatus = TurnStatus.HELD
    replica: str | None = None
    placed_at: float | None = None
    # False once the dataplane reported the request sent with a reply that does not stream (no
    # first token until it is whole, so a turn finishing beside it is what confirms it); None
    # otherwise: not sent yet, or streamed (its first token is the exact sign of its start).
    streamed: bool | None = None
    # Whether the engine is known to have started it (see admission.py): until then it may still
    # be waiting in the engine's queue, and counts against the replica's lookahead.
    confirmed: bool = False
    # The dataplane that admitted it: only that dataplane's resync replaces it once placed.
    dataplane: str = ""
    # Its request body's size and max_tokens, as admitted (see gate.py's estimates).
    request_bytes: int = 0
    max_tokens: int | None = None

    # Its transitions, as new records, written out field by field once (see `Run`'s).

    def placed_on(self, replica: str, at: float, seq: int) -> Turn:
        """Sent to `replica` at `at`; `seq` is now its place in the order turns went out (the
        order of the engine's queue), no longer its arrival."""
        return Turn(
            self.turn_id, self.run_id, self.service_class, self.caller, self.model, self.kind, self.arrived_at,
            seq, TurnStatus.PLACED, replica, at, self.streamed, self.confirmed, self.dataplane,
            self.request_bytes, self.max_tokens,
        )  # fmt: skip

    def sent(self, streamed: bool) -> Turn:
        """Its request went to the engine; `streamed`: its reply will stream."""
        return Turn(
            self.turn_id, self.run_id, self.service_class, self.caller, self.model, self.kind, self.arrived_at,
            self.seq, self.status, self.replica, self.placed_at, streamed, self.confirmed, self.dataplane,
            self.request_bytes, self.max_tokens,
        )  # fmt: skip

    def started(self) -> Turn:
        """The engine is known to have started it."""
        return Turn(
            self.turn_id, self.run_id, self.service_class, self.caller, self.model, self.kind, self.arrived_at,
            self.seq, self.status, self.replica, self.placed_at, self.streamed, True, self.dataplane,
            self.request_bytes, self.max_tokens,
        )  # fmt: skip


# The caller a reservation's placeholder turn is counted under: no client's (a header cannot hold
# a NUL), so no caller's fairness count includes another dataplane's reservations.
RESERVED_CALLER = "\x00reserved"


class Reservation(NamedTuple):
    """Room on `replica` set aside for `dataplane` while nothing is held (see `core.reserve`).

    It is counted there by a placeholder turn of the same id (run "", caller `RESERVED_CALLER`,
    interactive, placed and unconfirmed), so every count that limits the replica sees it, for
    either class, until the dataplane uses it (the placeholder becomes its turn) or gives it back."""

    reservation_id: str
    dataplane: str
    replica: str
    # Told to give it back: a turn is held. It still counts until the dataplane answers.
    revoked: bool = False


class Group(NamedTuple):
    """Where a held turn may go, as far as its own fields and its run's pin say. Held turns of
    one group may go to the same replicas, so the drain asks once per group, never once per turn;
    where the run gate sizes a group's runs (no pin), it asks for the turn the group would place
    next, and the rest wait behind it in order (first come, as an engine's own queue)."""

    kind: Kind
    model: str
    pin: str | None  # the replica its run is pinned to, or None
    service_class: ServiceClass


class Lane(NamedTuple):
    """A run's held turns of one kind, model, class and caller. They share a group and are
    placed in arrival order, so a lane enters its group by its first turn alone, and a run whose
    pin moves moves its lanes, not each of its turns."""

    run_id: str
    kind: Kind
    model: str
    service_class: ServiceClass
    caller: str


# The keys of the sorted indexes (`State`'s fields say what each holds).
TurnKey = tuple[int, str]  # (seq, turn id): a lane's turns, in arrival order
LaneKey = tuple[int, Lane]  # (seq of the lane's first turn, lane): a caller's lanes in a group
# ((attained service, turns in flight), first seq, caller): a group's callers, in drain order
CallerKey = tuple[tuple[float, int], int, str]
SentKey = tuple[float, int, str]  # (placed_at, seq, turn id): placed turns, in the order they went out
RunKey = tuple[float, str]  # (a time, run id): runs by when something is due

_NO_MAP: Map[Any, Any] = Map()

ToolPauses = tuple[tuple[str, tuple[float, ...]], ...]
"""A caller's recent pauses by tool (gate.py): (tool key, its pauses newest last), the tool learnt
from last at the end, at most `gate.TOOLS_PER_CALLER` of them."""


class State(NamedTuple):
    """The scheduler's whole state. Build it with `State()` and feed it `PoolConfigured` first.

    The first six fields and the two of reservations are the facts, and the learnt estimates
    (`pause_estimate`, `pause_samples`, `tool_pauses`, `tokens_per_byte`); the rest are indexes over them that `decide` keeps
    current so that no decision scans every turn or run. They are derived data: two states with
    equal facts reached by the same events have equal indexes too.
    """

    replicas: Map[str, Replica] = _NO_MAP
    # Config order: the tie-break between equally loaded replicas, and the order of the status page.
    order: tuple[str, ...] = ()
    runs: Map[str, Run] = _NO_MAP
    turns: Map[str, Turn] = _NO_MAP
    next_seq: int = 0
    # The latest time any event carried.
    now: float = 0.0

    # (kind, model) -> names of the replicas of that kind serving it, healthy or not, in config order.
    serving: Map[tuple[Kind, str], tuple[str, ...]] = _NO_MAP
    # replica -> the routers whose load includes it (their `load_from` names it).
    routers_of: Map[str, tuple[str, ...]] = _NO_MAP
    # Placed turns per replica and per caller; interactive runs paused on a tool per replica.
    in_flight_by_replica: Map[str, int] = _NO_MAP
    in_flight_by_caller: Map[str, int] = _NO_MAP
    paused_by_replica: Map[str, int] = _NO_MAP
    # Held turns, in three levels so that every change is a few sorted-set updates:
    # - per lane, the lane's turns in arrival order as (seq, turn id);
    # - per (group, caller), the lanes there as (seq of the lane's first turn, lane);
    # - per group, each caller with lanes there as ((its attained service, its turns in flight),
    #   its first seq, caller), so a group's first key leads to the turn it would place next;
    # and the groups each caller has turns held in (re-keyed when either of the two changes).
    held_queues: Map[tuple[Group, str], SortedSet[LaneKey]] = _NO_MAP
    held_groups: Map[Group, SortedSet[CallerKey]] = _NO_MAP
    caller_groups: Map[str, frozenset[Group]] = _NO_MAP
    lanes: Map[Lane, SortedSet[TurnKey]] = _NO_MAP
    # Per run id: the lanes of its held generative turns (they move when the run's pin moves);
    # its open turns of any kind (a run with one is never forgotten as idle); its placed
    # generative turns.
    run_lanes: Map[str, tuple[Lane, ...]] = _NO_MAP
    run_open: Map[str, int] = _NO_MAP
    run_placed: Map[str, int] = _NO_MAP
    # Placed turns as (placed_at, seq, turn id), oldest first: what the turn timeout looks at.
    placed_order: SortedSet[SentKey] = EMPTY
    # Runs with no open turn as (last activity, run id), quietest first: what idle expiry looks at.
    quiet_order: SortedSet[RunKey] = EMPTY
    # Per replica, our placed turns not yet seen running there, as (placed_at, seq, turn id), in
    # the order they went out: the ones that may be waiting in its engine's queue (see admission.py).
    unconfirmed: Map[str, SortedSet[SentKey]] = _NO_MAP
    # Interactive runs paused on a tool with room kept for them, as (kept_until, run id), soonest
    # first: what ends a kept slot whose tool is taking longer than its caller's usually do.
    kept_order: SortedSet[RunKey] = EMPTY
    # Per caller, the running average of its runs' pauses on tools, in seconds.
    pause_estimate: Map[str, float] = _NO_MAP
    # Per replica, how many of `unconfirmed` are interactive turns.
    unconfirmed_interactive: Map[str, int] = _NO_MAP
    # Reservations (see `core.reserve`): per dataplane that takes them, the replicas its turns
    # went to and when last (where it may get them); and those granted, by id.
    reserving: Map[str, Map[str, float]] = _NO_MAP
    reservations: Map[str, Reservation] = _NO_MAP
    # The run gate (see gate.py): per replica, the working sets of the runs it holds (pinned
    # there: generating, or paused within their keep time) and how many; paused runs' keep times
    # as (hold_until, run id), soonest first; per caller its recent pauses on tools; per model the
    # tokens its requests carry per byte.
    held_kv: Map[str, int] = _NO_MAP
    held_runs: Map[str, int] = _NO_MAP
    hold_order: SortedSet[RunKey] = EMPTY
    pause_samples: Map[str, tuple[float, ...]] = _NO_MAP
    tokens_per_byte: Map[str, float] = _NO_MAP
    # Per caller, its attained service: the engine tokens its turns asked for, decayed over
    # fairness.HALF_LIFE_S and kept as a log so that callers compare without a re-key as time
    # passes (fairness.py). The drain's order within a class.
    attained: Map[str, float] = _NO_MAP
    # Per slot engine, the slots of the runs it holds (Run.slot): a new run takes a free one.
    held_slots: Map[str, frozenset[int]] = _NO_MAP
    # Per caller, its recent pauses on each of its tools (gate.ToolPauses), beside `pause_samples`.
    tool_pauses: Map[str, ToolPauses] = _NO_MAP

    def held(self) -> list[Turn]:
        return [t for t in self.turns.values() if t.status is TurnStatus.HELD]

    def placed(self) -> list[Turn]:
        """Turns placed on a replica, reservations' placeholders not among them."""
        return [
            t
            for t in self.turns.values()
            if t.status is TurnStatus.PLACED and t.turn_id not in self.reservations
        ]

    def in_flight(self, replica: str) -> int:
        """Our turns placed on `replica` and not yet reported done."""
        return self.in_flight_by_replica.get(replica, 0)

    def waiting_ours(self, replica: str) -> int:
        """Our turns placed on `replica` that its engine is not yet known to have started."""
        waiting = self.unconfirmed.get(replica)
        return len(waiting) if waiting is not None else 0

    def waiting_interactive(self, replica: str) -> int:
        """Of `waiting_ours`, the interactive turns."""
        return self.unconfirmed_interactive.get(replica, 0)

    def paused_interactive(self, replica: str) -> int:
        """Interactive runs paused on a tool whose last turn ran on `replica`: each will come back there."""
        return self.paused_by_replica.get(replica, 0)

    def replicas_in_order(self) -> list[Replica]:
        return [self.replicas[name] for name in self.order]
