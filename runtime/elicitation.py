"""Asking the harness user about approvals while an await or run covers the run.

If the client advertises elicitation, a tool call waiting for approval becomes a question: on a
legacy session an elicitation request inside the call, on a sessionless 2026-07-28 request an
input-required result that the client answers by retrying the call (the SDK seals the call's
state, the deadline and the questions dismissed, into the result). A client that cannot be
asked gets the runs back at once, for its model to answer with approve.
"""

from __future__ import annotations

import contextlib
import json
import logging
import time
from typing import TYPE_CHECKING, Any

from mcp.server.mcpserver import Context
from mcp_types import ElicitRequest, ElicitRequestFormParams, InputRequiredResult
from mcp_types.version import MODERN_PROTOCOL_VERSIONS

from luftpause.runtime.approvals import Approval, ApprovalForm, answer_of, decide_approval
from luftpause.runtime.run import Run, UnknownRun
from luftpause.runtime.waiting import AwaitMode, clamped, ended

if TYPE_CHECKING:
    from luftpause.runtime.parts import Runtime

log = logging.getLogger(__name__)


# How an approval is named in an input-required result's inputRequests.
def approval_key(run: Run, approval: Approval) -> str:
    return f"approve:{run.handle}:{approval.call_id}"


def parse_approval_key(key: str) -> tuple[str, str] | None:
    parts = key.split(":", 2)
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "approve" else None


def request_state(ctx: Context) -> dict[str, Any]:
    """What an earlier round of this call left in its input-required result (the SDK seals it)."""
    try:
        state = json.loads(ctx.request_state) if ctx.request_state else {}
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


async def await_runs(
    runtime: Runtime,
    ctx: Context,
    handles: list[str],
    mode: AwaitMode,
    timeout_s: float,
    state: dict[str, Any],
    return_on_approval: bool = True,
) -> tuple[list[Run], bool] | InputRequiredResult:
    """Waits on runs, asking the user about their approvals when the client can be asked.

    On a legacy session the question is an elicitation request inside this call; on a
    sessionless 2026-07-28 request it is an input-required result (the client retries the
    call with the answers, and `state` carries the deadline across the retries). A client
    that cannot be asked gets the runs back as soon as one is AwaitingApproval (with
    `return_on_approval`), so that its model can answer with approve.
    """
    who = runtime.who(ctx)
    found = await runtime.runs_for(handles, who)
    caps = ctx.client_capabilities
    can_elicit = caps is not None and caps.elicitation is not None
    modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
    deadline = float(state.get("deadline") or time.time() + clamped(timeout_s))
    dismissed: set[str] = set(state.get("dismissed") or [])
    for key, response in (ctx.input_responses or {}).items():
        target = parse_approval_key(key)
        action = getattr(response, "action", None)
        if target is None or action is None:
            continue
        decision = answer_of(action, getattr(response, "content", None))
        if decision is None:
            dismissed.add(key)
            continue
        with contextlib.suppress(UnknownRun):
            (run,) = await runtime.runs_for([target[0]], who)
            decide_approval(runtime.runs, run, decision, target[1])

    def unasked(run: Run, approval: Approval) -> bool:
        return approval_key(run, approval) not in dismissed

    stop = unasked if can_elicit else (lambda r, a: True) if return_on_approval else None
    while True:
        remaining = deadline - time.time()
        runs, timed_out = await runtime.runs.wait_on(found, mode, max(remaining, 0.0), stop_on_approval=stop)
        if timed_out or ended(runs, mode) or not can_elicit:
            return runs, timed_out
        pending = [(r, a) for r in runs for a in list(r.approvals.values()) if unasked(r, a)]
        if not pending:
            continue
        if modern:
            requests: dict[str, Any] = {
                approval_key(r, a): ElicitRequest(
                    params=ElicitRequestFormParams(
                        message=a.question(r.handle), requested_schema=ApprovalForm.model_json_schema()
                    )
                )
                for r, a in pending
            }
            return InputRequiredResult(
                input_requests=requests,
                request_state=json.dumps({**state, "deadline": deadline, "dismissed": sorted(dismissed)}),
            )
        for run, approval in pending:
            dismissed.add(approval_key(run, approval))
            try:
                answer = await ctx.elicit(approval.question(run.handle), ApprovalForm)
            except Exception as e:
                # A client that fails the question leaves the call waiting for approve.
                log.warning("run %s: asking for approval failed: %s", run.handle, e)
                continue
            decision = answer_of(
                answer.action, answer.data.model_dump() if answer.action == "accept" else None
            )
            if decision is not None:
                decide_approval(runtime.runs, run, decision, approval.call_id)
