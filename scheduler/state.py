"""What the scheduler knows: the replicas of the pool, the runs it has seen, the turns it holds or placed.

Everything here is immutable. `State` is a handful of persistent maps (`immutables.Map`, a HAMT),
so `decide` returns a new state that shares all but the changed paths with the old one, and a
recorded state can be kept, compared or replayed against without copying.

Times are plain floats in seconds on whatever clock the events carry (the host's monotonic
clock in production, a virtual clock in the simulator); nothing here reads a clock.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from immutables import Map


class ServiceClass(StrEnum):
    """What kind of work a turn is. Interactive goes first; batch leaves room for paused interactive runs."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class Kind(StrEnum):
    """What kind of model a replica serves and a turn asks for (the config's spelling)."""

    GENERATIVE = "generative"
    SINGLE_PASS = "single-pass"

    @property
    def title(self) -> str:
        """The name used in messages clients see, e.g. "no Generative replica serves model ..."."""
        return "Generative" if self is Kind.GENERATIVE else "SinglePass"


class Phase(StrEnum):
    """Where a run is between its turns; decides whether it is pinned to its replica."""

    GENERATING = "generating"  # a turn of it is placed and not yet reported done
    PAUSED = "paused"  # its last turn ended in tool calls: it will come back, soon
    IDLE = "idle"  # anything else: it may go anywhere next time


class TurnStatus(StrEnum):
    HELD = "held"  # waiting in the scheduler; its Admit call is still open
    PLACED = "placed"  # on a replica, counted against its capacity until reported done


@dataclass(frozen=True, slots=True)
class Replica:
    """One endpoint of the pool as configured, with what the last probe said about it."""

    name: str
    url: str
    kind: Kind
    models: frozenset[str]
    # False for engines that report no load (metrics "none"): never capped.
    reports_load: bool = True
    load_from: tuple[str, ...] = ()
    # A replica nobody probed yet counts as healthy so that the stack serves at once; the first
    # probe that fails takes it out of rotation.
    healthy: bool = True
    probed: bool = False
    running: int | None = None
    waiting: int | None = None

    def capacity(self) -> int | None:
        """How many of our turns it may hold now, or None when it is not capped.

        An engine that queues nothing takes more; once it reports a waiting queue, what it
        runs is all it can take, so our in-flight turns there are capped at its running count.
        """
        if not self.reports_load or self.waiting is None or self.waiting <= 0:
            return None
        return max(self.running or 0, 0)


@dataclass(frozen=True, slots=True)
class Run:
    """An agent's run as the scheduler sees it: where it last ran and whether it will come back there."""

    run_id: str
    service_class: ServiceClass
    caller: str
    phase: Phase = Phase.IDLE
    replica: str | None = None  # the replica of its last placed turn
    last_activity: float = 0.0


@dataclass(frozen=True, slots=True)
class Turn:
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


@dataclass(frozen=True, slots=True)
class State:
    """The scheduler's whole state. Build it with `State()` and feed it `PoolConfigured` first."""

    replicas: Map[str, Replica] = field(default_factory=Map)
    # Config order: the tie-break between equally loaded replicas, and the order of the status page.
    order: tuple[str, ...] = ()
    runs: Map[str, Run] = field(default_factory=Map)
    turns: Map[str, Turn] = field(default_factory=Map)
    next_seq: int = 0
    # The latest time any event carried.
    now: float = 0.0

    def held(self) -> list[Turn]:
        return [t for t in self.turns.values() if t.status is TurnStatus.HELD]

    def placed(self) -> list[Turn]:
        return [t for t in self.turns.values() if t.status is TurnStatus.PLACED]

    def in_flight(self, replica: str) -> int:
        """Our turns placed on `replica` and not yet reported done."""
        return sum(1 for t in self.turns.values() if t.status is TurnStatus.PLACED and t.replica == replica)

    def paused_interactive(self, replica: str) -> int:
        """Interactive runs paused on a tool whose last turn ran on `replica`: each will come back there."""
        return sum(
            1
            for r in self.runs.values()
            if r.phase is Phase.PAUSED
            and r.service_class is ServiceClass.INTERACTIVE
            and r.replica == replica
        )

    def replicas_in_order(self) -> list[Replica]:
        return [self.replicas[name] for name in self.order]
