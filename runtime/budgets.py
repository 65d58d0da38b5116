"""Budgets: limits on what a run's whole subtree may spend.

spawn's budgetTokens, budgetToolCalls and budgetSeconds cap the run and every run spawned under
it, later ones included: prompt plus completion tokens, tool calls, and wall-clock seconds since
the budgeted run was spawned. The limits are checked on every turn and before every tool call
anywhere below a budgeted run, and by a timer for seconds so that an idle subtree trips too.
Past a limit the subtree is cancelled with `budget exceeded: <which> <used>/<limit>`.

A tool-call budget is checked before each call starts (one more call would pass the limit), so
a subtree never makes more calls than its limit; tokens can only be counted after a turn, so a
token budget trips on the turn that passes it.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from pydantic import BaseModel, Field

if TYPE_CHECKING:
    from luftpause.runtime.runs import Run

BUDGET_KINDS = ("tokens", "toolCalls", "seconds")


class BudgetView(BaseModel):
    limits: dict[str, float] = Field(description="the limits set at spawn: tokens, toolCalls, seconds")
    used: dict[str, float] = Field(description="what the run's subtree has used of each, so far")
    exceeded: str | None = Field(
        description="`budget exceeded: <which> <used>/<limit>` once tripped, else null"
    )


def subtree_used(owner: Run, now: float | None = None) -> dict[str, float]:
    """What a run's subtree has spent, in the budget's units."""
    tokens = tool_calls = 0
    for run in owner.subtree():
        tokens += int(run.counters["promptTokens"]) + int(run.counters["completionTokens"])
        tool_calls += int(run.counters["toolCalls"])
    seconds = round((now if now is not None else time.time()) - owner.created_at, 1)
    return {"tokens": tokens, "toolCalls": tool_calls, "seconds": seconds}


def _number(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def exceeded_message(limits: dict[str, float], used: dict[str, float], calling_tool: bool) -> str | None:
    """`budget exceeded: <which> <used>/<limit>` for the first limit that is spent, else None."""
    if "tokens" in limits and used["tokens"] > limits["tokens"]:
        return f"budget exceeded: tokens {used['tokens']}/{_number(limits['tokens'])}"
    if "toolCalls" in limits:
        calls = used["toolCalls"] + (1 if calling_tool else 0)
        if calls > limits["toolCalls"]:
            return f"budget exceeded: toolCalls {used['toolCalls']}/{_number(limits['toolCalls'])}"
    if "seconds" in limits and used["seconds"] >= limits["seconds"]:
        return f"budget exceeded: seconds {_number(used['seconds'])}/{_number(limits['seconds'])}"
    return None
