"""The archive: `archive.jsonl`, where run trees go once they leave memory, indexed by handle.

Its records are journal.py's `archived` records, one a run, appended and never edited; a run's
first record is the one that counts. The index holds each handle's byte offset in the file and
each run's children (from the `parent` of their specs), so that a lookup reads one line a run,
whatever the archive holds: it is built by one scan of the file the first time it is needed
(compaction at start needs it) and kept up to date by every append. It costs some 130 bytes of
memory an archived run, and the archive is trimmed, so both stay bounded: a tree whose last run
ended more than `[runtime] archive_retention_s` ago (a week by default) is dropped, at start and
by the eviction pass once the oldest tree is a tenth of the window past it; the file is
rewritten beside the old one and renamed over it. A dropped run's handle is unknown from then on.

Every method blocks on the file: the event loop calls them through `asyncio.to_thread`
(runs.py, restore.py). One lock keeps scans, lookups, appends and trims of one archive in turn.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# The trim rewrites the file once its oldest tree is this share of the window past the window.
TRIM_SLACK = 0.1


@dataclass
class _Index:
    offsets: dict[str, int] = field(default_factory=dict)
    children: dict[str, list[str]] = field(default_factory=dict)
    # When the oldest run in the file ended (Unix time); None: the file holds none.
    oldest: float | None = None


def parent_of(record: dict[str, Any]) -> str | None:
    """The handle of the run's parent, as its spec names it (None: a root, or itself)."""
    spec = record.get("spec")
    parent = spec.get("parent") if isinstance(spec, dict) else None
    return parent if isinstance(parent, str) and parent != record.get("run") else None


def _ended_at(record: dict[str, Any]) -> float:
    try:
        return float(record.get("at") or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _parsed(raw: bytes) -> dict[str, Any] | None:
    """An `archived` record, or None for a torn or foreign line."""
    try:
        record = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError):
        return None
    if isinstance(record, dict) and record.get("type") == "archived" and isinstance(record.get("run"), str):
        return record
    return None


