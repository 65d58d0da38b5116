"""The runtime's MCP tools: spawn, await, run, status, cancel, approve, tools and decide.

Each tool is a typed function of the runtime; `register_tools` adds them to an MCP server. The
registrar binds the runtime, publishes a parameter `arguments: SpawnArguments` as spawn's
arguments one by one (so spawn and run take the same arguments from one model, spec.py), and
turns the runs' refusals (an unknown or foreign run, a spawn refused, a journal that cannot be
written) into tool errors whose text is the refusal's message.

The tools' descriptions (their docstrings) are what the harness model reads, so they say what
each tool does and returns in a sentence or two.
"""

from __future__ import annotations

import inspect
import typing
from collections.abc import Awaitable, Callable
from typing import Annotated, Any

from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import InputRequiredResult
from pydantic import BaseModel, Field

from luftpause.lifecycle import CALLER_HEADER, CLASS_HEADER, INTERACTIVE
from luftpause.runtime import elicitation
from luftpause.runtime.agent import caller_header
from luftpause.runtime.approvals import decide_approval, needs_approval
from luftpause.runtime.llm import DecideFailed, decision_of
from luftpause.runtime.parts import Runtime
from luftpause.runtime.runs import REFUSALS
from luftpause.runtime.spec import SpawnArguments
from luftpause.runtime.views import RunView, view
from luftpause.runtime.waiting import DEFAULT_AWAIT_TIMEOUT_S, MAX_AWAIT_TIMEOUT_S, AwaitMode


class SpawnResult(BaseModel):
    handle: str = Field(description="the run's handle, for await, status, cancel and approve")


class AwaitResult(BaseModel):
    runs: list[RunView] = Field(description="the awaited runs, in the order asked, each as it stands now")
    timedOut: bool = Field(description="true when the timeout passed before the runs were done")
    needsApproval: list[str] = Field(
        description="handles of awaited runs waiting for the user's approval (answer with approve); "
        "await returns early, before the runs are done, only for these"
    )


class RunsResult(BaseModel):
    runs: list[RunView]


class ToolInfo(BaseModel):
    name: str
    server: str = Field(description="the MCP server that runs it")
    description: str
    needsApproval: bool = Field(
        description="true when its calls wait for the user (the server marks it destructive)"
    )


class ToolsResult(BaseModel):
    tools: list[ToolInfo] = Field(description="every tool a sub-agent can be given, by name")
    unavailable: list[str] = Field(description="tool servers that cannot be reached now, and why")


async def spawn(runtime: Runtime, arguments: SpawnArguments, ctx: Context) -> SpawnResult:
    """Start a sub-agent on `task` and return its handle at once, without waiting for it.

    The sub-agent answers with the help of the tool servers' tools (see tools); collect its
    answer with await. Spawn several and await them together to work in parallel. With
    `parent`, the run is a child of that run; budgets cap a run and everything spawned under it.
    """
    run = await runtime.spawn(arguments, runtime.who(ctx))
    return SpawnResult(handle=run.handle)


async def await_runs(
    runtime: Runtime,
    handles: Annotated[list[str], Field(min_length=1, description="handles returned by spawn")],
    ctx: Context,
    mode: Annotated[AwaitMode, Field(description="all: wait for every run; any: for the first")] = "all",
    timeout: Annotated[  # noqa: ASYNC109 (the tool's argument, part of its contract)
        float, Field(ge=0, description=f"seconds to wait (default 60, at most {MAX_AWAIT_TIMEOUT_S:.0f})")
    ] = DEFAULT_AWAIT_TIMEOUT_S,
) -> AwaitResult | InputRequiredResult:
    """Wait until all (or any) of the runs are done, or the timeout passes; return each run's
    status, result, error, toolCalls, failedToolCalls and turns, and whether it timed out.

    Runs still running after a timeout keep going: await them again. A run whose tool call
    needs the user's approval shows as AwaitingApproval: the user may be asked here, or,
    when they cannot be, await returns at once with the run in needsApproval: answer it
    with approve, then await again.
    """
    state = elicitation.request_state(ctx)
    outcome = await elicitation.await_runs(runtime, ctx, handles, mode, timeout, state)
    # What it reports (an end, a decision) is on disk before the client hears of it.
    await runtime.journal.durable()
    if isinstance(outcome, InputRequiredResult):
        return outcome
    runs, timed_out = outcome
    return AwaitResult(
        runs=[view(r) for r in runs],
        timedOut=timed_out,
        needsApproval=[r.handle for r in runs if r.running and r.approvals],
    )


