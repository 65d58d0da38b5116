"""The rules of a run's life that the scheduler, the dataplane and the runtime must agree on.

Each lives here once; the scheduler's core, the dataplane's run book (kept for resyncs) and the
runtime's turns read them from here, so a change to one is made in one place:

- when a model's reply pauses its run: it asked for tools, so the agent will come back with the
  results, to the replica that holds its prefix (`pauses_run`), and which phase a run is in
  once one of its turns has ended (`phase_after_turn`);
- how long a run with no turn is remembered before its next turn starts afresh
  (`RUN_IDLE_EXPIRY_S`);
- the headers that carry a turn's run, class and caller, the class names, and how long a caller
  may be (`CALLER_MAX_BYTES`).
"""

from __future__ import annotations

from collections.abc import Collection
from enum import StrEnum

# A run with no turn for this long is forgotten; its next turn starts without affinity.
RUN_IDLE_EXPIRY_S = 30 * 60.0

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
