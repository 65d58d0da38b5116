"""The lifeline between `luftpause up` and its children: a child never outlives `up`.

`up` stops its children itself on Ctrl-C, SIGTERM and SIGHUP. For the deaths it cannot handle
(`kill -9`, a crash) each child holds two lifelines, either of which stops it with SIGTERM, so
that it shuts down as it would on Ctrl-C:

- on Linux, `PR_SET_PDEATHSIG`, set between fork and exec (`preexec`): the kernel signals the
  child the moment the thread of `up` that started it ends;
- everywhere (macOS has no PDEATHSIG), a watch thread in the child (`watch_parent`) that sees
  its parent change (it is re-parented once `up` is gone) within `WATCH_PERIOD_S`.

`up` names itself in `PARENT_ENV`; the child removes the variable at once, so that processes it
starts in turn (a stdio tool server) do not take `up` for their parent.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

PARENT_ENV = "LUFTPAUSE_PARENT_PID"
WATCH_PERIOD_S = 0.5
_PR_SET_PDEATHSIG = 1

# Loaded before any fork: nothing may be imported or loaded between fork and exec.
_libc = ctypes.CDLL(None, use_errno=True) if sys.platform.startswith("linux") else None


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """The environment for a child of this process: `env` (default ours) naming us as its parent."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def preexec() -> None:
    """Runs in the child between fork and exec: SIGTERM when the parent dies (Linux only)."""
    if _libc is not None:
        _libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def watch_parent() -> None:
    """In a child of `up`: SIGTERM to ourselves once `up` is gone. Does nothing for other processes."""
    expected = os.environ.pop(PARENT_ENV, None)
    if expected is None or not expected.isdigit():
        return
    parent = int(expected)

    def orphaned() -> bool:
        return os.getppid() != parent

    if orphaned():
        # `up` died before we got here (before the PDEATHSIG was armed, or on macOS).
        os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while True:
            time.sleep(WATCH_PERIOD_S)
            if orphaned():
                os.kill(os.getpid(), signal.SIGTERM)
                return

    threading.Thread(target=watch, name="lifeline", daemon=True).start()
