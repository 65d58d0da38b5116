"""The run store: where a runtime keeps its runs between restarts, behind one interface.

Two stores implement it. The journal file, `runs.jsonl` in the state directory (journal.py), is
the embedded default: one runtime, no server. PostgreSQL (postgres_store.py), chosen by
`[runtime] store = "postgresql://..."`, is the store several runtimes share. Both hold the same
records (journal.py documents each one) and are read back by the same replay, so a runtime
restores the same runs from either, under the same rules.

`RunStore` writes the typed records through `append` and leaves the rest to each store: when a
record is durable, replay, compaction at start, and the archive that finished run trees move to.
`open_store` picks the store the config names; a store that cannot be opened is `StoreUnavailable`,
whose message names the setting and what to do.
"""

from __future__ import annotations

import socket
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from luftpause.config import RuntimeSettings
    from luftpause.runtime.journal import ReplayedRun
    from luftpause.runtime.journal_writer import JsonlWriter

FORMAT_VERSION = 1
# `[runtime] store` for the journal file: the default.
FILE_STORE = "file"

COUNTERS = (
    "toolCalls",
    "failedToolCalls",
    "turns",
    "promptTokens",
    "completionTokens",
    "turnSeconds",
    "toolSeconds",
)
# Counters that are durations, kept as floats; the others are whole numbers.
SECONDS_COUNTERS = ("turnSeconds", "toolSeconds")


class StoreUnavailable(RuntimeError):
    """The configured run store cannot be opened; the message names the setting and what to do."""


def rounded(counters: dict[str, float]) -> dict[str, float]:
    """Counters as written: durations to the millisecond."""
    return {k: round(v, 3) if k in SECONDS_COUNTERS else v for k, v in counters.items()}


