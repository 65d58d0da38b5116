"""Runs: what a spawned sub-agent is, the run tree, and waiting on runs.

A run is created by spawn (journaled, then its loop starts as an asyncio task) or restored from
the journal at startup (finished runs only answer; unfinished ones get their loop again, from
their last journaled step). It ends exactly once, as finished, failed or cancelled: the end is
journaled first, then announced to whoever awaits it. Stopping the runtime is not an end: a run
interrupted by shutdown stays unfinished in the journal and resumes on the next start.

Runs form a tree: spawn(parent) makes a run a child of another. Cancelling a run cancels its
running descendants, and a budget set on a run caps its whole subtree (see budgets.py).
A run whose tool call waits for the user's approval shows as AwaitingApproval (see approvals.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from luftpause.runtime.approvals import Approval
from luftpause.runtime.budgets import BUDGET_KINDS, BudgetView, exceeded_message, subtree_used
from luftpause.runtime.journal import Journal, ReplayedRun, new_counters, read_counters
from luftpause.runtime.journal_writer import JournalError

log = logging.getLogger(__name__)

ServiceClass = Literal["interactive", "batch"]
RunStatus = Literal["running", "finished", "failed", "cancelled"]
# What await and status show: a running run whose tool call waits for the user is AwaitingApproval.
ShownStatus = Literal["running", "AwaitingApproval", "finished", "failed", "cancelled"]
AwaitMode = Literal["all", "any"]

DEFAULT_MAX_TOOL_CALLS = 8
DEFAULT_MAX_TOKENS = 256
DEFAULT_AWAIT_TIMEOUT_S = 60.0
MAX_AWAIT_TIMEOUT_S = 600.0


class UnknownRun(LookupError):
    """No run has this handle."""

    def __init__(self, handle: str) -> None:
        super().__init__(f"unknown run handle {handle!r}: no run with this handle was spawned here")


class SpawnRefused(ValueError):
    """spawn cannot start this run; the message says why."""


class RunSpec(BaseModel):
    """Everything spawn was asked for, as journaled; field names are the tool's argument names."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    task: str
    model: str
    serviceClass: ServiceClass = "interactive"
    system: str | None = None
    maxToolCalls: int = Field(default=DEFAULT_MAX_TOOL_CALLS, ge=0)
    tools: list[str] | None = None
    maxTokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=0)
    parallelToolCalls: bool = False
    parent: str | None = None
    budgetTokens: int | None = Field(default=None, ge=1)
    budgetToolCalls: int | None = Field(default=None, ge=0)
    budgetSeconds: float | None = Field(default=None, gt=0)
    approveTools: list[str] | None = None

    def limits(self) -> dict[str, float]:
        """This run's budget limits by kind (tokens, toolCalls, seconds); empty without a budget."""
        values = {
            "tokens": self.budgetTokens,
            "toolCalls": self.budgetToolCalls,
            "seconds": self.budgetSeconds,
        }
        return {k: v for k, v in values.items() if v is not None}


class PendingApprovalView(BaseModel):
    tool: str = Field(description="the tool the sub-agent wants to call")
    arguments: dict[str, Any] = Field(description="the arguments it wants to call it with")


class RunView(BaseModel):
    """A run as await and status report it."""

    handle: str = Field(description="the run's handle, as spawn returned it")
    status: ShownStatus = Field(
        description="running, AwaitingApproval (a tool call waits for approve), finished, failed or cancelled"
    )
    result: str | None = Field(description="the sub-agent's final answer once finished, else null")
    error: str | None = Field(description="why the run failed or was cancelled, else null")
    toolCalls: int = Field(description="tool calls made so far")
    failedToolCalls: int = Field(description="tool calls that errored, were refused as malformed or declined")
    turns: int = Field(description="model turns so far")
    parent: str | None = Field(default=None, description="the parent run's handle, if spawned under one")
    children: list[str] = Field(default_factory=list, description="handles of runs spawned under this one")
    pendingApproval: PendingApprovalView | None = Field(
        default=None, description="while AwaitingApproval: the tool call waiting; answer with approve"
    )
    budget: BudgetView | None = Field(default=None, description="this run's budget over its subtree, if set")


