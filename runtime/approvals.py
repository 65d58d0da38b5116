"""Tool approval: which sub-agent tool calls wait for the user, and one such wait.

A call waits when its server marks the tool `destructiveHint: true` (and not `readOnlyHint:
true`), or when spawn's `approveTools` names it. The run shows AwaitingApproval with the call's
tool and arguments until someone decides: the harness user through an elicitation (asked while
an await or run covers the run, see server.py), a Tasks client through `tasks/update`, or any
client through the approve tool. A declined call is answered to the sub-agent with
`DECLINED_TEXT`. Decisions are journaled by tool_call id (runs.py), so a decision made just
before a restart is not asked again; an unanswered one is.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, Field

DECLINED_TEXT = "Error: the user declined this tool call"


def needs_approval(
    tool_name: str, annotations: dict[str, Any] | None, approve_tools: list[str] | None
) -> bool:
    """Whether a call of this tool must wait for the user."""
    if approve_tools and tool_name in approve_tools:
        return True
    hints = annotations or {}
    return bool(hints.get("destructiveHint")) and not bool(hints.get("readOnlyHint"))


@dataclass
class Approval:
    """One tool call waiting for the user's decision."""

    call_id: str
    tool: str
    arguments: dict[str, Any]
    decision: asyncio.Future[bool] = field(default_factory=lambda: asyncio.get_running_loop().create_future())

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
