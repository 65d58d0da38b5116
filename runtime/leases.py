"""Runs shared by several runtimes: one runtime drives each run, under a lease, and every runtime
answers for every run.

With the PostgreSQL store (postgres_store.py) a run is driven by the runtime holding its lease,
a row in `luftpause_leases` (run, owner, expires): taken when the run is spawned (or resumed at
start), renewed every third of `[runtime] lease_s` while the runtime lives, let go when the run
ends. A row rather than an advisory lock: an advisory lock lives as long as one connection, so a
runtime whose connection dropped (a database restart, a network blip) would lose every run at
once, and one cut off from the database but still connected by a half-open TCP socket would keep
them for as long as the kernel keeps the socket; a row lives until its expiry, in the database's
clock (runtimes' clocks need not agree), can be read by anyone (which runtime drives what), and
fences the holder's writes: a record of a run goes in only while the writer holds its lease, so
a runtime that lost a run (paused past its lease, then woken) cannot write a step of it.

The keeper here, every third of the lease:
- renews this runtime's leases; a run whose lease it lost stops here (`Runs.let_go`);
- takes every lease whose holder has not renewed it in time (a runtime killed, or cut off) and
  resumes those runs from their last journaled step, as a restart does (`restore.take_over`).
  Not in the first round after the store could not be reached: an outage longer than `lease_s`
  lets every lease expire, and the runtimes driving those runs, cut off as well, renew them
  in their own first round back, so each keeps its runs instead of the quickest taking all;
- reads again the runs it shows as driven elsewhere, and links into each tree under a budget
  the runs spawned in it on other runtimes (`Runs.link_children_elsewhere`), so that the budget
  counts what they spent.

Any runtime answers status, await, cancel and approve for any run: one it does not drive is read
from the store (`Runs.find`). A cancel or an approval from a runtime that does not drive the run
is a record in the store like any other, and the end of a run and each approval decided are
notified on the store's channel (LISTEN/NOTIFY): the runtime driving the run stops it or goes on
with the decision, and a runtime whose client awaits the run wakes it at once. A notification
lost with a connection is made up for by the keeper's reading: an await hears of a run that
ended elsewhere at most a third of `lease_s` late.

When a runtime dies, its runs resume on another once their leases expire: between `lease_s` and
`lease_s` plus a third of it after its last renewal.
"""

from __future__ import annotations

import asyncio
import logging
import threading

from luftpause.runtime.journal_writer import JournalError
from luftpause.runtime.postgres_store import PostgresStore
from luftpause.runtime.restore import take_over
from luftpause.runtime.runs import Runs

log = logging.getLogger(__name__)


class Leases:
    """Keeps this runtime's leases, takes the expired ones, and hears of runs acted on elsewhere."""

    def __init__(self, runs: Runs, store: PostgresStore) -> None:
        self.runs, self.store = runs, store
        self.period_s = store.lease_s / 3
        self._stopping = threading.Event()
        self._listener: threading.Thread | None = None
        self._keeping: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._refreshing: set[asyncio.Task[None]] = set()
        # The last round could not reach the store: the next one takes no lease (`tick`).
        self._cut_off = False

    def start(self) -> None:
        """Starts the keeper and the listener (on the event loop)."""
        self._loop = asyncio.get_running_loop()
        self._listener = threading.Thread(
            target=self.store.listen, args=(self._heard, self._stopping), name="store-listener", daemon=True
        )
        self._listener.start()
        self._keeping = asyncio.create_task(self._keep(), name="leases")

    async def stop(self) -> None:
        """Stops keeping leases; the runs' loops are stopped by the caller, and then `release`."""
        self._stopping.set()
        if self._keeping is not None:
            self._keeping.cancel()
            await asyncio.wait([self._keeping], timeout=5)
        for task in self._refreshing:
            task.cancel()
        if self._listener is not None:
            await asyncio.to_thread(self._listener.join, 5)

    async def _keep(self) -> None:
        while True:
            await asyncio.sleep(self.period_s)
            try:
                await self.tick()
            except JournalError as e:
                self._cut_off = True
                log.warning("leases not renewed this time (%s); runs driven here go on", e)
            except Exception:
                # Anything else (a driver error the store does not translate) is taken as an outage
                # too: the keeper must go on, or the other runtimes take these runs.
                self._cut_off = True
                log.exception("leases not renewed this time; runs driven here go on")

    async def tick(self) -> None:
        """One round of the keeper: renew, take the expired, read the runs shown elsewhere again."""
        lost = await asyncio.to_thread(self.store.renew)
        for handle in lost:
            self.runs.let_go(handle)
        # Back from an outage: every lease may have expired in it; their holders renew them now.
        taken = [] if self._cut_off else await asyncio.to_thread(self.store.take_expired)
        self._cut_off = False
        if taken:
            resumed = take_over(self.runs, await asyncio.to_thread(self.store.load, taken))
            await self.runs.link_to_parents_elsewhere()
            log.warning(
                "took over %d runs whose leases expired (their runtime stopped renewing them); %d resumed",
                len(taken),
                len(resumed),
            )
        shown = [h for h, r in self.runs.foreign.items() if r.running]
        await self.refresh([*lost, *shown])
        try:
            await self.runs.link_children_elsewhere()
        except JournalError as e:
            log.warning("reading the runs below budgets on other runtimes failed (%s); next round", e)

    async def refresh(self, handles: list[str]) -> None:
        """Reads these runs from the store again and tells the registry what changed."""
        if handles:
            self.runs.stored_news(await asyncio.to_thread(self.store.load, list(dict.fromkeys(handles))))

    def _heard(self, kind: str | None, handle: str | None) -> None:
        """From the listener's thread: a run ended or an approval was decided (None: anything may
        have been, while the listener was reconnecting)."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._news, handle)

    def _news(self, handle: str | None) -> None:
        if handle is None:
            handles = [*self.runs.foreign, *(r.handle for r in self.runs if r.running and r.approvals)]
        else:
            held = self.runs.held(handle)
            if handle not in self.runs.foreign and (held is None or not held.running):
                return  # not a run this runtime shows, or one it ended itself
            handles = [handle]
        task = asyncio.ensure_future(self._refreshed(handles))
        self._refreshing.add(task)
        task.add_done_callback(self._refreshing.discard)

    async def _refreshed(self, handles: list[str]) -> None:
        try:
            await self.refresh(handles)
        except JournalError as e:
            log.warning("reading runs acted on elsewhere failed (%s); the keeper reads them again", e)
