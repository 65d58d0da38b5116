"""MCP Tasks (`io.modelcontextprotocol/tasks`, protocol 2026-07-28) for the run tool.

A client that declares the extension on its `tools/call` of `run` gets a task at once instead of
waiting for the run in the call (`resultType: "task"`, with the task's id, status and times).
It then polls `tasks/get`: `working` while the run runs; `input_required` while one of its tool
calls waits for approval, with the approval as an elicitation in `inputRequests`; `completed`
once the run has ended, with the run as the tool result (`isError` when the run failed);
`cancelled` after `tasks/cancel` or once the run is cancelled any other way. It answers an approval with `tasks/update`.
Clients that do not declare the extension get `run` as one blocking call.

Tasks are journaled to `tasks.jsonl` beside `runs.jsonl`, one JSON object per line, through the
writer runs.jsonl uses (journal_writer.py), fsynced before the step is acknowledged:

    {"v":1,"type":"created","task":ID,"run":H,"at":T}
    {"v":1,"type":"closed","task":ID,"at":T,"status":S,"message":M}
        The task reached a terminal status (completed, cancelled or failed).

With a store that runtimes share (`[runtime] store = "postgresql://..."`), tasks are kept there
instead (postgres_store.py, `luftpause_tasks`), so that tasks/get, tasks/update and tasks/cancel
answer on any runtime: a task is read from the store when this runtime did not hand it out, and
its status comes from its run, wherever that runs; nothing is failed at a restart.

A task still open when the runtime stops is failed on restart (its run resumes as usual, and
await on the run's handle still answers), unless its run had ended (the process stopped between
the run's end and the task's `closed` record): then it closes as its run ended, as tasks/get had
already answered. A torn last line is skipped with a warning.

An ended task is kept for `[runtime] task_retention_s` (an hour by default; tasks/get says so as
its `ttlMs`), then forgotten: at start, and by the runtime's eviction pass, which then rewrites
tasks.jsonl with the tasks kept (beside the old file, renamed over it), so neither memory nor
the file grows with the tasks ever made. tasks/get of a forgotten task is an unknown task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mcp.server.context import CallNext, HandlerResult, ServerRequestContext
from mcp.server.extension import Extension, MethodBinding
from mcp.server.mcpserver.exceptions import ToolError
from mcp.shared.exceptions import MCPError
from mcp_types import CallToolRequestParams, CallToolResult, RequestParams, TextContent
from pydantic import ConfigDict, ValidationError

from luftpause.runtime.approvals import ApprovalForm, answer_of, decide_approval
from luftpause.runtime.arguments import readable_arguments_error
from luftpause.runtime.journal import read_records, replace_durably
from luftpause.runtime.journal_writer import JournalError, JsonlWriter
from luftpause.runtime.run import Run, UnknownRun
from luftpause.runtime.runs import REFUSALS, Runs
from luftpause.runtime.spec import SpawnArguments
from luftpause.runtime.views import view

if TYPE_CHECKING:
    from luftpause.runtime.parts import Runtime
    from luftpause.runtime.postgres_store import PostgresStore

log = logging.getLogger(__name__)

IDENTIFIER = "io.modelcontextprotocol/tasks"
TASKS_PROTOCOL_VERSIONS = frozenset({"2026-07-28"})
FILE_NAME = "tasks.jsonl"
POLL_INTERVAL_MS = 1000
INVALID_PARAMS = -32602
INTERNAL_ERROR = -32603


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, UTC).isoformat().replace("+00:00", "Z")


def task_approval_key(call_id: str) -> str:
    """The inputRequests key of one approval in a task (of one run); unique over the task's life,
    as the spec asks. An await's input-required result names the run too (elicitation.py)."""
    return f"approve:{call_id}"


def task_approval_call(key: str) -> str | None:
    """The tool_call id a `task_approval_key` names; None for any other key."""
    return key.removeprefix("approve:") if key.startswith("approve:") else None


def elicitation_request(run: Run, call_id: str) -> dict[str, Any] | None:
    """The approval of one pending call as an `elicitation/create` input request."""
    approval = run.approvals.get(call_id)
    if approval is None:
        return None
    return {
        "method": "elicitation/create",
        "params": {
            "mode": "form",
            "message": approval.question(run.handle),
            "requestedSchema": ApprovalForm.model_json_schema(),
        },
    }