async def run(runtime: Runtime, arguments: SpawnArguments, ctx: Context) -> RunView | InputRequiredResult:
    """Start a sub-agent on `task` and wait for it in the same call; return the finished run
    (status, result, error, toolCalls, failedToolCalls, turns).

    Takes spawn's arguments. Use it for one sub-agent you need before going on; to work in
    parallel, spawn several and await them instead.
    """
    state = elicitation.request_state(ctx)
    handle = state.get("handle")
    if not isinstance(handle, str):
        handle = (await runtime.spawn(arguments, runtime.who(ctx))).handle
        state = {"handle": handle}
    while True:
        outcome = await elicitation.await_runs(
            runtime, ctx, [handle], "all", MAX_AWAIT_TIMEOUT_S, state, return_on_approval=False
        )
        if isinstance(outcome, InputRequiredResult):
            return outcome
        (done,), _ = outcome
        if not done.running:
            return view(done)
        state = {"handle": handle}


async def status(
    runtime: Runtime,
    ctx: Context,
    handle: Annotated[
        str | None,
        Field(
            description="one run's handle, ended up to the archive's window ago (a week by default); omit for your recent runs"
        ),
    ] = None,
) -> RunsResult:
    """Return runs as they stand now, without waiting: one run by its handle (with its parent and
    children), or, without a handle, your runs that are running or ended within the runtime's
    retention window (two minutes by default), on any runtime sharing its store. An older run is
    not listed, but its handle still answers here and in await."""
    who = runtime.who(ctx)
    runs = await runtime.runs_for([handle], who) if handle is not None else await runtime.listed(who)
    return RunsResult(runs=[view(r) for r in runs])


async def cancel(
    runtime: Runtime, handle: Annotated[str, Field(description="the run to cancel")], ctx: Context
) -> RunView:
    """Cancel a running run and every run under it, and return it; its status becomes cancelled.
    A run already done is returned unchanged."""
    await runtime.runs_for([handle], runtime.who(ctx))
    return view(await runtime.runs.cancel(handle))


async def approve(
    runtime: Runtime,
    handle: Annotated[str, Field(description="a run whose status is AwaitingApproval")],
    allow: Annotated[bool, Field(description="true to let the tool call run, false to decline it")],
    ctx: Context,
) -> RunView:
    """Answer a run's tool call that waits for approval (status AwaitingApproval, see
    pendingApproval): allow it, or decline it (the sub-agent is told the user declined)."""
    (run,) = await runtime.runs_for([handle], runtime.who(ctx))
    decided = decide_approval(runtime.runs, run, allow)
    await runtime.journal.durable()
    if decided is None:
        raise ToolError(f"run {handle} has no tool call waiting for approval (status {run.shown_status()})")
    return view(run)


async def list_tools(runtime: Runtime) -> ToolsResult:
    """List the tools sub-agents can use (name, server, description, and whether calls need
    the user's approval), and which tool servers are unreachable now."""
    tools, unavailable = runtime.tool_servers.catalog()
    return ToolsResult(
        tools=[
            ToolInfo(
                name=t.name,
                server=t.server,
                description=t.description,
                needsApproval=needs_approval(t.name, t.annotations, None),
            )
            for t in sorted(tools.values(), key=lambda t: t.name)
        ],
        unavailable=unavailable,
    )


