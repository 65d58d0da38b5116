"""The rules of a run's life that the scheduler, the dataplane and the runtime must agree on.

Each lives here once; the scheduler's core, the dataplane's run book (kept for resyncs) and the
runtime's turns read them from here, so a change to one is made in one place:

- when a model's reply pauses its run: it asked for tools, so the agent will come back with the
  results, to the replica that holds its prefix (`pauses_run`), and which phase a run is in
  once one of its turns has ended (`phase_after_turn`);
- which turns enter run state at all (`keeps_run_state`); how long a run with no turn is
  remembered before its next turn starts afresh (`RUN_IDLE_EXPIRY_S`, `forgotten`), and how
  long, and how many, ended runs are remembered as ended (`EndedRuns`), so that a book still
  holding one (another worker's) cannot bring it back;
- the headers that carry a turn's run, class and caller, the class names, and how long a caller
  may be (`CALLER_MAX_BYTES`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from enum import StrEnum

# A run with no turn for this long is forgotten; its next turn starts without affinity.
RUN_IDLE_EXPIRY_S = 30 * 60.0
# At most this many ended runs are remembered as ended (the oldest go first); each for
# RUN_IDLE_EXPIRY_S, by when every book has let the run go for being idle.
ENDED_RUNS_KEPT = 100_000


def forgotten(quiet_s: float, expiry_s: float = RUN_IDLE_EXPIRY_S) -> bool:
    """Whether a run with no turn for `quiet_s` is forgotten (at the expiry itself, it is): the
    scheduler's core and the dataplane's run book let a quiet run go by this one comparison."""
    return quiet_s >= expiry_s


def keeps_run_state(generative: bool, run_id: str) -> bool:
    """Whether a turn enters its run's state: single-pass turns keep none between calls, and
    decide's turns sent without a run have no run to keep it in."""
    return generative and run_id != ""


RUN_ID_HEADER = "x-luftpause-run-id"
CLASS_HEADER = "x-luftpause-class"
CALLER_HEADER = "x-luftpause-caller"
REPLICA_HEADER = "x-luftpause-replica"
# The W3C trace context of the span a request was sent from (luftpause/tracing.py).
TRACEPARENT_HEADER = "traceparent"

# The service classes, as the class header, spawn's serviceClass and the scheduler name them.
INTERACTIVE = "interactive"
BATCH = "batch"
CLASSES = (INTERACTIVE, BATCH)

# A caller identity longer than this is cut (fairness is counted per caller; the scheduler keeps
# one entry per caller).
CALLER_MAX_BYTES = 128


class Phase(StrEnum):
    """Where a run is between its turns; decides whether it is pinned to its replica."""

    GENERATING = "generating"  # a turn of it is placed and not yet reported done
    PAUSED = "paused"  # its last turn ended in tool calls: it will come back, soon
    IDLE = "idle"  # anything else: it may go anywhere next time


def phase_after_turn(paused_on_tool: bool, others_running: bool) -> Phase:
    """A run's phase once one of its turns ended: still generating while another of its turns
    runs (that one's end decides); paused when the turn completed in tool calls (`pauses_run`);
    idle otherwise: completed in text, failed, abandoned or expired (a failed turn never leaves
    its run paused, so a retry is admitted like any next turn)."""
    if others_running:
        return Phase.GENERATING
    return Phase.PAUSED if paused_on_tool else Phase.IDLE


def pauses_run(finish_reason: str, tool_call_ids: Collection[str]) -> bool:
    """Whether a completed reply leaves its run paused on a tool rather than idle."""
    # Some engines say "stop" while returning tool calls; the calls are what make the run come back.
    return finish_reason == "tool_calls" or bool(tool_call_ids)


class EndedRuns:
    """The ids of runs ended lately (a DELETE, the agent's end of its run), oldest first.

    A run's turns may go through several dataplane workers, each with a book of its own, and a
    DELETE reaches one of them. The one that took it keeps the id here and says so in its
    resyncs; the scheduler keeps the ids it hears of here too, tells every other stream, and
    leaves such a run out of any resync that still names it. An id is kept RUN_IDLE_EXPIRY_S,
    at most ENDED_RUNS_KEPT of them; a new turn of the same id takes it out (the id is reused).
    """

    def __init__(self, keep_s: float = RUN_IDLE_EXPIRY_S, most: int = ENDED_RUNS_KEPT) -> None:
        self._keep_s = keep_s
        self._most = most
        self._at: dict[str, float] = {}

    def add(self, run_id: str, now: float) -> bool:
        """Remembers `run_id` as ended at `now`; whether it was not already remembered (one that
        was keeps its first time, so that hearing of it again does not keep it longer)."""
        if run_id in self._at:
            return False
        self._at[run_id] = now
        while len(self._at) > self._most:
            del self._at[next(iter(self._at))]
        return True

    def discard(self, run_id: str) -> None:
        self._at.pop(run_id, None)

    def prune(self, now: float) -> None:
        while self._at:
            oldest = next(iter(self._at))
            if now - self._at[oldest] < self._keep_s:
                break
            del self._at[oldest]

    def __contains__(self, run_id: object) -> bool:
        return run_id in self._at

    def __iter__(self) -> Iterator[str]:
        return iter(self._at)

    def __len__(self) -> int:
        return len(self._at)
