"""Runs: the registry of every run this runtime knows, and the journaled steps of a run's life.

A run is created by spawn (journaled, then its loop starts as an asyncio task) or restored from
the journal at startup (restore.py). It ends exactly once, as finished, failed or cancelled: the
end is journaled first, then announced to whoever awaits it (waiting.py). Stopping the runtime is
not an end: a run interrupted by shutdown stays unfinished in the journal and resumes on the
next start.

With a store that runtimes share (leases.py), the registry holds the runs this runtime drives
and those it has ended; a run driven by another runtime is read from the store when asked for
and shown (`foreign`) until it ends, and one whose lease was lost is let go.

Cancelling a run cancels its running descendants, and a budget set on a run caps its whole
subtree (budgets.py): a spent budget cancels the subtree of the run that set it. A run whose
parent another runtime drives is linked to the parent as shown (`foreign`): the parent's end,
read from the store, cancels it there too, and the parent's budget caps it; the runs another
runtime spawned in a tree under a budget are linked into it as shown at each lease keeper's
round (`link_children_elsewhere`), so the budget counts what they spent.

Spawn is bounded: a run tree at most `[runtime] max_depth` runs deep (16 by default), and at most
`[runtime] max_running_per_caller` runs running at once for one caller (256), counted on every
runtime sharing the store; past either, spawn is refused with a message naming the limit and its
key.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any

from luftpause.config import RuntimeSettings
from luftpause.runtime import spans
from luftpause.runtime.approvals import Approval
from luftpause.runtime.archive import parent_of
from luftpause.runtime.budgets import spent_budget, tripped_above, tripped_kind
from luftpause.runtime.journal import ReplayedRun, read_counters
from luftpause.runtime.journal_writer import JournalError
from luftpause.runtime.metrics import RuntimeMetrics
from luftpause.runtime.restore import from_archive, rebuild, waiting_approvals
from luftpause.runtime.run import ENDED, Run, RunStatus, UnknownRun, new_handle
from luftpause.runtime.spec import RunSpec, initial_messages
from luftpause.runtime.store import RunStore
from luftpause.runtime.waiting import AwaitMode, Changes, waited_enough

log = logging.getLogger(__name__)


class SpawnRefused(ValueError):
    """spawn cannot start this run; the message says why."""


# What the registry refuses a request with; each says why in its message (a NotYours from
# callers.py is an UnknownRun).
REFUSALS = (UnknownRun, SpawnRefused, JournalError)


# What drives a run once it exists: the sub-agent loop (see agent.py), given the registry to
# journal its rounds and its end through.
Driver = Callable[["Runs", Run], Awaitable[None]]
# What tells the dataplane a run is over.
EndHook = Callable[[str], Awaitable[None]]


class Runs:
    """Every run this runtime knows, live or restored from the journal."""

    def __init__(
        self,
        journal: RunStore,
        driver: Driver,
        on_end: EndHook,
        metrics: RuntimeMetrics | None = None,
        settings: RuntimeSettings | None = None,
    ) -> None:
        self.journal = journal
        self.settings = settings or RuntimeSettings()
        self.metrics = metrics or RuntimeMetrics()
        self._driver = driver
        self._on_end = on_end
        self._runs: dict[str, Run] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._timers: dict[str, asyncio.Task[None]] = {}
        # Runs running now, by caller: what `[runtime] max_running_per_caller` bounds.
        self._running: collections.Counter[str | None] = collections.Counter()
        self.changes = Changes(self._in_background)
        # With a store runtimes share: runs another runtime drives that this one was asked about,
        # as the store last showed them (kept up to date by leases.py until they end).
        self.foreign: dict[str, Run] = {}

    def __iter__(self) -> Iterator[Run]:
        return iter(list(self._runs.values()))

    def get(self, handle: str) -> Run:
        """The run, live or restored; one that left memory for the archive is read from there
        (blocking: on the event loop, `find` it instead)."""
        run = self._runs.get(handle)
        if run is not None:
            return run
        archived = self._archived([handle])
        if handle not in archived:
            raise UnknownRun(handle)
        return archived[handle]

    async def find(self, handles: list[str]) -> list[Run]:
        """The runs, each once, in the order asked; those that left memory are read from the
        archive in one go, off the event loop, and (with a shared store) those another runtime
        drives from the store. UnknownRun for the first handle nobody knows."""
        handles = list(dict.fromkeys(handles))
        known = await self._known(handles)
        for h in handles:
            if h not in known:
                raise UnknownRun(h)
        return [known[h] for h in handles]

    async def _known(self, handles: list[str]) -> dict[str, Run]:
        """Of these handles, the runs known here, in the archive, or (with a shared store) driven
        by another runtime, by handle."""
        missing = [h for h in handles if h not in self._runs and h not in self.foreign]
        archived, elsewhere = await asyncio.to_thread(self._stored, missing) if missing else ({}, [])
        shown = {run.handle: run for run in map(self._shown, elsewhere) if run is not None}
        known = {}
        for h in handles:
            run = self._runs.get(h) or self.foreign.get(h) or archived.get(h) or shown.get(h)
            if run is not None:
                known[h] = run
        return known

    def _stored(self, handles: list[str]) -> tuple[dict[str, Run], list[ReplayedRun]]:
        """Archived runs by handle, and the rest as the store has them (driven elsewhere)."""
        archived = self._archived(handles)
        return archived, self.journal.load([h for h in handles if h not in archived])

    def _archived(self, handles: list[str]) -> dict[str, Run]:
        """Archived runs by handle, each whole: with the runs below it (archive.py, restore.py)."""
        trees = self.journal.archived_trees(handles)
        return {h: from_archive(tree[0], tree[1:]) for h, tree in trees.items()}

    # -- runs driven by another runtime (a shared store) --------------------------------------------

    def _shown(self, replayed: ReplayedRun) -> Run | None:
        """A run another runtime drives, as the store has it: held in `foreign` while it runs,
        with its tool calls waiting for approval, so that status shows them and approve answers."""
        run = rebuild(replayed)
        if run is None:
            return None
        if run.running:
            run.approvals = waiting_approvals(replayed)
            self.foreign[run.handle] = run
        return run

    def stored_news(self, replayed: list[ReplayedRun]) -> None:
        """What the store says now of runs another runtime may have acted on: one that ended
        there ends here (its loop here, if any, stops, and its waiters wake), an approval decided
        there goes on here, and a run shown as driven elsewhere takes its counters."""
        for r in replayed:
            run = self._runs.get(r.handle) or self.foreign.get(r.handle)
            if run is None or not run.running:
                continue
            if r.finished is not None:
                self._ended_elsewhere(run, r.finished)
            elif r.handle in self.foreign:
                run.counters.update(r.counters)
                run.decisions, run.approval_deadlines = dict(r.decisions), dict(r.deadlines)
                waiting = waiting_approvals(r)
                run.approvals = {k: run.approvals.get(k) or a for k, a in waiting.items()}
                self.changes.pulse()
            else:
                for call_id, allow in r.decisions.items():
                    approval = run.approvals.get(call_id)
                    if approval is not None and not approval.decision.done():
                        run.decisions[call_id] = allow
                        run.approvals.pop(call_id, None)
                        approval.decision.set_result(allow)
                        self.changes.pulse()

    def _ended_elsewhere(self, run: Run, finished: dict[str, Any]) -> None:
        status = finished.get("status")
        run.counters.update(read_counters(finished))
        self.finish(
            run,
            status if status in ("finished", "failed", "cancelled") else "failed",
            finished.get("result"),
            finished.get("error"),
            elsewhere=finished,
        )
        self.foreign.pop(run.handle, None)
        if run.task is not None and run.task is not asyncio.current_task() and not run.task.done():
            run.task.cancel()
        for child in list(run.children):
            self._ended_above(child, run)

    async def link_to_parents_elsewhere(self) -> None:
        """Links each running run whose parent another runtime drives to that parent as the store
        has it, as a spawn under it does (`add`): after a restart or a takeover. A parent cancelled
        meanwhile cancels it."""
        orphans: dict[str, list[Run]] = collections.defaultdict(list)
        for run in list(self._runs.values()):
            above = run.spec.parent
            if not run.running or above is None or above == run.handle:
                continue
            if run.parent is not None:
                # Its parent's end was restored with it (another runtime's, read from the store).
                self._ended_above(run, run.parent)
            elif above not in self._runs:
                orphans[above].append(run)
        for handle, children in orphans.items():
            try:
                (parent,) = await self.find([handle])
            except UnknownRun:
                continue
            for child in children:
                if parent.running:
                    child.link_under(parent)
                else:
                    self._ended_above(child, parent)

    async def link_children_elsewhere(self) -> None:
        """Links into every run tree under a budget the runs spawned in it that another runtime
        drives or drove (ended ones too: what they spent counts), as the store has them, down to
        the last level: a budget counts its whole subtree on every runtime (budgets.py). The
        lease keeper calls this each round (leases.py), so what runs elsewhere spent since the
        last round is counted at the next; their end, or a trip here, cancels them as any run of
        the tree. A store of one runtime holds every run here and finds none."""
        if not self.journal.shared:
            return
        members: dict[str, Run] = {}
        for owner in (*self._runs.values(), *self.foreign.values()):
            tree = list(owner.subtree()) if owner.spec.limits() else []
            if any(r.running for r in tree):
                members.update((r.handle, r) for r in tree)
        parents = members
        while parents:
            pairs = await asyncio.to_thread(self.journal.children, list(parents))
            unlinked: dict[str, Run] = {}
            for above, handle in pairs:
                parent = parents.get(above)
                if parent is not None and handle not in members:
                    unlinked.setdefault(handle, parent)
            known = await self._known(list(unlinked))
            parents = {}
            for handle, run in known.items():
                parent = unlinked[handle]
                if run.parent is None and run is not parent:
                    run.link_under(parent)
                    members[handle] = parents[handle] = run

    def _ended_above(self, run: Run, parent: Run) -> None:
        """Cancels `run`'s subtree when its parent, ended elsewhere, was cancelled: a cancel ends
        the subtree, as on one runtime; a parent that finished or failed leaves it running."""
        if parent.status == "cancelled":
            self._cancel_subtree(run, f"its parent {parent.handle} ended (cancelled)")

    def let_go(self, handle: str) -> None:
        """This runtime's lease on a run it drives was lost (it could not renew it in time, and
        another runtime took it, or the run was ended elsewhere): its loop here stops without
        ending it, and it is shown as driven elsewhere from then on."""
        run = self._runs.get(handle)
        if run is None or not run.running:
            return
        log.warning("run %s: this runtime's lease on it is lost; its loop here stops", handle)
        self.forget(run)
        if run.parent is not None and run in run.parent.children:
            run.parent.children.remove(run)
            run.parent = None
        if run.task is not None and not run.task.done():
            run.task.cancel()
        self.foreign[handle] = run

    def held(self, handle: str) -> Run | None:
        """The run if this runtime holds it in memory (not archived, not shown as driven elsewhere)."""
        return self._runs.get(handle)

    def roots(self) -> list[Run]:
        return [r for r in self._runs.values() if r.parent is None]

    # -- spawning -------------------------------------------------------------------------------

    def spawn(
        self,
        spec: RunSpec,
        caller: str | None,
        owner: str | None = None,
        parent: Run | None = None,
        elsewhere: int = 0,
    ) -> Run:
        """Journals the run, then starts its loop; returns once the journal has it. `parent`: the
        run `spec.parent` names, when the caller has looked it up already; `elsewhere`: the
        caller's runs running on other runtimes sharing the store. The tree's depth and
        `elsewhere` are read by `spawn_durably`, off the event loop."""
        if parent is None and spec.parent is not None:
            parent = self.get(spec.parent)
        if parent is not None:
            tripped = tripped_above(parent)
            if tripped is not None:
                raise SpawnRefused(
                    f"run {tripped.handle} is over its budget ({tripped.budget_exceeded}); "
                    "nothing more can be spawned under it"
                )
        limit = self.settings.max_running_per_caller
        running = self._running[caller] + elsewhere
        if running >= limit:
            where = f" ({elsewhere} of them on other runtimes sharing the run store)" if elsewhere else ""
            raise SpawnRefused(
                f"caller {caller!r} has {running} runs running{where}, the most one caller may "
                f"([runtime] max_running_per_caller = {limit}): await or cancel some of them before "
                "spawning more, or raise max_running_per_caller in the config"
            )
        handle = new_handle()
        traceparent = spans.parent_of_new_run(parent)
        self.journal.spawned(handle, spec.model_dump(), caller, owner, traceparent)
        run = Run(
            handle=handle,
            spec=spec,
            caller=caller,
            created_at=time.time(),
            messages=initial_messages(spec),
            owner=owner,
            traceparent=traceparent,
        )
        self.add(run)
        self.start(run)
        return run

    async def _check_depth(self, parent: Run) -> None:
        """SpawnRefused when a child of `parent` would be deeper than `[runtime] max_depth`."""
        limit = self.settings.max_depth
        depth, run = 1, parent  # `parent`'s depth, the root counting as one
        while depth < limit and run.parent is not None:
            depth, run = depth + 1, run.parent
        above = run.spec.parent
        if depth < limit and above is not None and above != run.handle:
            # Not linked in memory (an archived run, one above it, or with a shared store one
            # another runtime drives): the store knows the rest.
            depth = await asyncio.to_thread(self._stored_depth, above, depth, limit)
        if depth >= limit:
            raise SpawnRefused(
                f"run {parent.handle} is {limit} runs deep (its root counting as one), and a run tree may "
                f"be at most {limit} deep ([runtime] max_depth = {limit}): spawn this run under a run "
                "nearer the root, or raise max_depth in the config"
            )

    def _stored_depth(self, handle: str, depth: int, limit: int) -> int:
        """`depth` plus the runs from `handle` up to the root that the store has (archived, or
        with a shared store not yet archived), counted at most to `limit` (blocking: a read a run)."""
        while depth < limit:
            record = self.journal.archived(handle) or self.journal.spawned_record(handle)
            if record is None:
                break
            depth += 1
            above = parent_of(record)
            if above is None:
                break
            handle = above
        return depth

    async def spawn_durably(
        self, spec: RunSpec, caller: str | None, owner: str | None = None, parent: Run | None = None
    ) -> Run:
        """`spawn`, once the tree's depth allows it, acknowledged only once the journal has the
        run on disk. When it cannot be written the run is taken back (its loop stopped,
        forgotten) and JournalError raised: a run the journal does not have must not go on in
        memory."""
        if parent is not None:
            await self._check_depth(parent)
        elsewhere = 0
        if self.journal.shared:
            limit = self.settings.max_running_per_caller
            elsewhere = await asyncio.to_thread(self.journal.running_elsewhere, caller, limit)
        run = self.spawn(spec, caller, owner, parent, elsewhere)
        try:
            await self.journal.durable_spawn()
        except JournalError as e:
            self._take_back(run, e)
            raise
        return run

    def _take_back(self, run: Run, why: JournalError) -> None:
        if run.task is not None and not run.task.done():
            run.task.cancel()
        if run.parent is not None:
            run.parent.children.remove(run)
        self.forget(run)
        # Its spawned record may still reach the store later (a database back after the refusal,
        # a disk slow rather than failed): its end goes after it, so that nothing resumes a run
        # its client was told was refused. A writer that failed for good takes neither.
        with contextlib.suppress(JournalError):
            self.journal.finished(run.handle, "failed", None, f"spawn refused: {why}", dict(run.counters))

    def forget(self, run: Run) -> None:
        """The run leaves memory (taken back, or moved to the archive), with its budget's timer."""
        if self._runs.pop(run.handle, None) is not None and run.running:
            self._ran(run)
        self._stop_timer(run.handle)

    def _ran(self, run: Run) -> None:
        """One run of its caller's fewer running."""
        self._running[run.caller] -= 1
        if self._running[run.caller] <= 0:
            del self._running[run.caller]

    def _stop_timer(self, handle: str) -> None:
        timer = self._timers.pop(handle, None)
        if timer is not None and not timer.done() and timer is not asyncio.current_task():
            timer.cancel()

    def add(self, run: Run) -> None:
        """Holds the run (spawned or restored), linked to its parent, with its seconds budget's timer."""
        self._runs[run.handle] = run
        if run.running:
            self._running[run.caller] += 1
        if run.spec.parent is not None:
            # A parent another runtime drives is linked as shown here (`foreign`): its end, read
            # from the store, cancels this run (`_ended_elsewhere`), and its budget caps it.
            parent = self._runs.get(run.spec.parent) or self.foreign.get(run.spec.parent)
            if parent is run:
                # Only a damaged journal names a run its own parent; linking it would make its
                # subtree endless.
                log.warning("run %s names itself as its parent; it stands alone", run.handle)
            elif parent is not None:
                run.link_under(parent)
        if run.spec.budgetSeconds is not None and run.running:
            timer = asyncio.create_task(self._seconds_timer(run), name=f"budget:{run.handle}")
            self._timers[run.handle] = timer
            timer.add_done_callback(
                lambda t: self._timers.pop(run.handle, None) if self._timers.get(run.handle) is t else None
            )

    def start(self, run: Run) -> None:
        """Starts the run's loop as a task of its own; a run that has ended lets go of it once it
        has stopped (a loop stopped by shutdown stays, its run unfinished)."""
        spans.start_run(run)
        task = asyncio.create_task(self._drive(run), name=f"run:{run.handle}")
        run.task = task

        def stopped(t: asyncio.Task[None]) -> None:
            if run.task is t and not run.running:
                run.task = None

        task.add_done_callback(stopped)

    async def _drive(self, run: Run) -> None:
        try:
            with spans.running(run):
                await self._drive_loop(run)
        finally:
            spans.end_run(run)
        await self._on_end(run.handle)

    async def _drive_loop(self, run: Run) -> None:
        try:
            await self._driver(self, run)
        except asyncio.CancelledError:
            # Either a cancel (which ends the run itself) or shutdown (which must not end it).
            raise
        except JournalError as e:
            # A step could not be journaled (a full or failing disk): the run stops there, and
            # whoever awaits it is told why. The journal still has it unfinished, so once the
            # disk is fixed the next start resumes it from its last journaled step.
            self.finish(run, "failed", error=f"journal: {e}")
        except Exception as e:
            log.exception("run %s: the loop crashed", run.handle)
            self.finish(run, "failed", error=f"internal error in the runtime: {type(e).__name__}: {e}")
        if run.running:
            self.finish(
                run, "failed", error="internal error in the runtime: the loop ended without an answer"
            )

    # -- steps of a run ---------------------------------------------------------------------------

    def record_turn(self, run: Run, message: dict[str, Any]) -> None:
        """Journals a reply that asks for tools, before any of its calls runs."""
        if run.running:
            self.journal.turn(run.handle, message, dict(run.counters))
            run.pending_turn, run.pending_results, run.sent_calls = message, [], {}

    def record_sent(self, run: Run, call_id: str, tool: str, key: str) -> None:
        """Journals that a call of the pending turn goes to its tool server now, under `key`."""
        if run.running:
            self.journal.sent(run.handle, call_id, tool, key, dict(run.counters))
            run.sent_calls[call_id] = key

    def record_call(self, run: Run, message: dict[str, Any]) -> None:
        """Journals one answered call of the pending turn."""
        if run.running:
            self.journal.call(run.handle, message, dict(run.counters))
            run.pending_results.append(message)

    def record_round(self, run: Run, messages: list[dict[str, Any]]) -> None:
        """Journals one complete tool round and adds it to the run's conversation."""
        if not run.running:
            return
        self.journal.round(run.handle, messages, dict(run.counters))
        run.messages.extend(messages)
        run.pending_turn, run.pending_results, run.sent_calls = None, [], {}

    def finish(
        self,
        run: Run,
        status: RunStatus,
        result: str | None = None,
        error: str | None = None,
        elsewhere: dict[str, Any] | None = None,
    ) -> bool:
        """Ends the run once (journal first, then waiters); False when it had already ended.
        `elsewhere`: the `finished` record another runtime journaled (nothing is journaled)."""
        if not run.running:
            return False
        try:
            if elsewhere is None:
                self.journal.finished(run.handle, status, result, error, dict(run.counters))
        except JournalError as e:
            # Its end cannot be journaled: it ends here all the same, whoever awaits it is told
            # of the journal's failure, and the next start resumes it.
            log.error("run %s: its end is not journaled (%s); it resumes on the next start", run.handle, e)
        run.status, run.result, run.error = status, result, error
        run.finished_at = time.time() if elsewhere is None else float(elsewhere.get("at") or time.time())
        if run.handle in self._runs:
            self._ran(run)
        # Its conversation is never read again (await answers with the result; a restart replays
        # only unfinished runs): a finished run kept for the retention window costs little.
        run.messages, run.pending_turn, run.pending_results, run.sent_calls = [], None, [], {}
        for approval in run.approvals.values():
            approval.abandon()
        run.approvals.clear()
        run.decisions.clear()
        run.approval_deadlines.clear()
        run.done.set()
        run.done = ENDED
        self.foreign.pop(run.handle, None)
        # A seconds budget whose whole subtree has ended has nothing left to cap.
        for owner in run.ancestors():
            if owner.handle in self._timers and not any(r.running for r in owner.subtree()):
                self._stop_timer(owner.handle)
        self.changes.pulse()
        log.info(
            "run %s %s after %d turns, %d tool calls%s",
            run.handle,
            status,
            run.counters["turns"],
            run.counters["toolCalls"],
            f": {error}" if error and status != "finished" else "",
        )
        return True

    # -- cancelling -------------------------------------------------------------------------------

    async def cancel(self, handle: str, reason: str = "cancelled by the client") -> Run:
        """Cancels a running run and its running descendants (each journaled as cancelled)."""
        (run,) = await self.find([handle])
        ended = self._cancel_subtree(run, reason)
        tasks = [r.task for r in ended if r.task is not None and not r.task.done()]
        await self.journal.durable()
        if tasks:
            # Let their turns' connections close first, so the dataplane sees the abandoned turns
            # before it hears that the runs ended.
            await asyncio.wait(tasks, timeout=5)
        for r in ended:
            self._in_background(self._on_end(r.handle))
        return run

    def _cancel_subtree(self, run: Run, reason: str) -> list[Run]:
        """Ends every running run of the subtree as cancelled and stops its loop; returns them."""
        current = asyncio.current_task()
        ended = []
        for r in run.subtree():
            if self.finish(r, "cancelled", error=reason):
                ended.append(r)
                if r.task is not None and r.task is not current and not r.task.done():
                    r.task.cancel()
        return ended

    def trip_budget(self, owner: Run, message: str) -> None:
        """Cancels the budget owner's subtree with `budget exceeded: ...`; the calling loop (if it
        is one of them) sees its run ended and stops by itself."""
        if owner.budget_exceeded is None:
            owner.budget_exceeded = message
            self.metrics.budget_tripped(tripped_kind(message))
            log.warning("run %s: %s; cancelling its subtree", owner.handle, message)
        current = asyncio.current_task()
        for r in self._cancel_subtree(owner, message):
            if r.task is current:
                continue  # its own _drive reports the end once the loop returns
            self._in_background(self._end_after(r))

    async def _end_after(self, run: Run) -> None:
        if run.task is not None and not run.task.done():
            await asyncio.wait([run.task], timeout=5)
        await self._on_end(run.handle)

    # -- budgets ----------------------------------------------------------------------------------

    def check_budgets(self, run: Run, calling_tool: bool = False) -> bool:
        """Trips the first budget above (or on) `run` that is spent (budgets.py); True when the
        run may go on."""
        spent = spent_budget(run, calling_tool)
        if spent is not None:
            self.trip_budget(*spent)
            return False
        return run.running

    async def _seconds_timer(self, owner: Run) -> None:
        # An idle subtree (every run waiting on a tool, or on approval) must trip on time too.
        assert owner.spec.budgetSeconds is not None
        delay = owner.created_at + owner.spec.budgetSeconds - time.time()
        if delay > 0:
            await asyncio.sleep(delay)
        if any(r.running for r in owner.subtree()):
            self.check_budgets(owner)

    # -- waiting ----------------------------------------------------------------------------------

    def _in_background(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait(
        self,
        handles: list[str],
        mode: AwaitMode,
        timeout_s: float,
        stop_on_approval: Callable[[Run, Approval], bool] | None = None,
    ) -> tuple[list[Run], bool]:
        """Waits until all (or any) of the runs have ended, or the timeout; returns them and timedOut.

        With `stop_on_approval`, also returns (not timed out) as soon as one of the runs has a
        pending approval for which it answers True, so the caller can ask the user.
        """
        return await self.wait_on(await self.find(handles), mode, timeout_s, stop_on_approval)

    async def wait_on(
        self,
        runs: list[Run],
        mode: AwaitMode,
        timeout_s: float,
        stop_on_approval: Callable[[Run, Approval], bool] | None = None,
    ) -> tuple[list[Run], bool]:
        """`wait` on runs already found."""
        timed_out = await self.changes.until(lambda: waited_enough(runs, mode, stop_on_approval), timeout_s)
        return runs, timed_out

    # -- stopping ---------------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stops every loop without ending its run, so that the next start resumes it."""
        tasks = [r.task for r in self._runs.values() if r.task is not None and not r.task.done()]
        tasks.extend(self._background)
        tasks.extend(t for t in self._timers.values() if not t.done())
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
        with contextlib.suppress(JournalError):
            await self.journal.durable()
