"""A full disk under one directory, for one process: copied as `sitecustomize.py` onto its PYTHONPATH.

With `LUFTPAUSE_TEST_FULL_DISK_DIR` and `LUFTPAUSE_TEST_FULL_DISK_TRIGGER` set, every write to a
file under that directory fails with ENOSPC while the trigger file exists, as on a full disk:
the bytes do not reach the file, and a buffered file keeps them in its buffer. So do `os.write`
and `os.fsync` on descriptors of files there. Files are caught by how they are opened: `open`
and `io.open` (which `pathlib.Path.open` calls) hand back, for a path under the directory opened
for writing, the usual layers over a `FileIO` whose `write` fails. Other processes, other paths
and every read are untouched.
"""

from __future__ import annotations

import builtins
import errno
import io
import os

_DIR = os.environ.get("LUFTPAUSE_TEST_FULL_DISK_DIR")
_TRIGGER = os.environ.get("LUFTPAUSE_TEST_FULL_DISK_TRIGGER")


def _no_space() -> OSError:
    # As the kernel's write(2) reports it: no file name.
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def install(directory: str, trigger: str) -> None:
    root = os.path.realpath(directory)

    def full() -> bool:
        return os.path.exists(trigger)

    def under(path: str) -> bool:
        real = os.path.realpath(path)
        return real == root or real.startswith(root + os.sep)

    def fd_under(fd: int) -> bool:
        try:
            return under(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            return False

    class FullDiskFileIO(io.FileIO):
        def write(self, b):  # type: ignore[override]
            if full():
                raise _no_space()
            return super().write(b)

    real_open = io.open

    def open_(
        file, mode="r", buffering=-1, encoding=None, errors=None, newline=None, closefd=True, opener=None
    ):
        writing = any(c in mode for c in "wax+")
        if isinstance(file, int) or not writing or not under(os.fspath(file)):
            return real_open(file, mode, buffering, encoding, errors, newline, closefd, opener)
        raw = FullDiskFileIO(file, mode.replace("b", "").replace("t", ""), closefd=closefd, opener=opener)
        if buffering == 0:
            return raw
        size = buffering if buffering > 1 else io.DEFAULT_BUFFER_SIZE
        buffered = io.BufferedRandom(raw, size) if "+" in mode else io.BufferedWriter(raw, size)
        if "b" in mode:
            return buffered
        text = io.TextIOWrapper(buffered, encoding, errors, newline, line_buffering=buffering == 1)
        text.mode = mode
        return text

    io.open = open_
    builtins.open = open_

    real_write, real_fsync = os.write, os.fsync

    def write(fd, data):
        if full() and fd_under(fd):
            raise _no_space()
        return real_write(fd, data)

    def fsync(fd):
        number = fd if isinstance(fd, int) else fd.fileno()
        if full() and fd_under(number):
            raise _no_space()
        return real_fsync(fd)

    os.write, os.fsync = write, fsync


if _DIR and _TRIGGER:
    install(_DIR, _TRIGGER)
