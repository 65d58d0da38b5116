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

from luftpause import counts

if TYPE_CHECKING:
    from luftpause.runtime.run import Run

BUDGET_KINDS = ("tokens", "toolCalls", "seconds")


def reported_tokens(usage: object) -> tuple[int, int]:
    """The prompt and completion tokens a reply's `usage` says it took, as its run counts them.

    A count that is missing or out of range (negative, not a whole number, NaN, above
    `counts.MAX_TOKEN_COUNT`: luftpause/counts.py) counts as 0, so a budget only ever grows by
    what an engine could have spent, and an engine's nonsense can neither refund a budget nor
    trip one.
    """
    if not isinstance(usage, dict):
        return 0, 0
    prompt = counts.token_count(usage.get("prompt_tokens")) or 0
    completion = counts.token_count(usage.get("completion_tokens")) or 0
    return prompt, completion


class BudgetView(BaseModel):
    limits: dict[str, float] = Field(description="the limits set at spawn: tokens, toolCalls, seconds")
    used: dict[str, float] = Field(description="what the run's subtree has used of each, so far")
    exceeded: str | None = Field(
        description="`budget exceeded: <which> <used>/<limit>` once tripped, else null"
    )


def subtree_used(owner: Run, now: float | None = None) -> dict[str, float]:
    """What a run's subtree has spent, in the budget's units. Seconds run from the owner's spawn
    until now while a run of the subtree runs, and stop when the last of them ended."""
    tokens = tool_calls = 0
    running, ended = False, owner.created_at
    for run in owner.subtree():
        tokens += int(run.counters["promptTokens"]) + int(run.counters["completionTokens"])
        tool_calls += int(run.counters["toolCalls"])
        if run.running:
            running = True
        elif run.finished_at is not None:
            ended = max(ended, run.finished_at)
    until = (now if now is not None else time.time()) if running else ended
    return {"tokens": tokens, "toolCalls": tool_calls, "seconds": round(until - owner.created_at, 1)}


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


def budget_view(run: Run) -> BudgetView | None:
    """The run's budget as await and status show it; None without one."""
    limits = run.spec.limits()
    if not limits:
        return None
    used = subtree_used(run)
    return BudgetView(
        limits=limits,
        used={k: used[k] for k in BUDGET_KINDS if k in limits},
        exceeded=run.budget_exceeded,
    )


def spent_budget(run: Run, calling_tool: bool = False) -> tuple[Run, str] | None:
    """The first budget above (or on) `run` that is spent, as its owner and its `budget exceeded:
    ...` message; None while every one has room.

    With `calling_tool`, one more tool call is about to start: a tool-call budget that is
    already used up counts as spent, so a subtree never makes more calls than its limit.
    """
    for owner in run.ancestors():
        limits = owner.spec.limits()
        if not limits:
            continue
        message = exceeded_message(limits, subtree_used(owner), calling_tool)
        if message is not None:
            return owner, message
    return None


def tripped_above(run: Run) -> Run | None:
    """The run, or the nearest run above it, whose budget has tripped; None if none has."""
    return next((a for a in run.ancestors() if a.budget_exceeded), None)


def tripped_kind(message: str) -> str:
    """Which budget a `budget exceeded: <which> <used>/<limit>` message names."""
    return message.removeprefix("budget exceeded: ").split(" ")[0]


def own_trip(error: str | None, kinds: set[str]) -> str | None:
    """The `budget exceeded: <which> ...` error of a run that ended so, when `<which>` is one of
    the kinds of its own limits (`kinds`): its own budget tripped. None otherwise."""
    if error and error.startswith("budget exceeded") and tripped_kind(error) in kinds:
        return error
    return None


# The spawn argument that sets each kind of limit (spec.py).
LIMIT_ARGUMENTS = {"tokens": "budgetTokens", "toolCalls": "budgetToolCalls", "seconds": "budgetSeconds"}


def restore_tripped(run: Run) -> None:
    """Marks a restored run whose end was its own budget tripping: the tripped budget shows on its
    owner, the run whose limit the `budget exceeded: <which> ...` error names."""
    tripped = own_trip(run.error, set(run.spec.limits()))
    if tripped is not None:
        run.budget_exceeded = tripped
