"""A small driver for the scheduler core in tests: a pool, a clock, and one-line events."""

from __future__ import annotations

from luftpause.config import GATE_MIN_RUNS, LOOKAHEAD
from luftpause.scheduler.actions import Action, Place, Refuse
from luftpause.scheduler.core import decide
from luftpause.scheduler.events import (
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    Tick,
    TurnAbandoned,
    TurnArrived,
    TurnCompleted,
    TurnFailed,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, ServiceClass, State, TurnStatus


def spec(
    name: str,
    *models: str,
    kind: Kind = Kind.GENERATIVE,
    reports_load: bool = True,
    load_from: tuple[str, ...] = (),
    lookahead: int = LOOKAHEAD,
    kv_tokens: int | None = None,
    gate_min_runs: int = GATE_MIN_RUNS,
    kv_slots: int | None = None,
    host_cache: bool = False,
    host_cache_configured: bool = False,
) -> ReplicaSpec:
    """A replica serving `models` (default "m"); `lookahead` 0 takes any number of our turns;
    `kv_tokens`: its KV pool as configured (None: as its probes say); `gate_min_runs` 0: no gate;
    `kv_slots`: a slot engine's slots as configured; `host_cache`: its engine keeps evicted
    prefixes, as the config says (`host_cache_configured`) or by default until a probe says."""
    return ReplicaSpec(
        name, f"http://{name}", kind, models or ("m",), reports_load, load_from, lookahead, kv_tokens,
        gate_min_runs, kv_slots, host_cache, host_cache_configured,
    )  # fmt: skip


class Pool:
    """Feeds events to `decide` one at a time, keeping the state and a clock that only moves when told."""

    def __init__(self, *replicas: ReplicaSpec) -> None:
        self.now = 0.0
        self.state = State()
        self.log: list[Event] = []
        self.feed(PoolConfigured(replicas or (spec("a"), spec("b")), self.now))

    def feed(self, event: Event) -> tuple[Action, ...]:
        self.log.append(event)
        self.state, actions = decide(self.state, event)
        return actions

    def wait(self, seconds: float) -> None:
        self.now += seconds

    def arrive(
        self,
        turn_id: str,
        run_id: str | None = None,
        cls: str = "interactive",
        caller: str = "c",
        model: str = "m",
        kind: Kind = Kind.GENERATIVE,
        dataplane: str = "",
        request_bytes: int = 0,
        max_tokens: int | None = None,
    ) -> tuple[Action, ...]:
        return self.feed(
            TurnArrived(
                turn_id,
                run_id or f"run-{turn_id}",
                ServiceClass(cls),
                caller,
                model,
                kind,
                self.now,
                dataplane,
                request_bytes,
                max_tokens,
            )
        )

    def start(self, *turn_ids: str, streamed: bool = True) -> tuple[Action, ...]:
        """The dataplane reports each turn's request sent; `streamed`: its reply streams."""
        actions: tuple[Action, ...] = ()
        for turn_id in turn_ids:
            actions += self.feed(TurnStarted(turn_id, self.state.turns[turn_id].run_id, self.now, streamed))
        return actions

    def first_token(self, *turn_ids: str) -> tuple[Action, ...]:
        """Each turn's first token reached the dataplane: its engine started it."""
        actions: tuple[Action, ...] = ()
        for turn_id in turn_ids:
            actions += self.feed(FirstToken(turn_id, self.state.turns[turn_id].run_id, self.now))
        return actions

    def complete(
        self,
        turn_id: str,
        tool_calls: bool = False,
        prompt_tokens: int = 100,
        completion_tokens: int = 20,
        tools: tuple[str, ...] = (),
    ) -> tuple[Action, ...]:
        """The turn completes; with `tool_calls`, in calls of the tools named `tools` (none named: ())."""
        turn = self.state.turns[turn_id]
        reason, ids = ("tool_calls", ("call_1",)) if tool_calls else ("stop", ())
        return self.feed(
            TurnCompleted(
                turn_id, turn.run_id, reason, prompt_tokens, completion_tokens, ids, self.now, tools
            )
        )

    def fail(self, turn_id: str) -> tuple[Action, ...]:
        return self.feed(
            TurnFailed(turn_id, self.state.turns[turn_id].run_id, "engine a: connection refused", self.now)
        )

    def abandon(self, turn_id: str) -> tuple[Action, ...]:
        return self.feed(TurnAbandoned(turn_id, self.state.turns[turn_id].run_id, self.now))

    def end_run(self, run_id: str) -> tuple[Action, ...]:
        return self.feed(RunEnded(run_id, self.now))

    def probe(
        self,
        name: str,
        healthy: bool = True,
        running: int | None = None,
        waiting: int | None = None,
        sent_at: float | None = None,
        kv_tokens: int | None = None,
        kv_slots: int | None = None,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        host_cache: bool | None = None,
    ) -> tuple[Action, ...]:
        """A probe answered now; `sent_at`: when the load was asked for (default: now);
        `kv_tokens`, `kv_slots`: the KV pool and slots the engine said it has (None: not read);
        `prompt_tokens`, `cached_tokens`: its prompt-cache counters (None: not on its page);
        `host_cache`: whether it said it keeps a host tier (None: not said)."""
        return self.feed(
            ReplicaProbed(
                name, healthy, running, waiting, self.now, sent_at, kv_tokens=kv_tokens, kv_slots=kv_slots,
                host_cache=host_cache, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            )
        )  # fmt: skip

    def tick(self) -> tuple[Action, ...]:
        return self.feed(Tick(self.now))

    def replica_of(self, turn_id: str) -> str | None:
        """Where the turn is placed; None while it is held."""
        turn = self.state.turns[turn_id]
        return turn.replica if turn.status is TurnStatus.PLACED else None

    def held(self) -> list[str]:
        return [t.turn_id for t in sorted(self.state.held(), key=lambda t: t.seq)]

    def unconfirmed(self, name: str) -> list[str]:
        """Our turns placed on `name` that its engine is not yet known to have started, in the
        order they went out."""
        waiting = [self.state.turns[key[-1]] for key in self.state.unconfirmed.get(name, ())]
        return [t.turn_id for t in sorted(waiting, key=lambda t: t.seq)]


def placements(actions: tuple[Action, ...]) -> list[tuple[str, str]]:
    """(turn, replica) for each Place, in the order decided."""
    return [(a.turn_id, a.replica) for a in actions if isinstance(a, Place)]


def refusals(actions: tuple[Action, ...]) -> list[str]:
    return [a.message for a in actions if isinstance(a, Refuse)]