@dataclass
class Run:
    handle: str
    spec: RunSpec
    caller: str | None
    created_at: float
    messages: list[dict[str, Any]]
    counters: dict[str, float] = field(default_factory=new_counters)
    status: RunStatus = "running"
    result: str | None = None
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    children: list[Run] = field(default_factory=list)
    parent: Run | None = None
    # A round cut short by a restart: its assistant message and the calls already answered.
    pending_turn: dict[str, Any] | None = None
    pending_results: list[dict[str, Any]] = field(default_factory=list)
    # Approval decisions by tool_call id (journaled), and the calls waiting for one.
    decisions: dict[str, bool] = field(default_factory=dict)
    approvals: dict[str, Approval] = field(default_factory=dict)
    # Set when this run's budget tripped: the `budget exceeded: ...` message.
    budget_exceeded: str | None = None
    # Who may see the run once its caller's session is gone (callers.py); None: everyone.
    owner: str | None = None
    # Restored from the journal by this process, rather than spawned in it.
    restored: bool = False
    # When it ended (Unix time), for the retention window; None while it runs.
    finished_at: float | None = None

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def pending_approval(self) -> Approval | None:
        return next(iter(self.approvals.values()), None)

    def subtree(self) -> Iterator[Run]:
        """This run and every run below it."""
        stack = [self]
        while stack:
            run = stack.pop()
            yield run
            stack.extend(reversed(run.children))

    def ancestors(self) -> Iterator[Run]:
        """This run, its parent, and so on up to the root."""
        run: Run | None = self
        while run is not None:
            yield run
            run = run.parent

    def shown_status(self) -> ShownStatus:
        return "AwaitingApproval" if self.running and self.approvals else self.status

    def budget_view(self) -> BudgetView | None:
        limits = self.spec.limits()
        if not limits:
            return None
        used = subtree_used(self)
        return BudgetView(
            limits=limits,
            used={k: used[k] for k in BUDGET_KINDS if k in limits},
            exceeded=self.budget_exceeded,
        )

    def view(self) -> RunView:
        pending = self.pending_approval
        return RunView(
            handle=self.handle,
            status=self.shown_status(),
            result=self.result,
            error=self.error,
            toolCalls=int(self.counters["toolCalls"]),
            failedToolCalls=int(self.counters["failedToolCalls"]),
            turns=int(self.counters["turns"]),
            parent=self.spec.parent,
            children=[c.handle for c in self.children],
            pendingApproval=PendingApprovalView(tool=pending.tool, arguments=pending.arguments)
            if pending
            else None,
            budget=self.budget_view(),
        )

    def own_work(self) -> dict[str, float]:
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in self.counters.items()}

    def subtree_totals(self) -> dict[str, float]:
        totals = new_counters()
        for run in self.subtree():
            for k, v in run.counters.items():
                totals[k] += v
        return {k: round(v, 3) if isinstance(v, float) else v for k, v in totals.items()}

    def summary(self) -> dict[str, Any]:
        """The run as the runtime's GET /status lists it: its own work and its subtree's totals."""
        pending = self.pending_approval
        budget = self.budget_view()
        return {
            "handle": self.handle,
            "status": self.shown_status(),
            "parent": self.spec.parent,
            "children": [c.handle for c in self.children],
            "task": self.spec.task,
            "model": self.spec.model,
            "serviceClass": self.spec.serviceClass,
            "caller": self.caller,
            "createdAt": self.created_at,
            "error": self.error,
            **self.own_work(),
            "own": self.own_work(),
            "subtree": self.subtree_totals(),
            "pendingApproval": {"tool": pending.tool, "arguments": pending.arguments} if pending else None,
            "budget": budget.model_dump() if budget else None,
        }