async def decide(
    runtime: Runtime,
    input: Annotated[str, Field(description="the text to classify")],
    ctx: Context,
    labels: Annotated[
        list[str] | None,
        Field(description="2 to 20 labels to choose from; omit to use the classifier model's own labels"),
    ] = None,
    model: Annotated[
        str | None,
        Field(
            description="model to decide with; default: the classifier, or with labels the runtime's model"
        ),
    ] = None,
) -> dict[str, Any]:
    """Classify `input` in one quick model call: returns the chosen label, each label's
    probability, and which labels could not be scored. Cheaper than a sub-agent for routing.

    Without labels the pool's classifier model decides among its own classes; with 2 to 20
    labels a generative model picks one of them.
    """
    if labels is not None and not 2 <= len(labels) <= 20:
        raise ToolError(f"labels: give 2 to 20 labels, or none (got {len(labels)})")
    if model is None:
        model = runtime.decide_model(with_labels=labels is not None)
    if model is None:
        raise ToolError("no classifier model is configured (no single-pass replica): give 2 to 20 labels")
    body: dict[str, Any] = {"model": model, "input": input}
    if labels is not None:
        body["labels"] = labels
    headers = {CLASS_HEADER: INTERACTIVE, CALLER_HEADER: caller_header(runtime.who(ctx).caller)}
    try:
        return decision_of(await runtime.dataplane.decide(body, headers))
    except DecideFailed as e:
        raise ToolError(f"decide failed: {e}") from None


# Every tool, by the name clients call it with.
TOOLS: dict[str, Callable[..., Awaitable[Any]]] = {
    "spawn": spawn,
    "await": await_runs,
    "run": run,
    "status": status,
    "cancel": cancel,
    "approve": approve,
    "tools": list_tools,
    "decide": decide,
}


def _spawn_parameters() -> list[inspect.Parameter]:
    """SpawnArguments' fields as keyword parameters, annotated as the model declares them."""
    hints = typing.get_type_hints(SpawnArguments, include_extras=True)
    return [
        inspect.Parameter(
            name,
            inspect.Parameter.KEYWORD_ONLY,
            annotation=hints[name],
            default=inspect.Parameter.empty if field.is_required() else field.default,
        )
        for name, field in SpawnArguments.model_fields.items()
    ]


def as_tool(runtime: Runtime, fn: Callable[..., Awaitable[Any]]) -> Callable[..., Awaitable[Any]]:
    """`fn` as the SDK's tool function: `runtime` bound, spawn's arguments taken one by one and
    given to `fn` as one SpawnArguments, and the runs' refusals raised as tool errors."""
    hints = typing.get_type_hints(fn, include_extras=True)
    parameters: list[inspect.Parameter] = []
    takes_spawn_arguments = False
    for p in inspect.signature(fn).parameters.values():
        if p.name == "runtime":
            continue
        if hints.get(p.name) is SpawnArguments:
            takes_spawn_arguments = True
            parameters.extend(_spawn_parameters())
        else:
            parameters.append(p.replace(kind=inspect.Parameter.KEYWORD_ONLY, annotation=hints[p.name]))

    async def tool(**kwargs: Any) -> Any:
        if takes_spawn_arguments:
            fields = {name: kwargs.pop(name) for name in SpawnArguments.model_fields}
            kwargs["arguments"] = SpawnArguments(**fields)
        try:
            return await fn(runtime, **kwargs)
        except REFUSALS as e:
            raise ToolError(str(e)) from None

    # The SDK reads the tool's arguments, context parameter and result from these.
    tool.__name__ = tool.__qualname__ = fn.__name__
    tool.__signature__ = inspect.Signature(parameters, return_annotation=hints["return"])  # type: ignore[attr-defined]
    tool.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": hints["return"]}
    return tool


def register_tools(mcp: MCPServer, runtime: Runtime) -> None:
    """Adds every tool to `mcp`, described by its docstring without the indentation the SDK keeps."""
    for name, fn in TOOLS.items():
        mcp.add_tool(as_tool(runtime, fn), name=name, description=inspect.cleandoc(fn.__doc__ or ""))
