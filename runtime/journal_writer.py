"""The one writer of the runtime's JSONL files (`runs.jsonl`, `tasks.jsonl`): off the event loop,
in order, with group commit.

`append` encodes a record and queues its line at once, without touching the disk; a writer
thread takes everything queued so far, writes it in order, then flushes and fsyncs each file it
touched once (group commit: eight sub-agents finishing a tool round together cost one fsync, not
eight, and none of it blocks the event loop). Lines reach each file in the order they were
appended. `await durable()` returns once every line appended before the call is on disk: a
step waits for it before it is acknowledged (spawn returns its handle, a tool round's results go
to the model, await and cancel answer).

A write or fsync that fails (a full disk, an I/O error) fails every waiter and every later
append with `JournalError`, and a disk slower than `DURABLE_TIMEOUT_S` fails the waiter: the
client sees the error, and nothing is lost silently. Nor does a failed step come back: files are
written unbuffered, so no line waits in a buffer for a later flush (a stop once space is freed)
to write, and each file the failed batch wrote to is cut back to its last durable line, so a
spawn refused for a full disk is not in the journal the next start replays. Opening a file ends
a torn last line (a crash mid-write) with a newline, so the next record starts on a line of its
own; readers skip the fragment.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from collections.abc import Callable
from io import FileIO
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Longest a step waits for the disk before its client is told the journal cannot keep up.
DURABLE_TIMEOUT_S = 30.0


class JournalError(RuntimeError):
    """The journal cannot be written (or not in time); the message says which file and why."""


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


class GroupCommit:
    """What a store's writer thread and those waiting on it share: how many records were
    appended and how many are durable, the waiters of `durable`, and a failure that ends it.
    JsonlWriter (here) and the PostgreSQL store's writer (postgres_store.py) build on it."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._appended = 0  # records queued so far
        self._durable = 0  # of those, the records stored
        self._failed: JournalError | None = None
        self._closing = False
        self._waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future[None]]] = []
        # What the writer thread has still to write, in order.
        self._queue: list[Any] = []

    def _work(self) -> bool:
        """Under `_cond`, in the writer thread: waits until something is queued (True) or the
        writer is closing with nothing left (False)."""
        while not self._queue and not self._closing:
            self._cond.wait()
        return bool(self._queue)

    def waiter(self) -> asyncio.Future[None] | None:
        """A future resolved once every record appended so far is durable; None when they are."""
        loop = asyncio.get_running_loop()
        with self._cond:
            if self._failed is not None:
                raise self._failed
            upto = self._appended
            if self._durable >= upto:
                return None
            future: asyncio.Future[None] = loop.create_future()
            self._waiters.append((upto, loop, future))
        return future

    def flush(self) -> None:
        """Blocks until every record appended so far is durable (start, stop, replay)."""
        with self._cond:
            upto = self._appended
            while self._durable < upto and self._failed is None:
                self._cond.wait()
            if self._failed is not None:
                raise self._failed

    def _committed(self, upto: int) -> None:
        """The first `upto` records are durable: wakes whoever waits for them. Under `_cond`."""
        self._durable = upto
        ready = [w for w in self._waiters if w[0] <= upto]
        self._waiters = [w for w in self._waiters if w[0] > upto]
        self._cond.notify_all()
        for _, loop, future in ready:
            wake(loop, future, None)

    def _fail(self, error: JournalError) -> None:
        log.error("%s; every step from now on fails until the runtime is restarted", error)
        with self._cond:
            self._failed = error
            waiters, self._waiters = self._waiters, []
            self._cond.notify_all()
        for _, loop, future in waiters:
            wake(loop, future, error)


