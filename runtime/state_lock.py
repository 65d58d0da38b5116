"""One runtime per state directory: an exclusive lock on `<state_dir>/runtime.lock`.

Two runtimes replaying the same `runs.jsonl` would both resume its unfinished runs, and each
would make their tool calls again. So a runtime takes the lock before it reads or writes
anything in the directory, and holds it until it stops. The lock is `flock` (Linux, macOS): the
kernel drops it when the process ends in any way, `kill -9` included, so a crash never leaves a
stale lock behind. The file holds the holder's pid, which a refused runtime names.
"""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

FILE_NAME = "runtime.lock"


class StateDirInUse(RuntimeError):
    """Another process holds the state directory; the message says which and what to do."""


class StateLock:
    """Holds `<state_dir>/runtime.lock` from construction until `release`."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.read(fd, 32).decode(errors="replace").strip()
            os.close(fd)
            who = f"pid {holder}" if holder.isdigit() else "another process"
            raise StateDirInUse(
                f"state directory {self.path.parent} is in use by another runtime ({who}): stop it, "
                "or give this runtime another --state-dir"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
