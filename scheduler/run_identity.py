"""Which run a turn without a run header belongs to, for every dataplane sharing the scheduler.

An agent that cannot set `x-luftpause-run-id` is still recognised: each turn of a tool loop echoes
the tool_call_ids of the reply before it (in the assistant message that asked for the tools and in
each role "tool" result). The dataplane sends the ids a turn echoes, newest first, with its
admission (and a run id of its own choosing for the case that none is known); the ids of a reply's
tool calls come back in its turn's `completed` event. This lives in the scheduler, not in each
dataplane, because with several dataplanes behind one port a run's next turn may reach another
one than its last.

A run's ids are kept as long as the scheduler keeps the run: the host forgets them when the core
forgets the run (idle, or ended by its agent), so the idle expiry stays one rule, the core's. Only
the latest reply's ids are kept per run: they are what its next turn echoes first, and they are
what a resync brings back (`RunState.tool_call_ids`).
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class RunIdentity:
    """tool_call_id -> run, for the latest reply of each run the scheduler knows."""

    __slots__ = ("_run_of", "_ids_of")

    def __init__(self) -> None:
        self._run_of: dict[str, str] = {}
        self._ids_of: dict[str, tuple[str, ...]] = {}

    def __len__(self) -> int:
        return len(self._run_of)

    def remember(self, run_id: str, tool_call_ids: Iterable[str]) -> None:
        """The run's latest reply asked for these tools; its earlier replies' ids are let go."""
        ids = tuple(i for i in tool_call_ids if i)
        if not ids or not run_id:
            return
        self.forget(run_id)
        self._ids_of[run_id] = ids
        for tool_call_id in ids:
            self._run_of[tool_call_id] = run_id

    def run_of(self, echoed: Iterable[str]) -> str | None:
        """The run of the first echoed id that is known, or None."""
        for tool_call_id in echoed:
            run_id = self._run_of.get(tool_call_id)
            if run_id is not None:
                return run_id
        return None

    def forget(self, run_id: str) -> None:
        for tool_call_id in self._ids_of.pop(run_id, ()):
            if self._run_of.get(tool_call_id) == run_id:
                del self._run_of[tool_call_id]

    def keep_only(self, runs: Collection[str]) -> int:
        """Forgets the runs not in `runs` (the core's, after a resync rebuilt it); returns how many went."""
        gone = [run_id for run_id in self._ids_of if run_id not in runs]
        for run_id in gone:
            self.forget(run_id)
        return len(gone)