class JsonlWriter(GroupCommit):
    """Appends JSON lines to the files it opened, in order, from one thread."""

    def __init__(self, observe: Callable[[float], None] | None = None) -> None:
        super().__init__()
        # Told each group commit's write-and-fsync time, in seconds, from the writer thread.
        self._observe = observe
        self._files: dict[Path, FileIO] = {}
        # Each open file's length up to its last durable line: a failed batch is cut back to it.
        self._sizes: dict[Path, int] = {}
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    def open(self, path: Path) -> None:
        """Makes `path` writable through `append`, ending a torn last line first."""
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.exists() and path.stat().st_size:
            with path.open("rb+") as torn:
                torn.seek(-1, os.SEEK_END)
                if torn.read(1) != b"\n":
                    torn.write(b"\n")
                    torn.flush()
                    os.fsync(torn.fileno())
        f = path.open("ab", buffering=0)
        with self._cond:
            self._files[path] = f
            self._sizes[path] = f.seek(0, os.SEEK_END)

    def append(self, path: Path, record: dict[str, Any]) -> None:
        """Queues one record for `path`; `durable` says when it is on disk."""
        line = json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"
        with self._cond:
            if self._failed is not None:
                raise self._failed
            if path not in self._files:
                raise JournalError(f"{path} is not open for writing (the runtime is stopping)")
            self._queue.append((path, line))
            self._appended += 1
            self._cond.notify_all()

    async def durable(self, timeout_s: float = DURABLE_TIMEOUT_S) -> None:
        """Returns once every record appended so far is on disk; raises `JournalError` if it cannot be."""
        future = self.waiter()
        if future is None:
            return
        try:
            await asyncio.wait_for(future, timeout_s)
        except TimeoutError:
            raise JournalError(
                f"the disk took more than {timeout_s:g} s to write the journal; the step is not acknowledged"
            ) from None

    def close_file(self, path: Path) -> None:
        """Writes what is queued, then closes `path`; later appends to it fail."""
        try:
            self.flush()
        finally:
            with self._cond:
                f = self._files.pop(path, None)
                self._sizes.pop(path, None)
            if f is not None:
                try:
                    f.close()
                except OSError as e:
                    log.error("journal: closing %s failed: %s", path, e)

    def close(self) -> None:
        """Writes what is queued, closes every file and stops the thread."""
        for path in list(self._files):
            try:
                self.close_file(path)
            except JournalError:
                pass  # already reported to whoever waited
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=10)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._work():
                    return
                batch, self._queue = self._queue, []
                upto = self._appended
                files, sizes = dict(self._files), dict(self._sizes)
            lines: dict[Path, list[str]] = {}
            for path, line in batch:
                lines.setdefault(path, []).append(line)
            written: dict[Path, int] = {}
            current = None
            began = time.perf_counter()
            try:
                for current, text in lines.items():
                    f = files[current]
                    data = memoryview("".join(text).encode("utf-8"))
                    while data:
                        n = f.write(data)
                        written[current] = written.get(current, 0) + n
                        data = data[n:]
                    os.fsync(f.fileno())
            except (OSError, KeyError, ValueError) as e:
                reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e) or type(e).__name__
                self._cut_back(files, sizes, written)
                self._fail(JournalError(f"cannot write the journal {current}: {reason}"))
                return
            if self._observe is not None:
                self._observe(time.perf_counter() - began)
            with self._cond:
                for path, n in written.items():
                    if self._files.get(path) is files[path]:  # not closed and opened again since
                        self._sizes[path] += n
                self._committed(upto)

    @staticmethod
    def _cut_back(files: dict[Path, FileIO], sizes: dict[Path, int], written: dict[Path, int]) -> None:
        """Takes the lines of a failed batch out of every file it wrote to: none of its steps is
        acknowledged, so none may be replayed."""
        for path, n in written.items():
            if not n:
                continue
            try:
                fd = files[path].fileno()
                os.ftruncate(fd, sizes[path])
            except (OSError, ValueError) as e:
                log.error("journal: cannot cut %s back to its last durable line (%s)", path, e)
                continue
            try:
                os.fsync(fd)
            except OSError:
                pass  # it reads back cut all the same; only a crash now could bring the lines back


def wake(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None], error: BaseException | None) -> None:
    """Resolves a waiter's future from a writer's thread, in its loop (a store's writers share it)."""
    try:
        loop.call_soon_threadsafe(_resolve, future, error)
    except RuntimeError:
        pass  # that loop is closed: nobody waits any more
