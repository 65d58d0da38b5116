"""How a run is shown: to MCP clients by await, run, status and cancel, and on GET /status.

`view` is a run as the tools return it (`RunView`, whose field descriptions the harness model
reads in the tools' output schemas); `summary` is a run as the runtime's status document lists
it, with its own work and its subtree's totals; `status_runs` lists them for GET /status, as a
list and as the run tree (`status_tree`).

Nothing here recurses: a run tree restored from a journal may be deeper than spawn allows now
(`[runtime] max_depth`), and the operator's view must still render it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel, Field

from luftpause.runtime.budgets import BudgetView, budget_view
from luftpause.runtime.journal import new_counters
from luftpause.runtime.run import Run, ShownStatus


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


def view(run: Run) -> RunView:
    """The run as the tools return it."""
    pending = run.pending_approval
    return RunView(
        handle=run.handle,
        status=run.shown_status(),
        result=run.result,
        error=run.error,
        toolCalls=int(run.counters["toolCalls"]),
        failedToolCalls=int(run.counters["failedToolCalls"]),
        turns=int(run.counters["turns"]),
        parent=run.spec.parent,
        children=[c.handle for c in run.children],
        pendingApproval=PendingApprovalView(tool=pending.tool, arguments=pending.arguments)
        if pending
        else None,
        budget=budget_view(run),
    )


def _rounded(counters: dict[str, float]) -> dict[str, float]:
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in counters.items()}


def subtree_totals(run: Run) -> dict[str, float]:
    """The counters of the run and every run below it, added up."""
    totals = new_counters()
    for r in run.subtree():
        for k, v in r.counters.items():
            totals[k] += v
    return _rounded(totals)


def _totals(order: list[Run]) -> dict[str, dict[str, float]]:
    """`subtree_totals` of every run of `order` (each after its parent), by handle, in one pass
    (children before their parent), rather than one walk of its subtree per run: a chain n deep
    costs n, not n^2."""
    totals: dict[str, dict[str, float]] = {}
    for run in reversed(order):
        sums = {**new_counters(), **run.counters}
        for child in run.children:
            for k, v in totals[child.handle].items():
                sums[k] += v
        totals[run.handle] = sums
    return {h: _rounded(t) for h, t in totals.items()}


# How many levels of the run tree GET /status nests in one entry of `tree`; a run deeper than
# that below its entry's root starts an entry of its own (its `parent` says where it hangs). Each
# level is two levels of JSON (an object in a list): 64 keeps the document readable by parsers
# that limit nesting (Python's json stops near 1,000 levels), whatever the tree's depth.
TREE_NESTING = 64


def status_runs(
    held: Sequence[Run], elsewhere: Sequence[Run] = ()
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """GET /status's `runs` and `tree`: the runs this runtime holds, then `elsewhere` (runs other
    runtimes sharing its store drive or ended, read from it and linked to each other), and their
    trees. An entry's root is a run whose parent is not shown with it (none, or one another
    runtime drives); the runs of another runtime that a held tree links in (a budget's, runs.py)
    show in it as last read, and the rest of `elsewhere` in trees of their own."""
    here = {r.handle for r in held}
    roots = [r for r in held if r.parent is None or r.parent.handle not in here]
    order = [r for root in roots for r in root.subtree()]
    shown = {r.handle for r in order}
    rest = [r for r in elsewhere if r.handle not in shown]
    apart = {r.handle for r in rest}
    rest_roots = [r for r in rest if r.parent is None or r.parent.handle not in apart]
    rest_order = [r for root in rest_roots for r in root.subtree()]
    totals = _totals(order) | _totals(rest_order)
    summaries = {r.handle: summary(r, totals[r.handle]) for r in (*order, *rest_order)}
    runs = [summaries[r.handle] if r.handle in summaries else summary(r) for r in (*held, *elsewhere)]
    return runs, status_tree([*roots, *rest_roots], summaries)


def link_among(runs: Sequence[Run]) -> Sequence[Run]:
    """`runs` (read from the store, kept by nobody) each linked under its parent where that is
    among them; a run that names itself as its parent (only a damaged journal does) stands alone,
    as runs.py has it, or its subtree would never end."""
    by_handle = {r.handle: r for r in runs}
    for run in runs:
        parent = by_handle.get(run.spec.parent or "")
        if parent is not None and parent is not run:
            run.link_under(parent)
    return runs


def status_tree(roots: list[Run], summaries: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    """The run tree as GET /status shows it: each root with its children nested inside it, down
    to TREE_NESTING levels (see above); built with a stack, not by recursion."""
    entries: list[dict[str, Any]] = []
    # (the run, the list its node goes into, its level within its entry)
    stack: list[tuple[Run, list[dict[str, Any]] | None, int]] = [(r, None, 0) for r in reversed(roots)]
    while stack:
        run, siblings, level = stack.pop()
        if siblings is None or level >= TREE_NESTING:
            siblings, level = entries, 0
        node = {**summaries[run.handle], "children": []}
        siblings.append(node)
        stack.extend((c, node["children"], level + 1) for c in reversed(run.children))
    return entries


def summary(run: Run, subtree: dict[str, float] | None = None) -> dict[str, Any]:
    """The run as the runtime's GET /status lists it: its own work and its subtree's totals
    (`subtree`, when they are known already)."""
    pending = run.pending_approval
    budget = budget_view(run)
    own = _rounded(run.counters)
    return {
        "handle": run.handle,
        "status": run.shown_status(),
        "parent": run.spec.parent,
        "children": [c.handle for c in run.children],
        "task": run.spec.task,
        "model": run.spec.model,
        "serviceClass": run.spec.serviceClass,
        "caller": run.caller,
        "createdAt": run.created_at,
        "error": run.error,
        **own,
        "own": dict(own),
        "subtree": subtree if subtree is not None else subtree_totals(run),
        "pendingApproval": {"tool": pending.tool, "arguments": pending.arguments} if pending else None,
        "budget": budget.model_dump() if budget else None,
    }
