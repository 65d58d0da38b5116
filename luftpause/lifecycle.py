"""The rules of a run's life that the scheduler, the dataplane and the runtime must agree on.

Each lives here once; the scheduler's core, the dataplane's run book (kept for resyncs) and the
runtime's turns read them from here, so a change to one is made in one place:

- when a model's reply pauses its run: it asked for tools, so the agent will come back with the
  results, to the replica that holds its prefix (`pauses_run`);
- how long a run with no turn is remembered before its next turn starts afresh
  (`RUN_IDLE_EXPIRY_S`);
- the headers that carry a turn's run, class and caller, the class names, and how long a caller
  may be (`CALLER_MAX_BYTES`).
"""

from __future__ import annotations

from collections.abc import Collection

# A run with no turn for this long is forgotten; its next turn starts without affinity.
RUN_IDLE_EXPIRY_S = 30 * 60.0

RUN_ID_HEADER = "x-luftpause-run-id"
CLASS_HEADER = "x-luftpause-class"
CALLER_HEADER = "x-luftpause-caller"
REPLICA_HEADER = "x-luftpause-replica"

# The service classes, as the class header, spawn's serviceClass and the scheduler name them.
INTERACTIVE = "interactive"
BATCH = "batch"
CLASSES = (INTERACTIVE, BATCH)

# A caller identity longer than this is cut (fairness is counted per caller; the scheduler keeps
# one entry per caller).
CALLER_MAX_BYTES = 128


def pauses_run(finish_reason: str, tool_call_ids: Collection[str]) -> bool:
    """Whether a completed reply leaves its run paused on a tool rather than idle."""
    # Some engines say "stop" while returning tool calls; the calls are what make the run come back.
    return finish_reason == "tool_calls" or bool(tool_call_ids)