class RunStore(ABC):
    """Where runs are journaled: records in order, durable before a step is acknowledged."""

    # Where the store is, for a person: a path, or a URL without its password.
    where: str
    # Whether several runtimes share the store: then each run is driven by one of them at a
    # time, under a lease (leases.py).
    shared = False

    def new_record(self, record_type: str, run: str, **fields: Any) -> dict[str, Any]:
        return {"v": FORMAT_VERSION, "type": record_type, "run": run, "at": round(time.time(), 3), **fields}

    @abstractmethod
    def append(self, record_type: str, run: str, **fields: Any) -> dict[str, Any]:
        """Queues one record, in order; `durable` says when the store has it."""

    @abstractmethod
    async def durable(self) -> None:
        """Returns once every record so far is stored; `JournalError` if it cannot be."""

    def holds(self, handle: str) -> bool:
        """Whether this runtime still drives the run, as far as the records written so far tell: a
        shared store refuses a `sent` record of a run whose lease another runtime has taken, and
        then the call must not leave. A store of one runtime holds every run."""
        return True

    async def durable_spawn(self) -> None:
        """`durable` for a spawn, which a store may refuse sooner than a step: a client waiting for
        its handle is told at once that no new run can be kept (postgres_store.py)."""
        await self.durable()

    @abstractmethod
    def replay(self, warn: bool = True) -> list[ReplayedRun]:
        """Every run the store knows, in spawn order (journal.py's replay rules)."""

    @abstractmethod
    def compact(
        self, retention_s: float, now: float | None = None, archive_retention_s: float | None = None
    ) -> int:
        """Drops what no restart reads again and moves old finished trees to the archive, at start;
        returns how many runs went to the archive (journal.py says which)."""

    @abstractmethod
    def archive(self, runs: list[ReplayedRun]) -> None:
        """Stores runs leaving memory in the archive, durably, before they are forgotten."""

    @abstractmethod
    def archived(self, handle: str) -> dict[str, Any] | None:
        """The archive's record of a run, or None."""

    @abstractmethod
    def archived_trees(self, handles: list[str]) -> dict[str, list[dict[str, Any]]]:
        """For each archived handle: its record, then those of the runs below it, parents first."""

    @abstractmethod
    def trim_archive(self, retention_s: float, now: float) -> int:
        """Drops archived trees whose last run ended more than `retention_s` ago; how many runs."""

    @abstractmethod
    def records(self) -> list[dict[str, Any]]:
        """Every record the store holds for runs not archived, in the order written."""

    @abstractmethod
    def close(self) -> None:
        """Writes what is queued and lets go of the store."""

    def take(self, handles: list[str]) -> set[str]:
        """Of these unfinished runs, those this runtime is to drive (at start); with a store of
        its own, every one."""
        return set(handles)

    def recent(self, since: float) -> list[str]:
        """Handles of the runs not archived that are running or ended at `since` (Unix time) or
        later, in spawn order, whichever runtime drives them; a store of one runtime holds all of
        its runs in memory and lists none here."""
        return []

    def spawned_record(self, handle: str) -> dict[str, Any] | None:
        """The spawned record of a run not archived, whichever runtime drives it; a store of one
        runtime holds every such run in memory and reads none here. Blocking."""
        return None

    def running_elsewhere(self, caller: str | None, at_most: int) -> int:
        """How many of `caller`'s runs are running on the other runtimes sharing the store, up to
        `at_most` (what `[runtime] max_running_per_caller` counts beside this runtime's own); a
        store of one runtime has no others. Blocking: call it off the event loop."""
        return 0

    def children(self, parents: list[str]) -> list[tuple[str, str]]:
        """(parent, child) for every run spawned under one of `parents`, running, ended or
        archived, whichever runtime drives it (a budget counts what its whole subtree spent); a
        store of one runtime holds every such run in memory and reads none here. Blocking."""
        return []

    def load(self, handles: list[str]) -> list[ReplayedRun]:
        """Runs not archived as the store has them now, for runs another runtime drives; a store
        of one runtime has none that it does not hold in memory."""
        return []

    # -- the records --------------------------------------------------------------------------------

    def spawned(
        self,
        run: str,
        spec: dict[str, Any],
        caller: str | None,
        owner: str | None = None,
        traceparent: str | None = None,
    ) -> None:
        extra: dict[str, str] = {"owner": owner} if owner is not None else {}
        if traceparent:
            extra["traceparent"] = traceparent
        self.append("spawned", run, spec=spec, caller=caller, **extra)

    def round(self, run: str, messages: list[dict[str, Any]], counters: dict[str, float]) -> None:
        self.append("round", run, messages=messages, **rounded(counters))

    def turn(self, run: str, message: dict[str, Any], counters: dict[str, float]) -> None:
        self.append("turn", run, message=message, **rounded(counters))

    def sent(self, run: str, call_id: str, tool: str, key: str, counters: dict[str, float]) -> None:
        self.append("sent", run, call=call_id, tool=tool, key=key, **rounded(counters))

    def call(self, run: str, message: dict[str, Any], counters: dict[str, float]) -> None:
        self.append("call", run, message=message, **rounded(counters))

    def asked(self, run: str, call_id: str, tool: str, deadline: float) -> None:
        self.append("asked", run, call=call_id, tool=tool, deadline=round(deadline, 3))

    def approval(self, run: str, call_id: str, tool: str, allow: bool) -> None:
        self.append("approval", run, call=call_id, tool=tool, allow=allow)

    def finished(
        self, run: str, status: str, result: str | None, error: str | None, counters: dict[str, float]
    ) -> None:
        self.append("finished", run, status=status, result=result, error=error, **rounded(counters))


def open_store(settings: RuntimeSettings, state_dir: Path, writer: JsonlWriter) -> RunStore:
    """The store `[runtime] store` names: the journal file in `state_dir` (through `writer`, shared
    with tasks.jsonl), or PostgreSQL, where this runtime is named by its host and state directory
    (one runtime at a time holds a state directory: state_lock.py), the same across its restarts.
    `StoreUnavailable` when it cannot be opened."""
    if settings.store == FILE_STORE:
        from luftpause.runtime.journal import Journal

        return Journal(state_dir, writer)
    try:
        from luftpause.runtime.postgres_store import PostgresStore
    except ImportError as e:
        raise StoreUnavailable(
            f"[runtime] store names PostgreSQL, but its driver is not installed ({e}): install "
            'luftpause[postgresql], or set store = "file"'
        ) from None
    owner = f"{socket.gethostname()}:{state_dir.resolve()}"
    return PostgresStore(settings.store, owner=owner, lease_s=settings.lease_s)