@dataclass
class Task:
    task_id: str
    handle: str
    created_at: float
    updated_at: float
    # Set when the task is terminal for a reason of its own (cancelled, or failed by a restart).
    closed_status: str | None = None
    closed_message: str | None = None


class TaskParams(RequestParams):
    model_config = ConfigDict(populate_by_name=True, extra="allow")
    taskId: str


class UpdateTaskParams(TaskParams):
    inputResponses: dict[str, Any] = {}


def closing(run: Run) -> tuple[str, str | None]:
    """The terminal status and message of a task whose run has ended."""
    if run.status == "cancelled":
        return "cancelled", run.error
    return "completed", None


class Tasks:
    """Every task this runtime has handed out, and `tasks.jsonl` (or, with a store runtimes share,
    the store's tasks)."""

    def __init__(self, state_dir: str | os.PathLike[str], runs: Runs, writer: JsonlWriter) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.runs = runs
        self._tasks: dict[str, Task] = {}
        self._watchers: set[asyncio.Task[None]] = set()
        self.writer = writer
        # With a store runtimes share, tasks live there, so that tasks/* answers on any runtime.
        self.shared = cast("PostgresStore", runs.journal) if runs.journal.shared else None
        if self.shared is None:
            writer.open(self.path)  # a torn last line is ended; the next record starts on its own line

    def _append(self, record_type: str, task: str, **fields: Any) -> None:
        record = {"v": 1, "type": record_type, "task": task, "at": round(time.time(), 3), **fields}
        if self.shared is not None:
            self.shared.append_task(record)
        else:
            self.writer.append(self.path, record)

    async def durable(self) -> None:
        """Returns once every task record so far is stored."""
        if self.shared is not None:
            await self.shared.durable()
        else:
            await self.writer.durable()

    @property
    def retention_s(self) -> float:
        return self.runs.settings.task_retention_s

    def trim(self, now: float | None = None) -> int:
        """Forgets every task that ended more than `retention_s` ago, and rewrites tasks.jsonl
        without them (or drops them from the shared store); returns how many were forgotten."""
        now = time.time() if now is None else now
        old = [
            t
            for t in self._tasks.values()
            if t.closed_status is not None and now - t.updated_at > self.retention_s
        ]
        for task in old:
            del self._tasks[task.task_id]
        if self.shared is not None:
            return self.shared.trim_tasks(self.retention_s, now)
        if not old:
            return 0
        records: list[dict[str, Any]] = []
        for t in self._tasks.values():
            records.append(
                {"v": 1, "type": "created", "task": t.task_id, "run": t.handle, "at": t.created_at}
            )
            if t.closed_status is not None:
                records.append({"v": 1, "type": "closed", "task": t.task_id, "at": t.updated_at,
                                "status": t.closed_status, "message": t.closed_message})  # fmt: skip
        # Nothing is appended meanwhile: this runs on the event loop, which does all the appending.
        self.writer.flush()
        self.writer.close_file(self.path)
        try:
            replace_durably(self.path, records)
        finally:
            self.writer.open(self.path)
        log.info("tasks: %d ended more than %.0f s ago forgotten, %d kept", len(old), self.retention_s,
                 len(self._tasks))  # fmt: skip
        return len(old)

    def restore(self) -> None:
        """Reads tasks.jsonl; a task left open by the last process is failed now, and ended ones
        past the retention window are forgotten. With a shared store nothing is read (tasks are
        read from it when asked for) and nothing is failed: a task open there answers from its
        run, wherever that runs."""
        if self.shared is not None:
            self.trim()
            return
        self.writer.flush()
        open_tasks = []
        for record in read_records(self.path):
            task_id = record.get("task")
            if not isinstance(task_id, str):
                continue
            if record.get("type") == "created" and isinstance(record.get("run"), str):
                at = float(record.get("at") or 0.0)
                self._tasks[task_id] = Task(task_id, record["run"], at, at)
            elif record.get("type") == "closed" and task_id in self._tasks:
                task = self._tasks[task_id]
                task.closed_status = str(record.get("status") or "failed")
                task.closed_message = record.get("message")
                task.updated_at = float(record.get("at") or task.updated_at)
        for task in self._tasks.values():
            if task.closed_status is None:
                open_tasks.append(task)
        failed = 0
        for task in open_tasks:
            run = self._run_of(task.handle)
            if run is not None and not run.running:
                # Its run had ended, and tasks/get had said so; only the task's own closing
                # record was lost with the process. It closes as its run ended.
                self._close(task, *closing(run))
                continue
            message = (
                f"the runtime restarted while this task was open; its run {task.handle} goes on: "
                "call await with that handle for its result"
            )
            self._close(task, "failed", message)
            failed += 1
        if failed:
            log.info("tasks: %d open tasks failed after the restart", failed)
        try:
            self.trim()
        except (OSError, JournalError) as e:
            log.error("rewriting tasks.jsonl failed (%s); it is tried again at the next pass", e)

    def _close(self, task: Task, status: str, message: str | None) -> None:
        if task.closed_status is not None:
            return
        self._append("closed", task.task_id, status=status, message=message)
        task.closed_status, task.closed_message, task.updated_at = status, message, time.time()

    def create(self, run: Run) -> Task:
        """A task for a run, journaled before it is returned."""
        task = Task(f"task-{uuid.uuid4().hex}", run.handle, time.time(), time.time())
        self._append("created", task.task_id, run=run.handle)
        self._tasks[task.task_id] = task
        watcher = asyncio.create_task(self._close_when_done(task, run), name=f"task:{task.task_id}")
        self._watchers.add(watcher)
        watcher.add_done_callback(self._watchers.discard)
        return task

    def _run_of(self, handle: str) -> Run | None:
        """The task's run, in memory or archived (at start: the archive is read blocking)."""
        try:
            return self.runs.get(handle)
        except UnknownRun:
            return None

    async def _close_when_done(self, task: Task, run: Run) -> None:
        await run.done.wait()
        self._close(task, *closing(run))

    async def find(self, task_id: str) -> Task:
        """The task: one handed out here, or (with a shared store) one the store has, read off
        the event loop and not kept; an unknown task is an MCPError."""
        task = self._tasks.get(task_id)
        if task is None and self.shared is not None:
            row = await asyncio.to_thread(self.shared.task, task_id)
            if row is not None:
                task = Task(row["task"], row["run"], row["created_at"], row["updated_at"],
                            row["closed_status"], row["closed_message"])  # fmt: skip
        if task is None:
            raise MCPError(code=INVALID_PARAMS, message=f"unknown task {task_id!r}")
        return task

    async def detailed(self, task: Task) -> dict[str, Any]:
        """The task as tasks/get answers it (a DetailedTask); its run read off the event loop
        when it has left memory."""
        body: dict[str, Any] = {
            "taskId": task.task_id,
            "createdAt": iso(task.created_at),
            "lastUpdatedAt": iso(task.updated_at),
            "ttlMs": round(self.retention_s * 1000),
            "pollIntervalMs": POLL_INTERVAL_MS,
        }
        try:
            (run,) = await self.runs.find([task.handle])
        except UnknownRun:
            run = None
        if task.closed_status == "cancelled":
            return {**body, "status": "cancelled", "statusMessage": task.closed_message}
        if task.closed_status == "failed" or run is None:
            message = task.closed_message or f"run {task.handle} is unknown to this runtime"
            return {
                **body,
                "status": "failed",
                "statusMessage": message,
                "error": {"code": INTERNAL_ERROR, "message": message},
            }
        if run.status == "cancelled":
            return {**body, "status": "cancelled", "statusMessage": run.error}
        if not run.running:
            return {
                **body,
                "status": "completed",
                "lastUpdatedAt": iso(max(task.updated_at, task.created_at)),
                "result": run_result(run).model_dump(by_alias=True, mode="json", exclude_none=True),
            }
        if run.approvals:
            requests = {task_approval_key(c): elicitation_request(run, c) for c in list(run.approvals)}
            return {
                **body,
                "status": "input_required",
                "statusMessage": "a tool call waits for approval",
                "inputRequests": {k: v for k, v in requests.items() if v is not None},
            }
        return {**body, "status": "working", "statusMessage": f"run {run.handle} is running"}

    async def update(self, task: Task, responses: dict[str, Any]) -> None:
        """Applies approval answers from tasks/update; unknown or answered keys are ignored."""
        (run,) = await self.runs.find([task.handle])
        for key, response in responses.items():
            call_id = task_approval_call(key)
            if call_id is None or not isinstance(response, dict):
                continue
            decision = answer_of(str(response.get("action")), response.get("content"))
            if decision is not None:
                decide_approval(self.runs, run, decision, call_id)
        task.updated_at = time.time()

    async def cancel(self, task: Task) -> None:
        if task.closed_status is not None:
            return
        self._close(task, "cancelled", "cancelled through tasks/cancel")
        with contextlib.suppress(UnknownRun):
            await self.runs.cancel(task.handle, reason="cancelled through its task")

    async def close(self) -> None:
        for w in list(self._watchers):
            w.cancel()
        if self._watchers:
            await asyncio.wait(list(self._watchers), timeout=5)
        if self.shared is None:
            self.writer.close_file(self.path)


