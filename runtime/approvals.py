"""Tool approval: which sub-agent tool calls wait for the user, and one such wait.

A call waits when its server marks the tool `destructiveHint: true` (and not `readOnlyHint:
true`), or when spawn's `approveTools` names it. The run shows AwaitingApproval with the call's
tool and arguments until someone decides: the harness user through an elicitation (asked while
an await or run covers the run, see elicitation.py), a Tasks client through `tasks/update`, or any
client through the approve tool. A declined call is answered to the sub-agent with
`DECLINED_TEXT`. Decisions are journaled by tool_call id, so a decision made just before a
restart is not asked again; an unanswered one is, with the deadline it was first asked with:
a call waits at most `[runtime] approval_timeout_s` (an hour by default) from when it was first
asked, restarts included (the deadline is journaled), and its run then fails with `approval
expired: ...`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from luftpause.runtime.run import Run
    from luftpause.runtime.runs import Runs

log = logging.getLogger(__name__)

DECLINED_TEXT = "Error: the user declined this tool call"


def needs_approval(
    tool_name: str, annotations: dict[str, Any] | None, approve_tools: list[str] | None
) -> bool:
    """Whether a call of this tool must wait for the user."""
    if approve_tools and tool_name in approve_tools:
        return True
    hints = annotations or {}
    return bool(hints.get("destructiveHint")) and not bool(hints.get("readOnlyHint"))


class ApprovalExpired(Exception):
    """A tool call's approval was not given before its deadline."""


@dataclass
class Approval:
    """One tool call waiting for the user's decision."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    decision: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

    def expire(self) -> None:
        """Its deadline passed unanswered."""
        if not self.decision.done():
            self.decision.set_exception(ApprovalExpired())

    def abandon(self) -> None:
        """The run ended while waiting: nobody needs the decision any more."""
        if not self.decision.done():
            self.decision.cancel()

    def question(self, handle: str) -> str:
        """What the user is asked."""
        args = ", ".join(f"{k}={v!r}" for k, v in self.arguments.items())
        return f"Sub-agent {handle} wants to call {self.tool}({args}). Allow this tool call?"


class ApprovalForm(BaseModel):
    """The one-field form of an approval elicitation."""

    allow: bool = Field(description="true to let the sub-agent make this tool call, false to decline it")


def answer_of(action: str, content: dict[str, Any] | None) -> bool | None:
    """The decision in an elicitation result: True/False, or None when the user dismissed it."""
    if action == "accept":
        return bool((content or {}).get("allow"))
    if action == "decline":
        return False
    return None


async def ask_approval(runs: Runs, run: Run, call_id: str, tool: str, arguments: dict[str, Any]) -> bool:
    """Waits for the user's decision on one tool call (journaled once made); True to allow."""
    if call_id in run.decisions:
        return run.decisions[call_id]
    timeout_s = runs.settings.approval_timeout_s
    deadline = run.approval_deadlines.get(call_id)
    if deadline is None:
        deadline = run.approval_deadlines[call_id] = time.time() + timeout_s
        runs.journal.asked(run.handle, call_id, tool, deadline)
    approval = Approval(call_id=call_id, tool=tool, arguments=arguments)
    run.approvals[call_id] = approval
    log.info("run %s: tool call %s (%s) waits for approval", run.handle, call_id, tool)
    runs.changes.pulse()
    # At the deadline the decision fails (not a wait_for: a decision made wakes the run as directly).
    expiry = asyncio.get_running_loop().call_later(max(deadline - time.time(), 0.0), approval.expire)
    try:
        try:
            allow = await approval.decision
        except ApprovalExpired:
            runs.finish(
                run,
                "failed",
                error=f"approval expired: tool call {call_id} ({tool}) waited {timeout_s:g} s for approval "
                f"([runtime] approval_timeout_s = {timeout_s:g}); spawn the run again to be asked anew",
            )
            return False
        await runs.journal.durable()  # the call runs (or is declined) once the decision is on disk
        return allow
    finally:
        expiry.cancel()
        run.approvals.pop(call_id, None)
        runs.changes.pulse()


def decide_approval(runs: Runs, run: Run, allow: bool, call_id: str | None = None) -> Approval | None:
    """Answers the run's oldest pending approval (or the one for `call_id`); None if none waits."""
    approval = run.approvals.get(call_id) if call_id is not None else run.pending_approval
    if approval is None or approval.decision.done():
        return None
    runs.journal.approval(run.handle, approval.call_id, approval.tool, allow)
    run.decisions[approval.call_id] = allow
    # Off the pending list at once, so that nobody asks again before the run goes on.
    run.approvals.pop(approval.call_id, None)
    approval.decision.set_result(allow)
    runs.changes.pulse()
    log.info("run %s: tool call %s %s", run.handle, approval.call_id, "allowed" if allow else "declined")
    return approval
