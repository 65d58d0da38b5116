"""Runs across restarts: rebuilt from the journal at start, and moved to the archive when old.

At start the journal is compacted (journal.py), then replayed: finished runs only answer, and
unfinished ones get their loop again, from their last journaled step. While the runtime runs,
every run tree whose runs all finished longer ago than the retention window leaves memory for
the archive, which answers for them from then on (`from_archive`): whole, with the runs below
it (so its children, its budget's use over its subtree and a tripped budget are as they were
in memory), read off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from luftpause.runtime.approvals import Approval
from luftpause.runtime.budgets import restore_tripped
from luftpause.runtime.journal import ReplayedRun, new_counters, read_counters
from luftpause.runtime.run import ENDED, Run
from luftpause.runtime.spec import RunSpec, initial_messages
from luftpause.runtime.tool_calls import calls_in

if TYPE_CHECKING:
    from luftpause.runtime.runs import Runs

log = logging.getLogger(__name__)


def restore(runs: Runs, retention_s: float | None = None, archive_retention_s: float | None = None) -> None:
    """Rebuilds runs from the journal; unfinished ones resume from their last journaled step.
    With `retention_s`, the journal is compacted first (journal.py): finished trees older than
    that go to the archive and are not loaded; with `archive_retention_s`, archived trees older
    than that are trimmed from the archive first. With a store that runtimes share, only the
    unfinished runs whose leases this runtime takes are loaded and resumed (leases.py); the
    others are driven elsewhere, and the store answers for them."""
    journal = runs.journal
    if retention_s is not None:
        journal.compact(retention_s, archive_retention_s=archive_retention_s)
    # Compaction has warned of every record it could not read; the replay says it once more only without it.
    replayed = journal.replay(warn=retention_s is None)
    taken = journal.take([r.handle for r in replayed if r.finished is None])
    for run in filter(None, (rebuild(r) for r in replayed if r.finished is not None or r.handle in taken)):
        runs.add(run)
    every = list(runs)
    resumed = _resume(runs, every)
    if every:
        log.info("journal: %d runs restored, %d of them resumed", len(every), resumed)


async def restore_at_start(
    runs: Runs, retention_s: float | None = None, archive_retention_s: float | None = None
) -> None:
    """A runtime's start: `restore`, and with a store that runtimes share, each run resumed here
    whose parent another runtime drives linked under that parent as the store has it, so that the
    parent's end or cancel, or a budget over both, reaches it (`Runs.link_to_parents_elsewhere`;
    a parent that ended meanwhile ends it)."""
    restore(runs, retention_s, archive_retention_s)
    if runs.journal.shared:
        await runs.link_to_parents_elsewhere()


def take_over(runs: Runs, replayed: list[ReplayedRun]) -> list[Run]:
    """Resumes runs whose leases this runtime took from a runtime that stopped renewing them
    (leases.py), as a restart resumes its own; a run this runtime showed as driven elsewhere
    is resumed in the same object, so that whoever awaits it here sees it end."""
    taken = []
    for r in replayed:
        run = rebuild(r)
        if run is None or not run.running or r.handle in {t.handle for t in runs if t.running}:
            continue
        shown = runs.foreign.pop(run.handle, None)
        if shown is not None:
            for name in RESUMED_FIELDS:
                setattr(shown, name, getattr(run, name))
            run = shown
        runs.add(run)
        taken.append(run)
    _resume(runs, taken)
    return taken


# What a run resumed here takes from its replay when an object for it is shown already.
RESUMED_FIELDS = ("spec", "caller", "created_at", "messages", "counters", "pending_turn", "pending_results",
                  "sent_calls", "decisions", "approval_deadlines", "owner", "traceparent", "approvals")  # fmt: skip


def _resume(runs: Runs, restored: list[Run]) -> int:
    """Restores the tripped budgets of `restored` and starts the loops of those still running."""
    for run in restored:
        restore_tripped(run)
    resumed = 0
    for run in restored:
        if run.running:
            resumed += 1
            log.info(
                "run %s: resuming after %d journaled tool rounds%s",
                run.handle,
                sum(1 for m in run.messages if m.get("role") == "assistant"),
                " and a round cut short" if run.pending_turn is not None else "",
            )
            runs.start(run)
    return resumed


def rebuild(replayed: ReplayedRun) -> Run | None:
    """The run a replay tells of, as it was at its last journaled step; None when its spec
    cannot be read (with a warning)."""
    try:
        spec = RunSpec.model_validate(replayed.spec)
    except ValueError as e:
        log.warning("run %s: journaled spec is unreadable (%s); not restored", replayed.handle, e)
        return None
    messages = initial_messages(spec)
    for round_messages in replayed.rounds:
        messages.extend(round_messages)
    run = Run(
        handle=replayed.handle,
        spec=spec,
        caller=replayed.caller,
        created_at=replayed.spawned_at,
        messages=messages,
        counters={**new_counters(), **replayed.counters},
        pending_turn=replayed.pending_turn,
        pending_results=list(replayed.pending_results),
        sent_calls=dict(replayed.sent),
        decisions=dict(replayed.decisions),
        approval_deadlines=dict(replayed.deadlines),
        owner=replayed.owner,
        restored=True,
        traceparent=replayed.traceparent,
    )
    if replayed.finished is not None:
        ended(run, replayed.finished)
    return run


def waiting_approvals(replayed: ReplayedRun) -> dict[str, Approval]:
    """The tool calls of a run's round cut short that were asked about and not decided: what a
    runtime that does not drive the run shows as waiting, and answers with approve. On the event
    loop (an Approval holds a future)."""
    waiting: dict[str, Approval] = {}
    for call in calls_in(replayed.pending_turn or {}):
        if call.id in replayed.deadlines and call.id not in replayed.decisions:
            try:
                arguments = json.loads(call.arguments or "{}")
            except json.JSONDecodeError:
                arguments = {"arguments": call.arguments}
            waiting[call.id] = Approval(call_id=call.id, tool=call.name, arguments=arguments)
    return waiting


def ended(run: Run, finished: dict[str, Any]) -> None:
    """Gives `run` the end its `finished` record tells of (no journaling, no waking)."""
    status = finished.get("status")
    run.status = status if status in ("finished", "failed", "cancelled") else "failed"
    run.result = finished.get("result")
    run.error = finished.get("error")
    run.finished_at = _number(finished.get("at"))
    run.done = ENDED


async def evict(runs: Runs, retention_s: float, now: float | None = None) -> int:
    """Moves every run tree whose runs all finished more than `retention_s` ago from memory to
    the archive (written off the event loop, durably, first), which answers for them from
    then on; returns how many runs left. Their records leave runs.jsonl at the next start."""
    now = time.time() if now is None else now
    leaving: list[Run] = []
    for root in runs.roots():
        tree = list(root.subtree())
        if all(
            not r.running and r.finished_at is not None and now - r.finished_at > retention_s for r in tree
        ):
            leaving.extend(tree)
    if not leaving:
        return 0
    await asyncio.to_thread(runs.journal.archive, [_archived(r) for r in leaving])
    for r in leaving:
        runs.forget(r)
    log.info("%d finished runs older than %.0f s moved to the archive", len(leaving), retention_s)
    return len(leaving)


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _archived(run: Run) -> ReplayedRun:
    """A finished run as the archive records it."""
    return ReplayedRun(
        handle=run.handle,
        spec=run.spec.model_dump(),
        caller=run.caller,
        spawned_at=run.created_at,
        owner=run.owner,
        counters=dict(run.counters),
        finished={"at": run.finished_at, "status": run.status, "result": run.result, "error": run.error},
        budget_exceeded=run.budget_exceeded,
    )


def from_archive(record: dict[str, Any], below: list[dict[str, Any]] | None = None) -> Run:
    """A finished run read back from its archive record (its conversation is not kept), with the
    runs of `below` (the archive records of its descendants, parents first) linked under it."""
    run = _archived_run(record)
    held = {run.handle: run}
    for r in below or []:
        child = _archived_run(r)
        parent = held.get(child.spec.parent or "")
        if parent is None or child.handle in held:
            continue
        child.link_under(parent)
        held[child.handle] = child
    return run


def _archived_run(record: dict[str, Any]) -> Run:
    try:
        spec = RunSpec.model_validate(record.get("spec") or {})
    except ValueError:
        spec = RunSpec(task="(unreadable in the archive)", model="")
    status = record.get("status")
    run = Run(
        handle=str(record["run"]),
        spec=spec,
        caller=record.get("caller") if isinstance(record.get("caller"), str) else None,
        created_at=_number(record.get("spawnedAt")) or 0.0,
        messages=[],
        counters={**new_counters(), **read_counters(record)},
        status=status if status in ("finished", "failed", "cancelled") else "failed",
        result=record.get("result"),
        error=record.get("error"),
        owner=record.get("owner") if isinstance(record.get("owner"), str) else None,
        restored=True,
        finished_at=_number(record.get("at")),
        done=ENDED,
    )
    exceeded = record.get("budgetExceeded")
    if isinstance(exceeded, str):
        run.budget_exceeded = exceeded
    elif "budgetExceeded" not in record:
        restore_tripped(run)  # an older archive: read from the error, as a restart does
    return run
