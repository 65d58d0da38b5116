"""The runtime's parts, wired together: journal, runs, sub-agent loop, tool servers, tasks.

`Runtime` starts and stops them as one, and holds what the MCP tools (mcp_tools.py) and GET
/status share: who a request is and which runs it may see (callers.py), spawn's checks of the
parent, model and tools it names before a run exists, and the status document.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from mcp.server.mcpserver.exceptions import ToolError

from luftpause.config import Config
from luftpause.runtime.agent import Agent
from luftpause.runtime.callers import NotYours, Who, who_of
from luftpause.runtime.journal_writer import JournalError, JsonlWriter
from luftpause.runtime.llm import Dataplane
from luftpause.runtime.metrics import RuntimeMetrics
from luftpause.runtime.restore import evict, rebuild, restore_at_start
from luftpause.runtime.run import Run
from luftpause.runtime.runs import Runs
from luftpause.runtime.spec import SpawnArguments
from luftpause.runtime.state_lock import StateLock
from luftpause.runtime.store import open_store
from luftpause.runtime.tasks import Tasks
from luftpause.runtime.tool_servers import ToolServers
from luftpause.runtime.views import link_among, status_runs

if TYPE_CHECKING:
    from luftpause.runtime.leases import Leases
    from luftpause.runtime.postgres_store import PostgresStore

log = logging.getLogger(__name__)

# How long spawn waits for tool servers still being connected to before judging its `tools`.
SPAWN_LISTING_WAIT_S = 5.0

# How long GET /status waits for a shared store's runs before it answers without them (saying
# so): the image's health check reads /status with a 2 s timeout, and a runtime whose database
# is down is still up, its runs waiting for the database.
STATUS_STORE_WAIT_S = 1.0


def _nothing() -> None:
    return None


def _step_failed(step: str, then: str, error: Exception) -> None:
    """Logs a failed step of a background pass: the disk's or the store's errors by their message,
    anything else with its traceback (nobody expected it)."""
    if isinstance(error, (OSError, JournalError)):
        log.error("%s failed (%s); %s", step, error, then)
    else:
        log.exception("%s failed; %s", step, then, exc_info=error)


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
        self.metrics = RuntimeMetrics(s.name for s in settings.mcp_servers)
        self.writer = JsonlWriter(self.metrics.journal_written)
        try:
            self.journal = open_store(settings, self.state_dir, self.writer)
        except BaseException:
            self.writer.close()
            self.state_lock.release()
            raise
        self.tool_servers = ToolServers(settings.mcp_servers)
        self.dataplane = Dataplane(settings.dataplane, token=token)
        self.agent = Agent(self.dataplane, self.tool_servers, settings.default_model, self.metrics)
        self.runs = Runs(self.journal, self.agent.drive, self.dataplane.end_run, self.metrics, settings)
        self.metrics.watch_runs(lambda: self.runs)
        self.tasks = Tasks(self.state_dir, self.runs, self.writer)
        self._evicting: asyncio.Task[None] | None = None
        # With a store runtimes share: this runtime's leases on the runs it drives (leases.py).
        self.leases: Leases | None = None

    async def start(self) -> None:
        self.tool_servers.start()
        retention_s = self.config.runtime.retention_s
        await restore_at_start(self.runs, retention_s, self.config.runtime.archive_retention_s)
        if self.journal.shared:
            from luftpause.runtime.leases import Leases

            self.leases = Leases(self.runs, cast("PostgresStore", self.journal))
            self.leases.start()
        self.tasks.restore()
        # Each tenth of the shorter window, between 1 s and 10 minutes.
        period_s = min(max(min(retention_s, self.config.runtime.task_retention_s) / 10, 1.0), 600.0)
        self._evicting = asyncio.create_task(self._evict_every(period_s), name="evict")
        log.info("runtime: runs kept in %s, dataplane at %s", self.journal.where, self.dataplane.base_url)

    async def _evict_every(self, period_s: float) -> None:
        """Finished runs older than the retention window leave memory for the archive."""
        while True:
            await asyncio.sleep(period_s)
            settings = self.config.runtime
            # Each step's failure is logged and the loop goes on: a loop that ended on an error
            # nobody expected would leave every later finished run in memory.
            try:
                await evict(self.runs, settings.retention_s)
            except Exception as e:
                _step_failed("moving finished runs to the archive", "they stay in memory", e)
            try:
                await asyncio.to_thread(self.journal.trim_archive, settings.archive_retention_s, time.time())
            except Exception as e:
                _step_failed("trimming the archive", "it is tried again at the next pass", e)
            try:
                self.tasks.trim()
            except Exception as e:
                _step_failed("rewriting tasks.jsonl", "it is tried again at the next pass", e)

    async def stop(self) -> None:
        """Stops every part in turn. A part that fails to stop (a journal the disk refused cannot
        be closed cleanly) is logged and the rest still stop: the tool servers are left, the
        journal is closed and the state directory's lock is released whatever came before."""
        if self._evicting is not None:
            self._evicting.cancel()
        parts: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("leases", self.leases.stop if self.leases is not None else _nothing),
            ("runs", self.runs.shutdown),
            ("leases held", self._release),
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

    async def _release(self) -> None:
        """With a shared store: its loops stopped, this runtime lets go of its runs' leases, so
        that another runtime resumes them at once rather than once they expire."""
        if self.leases is not None:
            await asyncio.to_thread(self.leases.store.release)

    async def spawn(self, arguments: SpawnArguments, who: Who) -> Run:
        """Spawns a run for `who`, once its parent, model and tools are known to be there; the
        run is on disk when this returns. Refusals are `ToolError`, `UnknownRun`, `NotYours`,
        `SpawnRefused` or `JournalError`, each saying why."""
        spec = arguments.spec(self.config.runtime.default_model)
        parent = (await self.runs_for([spec.parent], who))[0] if spec.parent is not None else None
        await self._check_model(spec.model)
        if spec.tools is not None:
            await self._check_tool_names(spec.tools)
        return await self.runs.spawn_durably(spec, who.caller, who.owner, parent)

    def who(self, ctx: Any) -> Who:
        """The identity of the request `ctx` belongs to (callers.py)."""
        return who_of(ctx, self.operator_token)

    async def listed(self, who: Who) -> list[Run]:
        """`who`'s runs that are running or ended within the retention window, in spawn order:
        those this runtime holds, and with a shared store those other runtimes drive or ended,
        read from the store as they stand (not kept: a list is asked for now and then)."""
        here = [r for r in self.runs if who.may_see(r)]
        if not self.journal.shared:
            return here
        there = [r for r in await self._stored_elsewhere() if who.may_see(r)]
        return sorted([*here, *there], key=lambda r: r.created_at)

    async def _stored_elsewhere(self) -> list[Run]:
        """With a shared store, the runs this runtime does not hold that are running or ended
        within the retention window (other runtimes drive or ended them), read from the store as
        they stand, in spawn order: new objects each call, none kept. [] with a store of its own."""
        if not self.journal.shared:
            return []
        since = time.time() - self.config.runtime.retention_s
        held = {r.handle for r in self.runs}
        stored = await asyncio.to_thread(self.journal.recent, since)
        loaded = await asyncio.to_thread(self.journal.load, [h for h in stored if h not in held])
        return sorted((r for r in map(rebuild, loaded) if r is not None), key=lambda r: r.created_at)

    async def runs_for(self, handles: list[str], who: Who) -> list[Run]:
        """The runs with these handles (each once, in order), if `who` may see each; else
        `UnknownRun` (or `NotYours`) for the first that it may not. Archived ones are read off
        the event loop."""
        runs = await self.runs.find(handles)
        for run in runs:
            if not who.may_see(run):
                raise NotYours(run.handle)
        return runs

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

    async def status_document(self) -> dict[str, Any]:
        """GET /status: every run (flat, and as trees with subtree totals), tool servers, tools.
        The runs are the fleet's: those this runtime holds and, with a shared store, those other
        runtimes drive or ended within the retention window, so that any runtime behind a
        balancer answers with the same runs; where the store cannot be read within
        `STATUS_STORE_WAIT_S`, the runs held here, and `notListed` says why."""
        tools, _ = self.tool_servers.catalog()
        elsewhere: list[Run] = []
        unread = None
        try:
            elsewhere = await asyncio.wait_for(self._stored_elsewhere(), STATUS_STORE_WAIT_S)
        except JournalError as e:
            unread = str(e)
        except TimeoutError:
            unread = f"the run store did not answer within {STATUS_STORE_WAIT_S:g} s"
        not_listed = f"the runs other runtimes drive are not listed: {unread}" if unread else None
        # Read for this document alone, so linking them into their trees changes no live run.
        runs, tree = status_runs(list(self.runs), link_among(elsewhere))
        return {
            "runs": runs,
            "tree": tree,
            # With a shared store that could not be read now: what is missing and why; else null.
            "notListed": not_listed,
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
