"""Runs: what a spawned sub-agent is, the registry of all of them, and waiting on them.

A run is created by spawn (journaled, then its loop starts as an asyncio task) or restored from
the journal at startup (finished runs only answer; unfinished ones get their loop again, from
their last complete tool round). It ends exactly once, as finished, failed or cancelled: the end
is journaled first, then announced to whoever awaits it. Stopping the runtime is not an end: a
run interrupted by shutdown stays unfinished in the journal and resumes on the next start.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from luftpause.runtime.journal import COUNTERS, Journal

log = logging.getLogger(__name__)

ServiceClass = Literal["interactive", "batch"]
RunStatus = Literal["running", "finished", "failed", "cancelled"]
AwaitMode = Literal["all", "any"]

DEFAULT_MAX_TOOL_CALLS = 8
DEFAULT_MAX_TOKENS = 256
DEFAULT_AWAIT_TIMEOUT_S = 60.0
MAX_AWAIT_TIMEOUT_S = 600.0


class UnknownRun(LookupError):
    """No run has this handle."""

    def __init__(self, handle: str) -> None:
        super().__init__(f"unknown run handle {handle!r}: no run with this handle was spawned here")


class RunSpec(BaseModel):
    """Everything spawn was asked for, as journaled; field names are the tool's argument names."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    task: str
    model: str
    serviceClass: ServiceClass = "interactive"
    system: str | None = None
    maxToolCalls: int = Field(default=DEFAULT_MAX_TOOL_CALLS, ge=0)
    tools: list[str] | None = None
    maxTokens: int = Field(default=DEFAULT_MAX_TOKENS, ge=0)


class RunView(BaseModel):
    """A run as await and status report it."""

    handle: str = Field(description="the run's handle, as spawn returned it")
    status: RunStatus = Field(description="running, finished, failed or cancelled")
    result: str | None = Field(description="the sub-agent's final answer once finished, else null")
    error: str | None = Field(description="why the run failed or was cancelled, else null")
    toolCalls: int = Field(description="tool calls made so far")
    failedToolCalls: int = Field(description="tool calls that errored or were refused as malformed")
    turns: int = Field(description="model turns so far")


@dataclass
class Run:
    handle: str
    spec: RunSpec
    caller: str | None
    created_at: float
    messages: list[dict[str, Any]]
    counters: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    status: RunStatus = "running"
    result: str | None = None
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None

    @property
    def running(self) -> bool:
        return self.status == "running"

    def view(self) -> RunView:
        return RunView(
            handle=self.handle,
            status=self.status,
            result=self.result,
            error=self.error,
            toolCalls=self.counters["toolCalls"],
            failedToolCalls=self.counters["failedToolCalls"],
            turns=self.counters["turns"],
        )

    def summary(self) -> dict[str, Any]:
        """The run as the runtime's GET /status lists it."""
        return {
            "handle": self.handle,
            "status": self.status,
            "parent": None,
            "task": self.spec.task,
            "model": self.spec.model,
            "serviceClass": self.spec.serviceClass,
            "caller": self.caller,
            "createdAt": self.created_at,
            **self.counters,
        }


def initial_messages(spec: RunSpec) -> list[dict[str, Any]]:
    """The conversation a run starts from: the optional system prompt, then the task."""
    messages: list[dict[str, Any]] = []
    if spec.system:
        messages.append({"role": "system", "content": spec.system})
    messages.append({"role": "user", "content": spec.task})
    return messages


def new_handle() -> str:
    return f"run-{uuid.uuid4().hex[:20]}"


# What drives a run once it exists: the sub-agent loop (see agent.py), given the registry to
# journal its rounds and its end through.
Driver = Callable[["Runs", Run], Awaitable[None]]
# What tells the dataplane a run is over.
EndHook = Callable[[str], Awaitable[None]]


