"""The runtime's MCP server: spawn sub-agents, await them, see them, approve their tool calls.

`POST /mcp` speaks both wires of the `mcp` SDK: legacy stateful sessions (initialize, then
mcp-session-id) and the sessionless 2026-07-28 protocol. `GET /status` returns the run tree as
JSON, with CORS headers for the allowed origins so that the scheduler's status page can show it.
Each spawned run is a sub-agent whose loop (agent.py) runs as an asyncio task in this process; every run is
journaled (journal.py) and restored when the runtime starts again; one runtime at a time may use
a state directory (state_lock.py).

Approvals reach the harness user while an await or run covers the run, if the client advertises
elicitation: on a legacy session as an elicitation request inside the call, on a sessionless
2026-07-28 request as an input-required result that the client answers by retrying the call.
Tasks clients get run as a task (tasks.py). With `LUFTPAUSE_TOKEN` set, /mcp and /status need
it as a bearer token (auth.py).

The tools' descriptions are what the harness model reads, so they say what each tool does and
returns in a sentence or two.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import logging
import os
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Annotated, Any

import uvicorn
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError, UnexpectedToolError
from mcp_types import ElicitRequest, ElicitRequestFormParams, InputRequiredResult
from mcp_types.version import MODERN_PROTOCOL_VERSIONS
from pydantic import BaseModel, Field, ValidationError
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from luftpause import __version__, logs
from luftpause.config import OPERATOR_TOKEN_ENV, TOKEN_ENV, Config
from luftpause.hosts import HostGuard, allowed_hosts
from luftpause.runtime.agent import Agent, caller_header
from luftpause.runtime.approvals import Approval, ApprovalForm, answer_of, needs_approval
from luftpause.runtime.arguments import readable_arguments_error
from luftpause.runtime.auth import BearerAuth, cors_headers
from luftpause.runtime.callers import NotYours, Who, who_of
from luftpause.runtime.journal import Journal
from luftpause.runtime.journal_writer import JournalError, JsonlWriter
from luftpause.runtime.llm import Dataplane, DecideFailed, decision_of
from luftpause.runtime.runs import (
    DEFAULT_AWAIT_TIMEOUT_S,
    DEFAULT_MAX_TOKENS,
    DEFAULT_MAX_TOOL_CALLS,
    MAX_AWAIT_TIMEOUT_S,
    AwaitMode,
    Run,
    Runs,
    RunSpec,
    RunView,
    ServiceClass,
    SpawnRefused,
    UnknownRun,
)
from luftpause.runtime.state_lock import StateDirInUse, StateLock
from luftpause.runtime.tasks import Tasks, TasksExtension
from luftpause.runtime.tool_servers import ToolServers

log = logging.getLogger(__name__)

# How long spawn waits for tool servers still being connected to before judging its `tools`.
SPAWN_LISTING_WAIT_S = 5.0


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


# How an approval is named in an input-required result's inputRequests.
def approval_key(run: Run, approval: Approval) -> str:
    return f"approve:{run.handle}:{approval.call_id}"


def parse_approval_key(key: str) -> tuple[str, str] | None:
    parts = key.split(":", 2)
    return (parts[1], parts[2]) if len(parts) == 3 and parts[0] == "approve" else None


class Runtime:
    """The runtime's parts, wired together: journal, runs, sub-agent loop, tool servers, tasks."""

    def __init__(
        self,
        config: Config,
        state_dir: str | None = None,
        token: str | None = None,
        operator_token: str | None = None,
    ) -> None:
        settings = config.runtime
        self.config = config
        self.operator_token = operator_token
        self.state_dir = Path(state_dir or settings.state_dir)
        # Before anything reads the directory: a second runtime here must not resume these runs.
        self.state_lock = StateLock(self.state_dir)
        self.writer = JsonlWriter()
        self.journal = Journal(self.state_dir, self.writer)
        self.tool_servers = ToolServers(settings.mcp_servers)
        self.dataplane = Dataplane(settings.dataplane, token=token)
        self.agent = Agent(self.dataplane, self.tool_servers, settings.default_model)
        self.runs = Runs(self.journal, self.agent.drive, self.dataplane.end_run)
        self.tasks = Tasks(self.state_dir, self.runs, self.writer)
        self._evicting: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.tool_servers.start()
        retention_s = self.config.runtime.retention_s
        self.runs.restore(retention_s)
        self.tasks.restore()
        self._evicting = asyncio.create_task(self._evict_every(min(retention_s / 10, 600.0)), name="evict")
        log.info("runtime: journal at %s, dataplane at %s", self.journal.path, self.dataplane.base_url)

    async def _evict_every(self, period_s: float) -> None:
        """Finished runs older than the retention window leave memory for the archive."""
        while True:
            await asyncio.sleep(period_s)
            try:
                await self.runs.evict(self.config.runtime.retention_s)
            except OSError as e:
                log.error("moving finished runs to the archive failed (%s); they stay in memory", e)

    async def stop(self) -> None:
        """Stops every part in turn. A part that fails to stop (a journal the disk refused cannot
        be closed cleanly) is logged and the rest still stop: the tool servers are left, the
        journal is closed and the state directory's lock is released whatever came before."""
        if self._evicting is not None:
            self._evicting.cancel()
        parts: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("runs", self.runs.shutdown),
            ("tasks", self.tasks.close),
            ("tool servers", self.tool_servers.close),
            ("dataplane client", self.dataplane.close),
            ("journal", self.journal.close),
            ("journal writer", self.writer.close),
        )
        try:
            for name, stop in parts:
                try:
                    stopped = stop()
                    if inspect.isawaitable(stopped):
                        await stopped
                except Exception as e:
                    log.warning("stopping the %s failed: %s", name, e)
        finally:
            self.state_lock.release()

    def spec_from(self, arguments: dict[str, Any]) -> RunSpec:
        """A RunSpec from spawn's (or run's) arguments, with the default model filled in."""
        known = {k: v for k, v in arguments.items() if k in RunSpec.model_fields and v is not None}
        known.setdefault("model", self.config.runtime.default_model)
        return RunSpec.model_validate(known)

    def who(self, ctx: Any) -> Who:
        """The identity of the request `ctx` belongs to (callers.py)."""
        return who_of(ctx, self.operator_token)

    def run_for(self, handle: str, who: Who) -> Run:
        """The run with this handle, if `who` may see it; else `UnknownRun` (or `NotYours`)."""
        run = self.runs.get(handle)
        if not who.may_see(run):
            raise NotYours(handle)
        return run

    async def spawn(self, spec: RunSpec, who: Who) -> str:
        if spec.parent is not None:
            self.run_for(spec.parent, who)
        await self._check_model(spec.model)
        if spec.tools is not None:
            await self._check_tool_names(spec.tools)
        return (await self.runs.spawn_durably(spec, who.caller, who.owner)).handle

    async def _check_model(self, model: str) -> None:
        """Refuses a model the dataplane does not serve, so that spawn fails now, not the run later."""
        served = await self.dataplane.models()
        if served is None:
            # The dataplane cannot say now (down, restarting): the run's first turn will tell.
            log.warning(
                "spawn: cannot list the dataplane's models at %s; not checking %r",
                self.dataplane.base_url,
                model,
            )
            return
        if model not in served:
            raise ToolError(
                f"unknown model {model!r}: the pool serves {', '.join(repr(m) for m in served) or 'no models'}; "
                f"name one of them, or omit model for the default ({self.config.runtime.default_model!r})."
            )

    async def _check_tool_names(self, names: list[str]) -> None:
        tools, unavailable = self.tool_servers.catalog()
        if all(n in tools for n in names):
            return
        if unavailable:
            await self.tool_servers.listed(SPAWN_LISTING_WAIT_S)
            tools, unavailable = self.tool_servers.catalog()
        unknown = [n for n in names if n not in tools]
        if unknown:
            message = (
                f"unknown tools: {', '.join(unknown)}. Available tools: {', '.join(sorted(tools)) or 'none'}."
            )
            if unavailable:
                message += " Not reachable now: " + "; ".join(unavailable) + "."
            raise ToolError(message)

    def decide_model(self, with_labels: bool) -> str | None:
        """The model decide uses when none is named: with labels the runtime's own (generative)
        model, without them the first single-pass (classifier) model in the pool."""
        if with_labels:
            return self.config.runtime.default_model
        return next((r.models[0] for r in self.config.replicas if r.kind == "single-pass"), None)

    def tools_result(self) -> ToolsResult:
        tools, unavailable = self.tool_servers.catalog()
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

    def status_document(self) -> dict[str, Any]:
        """GET /status: every run (flat, and as a tree with subtree totals), tool servers, tools."""
        tools, _ = self.tool_servers.catalog()

        def node(run: Run) -> dict[str, Any]:
            return {**run.summary(), "children": [node(c) for c in run.children]}

        return {
            "runs": [run.summary() for run in self.runs],
            "tree": [node(root) for root in self.runs.roots()],
            "toolServers": [
                {
                    "name": s.name,
                    "tools": [t.name for t in s.tools] if s.tools is not None else None,
                    "problem": s.problem,
                }
                for s in self.tool_servers.servers
            ],
            "tools": sorted(tools),
        }

    async def await_runs(
        self,
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
        who = self.who(ctx)
        for handle in handles:
            self.run_for(handle, who)
        caps = ctx.client_capabilities
        can_elicit = caps is not None and caps.elicitation is not None
        modern = ctx.protocol_version in MODERN_PROTOCOL_VERSIONS
        deadline = float(state.get("deadline") or time.time() + min(max(timeout_s, 0.0), MAX_AWAIT_TIMEOUT_S))
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
                self.runs.decide_approval(self.run_for(target[0], who), decision, target[1])

        def unasked(run: Run, approval: Approval) -> bool:
            return approval_key(run, approval) not in dismissed

        stop = unasked if can_elicit else (lambda r, a: True) if return_on_approval else None
        while True:
            remaining = deadline - time.time()
            runs, timed_out = await self.runs.wait(handles, mode, max(remaining, 0.0), stop_on_approval=stop)
            ended = [not r.running for r in runs]
            if timed_out or (any(ended) if mode == "any" else all(ended)) or not can_elicit:
                return runs, timed_out
            pending = [(r, a) for r in runs for a in list(r.approvals.values()) if unasked(r, a)]
            if not pending:
                continue
            if modern:
                requests = {
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
                    self.runs.decide_approval(run, decision, approval.call_id)


def request_state(ctx: Context) -> dict[str, Any]:
    """What an earlier round of this call left in its input-required result (the SDK seals it)."""
    try:
        state = json.loads(ctx.request_state) if ctx.request_state else {}
    except ValueError:
        return {}
    return state if isinstance(state, dict) else {}


TaskArg = Annotated[str, Field(description="what the sub-agent should do: its first user message")]
ModelArg = Annotated[str | None, Field(description="model to run on; default: the runtime's")]
ClassArg = Annotated[
    ServiceClass, Field(description="interactive (someone waits on it) or batch (background)")
]
SystemArg = Annotated[str | None, Field(description="system prompt for the sub-agent")]
MaxToolCallsArg = Annotated[
    int, Field(ge=0, description="tool calls it may make before it must answer (default 8)")
]
ToolsArg = Annotated[
    list[str] | None, Field(description="names of the tools it may use (see tools); default: all")
]
MaxTokensArg = Annotated[
    int, Field(ge=0, description="reply length limit per model turn (default 256); 0 leaves it to the engine")
]
ParallelArg = Annotated[
    bool, Field(description="let the model ask for several tool calls per reply and run them at once")
]
ParentArg = Annotated[
    str | None, Field(description="handle of the run this one works for: it becomes that run's child")
]
BudgetTokensArg = Annotated[
    int | None, Field(ge=1, description="prompt+completion tokens this run and all runs under it may use")
]
BudgetToolCallsArg = Annotated[
    int | None, Field(ge=0, description="tool calls this run and all runs under it may make together")
]
BudgetSecondsArg = Annotated[
    float | None, Field(gt=0, description="seconds this run and all runs under it may take, from now")
]
ApproveToolsArg = Annotated[
    list[str] | None, Field(description="tools whose every call waits for the user's approval")
]


class RuntimeMCP(MCPServer):
    """The SDK's server, with arguments that fail the tool's schema refused in one sentence (the
    SDK's own message is pydantic's, with a URL per error) instead of a validation dump."""

    async def call_tool(self, name: str, arguments: dict[str, Any], context: Any = None) -> Any:
        try:
            return await super().call_tool(name, arguments, context)
        except ToolError as e:
            if isinstance(e.__cause__, ValidationError) and not isinstance(e, UnexpectedToolError):
                raise ToolError(readable_arguments_error(name, e.__cause__)) from None
            raise


def build_mcp(runtime: Runtime) -> MCPServer:
    """The MCP server with the runtime's tools, and the Tasks extension."""
    mcp = RuntimeMCP(
        "luftpause",
        version=__version__,
        instructions=(
            "Sub-agents on a shared model pool. spawn starts one and returns a handle at once; "
            "spawn several to work in parallel, then await them together. run does both for one. "
            "Runs survive restarts. A run shown as AwaitingApproval waits for approve."
        ),
        extensions=[TasksExtension(runtime)],
    )

    def tool(name: str | None = None):
        # The SDK passes docstrings through with their indentation; the model should not see it.
        def register(fn):
            mcp.add_tool(fn, name=name, description=inspect.cleandoc(fn.__doc__ or ""))
            return fn

        return register

    def spec_of(**arguments: Any) -> RunSpec:
        try:
            return runtime.spec_from(arguments)
        except ValidationError as e:
            raise ToolError(readable_arguments_error("spawn", e)) from None

    async def spawn_checked(spec: RunSpec, ctx: Context) -> str:
        try:
            return await runtime.spawn(spec, runtime.who(ctx))
        except (UnknownRun, SpawnRefused, JournalError) as e:
            raise ToolError(str(e)) from None

    @tool()
    async def spawn(
        task: TaskArg,
        ctx: Context,
        model: ModelArg = None,
        serviceClass: ClassArg = "interactive",
        system: SystemArg = None,
        maxToolCalls: MaxToolCallsArg = DEFAULT_MAX_TOOL_CALLS,
        tools: ToolsArg = None,
        maxTokens: MaxTokensArg = DEFAULT_MAX_TOKENS,
        parallelToolCalls: ParallelArg = False,
        parent: ParentArg = None,
        budgetTokens: BudgetTokensArg = None,
        budgetToolCalls: BudgetToolCallsArg = None,
        budgetSeconds: BudgetSecondsArg = None,
        approveTools: ApproveToolsArg = None,
    ) -> SpawnResult:
        """Start a sub-agent on `task` and return its handle at once, without waiting for it.

        The sub-agent answers with the help of the tool servers' tools (see tools); collect its
        answer with await. Spawn several and await them together to work in parallel. With
        `parent`, the run is a child of that run; budgets cap a run and everything spawned under it.
        """
        spec = spec_of(**{k: v for k, v in locals().items() if k not in ("ctx",)})
        return SpawnResult(handle=await spawn_checked(spec, ctx))

    @tool(name="await")
    async def await_runs(
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
        try:
            outcome = await runtime.await_runs(ctx, handles, mode, timeout, request_state(ctx))
            # What it reports (an end, a decision) is on disk before the client hears of it.
            await runtime.journal.durable()
        except (UnknownRun, JournalError) as e:
            raise ToolError(str(e)) from None
        if isinstance(outcome, InputRequiredResult):
            return outcome
        runs, timed_out = outcome
        return AwaitResult(
            runs=[r.view() for r in runs],
            timedOut=timed_out,
            needsApproval=[r.handle for r in runs if r.running and r.approvals],
        )

    @tool()
    async def run(
        task: TaskArg,
        ctx: Context,
        model: ModelArg = None,
        serviceClass: ClassArg = "interactive",
        system: SystemArg = None,
        maxToolCalls: MaxToolCallsArg = DEFAULT_MAX_TOOL_CALLS,
        tools: ToolsArg = None,
        maxTokens: MaxTokensArg = DEFAULT_MAX_TOKENS,
        parallelToolCalls: ParallelArg = False,
        parent: ParentArg = None,
        budgetTokens: BudgetTokensArg = None,
        budgetToolCalls: BudgetToolCallsArg = None,
        budgetSeconds: BudgetSecondsArg = None,
        approveTools: ApproveToolsArg = None,
    ) -> RunView | InputRequiredResult:
        """Start a sub-agent on `task` and wait for it in the same call; return the finished run
        (status, result, error, toolCalls, failedToolCalls, turns).

        Takes spawn's arguments. Use it for one sub-agent you need before going on; to work in
        parallel, spawn several and await them instead.
        """
        state = request_state(ctx)
        handle = state.get("handle")
        if not isinstance(handle, str):
            spec = spec_of(**{k: v for k, v in locals().items() if k not in ("ctx", "state", "handle")})
            handle = await spawn_checked(spec, ctx)
            state = {"handle": handle}
        while True:
            try:
                outcome = await runtime.await_runs(
                    ctx, [handle], "all", MAX_AWAIT_TIMEOUT_S, state, return_on_approval=False
                )
            except UnknownRun as e:
                raise ToolError(str(e)) from None
            if isinstance(outcome, InputRequiredResult):
                return outcome
            (done,), _ = outcome
            if not done.running:
                return done.view()
            state = {"handle": handle}

    @tool()
    async def status(
        ctx: Context,
        handle: Annotated[str | None, Field(description="one run's handle; omit for all of yours")] = None,
    ) -> RunsResult:
        """Return runs as they stand now, without waiting: one run (with its parent and children),
        or every run you spawned."""
        who = runtime.who(ctx)
        try:
            runs = (
                [runtime.run_for(handle, who)]
                if handle is not None
                else [r for r in runtime.runs if who.may_see(r)]
            )
        except UnknownRun as e:
            raise ToolError(str(e)) from None
        return RunsResult(runs=[r.view() for r in runs])

    @tool()
    async def cancel(handle: Annotated[str, Field(description="the run to cancel")], ctx: Context) -> RunView:
        """Cancel a running run and every run under it, and return it; its status becomes cancelled.
        A run already done is returned unchanged."""
        try:
            runtime.run_for(handle, runtime.who(ctx))
            run = await runtime.runs.cancel(handle)
        except (UnknownRun, JournalError) as e:
            raise ToolError(str(e)) from None
        return run.view()

    @tool()
    async def approve(
        handle: Annotated[str, Field(description="a run whose status is AwaitingApproval")],
        allow: Annotated[bool, Field(description="true to let the tool call run, false to decline it")],
        ctx: Context,
    ) -> RunView:
        """Answer a run's tool call that waits for approval (status AwaitingApproval, see
        pendingApproval): allow it, or decline it (the sub-agent is told the user declined)."""
        try:
            run = runtime.run_for(handle, runtime.who(ctx))
        except UnknownRun as e:
            raise ToolError(str(e)) from None
        try:
            decided = runtime.runs.decide_approval(run, allow)
            await runtime.journal.durable()
        except JournalError as e:
            raise ToolError(str(e)) from None
        if decided is None:
            raise ToolError(
                f"run {handle} has no tool call waiting for approval (status {run.shown_status()})"
            )
        return run.view()

    @tool(name="tools")
    async def list_tools() -> ToolsResult:
        """List the tools sub-agents can use (name, server, description, and whether calls need
        the user's approval), and which tool servers are unreachable now."""
        return runtime.tools_result()

    @tool()
    async def decide(
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
        headers = {"x-luftpause-class": "interactive"}
        headers["x-luftpause-caller"] = caller_header(runtime.who(ctx).caller)
        try:
            return decision_of(await runtime.dataplane.decide(body, headers))
        except DecideFailed as e:
            raise ToolError(f"decide failed: {e}") from None

    @mcp.custom_route("/status", methods=["GET", "OPTIONS"])
    async def status_route(request: Request) -> Response:
        cors = cors_headers(request.headers.get("origin"))
        if request.method == "OPTIONS":
            return Response(status_code=204, headers=cors)
        return JSONResponse(runtime.status_document(), headers=cors)

    return mcp


def build_app(config: Config, state_dir: str | None = None, token: str | None = None) -> Starlette:
    """The ASGI app: /mcp and /status, with the runtime started and stopped by its lifespan.

    `token` (default: `LUFTPAUSE_TOKEN` from the environment) guards /mcp and /status and is sent
    to the dataplane; without one everyone is accepted, with a warning.
    """
    if token is None:
        token = os.environ.get(TOKEN_ENV) or None
    if token is None:
        log.warning("runtime: %s is not set: /mcp and /status accept everyone", TOKEN_ENV)
    operator_token = os.environ.get(OPERATOR_TOKEN_ENV) or None
    runtime = Runtime(config, state_dir, token=token, operator_token=operator_token)
    mcp = build_mcp(runtime)
    app = mcp.streamable_http_app(host=config.runtime.host)
    if token is not None:
        app.add_middleware(BearerAuth, token=token, operator_token=operator_token)
    # Added last, so it runs first: a foreign Host or Origin is refused before anything else.
    app.add_middleware(HostGuard, allowed=allowed_hosts(config))
    session_manager_lifespan = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(a: Starlette) -> AsyncIterator[None]:
        await runtime.start()
        try:
            async with session_manager_lifespan(a):
                yield
        finally:
            await runtime.stop()

    app.router.lifespan_context = lifespan
    app.state.runtime = runtime
    return app


def serve(config: Config, state_dir: str | None = None) -> None:
    """Serves the runtime on config.runtime.host:port until SIGINT or SIGTERM."""
    try:
        app = build_app(config, state_dir)
    except StateDirInUse as e:
        raise SystemExit(f"luftpause runtime: {e}") from None
    settings = config.runtime
    log.info("runtime: MCP at http://%s:%d/mcp, status at /status", settings.host, settings.port)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_config=None,
            access_log=logs.access_log(),
            # An await may hold its request open for minutes; do not wait for it on shutdown.
            timeout_graceful_shutdown=3,
        )
    )
    server.run()