def initial_messages(spec: RunSpec) -> list[dict[str, Any]]:
    """The conversation a run starts from: the optional system prompt, then the task."""
    messages: list[dict[str, Any]] = []
    if spec.system:
        messages.append({"role": "system", "content": spec.system})
    messages.append({"role": "user", "content": spec.task})
    return messages


def new_handle() -> str:
    return f"run-{uuid.uuid4().hex[:20]}"


# What drives a run once it exists: the sub-agent loop (see agent.py), given the registry to
# journal its rounds and its end through.
Driver = Callable[["Runs", Run], Awaitable[None]]
# What tells the dataplane a run is over.
EndHook = Callable[[str], Awaitable[None]]


class Runs:
    """Every run this runtime knows, live or restored from the journal."""

    def __init__(self, journal: Journal, driver: Driver, on_end: EndHook) -> None:
        self.journal = journal
        self._driver = driver
        self._on_end = on_end
        self._runs: dict[str, Run] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._timers: dict[str, asyncio.Task[None]] = {}
        # Pulsed whenever a run's state changes in a way a waiter may care about (an approval
        # asked, a run ended): waiters re-check their condition.
        self._changed = asyncio.Condition()

    def __iter__(self):
        return iter(list(self._runs.values()))

    def get(self, handle: str) -> Run:
        """The run, live or restored; one that left memory for the archive is read from there."""
        run = self._runs.get(handle)
        if run is not None:
            return run
        archived = self.journal.archived(handle)
        if archived is None:
            raise UnknownRun(handle)
        return _from_archive(archived)

    def roots(self) -> list[Run]:
        return [r for r in self._runs.values() if r.parent is None]

    # -- spawning -------------------------------------------------------------------------------

    def spawn(self, spec: RunSpec, caller: str | None, owner: str | None = None) -> Run:
        """Journals the run, then starts its loop; returns once the journal has it."""
        parent = self.get(spec.parent) if spec.parent is not None else None
        if parent is not None:
            tripped = next((a for a in parent.ancestors() if a.budget_exceeded), None)
            if tripped is not None:
                raise SpawnRefused(
                    f"run {tripped.handle} is over its budget ({tripped.budget_exceeded}); "
                    "nothing more can be spawned under it"
                )
        handle = new_handle()
        self.journal.spawned(handle, spec.model_dump(), caller, owner)
        run = Run(
            handle=handle,
            spec=spec,
            caller=caller,
            created_at=time.time(),
            messages=initial_messages(spec),
            owner=owner,
        )
        self._add(run)
        self._start(run)
        return run

    async def spawn_durably(self, spec: RunSpec, caller: str | None, owner: str | None = None) -> Run:
        """`spawn`, acknowledged only once the journal has the run on disk. When it cannot be
        written the run is taken back (its loop stopped, forgotten) and JournalError raised: a run
        the journal does not have must not go on in memory."""
        run = self.spawn(spec, caller, owner)
        try:
            await self.journal.durable()
        except JournalError:
            self._take_back(run)
            raise
        return run

    def _take_back(self, run: Run) -> None:
        if run.task is not None and not run.task.done():
            run.task.cancel()
        timer = self._timers.pop(run.handle, None)
        if timer is not None:
            timer.cancel()
        if run.parent is not None:
            run.parent.children.remove(run)
        self._runs.pop(run.handle, None)

    def _add(self, run: Run) -> None:
        self._runs[run.handle] = run
        if run.spec.parent is not None:
            parent = self._runs.get(run.spec.parent)
            if parent is run:
                # Only a damaged journal names a run its own parent; linking it would make its
                # subtree endless.
                log.warning("run %s names itself as its parent; it stands alone", run.handle)
            elif parent is not None:
                run.parent = parent
                parent.children.append(run)
        if run.spec.budgetSeconds is not None and run.running:
            self._timers[run.handle] = asyncio.create_task(
                self._seconds_timer(run), name=f"budget:{run.handle}"
            )

    def _start(self, run: Run) -> None:
        run.task = asyncio.create_task(self._drive(run), name=f"run:{run.handle}")

    async def _drive(self, run: Run) -> None:
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
        await self._on_end(run.handle)

    # -- steps of a run ---------------------------------------------------------------------------

    def record_turn(self, run: Run, message: dict[str, Any]) -> None:
        """Journals a reply that asks for tools, before any of its calls runs."""
        if run.running:
            self.journal.turn(run.handle, message, dict(run.counters))
            run.pending_turn, run.pending_results = message, []

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
        run.pending_turn, run.pending_results = None, []

    def finish(
        self, run: Run, status: RunStatus, result: str | None = None, error: str | None = None
    ) -> bool:
        """Ends the run once (journal first, then waiters); False when it had already ended."""
        if not run.running:
            return False
        try:
            self.journal.finished(run.handle, status, result, error, dict(run.counters))
        except JournalError as e:
            # Its end cannot be journaled: it ends here all the same, whoever awaits it is told
            # of the journal's failure, and the next start resumes it.
            log.error("run %s: its end is not journaled (%s); it resumes on the next start", run.handle, e)
        run.status, run.result, run.error = status, result, error
        run.finished_at = time.time()
        # Its conversation is never read again (await answers with the result; a restart replays
        # only unfinished runs): a finished run kept for the retention window costs little.
        run.messages, run.pending_turn, run.pending_results = [], None, []
        for approval in run.approvals.values():
            approval.abandon()
        run.approvals.clear()
        run.done.set()
        self._pulse()
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
        run = self.get(handle)
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
        """Trips the first budget above (or on) `run` that is spent; True when the run may go on.

        With `calling_tool`, one more tool call is about to start: a tool-call budget that is
        already used up trips now, so a subtree never makes more calls than its limit.
        """
        for owner in run.ancestors():
            limits = owner.spec.limits()
            if not limits:
                continue
            message = exceeded_message(limits, subtree_used(owner), calling_tool)
            if message is not None:
                self.trip_budget(owner, message)
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

    # -- approvals --------------------------------------------------------------------------------

    async def ask_approval(self, run: Run, call_id: str, tool: str, arguments: dict[str, Any]) -> bool:
        """Waits for the user's decision on one tool call (journaled once made); True to allow."""
        if call_id in run.decisions:
            return run.decisions[call_id]
        approval = Approval(call_id=call_id, tool=tool, arguments=arguments)
        run.approvals[call_id] = approval
        log.info("run %s: tool call %s (%s) waits for approval", run.handle, call_id, tool)
        self._pulse()
        try:
            allow = await approval.decision
            await self.journal.durable()  # the call runs (or is declined) once the decision is on disk
            return allow
        finally:
            run.approvals.pop(call_id, None)
            self._pulse()

    def decide_approval(self, run: Run, allow: bool, call_id: str | None = None) -> Approval | None:
        """Answers the run's oldest pending approval (or the one for `call_id`); None if none waits."""
        approval = run.approvals.get(call_id) if call_id is not None else run.pending_approval
        if approval is None or approval.decision.done():
            return None
        self.journal.approval(run.handle, approval.call_id, approval.tool, allow)
        run.decisions[approval.call_id] = allow
        # Off the pending list at once, so that nobody asks again before the run goes on.
        run.approvals.pop(approval.call_id, None)
        approval.decision.set_result(allow)
        self._pulse()
        log.info("run %s: tool call %s %s", run.handle, approval.call_id, "allowed" if allow else "declined")
        return approval

    # -- waiting ----------------------------------------------------------------------------------

    def _pulse(self) -> None:
        async def notify() -> None:
            async with self._changed:
                self._changed.notify_all()

        self._in_background(notify())

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
        unique = list(dict.fromkeys(handles))
        runs = [self.get(h) for h in unique]
        timeout_s = min(max(timeout_s, 0.0), MAX_AWAIT_TIMEOUT_S)

        def satisfied() -> bool:
            ended = [not r.running for r in runs]
            if any(ended) if mode == "any" else all(ended):
                return True
            if stop_on_approval is not None:
                return any(stop_on_approval(r, a) for r in runs for a in list(r.approvals.values()))
            return False

        deadline = asyncio.get_running_loop().time() + timeout_s
        async with self._changed:
            while not satisfied():
                remaining = deadline - asyncio.get_running_loop().time()
                if remaining <= 0:
                    return runs, True
                try:
                    await asyncio.wait_for(self._changed.wait(), remaining)
                except TimeoutError:
                    return runs, not satisfied()
        return runs, False

    # -- restart ----------------------------------------------------------------------------------

    def restore(self, retention_s: float | None = None) -> None:
        """Rebuilds runs from the journal; unfinished ones resume from their last journaled step.
        With `retention_s`, the journal is compacted first (journal.py): finished trees older than
        that go to the archive and are not loaded."""
        if retention_s is not None:
            self.journal.compact(retention_s)
        resumed = 0
        # Compaction has warned of every record it could not read; the replay says it once more only without it.
        for replayed in self.journal.replay(warn=retention_s is None):
            try:
                spec = RunSpec.model_validate(replayed.spec)
            except ValueError as e:
                log.warning("run %s: journaled spec is unreadable (%s); not restored", replayed.handle, e)
                continue
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
                decisions=dict(replayed.decisions),
                owner=replayed.owner,
                restored=True,
            )
            if replayed.finished is not None:
                status = replayed.finished.get("status")
                run.status = status if status in ("finished", "failed", "cancelled") else "failed"
                run.result = replayed.finished.get("result")
                run.error = replayed.finished.get("error")
                run.finished_at = _number(replayed.finished.get("at"))
                run.done.set()
            self._add(run)
        for run in self._runs.values():
            # A budget that tripped shows on its owner: the run whose limit is named.
            if run.error and run.error.startswith("budget exceeded") and run.spec.limits():
                kind = run.error.removeprefix("budget exceeded: ").split(" ")[0]
                if kind in run.spec.limits():
                    run.budget_exceeded = run.error
        for run in self._runs.values():
            if run.running:
                resumed += 1
                log.info(
                    "run %s: resuming after %d journaled tool rounds%s",
                    run.handle,
                    sum(1 for m in run.messages if m.get("role") == "assistant"),
                    " and a round cut short" if run.pending_turn is not None else "",
                )
                self._start(run)
        if self._runs:
            log.info("journal: %d runs restored, %d of them resumed", len(self._runs), resumed)

    async def evict(self, retention_s: float, now: float | None = None) -> int:
        """Moves every run tree whose runs all finished more than `retention_s` ago from memory to
        the archive (written off the event loop, durably, first), which answers for them from
        then on; returns how many runs left. Their records leave runs.jsonl at the next start."""
        now = time.time() if now is None else now
        leaving: list[Run] = []
        for root in self.roots():
            tree = list(root.subtree())
            if all(not r.running and r.finished_at is not None and now - r.finished_at > retention_s for r in tree):
                leaving.extend(tree)
        if not leaving:
            return 0
        await asyncio.to_thread(self.journal.archive, [_replayed(r) for r in leaving])
        for r in leaving:
            self._runs.pop(r.handle, None)
        log.info("%d finished runs older than %.0f s moved to the archive", len(leaving), retention_s)
        return len(leaving)

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


def _number(value: Any) -> float | None:
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _replayed(run: Run) -> ReplayedRun:
    """A finished run as the archive records it."""
    return ReplayedRun(
        handle=run.handle,
        spec=run.spec.model_dump(),
        caller=run.caller,
        spawned_at=run.created_at,
        owner=run.owner,
        counters=dict(run.counters),
        finished={"at": run.finished_at, "status": run.status, "result": run.result, "error": run.error},
    )


def _from_archive(record: dict[str, Any]) -> Run:
    """A finished run read back from its archive record (its conversation is not kept)."""
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
    )
    run.done.set()
    return run