class Runs:
    """Every run this runtime knows, live or restored from the journal."""

    def __init__(self, journal: Journal, driver: Driver, on_end: EndHook) -> None:
        self.journal = journal
        self._driver = driver
        self._on_end = on_end
        self._runs: dict[str, Run] = {}
        self._background: set[asyncio.Task[Any]] = set()

    def __iter__(self):
        return iter(list(self._runs.values()))

    def get(self, handle: str) -> Run:
        try:
            return self._runs[handle]
        except KeyError:
            raise UnknownRun(handle) from None

    def spawn(self, spec: RunSpec, caller: str | None) -> Run:
        """Journals the run, then starts its loop; returns once the journal has it."""
        handle = new_handle()
        self.journal.spawned(handle, spec.model_dump(), caller)
        run = Run(
            handle=handle, spec=spec, caller=caller, created_at=time.time(), messages=initial_messages(spec)
        )
        self._runs[handle] = run
        self._start(run)
        return run

    def _start(self, run: Run) -> None:
        run.task = asyncio.create_task(self._drive(run), name=f"run:{run.handle}")

    async def _drive(self, run: Run) -> None:
        try:
            await self._driver(self, run)
        except asyncio.CancelledError:
            # Either cancel() (which ends the run itself) or shutdown (which must not end it).
            raise
        except Exception as e:
            log.exception("run %s: the loop crashed", run.handle)
            self.finish(run, "failed", error=f"internal error in the runtime: {type(e).__name__}: {e}")
        if run.running:
            self.finish(
                run, "failed", error="internal error in the runtime: the loop ended without an answer"
            )
        await self._on_end(run.handle)

    def record_round(self, run: Run, messages: list[dict[str, Any]]) -> None:
        """Journals one complete tool round and adds it to the run's conversation."""
        if not run.running:
            return
        self.journal.round(run.handle, messages, dict(run.counters))
        run.messages.extend(messages)

    def finish(
        self, run: Run, status: RunStatus, result: str | None = None, error: str | None = None
    ) -> bool:
        """Ends the run once (journal first, then waiters); False when it had already ended."""
        if not run.running:
            return False
        self.journal.finished(run.handle, status, result, error, dict(run.counters))
        run.status, run.result, run.error = status, result, error
        run.done.set()
        log.info(
            "run %s %s after %d turns, %d tool calls",
            run.handle,
            status,
            run.counters["turns"],
            run.counters["toolCalls"],
        )
        return True

    async def cancel(self, handle: str) -> Run:
        """Cancels a running run (journaled as cancelled); a run that already ended is left alone."""
        run = self.get(handle)
        if not self.finish(run, "cancelled", error="cancelled by the client"):
            return run
        task = run.task
        if task is not None and not task.done():
            task.cancel()
            # Let its turn's connection close first, so the dataplane sees the abandoned turn
            # before it hears that the run ended.
            await asyncio.wait([task], timeout=5)
        self._in_background(self._on_end(run.handle))
        return run

    def _in_background(self, coro: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def wait(self, handles: list[str], mode: AwaitMode, timeout_s: float) -> tuple[list[Run], bool]:
        """Waits until all (or any) of the runs have ended, or the timeout; returns them and timedOut."""
        unique = list(dict.fromkeys(handles))
        runs = [self.get(h) for h in unique]
        timeout_s = min(max(timeout_s, 0.0), MAX_AWAIT_TIMEOUT_S)

        def satisfied() -> bool:
            ended = [not r.running for r in runs]
            return any(ended) if mode == "any" else all(ended)

        if not runs or satisfied():
            return runs, False
        waiters = [asyncio.ensure_future(r.done.wait()) for r in runs if r.running]
        try:
            await asyncio.wait(
                waiters,
                timeout=timeout_s,
                return_when=asyncio.FIRST_COMPLETED if mode == "any" else asyncio.ALL_COMPLETED,
            )
        finally:
            for w in waiters:
                w.cancel()
        return runs, not satisfied()

    def restore(self) -> None:
        """Rebuilds runs from the journal; unfinished ones resume from their last tool round."""
        resumed = 0
        for replayed in self.journal.replay():
            try:
                spec = RunSpec.model_validate(replayed.spec)
            except ValueError as e:
                log.warning("run %s: journaled spec is unreadable (%s); not restored", replayed.handle, e)
                continue
            messages = initial_messages(spec)
            for round_messages in replayed.rounds:
                messages.extend(round_messages)
            run = Run(
                handle=replayed.handle,
                spec=spec,
                caller=replayed.caller,
                created_at=replayed.spawned_at,
                messages=messages,
                counters=dict(replayed.counters),
            )
            self._runs[run.handle] = run
            if replayed.finished is not None:
                status = replayed.finished.get("status")
                run.status = status if status in ("finished", "failed", "cancelled") else "failed"
                run.result = replayed.finished.get("result")
                run.error = replayed.finished.get("error")
                run.done.set()
            else:
                resumed += 1
                log.info("run %s: resuming after %d journaled tool rounds", run.handle, len(replayed.rounds))
                self._start(run)
        if self._runs:
            log.info("journal: %d runs restored, %d of them resumed", len(self._runs), resumed)

    async def shutdown(self) -> None:
        """Stops every loop without ending its run, so that the next start resumes it."""
        tasks = [r.task for r in self._runs.values() if r.task is not None and not r.task.done()]
        tasks.extend(self._background)
        for t in tasks:
            t.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=10)