def run_result(run: Run) -> CallToolResult:
    """A finished run as the run tool's result."""
    shown = view(run).model_dump(mode="json")
    return CallToolResult(
        content=[TextContent(type="text", text=json.dumps(shown))],
        structured_content=shown,
        is_error=run.status != "finished",
    )


def refused(message: str) -> CallToolResult:
    """A run call refused before its task exists, as an error result saying why."""
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


def declared_tasks(ctx: ServerRequestContext[Any, Any]) -> bool:
    """Whether this request's client declared the Tasks extension (per request on 2026-07-28)."""
    if ctx.protocol_version not in TASKS_PROTOCOL_VERSIONS:
        return False
    capabilities = ctx.session.client_capabilities
    declared = capabilities.extensions if capabilities is not None else None
    return declared is not None and IDENTIFIER in declared


class TasksExtension(Extension):
    """The Tasks extension through the SDK's Extension hook: the run tool's task, and tasks/*."""

    identifier = IDENTIFIER

    def __init__(self, runtime: Runtime) -> None:
        self.runtime = runtime

    @property
    def tasks(self) -> Tasks:
        return self.runtime.tasks

    def methods(self) -> list[MethodBinding]:
        return [
            MethodBinding("tasks/get", TaskParams, self._get, TASKS_PROTOCOL_VERSIONS),
            MethodBinding("tasks/update", UpdateTaskParams, self._update, TASKS_PROTOCOL_VERSIONS),
            MethodBinding("tasks/cancel", TaskParams, self._cancel, TASKS_PROTOCOL_VERSIONS),
        ]

    async def intercept_tool_call(
        self, params: CallToolRequestParams, ctx: ServerRequestContext[Any, Any], call_next: CallNext
    ) -> HandlerResult:
        if params.name != "run" or not declared_tasks(ctx):
            return await call_next(ctx)
        try:
            arguments = SpawnArguments.of_call(dict(params.arguments or {}))
            run = await self.runtime.spawn(arguments, self.runtime.who(ctx))
        except ValidationError as e:
            return refused(readable_arguments_error("run", e))
        except (*REFUSALS, ToolError, ValueError) as e:
            return refused(str(e))
        try:
            task = self.tasks.create(run)
            await self.tasks.durable()
        except JournalError as e:
            return refused(str(e))
        body = {
            k: v
            for k, v in (await self.tasks.detailed(task)).items()
            if k not in ("result", "error", "inputRequests")
        }
        return {"resultType": "task", **body}

    async def _get(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> HandlerResult:
        return {"resultType": "complete", **(await self.tasks.detailed(await self.tasks.find(params.taskId)))}

    async def _update(self, ctx: ServerRequestContext[Any, Any], params: UpdateTaskParams) -> HandlerResult:
        await self.tasks.update(await self.tasks.find(params.taskId), params.inputResponses)
        return {"resultType": "complete"}

    async def _cancel(self, ctx: ServerRequestContext[Any, Any], params: TaskParams) -> HandlerResult:
        await self.tasks.cancel(await self.tasks.find(params.taskId))
        return {"resultType": "complete"}