def _line(record: dict[str, Any]) -> bytes:
    return (json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n").encode("utf-8")


class Archive:
    """`archive.jsonl` and its index by handle."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._lock = threading.Lock()
        self._index: _Index | None = None

    # -- the index --------------------------------------------------------------------------------

    def _scan(self) -> _Index:
        """The index of the whole file, read a line at a time."""
        index = _Index()
        if not self.path.exists():
            return index
        offset = 0
        with self.path.open("rb") as f:
            for raw in f:
                record = _parsed(raw) if raw.strip() else None
                if record is not None:
                    _note(index, record, offset)
                offset += len(raw)
        return index

    def _indexed(self) -> _Index:
        if self._index is None:
            self._index = self._scan()
        return self._index

    def __contains__(self, handle: object) -> bool:
        with self._lock:
            return handle in self._indexed().offsets

    def __len__(self) -> int:
        with self._lock:
            return len(self._indexed().offsets)

    # -- reading ----------------------------------------------------------------------------------

    def _read(self, f: Any, index: _Index, handle: str) -> dict[str, Any] | None:
        offset = index.offsets.get(handle)
        if offset is None:
            return None
        f.seek(offset)
        record = _parsed(f.readline())
        return record if record is not None and record["run"] == handle else None

    def record(self, handle: str) -> dict[str, Any] | None:
        """The run's archive record, or None."""
        with self._lock:
            index = self._indexed()
            if handle not in index.offsets:
                return None
            with self.path.open("rb") as f:
                return self._read(f, index, handle)

    def trees(self, handles: list[str]) -> dict[str, list[dict[str, Any]]]:
        """For each archived handle: its record, then those of every run below it (parents before
        their children); handles the archive does not hold are left out."""
        out: dict[str, list[dict[str, Any]]] = {}
        with self._lock:
            index = self._indexed()
            wanted = [h for h in handles if h in index.offsets]
            if not wanted:
                return out
            with self.path.open("rb") as f:
                for handle in wanted:
                    tree, queue, seen = [], [handle], {handle}
                    while queue:
                        record = self._read(f, index, queue.pop(0))
                        if record is None:
                            continue
                        tree.append(record)
                        for child in index.children.get(record["run"], ()):
                            if child not in seen:
                                seen.add(child)
                                queue.append(child)
                    if tree:
                        out[handle] = tree
        return out

    # -- writing ----------------------------------------------------------------------------------

    def append(self, records: list[dict[str, Any]]) -> None:
        """Appends the records durably (fsynced before it returns), the index with them."""
        if not records:
            return
        with self._lock:
            with self.path.open("ab") as f:
                offset = f.seek(0, os.SEEK_END)
                if offset:
                    # A torn last line (a crash mid-append) is ended, so the next record is whole.
                    with self.path.open("rb") as r:
                        r.seek(offset - 1)
                        if r.read(1) != b"\n":
                            f.write(b"\n")
                            offset += 1
                lines = [_line(r) for r in records]
                f.writelines(lines)
                f.flush()
                os.fsync(f.fileno())
            index = self._index
            if index is None:
                return  # built on first need, from the file, which has them now
            for record, line in zip(records, lines, strict=True):
                _note(index, record, offset)
                offset += len(line)

    def trim(self, retention_s: float, now: float, slack: float = TRIM_SLACK) -> int:
        """Drops every tree whose last run ended more than `retention_s` before `now`, once the
        oldest is `slack` of the window past it; returns how many runs were dropped."""
        with self._lock:
            index = self._indexed()
            if index.oldest is None or now - index.oldest <= retention_s * (1 + slack):
                return 0
            # Each run's tree (its root in the archive) and when each tree's last run ended.
            parent_of: dict[str, str] = {c: p for p, cs in index.children.items() for c in cs}
            ends: dict[str, float] = {}
            root_of: dict[str, str] = {}
            with self.path.open("rb") as f:
                for handle, offset in index.offsets.items():
                    f.seek(offset)
                    record = _parsed(f.readline())
                    root, steps = handle, 0
                    while (
                        root in parent_of and parent_of[root] in index.offsets and steps < len(index.offsets)
                    ):
                        root, steps = parent_of[root], steps + 1
                    root_of[handle] = root
                    at = _ended_at(record) if record is not None else 0.0
                    ends[root] = max(ends.get(root, at), at)
            dropped = {h for h, root in root_of.items() if now - ends[root] > retention_s}
            if not dropped:
                # The oldest tree ended later than its first run: the next trim is due by that.
                index.oldest = min(ends.values(), default=None)
                return 0
            fresh = self.path.with_name(self.path.name + ".trimming")
            with self.path.open("rb") as old, fresh.open("wb") as new:
                for raw in old:
                    record = _parsed(raw) if raw.strip() else None
                    if record is None or record["run"] not in dropped:
                        new.write(raw if raw.endswith(b"\n") else raw + b"\n")
                new.flush()
                os.fsync(new.fileno())
            os.replace(fresh, self.path)
            directory = os.open(self.path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
            self._index = self._scan()
            # The next trim is due when the oldest tree left is, by its last run, not its first.
            self._index.oldest = min((e for r, e in ends.items() if r not in dropped), default=None)
        log.info(
            "archive trimmed: %d runs that ended more than %.0f s ago dropped, %d kept",
            len(dropped),
            retention_s,
            len(self._index.offsets),
        )
        return len(dropped)


def _note(index: _Index, record: dict, offset: int) -> None:
    """Puts a run's first record at `offset` into the index: its offset, its place among its
    parent's children, and the oldest end seen."""
    handle = record["run"]
    if handle in index.offsets:
        return
    index.offsets[handle] = offset
    parent = parent_of(record)
    if parent is not None:
        index.children.setdefault(parent, []).append(handle)
    at = _ended_at(record)
    index.oldest = at if index.oldest is None else min(index.oldest, at)
