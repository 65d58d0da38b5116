"""The dataplane's own view of runs and turns in flight, kept so a restarted scheduler can be resynced.

The scheduler holds the authoritative state, but it lives in another process and may restart.
Every event the dataplane reports to it is applied here too, so this view always says what the
scheduler would know had it seen every event: each run's last replica, phase, class and caller,
and each placed turn not yet finished, and the runs ended here lately (`EndedRuns`: a DELETE
reaches one worker, whose resyncs keep saying so). A run's latest reply's tool_call_ids go too, so that the
scheduler recognises its next turn by them (scheduler/run_identity.py), and its latest usage, reply
limit and tool names, so that its run gate sizes the run and keeps a paused one's place by its
tool as before the restart. After any reconnect, `resync_request` is sent before the
Turns stream reopens and before anything is admitted again, split over messages of at most
1 MiB (`resync_chunks`) so that its size never matters.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from luftpause.lifecycle import (
    RUN_IDLE_EXPIRY_S,
    EndedRuns,
    forgotten,
    keeps_run_state,
    pauses_run,
    phase_after_turn,
)
from luftpause.proto import PHASE_NUMBERS, pb

# How often runs past the idle expiry are let go.
PRUNE_PERIOD_S = 60.0
# Each Resync message stays under this, a quarter of gRPC's default message limit.
RESYNC_CHUNK_BYTES = 1 << 20


@dataclass(slots=True)
class BookedRun:
    run_id: str
    replica: str
    phase: pb.RunPhase
    service_class: pb.ServiceClass
    caller: str
    last_activity: float
    tool_call_ids: tuple[str, ...] = ()
    # Its latest completed turn's usage and reply limit, and the tools that reply called: what
    # sizes it for the scheduler's run gate, and what a paused run waits for.
    prompt_tokens: int = 0
    completion_tokens: int = 0
    max_tokens: int = 0
    tool_names: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class PlacedTurn:
    turn_id: str
    run_id: str
    replica: str
    service_class: pb.ServiceClass
    caller: str
    model: str
    kind: pb.ReplicaKind = pb.GENERATIVE
    max_tokens: int = 0
    """The reply limit its request set (0: none)."""


class RunBook:
    """Runs by id and placed turns by id, updated by the same events the scheduler is sent."""

    def __init__(self, idle_expiry_s: float = RUN_IDLE_EXPIRY_S) -> None:
        self._idle_expiry_s = idle_expiry_s
        self.runs: dict[str, BookedRun] = {}
        self.turns: dict[str, PlacedTurn] = {}
        self._turn_count: dict[str, int] = {}
        self.ended = EndedRuns(idle_expiry_s)

    def placed(self, turn: PlacedTurn, now: float | None = None) -> None:
        """The scheduler placed `turn`: its run is generating there from now on."""
        now = time.monotonic() if now is None else now
        # A turn of an id that ended: the id is in use again.
        self.ended.discard(turn.run_id)
        if not _in_run_state(turn):
            # Still in flight for the resync, but no run is generating because of it.
            self.turns[turn.turn_id] = turn
            return
        if turn.turn_id not in self.turns:
            self._turn_count[turn.run_id] = self._turn_count.get(turn.run_id, 0) + 1
        self.turns[turn.turn_id] = turn
        run = self.runs.get(turn.run_id)
        if run is None:
            self.runs[turn.run_id] = BookedRun(
                turn.run_id, turn.replica, pb.GENERATING, turn.service_class, turn.caller, now
            )
        else:
            run.replica, run.phase, run.last_activity = turn.replica, pb.GENERATING, now
            run.service_class, run.caller = turn.service_class, turn.caller

    def apply(self, event: pb.TurnEvent, now: float | None = None) -> None:
        now = time.monotonic() if now is None else now
        kind = event.WhichOneof("event")
        if kind == "run_ended":
            self.forget_run(event.run_id)
            self.ended.add(event.run_id, now)
            return
        run = self.runs.get(event.run_id)
        if run is not None:
            run.last_activity = now
        if kind not in ("completed", "failed", "abandoned"):
            return
        turn = self._finish(event.turn_id)
        if run is None:
            return
        completed = event.completed if kind == "completed" else None
        if completed is not None:
            if completed.tool_call_ids:
                run.tool_call_ids = tuple(completed.tool_call_ids)
            if completed.prompt_tokens > 0:
                run.prompt_tokens, run.completion_tokens = (
                    completed.prompt_tokens,
                    completed.completion_tokens,
                )
                run.max_tokens = turn.max_tokens if turn is not None else 0
            run.tool_names = tuple(completed.tool_names)
        paused = completed is not None and pauses_run(completed.finish_reason, completed.tool_call_ids)
        phase = phase_after_turn(paused, others_running=bool(self._turn_count.get(run.run_id)))
        run.phase = PHASE_NUMBERS[phase]

    def forget_run(self, run_id: str) -> None:
        # Its turns still in flight stay: they hold engine slots until they are reported done.
        self.runs.pop(run_id, None)

    def prune(self, now: float | None = None) -> int:
        """Forgets runs with no turn for 30 minutes, as the scheduler does, and runs ended as long
        ago; returns how many runs went."""
        now = time.monotonic() if now is None else now
        self.ended.prune(now)
        stale = [
            r.run_id
            for r in self.runs.values()
            if not self._turn_count.get(r.run_id) and forgotten(now - r.last_activity, self._idle_expiry_s)
        ]
        for run_id in stale:
            del self.runs[run_id]
        return len(stale)

    def resync_request(self, now: float | None = None) -> pb.ResyncRequest:
        now = time.monotonic() if now is None else now
        self.prune(now)
        return pb.ResyncRequest(
            runs=[
                pb.RunState(
                    run_id=r.run_id,
                    replica=r.replica,
                    phase=r.phase,
                    service_class=r.service_class,
                    caller=r.caller,
                    idle_s=max(0.0, now - r.last_activity),
                    tool_call_ids=r.tool_call_ids,
                    prompt_tokens=r.prompt_tokens,
                    completion_tokens=r.completion_tokens,
                    max_tokens=r.max_tokens,
                    tool_names=r.tool_names,
                )
                for r in self.runs.values()
            ],
            turns=[
                pb.InFlightTurn(
                    turn_id=t.turn_id,
                    run_id=t.run_id,
                    replica=t.replica,
                    service_class=t.service_class,
                    caller=t.caller,
                    model=t.model,
                    kind=t.kind,
                )
                for t in self.turns.values()
            ],
            ended_runs=list(self.ended),
        )

    def resync_chunks(
        self, now: float | None = None, max_bytes: int = RESYNC_CHUNK_BYTES
    ) -> list[pb.ResyncRequest]:
        """`resync_request` split into messages of at most about `max_bytes` each (one at least)."""
        return split_resync(self.resync_request(now), max_bytes)

    def _finish(self, turn_id: str) -> PlacedTurn | None:
        """The turn is no longer in flight; returns it as it was booked (None: not booked)."""
        turn = self.turns.pop(turn_id, None)
        if turn is not None and _in_run_state(turn):
            left = self._turn_count[turn.run_id] - 1
            if left:
                self._turn_count[turn.run_id] = left
            else:
                del self._turn_count[turn.run_id]
        return turn


def split_resync(request: pb.ResyncRequest, max_bytes: int = RESYNC_CHUNK_BYTES) -> list[pb.ResyncRequest]:
    """The runs, turns and ended runs of `request`, in order, over messages of at most about `max_bytes`
    each: gRPC refuses a message over its limit (4 MiB by default), and a busy dataplane's view
    grows past that within the idle window. Always at least one message, so an empty view is
    still said."""
    chunks = [pb.ResyncRequest()]
    size = 0
    fields = (("runs", request.runs), ("turns", request.turns), ("ended_runs", request.ended_runs))
    for field, items in fields:
        for item in items:
            # The item, its field tag and its length prefix.
            cost = (len(item.encode()) if isinstance(item, str) else item.ByteSize()) + 6
            if size and size + cost > max_bytes:
                chunks.append(pb.ResyncRequest())
                size = 0
            getattr(chunks[-1], field).append(item)
            size += cost
    return chunks


def _in_run_state(turn: PlacedTurn) -> bool:
    return keeps_run_state(turn.kind == pb.GENERATIVE, turn.run_id)
