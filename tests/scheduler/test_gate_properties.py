"""The run gate's promises, checked on random event sequences (hypothesis, stateful).

A pool of two replicas whose KV pools the scheduler knows (one told by the config, one read by
its probes, which change it now and then) and one whose pool it does not, is driven by callers
opening runs of random sizes (some small enough for the gate to hold, some too big for a pool
to keep `GATE_MIN_RUNS` of), turns completing in text or in tool calls with usage that differs
from the estimate, tools coming back after random pauses, first tokens, the clock, probes and runs
ending. After every decision:

- each admission of a run the gate holds found room: the runs held where it went, plus its own
  working set, fit that replica's pool less the headroom, or the replica held no run at all;
- a turn of a run held on a replica never waits for room: while it is held, its replica has no
  room for its class by the lookahead alone;
- no replica that holds no run is left without one while a run it may take waits and its
  lookahead has room (the gate never idles an engine);
- within a group of waiting runs, a caller with less attained service (fairness.py), then fewer
  turns in flight, then the earlier arrival, is never passed over: one caller's flood cannot keep
  another's run waiting behind it;
- the gate's indexes (held working sets and runs per replica, the keep times) agree with the runs;
and replaying the log reproduces every decision and the state.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from support import attained_as_each_was_placed, machine_settings

from luftpause.scheduler import admission, fairness, gate
from luftpause.scheduler.actions import Action, Place
from luftpause.scheduler.core import decide, replay
from luftpause.scheduler.events import (
    Event,
    FirstToken,
    PoolConfigured,
    ReplicaProbed,
    ReplicaSpec,
    RunEnded,
    Tick,
    TurnArrived,
    TurnCompleted,
    TurnStarted,
)
from luftpause.scheduler.state import Kind, Phase, ServiceClass, State, Turn, TurnStatus

POOL = PoolConfigured(
    (
        ReplicaSpec("a", "http://a", Kind.GENERATIVE, ("m",), lookahead=2, kv_tokens=6000),
        ReplicaSpec("b", "http://b", Kind.GENERATIVE, ("m",), lookahead=0),
        ReplicaSpec("c", "http://c", Kind.GENERATIVE, ("m", "n"), lookahead=1),
    )
)
CALLERS = {"flood": ServiceClass.BATCH, "team": ServiceClass.BATCH, "user": ServiceClass.INTERACTIVE}


def pin(state: State, run_id: str) -> str | None:
    run = state.runs.get(run_id)
    return run.replica if run is not None and run.phase is not Phase.IDLE else None


def room(state: State, name: str, service_class: ServiceClass) -> bool:
    """The lookahead's answer alone, from the state's counts (test_properties checks those)."""
    replica = state.replicas[name]
    others = replica.others_waiting
    for_interactive, for_batch = admission.room(
        replica,
        state.waiting_ours(name) + others,
        state.waiting_interactive(name) + others,
        state.paused_interactive(name),
    )
    return for_interactive if service_class is ServiceClass.INTERACTIVE else for_batch


class GateMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 0.0
        self.state = State()
        self.log: list[Event] = []
        self.actions: list[Action] = []
        self.last: tuple[State, Event, tuple[Action, ...]] | None = None
        self.next_id = 0
        # Per run: the size of its request so far, its caller, and whether its tool is running.
        self.bytes: dict[str, int] = {}
        self.caller: dict[str, str] = {}
        self.on_tool: set[str] = set()

    def feed(self, event: Event) -> tuple[Action, ...]:
        before = self.state
        self.state, actions = decide(before, event)
        self.log.append(event)
        self.actions.extend(actions)
        self.last = (before, event, actions)
        self.check_admissions(before, actions)
        return actions

    def check_admissions(self, before: State, actions: tuple[Action, ...]) -> None:
        """Each run placed without being held anywhere found room where it went."""
        after = self.state
        admitted: dict[str, list[str]] = defaultdict(list)
        for action in actions:
            if not isinstance(action, Place):
                continue
            turn = after.turns[action.turn_id]
            if turn.kind is Kind.GENERATIVE and turn.run_id and pin(before, turn.run_id) is None:
                admitted[action.replica].append(turn.run_id)
        for name, runs in admitted.items():
            replica = after.replicas[name]
            limit = gate.capacity(replica)
            sizes = [after.runs[r].working_set for r in runs]
            held = after.held_kv.get(name, 0) - sum(sizes)
            count = after.held_runs.get(name, 0) - len(sizes)
            for run_id, size in zip(runs, sizes, strict=True):
                if replica.kv_slots is not None:
                    # A slot engine: one run a slot, whatever the sizes.
                    assert not gate.gated(replica, size) or count < replica.kv_slots, (
                        f"{run_id} admitted on {name} holding {count} runs on {replica.kv_slots} slots"
                    )
                else:
                    # Where the pool keeps too few runs of its size warm, the gate does not hold it.
                    assert (
                        limit is None or not gate.gated(replica, size) or count == 0 or held + size <= limit
                    ), (
                        f"{run_id} ({size} tokens) admitted on {name} holding {count} runs of {held} (limit {limit})"
                    )
                held, count = held + size, count + 1

    @initialize()
    def configure(self) -> None:
        self.feed(POOL)
        self.feed(ReplicaProbed("b", True, 0, 0, self.now, kv_tokens=4000))

    # -- the agents --

    @rule(
        caller=st.sampled_from(sorted(CALLERS)),
        kb=st.integers(1, 8),
        max_tokens=st.sampled_from((None, 16, 64, 64)),
    )
    def open_run(self, caller: str, kb: int, max_tokens: int | None) -> None:
        run_id = f"run{self.next_id}"
        self.bytes[run_id] = kb * 250
        self.caller[run_id] = caller
        self.turn(run_id, max_tokens)

    def turn(self, run_id: str, max_tokens: int | None = 64) -> None:
        turn_id = f"t{self.next_id}"
        self.next_id += 1
        caller = self.caller[run_id]
        self.feed(
            TurnArrived(
                turn_id, run_id, CALLERS[caller], caller, "m", Kind.GENERATIVE, self.now,
                request_bytes=self.bytes[run_id], max_tokens=max_tokens,
            )
        )  # fmt: skip

    def _placed(self) -> list[str]:
        return sorted(t.turn_id for t in self.state.turns.values() if t.status is TurnStatus.PLACED)

    @precondition(lambda self: self._placed())
    @rule(
        data=st.data(),
        tool=st.booleans(),
        error=st.floats(0.5, 1.5),
        reply=st.integers(0, 60),
        names=st.sampled_from(((), ("read",), ("test",), ("read", "test"))),
    )
    def complete(
        self, data: st.DataObject, tool: bool, error: float, reply: int, names: tuple[str, ...]
    ) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._placed()))]
        prompt = int(self.bytes[turn.run_id] * 0.25 * error)
        ids = ("call",) if tool else ()
        self.feed(
            TurnCompleted(
                turn.turn_id,
                turn.run_id,
                "tool_calls" if tool else "stop",
                prompt,
                reply,
                ids,
                self.now,
                names if tool else (),
            )
        )
        if tool:
            self.on_tool.add(turn.run_id)
            self.bytes[turn.run_id] += 40 + reply

    @precondition(lambda self: self._placed())
    @rule(data=st.data())
    def first_token(self, data: st.DataObject) -> None:
        turn = self.state.turns[data.draw(st.sampled_from(self._placed()))]
        self.feed(TurnStarted(turn.turn_id, turn.run_id, self.now, True))
        self.feed(FirstToken(turn.turn_id, turn.run_id, self.now))

    @precondition(lambda self: self.on_tool)
    @rule(data=st.data())
    def tool_returns(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.on_tool)))
        self.on_tool.discard(run_id)
        self.turn(run_id)

    @precondition(lambda self: self.on_tool)
    @rule(data=st.data())
    def agent_ends_run(self, data: st.DataObject) -> None:
        run_id = data.draw(st.sampled_from(sorted(self.on_tool)))
        self.on_tool.discard(run_id)
        self.feed(RunEnded(run_id, self.now))

    @rule(seconds=st.sampled_from((0.5, 1.0, 2.0, 3.0, 8.0)))
    def wait(self, seconds: float) -> None:
        self.now += seconds
        self.feed(Tick(self.now))

    @rule(kv=st.sampled_from((None, 3000, 6000, 12000)))
    def probe_b(self, kv: int | None) -> None:
        self.feed(ReplicaProbed("b", True, None, None, self.now, kv_tokens=kv))

    @rule(slots=st.sampled_from((None, 2, 3)))
    def probe_c(self, slots: int | None) -> None:
        # c becomes a slot engine (llama.cpp) once a probe reads its slots.
        self.feed(ReplicaProbed("c", True, None, None, self.now, kv_slots=slots))

    # -- the promises --

    @invariant()
    def a_held_runs_turn_never_waits_for_room(self) -> None:
        for turn in self.state.held():
            where = pin(self.state, turn.run_id)
            if where is not None:
                assert not room(self.state, where, turn.service_class), (
                    f"{turn.turn_id} of {turn.run_id}, held on {where}, waits though {where} has room"
                )

    @invariant()
    def no_replica_holding_no_run_stays_empty_while_a_run_it_may_take_waits(self) -> None:
        for turn in self.state.held():
            if pin(self.state, turn.run_id) is not None:
                continue
            for replica in self.state.replicas_in_order():
                if turn.model in replica.models and self.state.held_runs.get(replica.name, 0) == 0:
                    assert not room(self.state, replica.name, turn.service_class), (
                        f"{turn.turn_id} waits while {replica.name} holds no run and has room"
                    )

    @invariant()
    def a_caller_with_less_attained_service_is_not_passed_over(self) -> None:
        if self.last is None:
            return
        before, _, actions = self.last
        places = [a for a in actions if isinstance(a, Place)]
        counts = Counter(t.caller for t in self.state.turns.values() if t.status is TurnStatus.PLACED)

        def arrival(turn: Turn) -> int:
            held = before.turns.get(turn.turn_id)
            return held.seq if held is not None else before.next_seq

        # Each caller's attained service as each placement was decided.
        standings = attained_as_each_was_placed(
            before, self.state, [self.state.turns[p.turn_id] for p in places]
        )
        waiting = [t for t in self.state.held() if pin(self.state, t.run_id) is None]
        for i, p in enumerate(places):
            placed = self.state.turns[p.turn_id]
            attained = standings[i]
            if pin(before, placed.run_id) is None:
                later = Counter(self.state.turns[q.turn_id].caller for q in places[i:])

                def standing(
                    caller: str, later: Counter[str] = later, attained: dict[str, float] = attained
                ) -> tuple[float, int]:
                    return (attained.get(caller, fairness.NONE), counts[caller] - later[caller])

                mine = (standing(placed.caller), arrival(placed))
                for h in waiting:
                    if h.service_class is placed.service_class and h.model == placed.model:
                        theirs = (standing(h.caller), h.seq)
                        assert mine < theirs, f"{h.turn_id} ({h.caller}) was passed over by {placed.turn_id}"

    @invariant()
    def the_gates_indexes_agree_with_the_runs(self) -> None:
        s = self.state
        held_kv: Counter[str] = Counter()
        held_runs: Counter[str] = Counter()
        for run in s.runs.values():
            where = pin(s, run.run_id)
            if where is not None:
                held_kv[where] += run.working_set
                held_runs[where] += 1
        assert dict(s.held_kv) == {k: v for k, v in held_kv.items() if v}
        assert dict(s.held_runs) == dict(held_runs)
        # The slots held runs name: one run a slot on each replica, and the index says which.
        slots: defaultdict[str, list[int]] = defaultdict(list)
        for run in s.runs.values():
            where = pin(s, run.run_id)
            if where is not None and run.slot is not None:
                slots[where].append(run.slot)
        assert all(len(taken) == len(set(taken)) for taken in slots.values()), dict(slots)
        assert dict(s.held_slots) == {k: frozenset(v) for k, v in slots.items()}
        assert list(s.hold_order) == sorted(
            (r.hold_until, r.run_id) for r in s.runs.values() if r.hold_until is not None
        )
        for run in s.runs.values():
            if run.hold_until is not None:
                assert run.phase is Phase.PAUSED and run.replica is not None
                assert gate.known(s.replicas[run.replica]), "a keep time only where the gate is on"
                assert run.hold_until > s.now

    def teardown(self) -> None:
        if self.last is None:
            return
        state, actions = replay(self.log)
        assert actions == self.actions
        assert state == self.state


GateMachine.TestCase.settings = machine_settings(200)
TestGate = GateMachine.TestCase
