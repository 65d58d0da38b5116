"""A run: one spawned sub-agent, as this process holds it, and its place in the run tree.

A run is running until it ends exactly once, as finished, failed or cancelled (runs.py ends it).
Runs form a tree: spawn's `parent` makes a run a child of another. A running run whose tool call
waits for the user's approval shows as AwaitingApproval (approvals.py).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

from opentelemetry.trace import Span

from luftpause.runtime.approvals import Approval
from luftpause.runtime.journal import new_counters
from luftpause.runtime.spec import RunSpec

RunStatus = Literal["running", "finished", "failed", "cancelled"]
# What await and status show: a running run whose tool call waits for the user is AwaitingApproval.
ShownStatus = Literal["running", "AwaitingApproval", "finished", "failed", "cancelled"]


class UnknownRun(LookupError):
    """No run has this handle."""

    def __init__(self, handle: str) -> None:
        super().__init__(f"unknown run handle {handle!r}: no run with this handle was spawned here")


def new_handle() -> str:
    return f"run-{uuid.uuid4().hex[:20]}"


def _set_event() -> asyncio.Event:
    event = asyncio.Event()
    event.set()
    return event


# The `done` of every run that has ended: set for good and shared, so that a finished run holds
# no Event of its own (an Event keeps a deque for its waiters: some 700 bytes). Nothing clears it.
ENDED = _set_event()


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
    # Set when the run ends (then the shared ENDED).
    done: asyncio.Event = field(default_factory=asyncio.Event)
    # Its loop while that runs; a run that has ended drops it, and with it the loop's context
    # (the request that spawned it).
    task: asyncio.Task[None] | None = None
    children: list[Run] = field(default_factory=list)
    parent: Run | None = None
    # A round cut short by a restart: its assistant message and the calls already answered.
    pending_turn: dict[str, Any] | None = None
    pending_results: list[dict[str, Any]] = field(default_factory=list)
    # The calls of the pending turn journaled as sent, by tool_call id: their idempotency keys.
    # One not answered when the run resumes has an unknown outcome and is not sent again.
    sent_calls: dict[str, str] = field(default_factory=dict)
    # Approval decisions by tool_call id (journaled), and the calls waiting for one.
    decisions: dict[str, bool] = field(default_factory=dict)
    approvals: dict[str, Approval] = field(default_factory=dict)
    # When each call asked (journaled) stops waiting for its approval (Unix time).
    approval_deadlines: dict[str, float] = field(default_factory=dict)
    # Set when this run's budget tripped: the `budget exceeded: ...` message.
    budget_exceeded: str | None = None
    # Who may see the run once its caller's session is gone (callers.py); None: everyone.
    owner: str | None = None
    # Restored from the journal by this process, rather than spawned in it.
    restored: bool = False
    # When it ended (Unix time), for the retention window; None while it runs.
    finished_at: float | None = None
    # With tracing on: the context its `invoke_agent` span is a child of (journaled), and that
    # span while its loop runs (runtime/spans.py).
    traceparent: str | None = None
    span: Span | None = None

    @property
    def running(self) -> bool:
        return self.status == "running"

    @property
    def pending_approval(self) -> Approval | None:
        return next(iter(self.approvals.values()), None)

    def link_under(self, parent: Run) -> None:
        """Makes this run a child of `parent`: both ends of the link at once."""
        self.parent = parent
        parent.children.append(self)

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
