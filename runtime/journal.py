"""The run journal: `runs.jsonl`, the embedded run store (store.py), and the records every store holds.

The PostgreSQL store (postgres_store.py) keeps these same records, a row each, and replays and
compacts them by this module's rules (`replay_records`, `plan_compaction`); what follows says how
the file keeps them.

One JSON object per line, appended, never rewritten. Records are written off the event loop by
the writer shared with tasks.jsonl (journal_writer.py: in order, with group commit), and each
step waits until its record is fsynced (`durable`) before it is acknowledged (spawn returns its
handle, a tool round's results go to the model, await and cancel answer), so a crash loses at
most the step in progress, and a disk that cannot keep up is an error the client sees. Every record has
`v` (format version, 1), `type`, `run` (the run's handle) and `at` (Unix time, seconds):

    {"v":1,"type":"spawned","run":H,"at":T,"spec":{...},"caller":C,"owner":O}
        `spec` holds every spawn argument by its tool name (task, model, serviceClass, system,
        maxToolCalls, tools, maxTokens), with defaults filled in; `caller` is the identity sent
        to the dataplane as x-luftpause-caller (null: none); `owner` is who may see the run
        once its caller's session is gone (callers.py; absent in older journals: everyone).
        With tracing on it may also carry `traceparent`: the W3C context its `invoke_agent`
        span is a child of (its parent run's, or the spawning request's), which a run resumed
        after a restart is traced under again, in the same trace (runtime/spans.py).
    {"v":1,"type":"round","run":H,"at":T,"messages":[...],"toolCalls":N,"failedToolCalls":N,
     "turns":N,"promptTokens":N,"completionTokens":N}
        One complete tool round: the OpenAI chat messages it appended to the conversation, the
        assistant message with its tool_calls followed by one role "tool" message per call.
        The counters are the run's totals after this round, not increments.
    {"v":1,"type":"finished","run":H,"at":T,"status":S,"result":R,"error":E,
     "toolCalls":N,"failedToolCalls":N,"turns":N,"promptTokens":N,"completionTokens":N}
        The run ended: status is finished, failed or cancelled; result is the final answer
        (or null), error says why it failed (or null); the counters are final totals.

A round in progress is journaled step by step too, so that a restart runs none of its finished
calls again and asks no answered approval again:

    {"v":1,"type":"turn","run":H,"at":T,"message":{...},<counters>}
        A model reply that asks for tools: the assistant message with its tool_calls, written
        before any of the calls runs.
    {"v":1,"type":"sent","run":H,"at":T,"call":ID,"tool":NAME,"key":K,<counters>}
        The call with this tool_call id goes to its tool server under idempotency key K:
        written, and durable, before the request leaves. Tool calls are at most once: a call
        sent but not answered when its run resumes (after a restart, or on another runtime
        once the lease of a dead one expired) has an unknown outcome and is not sent again;
        the model is told so (runtime/agent.py `UNKNOWN_OUTCOME`).
    {"v":1,"type":"call","run":H,"at":T,"message":{...},<counters>}
        One call of that reply done: its role "tool" message.
    {"v":1,"type":"asked","run":H,"at":T,"call":ID,"tool":NAME,"deadline":D}
        The call with this tool_call id waits for approval until D (Unix time: asked, plus
        `[runtime] approval_timeout_s`); past it the run fails "approval expired", after a
        restart too (the resumed run asks again with the same deadline).
    {"v":1,"type":"approval","run":H,"at":T,"call":ID,"tool":NAME,"allow":B}
        The user allowed (or declined) the call with this tool_call id.

The round record that closes the round repeats its messages, so a reader that only knows
spawned, round and finished still sees every complete round. Every record may carry the
counters (toolCalls, failedToolCalls, turns, promptTokens, completionTokens, and turnSeconds,
toolSeconds: seconds spent waiting on model turns and on tool calls), always as totals.

A run's conversation is its spawned record's system and task messages followed by the messages
of its rounds in order, then the pending turn and its finished calls if a round was cut short:
this is what replay hands back to resume an unfinished run.

Finished runs do not stay for ever. At each start the journal is compacted: of a finished run
only its `spawned` and `finished` records are kept (its rounds are never read again), and a run
tree whose runs all finished longer ago than the retention window (`[runtime] retention_s`) moves
to `archive.jsonl`, one record per run, from which `await` and the other tools still answer
(archive.py indexes it by handle, and trims trees older than `[runtime] archive_retention_s`):

    {"v":1,"type":"archived","run":H,"at":T,"spec":{...},"caller":C,"owner":O,"status":S,
     "result":R,"error":E,"budgetExceeded":B,<counters>}
        T is when the run finished; B is the `budget exceeded: ...` message of the run's own
        budget if it tripped, else null (absent in older archives: then read from an error
        naming one of the run's own limits, as a restart does). A run's children are the runs whose spec names it `parent`.

The new runs.jsonl is written beside the old one and renamed over it, so a crash leaves one or
the other whole; the archive is written (and fsynced) first, and a run already there is not
archived twice.

Readers skip a line that is not a JSON object, with a warning: after a crash the last line may be
torn. Unknown record types and unknown keys are ignored, so later versions can add both. A record
whose fields have the wrong types (an edited or damaged file) is skipped with a warning too, and so
is a second `spawned` record for a handle already spawned: one bad line costs at most its own run,
never the runtime's start.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Container
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from luftpause.runtime.archive import Archive
from luftpause.runtime.budgets import LIMIT_ARGUMENTS, own_trip
from luftpause.runtime.journal_writer import JsonlWriter
from luftpause.runtime.store import COUNTERS, FORMAT_VERSION, SECONDS_COUNTERS, RunStore, rounded

log = logging.getLogger(__name__)

FILE_NAME = "runs.jsonl"
ARCHIVE_NAME = "archive.jsonl"


def new_counters() -> dict[str, float]:
    return {k: 0.0 if k in SECONDS_COUNTERS else 0 for k in COUNTERS}


def read_counters(record: dict[str, Any]) -> dict[str, float]:
    """The counters a record carries, each as its type."""
    out: dict[str, float] = {}
    for k in COUNTERS:
        if k in record:
            try:
                out[k] = float(record[k]) if k in SECONDS_COUNTERS else int(record[k])
            except (TypeError, ValueError):
                continue
    return out


@dataclass
class ReplayedRun:
    """What the journal knows about one run: enough to answer for it or to resume it."""

    handle: str
    spec: dict[str, Any]
    caller: str | None
    spawned_at: float
    owner: str | None = None
    rounds: list[list[dict[str, Any]]] = field(default_factory=list)
    counters: dict[str, float] = field(default_factory=new_counters)
    finished: dict[str, Any] | None = None
    # A round cut short: the assistant message asking for tools, and the calls already answered.
    pending_turn: dict[str, Any] | None = None
    pending_results: list[dict[str, Any]] = field(default_factory=list)
    # The calls of that round journaled as sent: idempotency key by tool_call id.
    sent: dict[str, str] = field(default_factory=dict)
    # Approval decisions by tool_call id, and the deadlines of those asked.
    decisions: dict[str, bool] = field(default_factory=dict)
    deadlines: dict[str, float] = field(default_factory=dict)
    # The trace context its spans go under (tracing on when it was spawned); None: none.
    traceparent: str | None = None
    # Its own budget's `budget exceeded: ...` message, once tripped (archived runs only).
    budget_exceeded: str | None = None


class Journal(RunStore):
    """Appends records to `<state_dir>/runs.jsonl` through the shared writer, and replays them."""

    def __init__(self, state_dir: str | os.PathLike[str], writer: JsonlWriter | None = None) -> None:
        self.path = Path(state_dir) / FILE_NAME
        self.where = str(self.path)
        self._own_writer = writer is None
        self.writer = writer or JsonlWriter()
        # A torn last line (a crash mid-write) is ended first: the fragment stays for anyone
        # inspecting the file and is skipped on every replay.
        self.writer.open(self.path)
        self.archive_file = Archive(self.archive_path)

    def append(self, record_type: str, run: str, **fields: Any) -> dict[str, Any]:
        """Queues one record, in order; `durable` says when it is on disk."""
        record = self.new_record(record_type, run, **fields)
        self.writer.append(self.path, record)
        return record

    async def durable(self) -> None:
        """Returns once every record so far is on disk; `JournalError` if it cannot be."""
        await self.writer.durable()

    def close(self) -> None:
        self.writer.close_file(self.path)
        if self._own_writer:
            self.writer.close()

    def replay(self, warn: bool = True) -> list[ReplayedRun]:
        """Every run the journal knows, in spawn order; `warn`: a warning for each record skipped
        (off right after `compact`, which has said so already)."""
        self.writer.flush()
        return replay_records(read_records(self.path, warn), self.where, warn)

    def records(self) -> list[dict[str, Any]]:
        self.writer.flush()
        return read_records(self.path)

    # -- keeping it small ---------------------------------------------------------------------------

    @property
    def archive_path(self) -> Path:
        return self.path.with_name(ARCHIVE_NAME)

    def compact(
        self, retention_s: float, now: float | None = None, archive_retention_s: float | None = None
    ) -> int:
        """Rewrites runs.jsonl as the module says, before anything else is appended at start;
        returns how many runs went to the archive. With `archive_retention_s`, the archive is
        trimmed of trees older than that first (archive.py)."""
        now = time.time() if now is None else now
        if archive_retention_s is not None:
            self.archive_file.trim(archive_retention_s, now, slack=0.0)
        self.writer.flush()
        # It warns of what it skips; the replay at start, right after, then need not again.
        records = read_records(self.path)
        plan = plan_compaction(records, self.archive_file, retention_s, now, self.where)
        if plan.unchanged:
            return 0
        self.archive_file.append(plan.archive)
        self.writer.close_file(self.path)
        replace_durably(self.path, plan.kept)
        self.writer.open(self.path)
        log.info(
            "journal compacted: %d records kept of %d, %d runs archived",
            len(plan.kept),
            len(records),
            len(plan.archive),
        )
        return len(plan.archive)

    def archive(self, runs: list[ReplayedRun]) -> None:
        """Appends runs leaving memory to the archive (durably, before they are forgotten).

        A run in memory is never in the archive (compaction at start keeps archived runs out of
        memory; eviction forgets a run once it is written here), so nothing is checked. A write
        that failed part-way leaves its runs in memory, to be written again at the next pass:
        readers take a run's first archive record."""
        self.archive_file.append([archived_record(r) for r in runs])

    def archived(self, handle: str) -> dict[str, Any] | None:
        """The archive's record of a run (its first), or None: one line read, by the index."""
        return self.archive_file.record(handle)

    def archived_trees(self, handles: list[str]) -> dict[str, list[dict[str, Any]]]:
        return self.archive_file.trees(handles)

    def trim_archive(self, retention_s: float, now: float) -> int:
        return self.archive_file.trim(retention_s, now)


@dataclass
class Compaction:
    """What a compaction keeps of the records, and the archive records of the runs that leave."""

    kept: list[dict[str, Any]]
    archive: list[dict[str, Any]]
    unchanged: bool


def plan_compaction(
    records: list[dict[str, Any]], archived: Container[str], retention_s: float, now: float, where: str
) -> Compaction:
    """The compaction of a store's records, as the module says (every store compacts by it): of a
    finished run only its `spawned` and `finished` records are kept; a tree whose runs all
    finished more than `retention_s` before `now`, or a finished run already in the archive,
    leaves; a run replay could not read stays as it was."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for record in records:
        handle = record.get("run")
        if isinstance(handle, str) and (handle in by_run or record.get("type") == "spawned"):
            by_run.setdefault(handle, []).append(record)
    runs = {r.handle: r for r in replay_records(records, where, warn=True)}
    children: dict[str, list[str]] = {}
    for run in runs.values():
        parent = run.spec.get("parent")
        if isinstance(parent, str) and parent in runs and parent != run.handle:
            children.setdefault(parent, []).append(run.handle)
    # Old trees, and runs that left memory for the archive while the last process ran.
    leaving = set(_old_trees(runs, children, retention_s, now))
    leaving |= {h for h, r in runs.items() if r.finished is not None and h in archived}
    kept: list[dict[str, Any]] = []
    for handle, own in by_run.items():
        replayed = runs.get(handle)
        if handle in leaving:
            continue
        # A run replay could not read stays as it was: it is the evidence of what went wrong.
        kept.extend(own if replayed is None or replayed.finished is None else [own[0], replayed.finished])
    fresh = [archived_record(runs[h]) for h in runs if h in leaving and h not in archived]
    return Compaction(kept, fresh, unchanged=not leaving and len(kept) == len(records))


def _old_trees(
    runs: dict[str, ReplayedRun], children: dict[str, list[str]], retention_s: float, now: float
) -> list[str]:
    """The runs of every tree (from its root) whose runs all finished more than `retention_s` ago."""
    leaving: list[str] = []
    for run in runs.values():
        parent = run.spec.get("parent")
        if isinstance(parent, str) and parent in runs and parent != run.handle:
            continue  # not a root: it goes with its tree
        tree, stack = [], [run.handle]
        while stack:
            handle = stack.pop()
            tree.append(handle)
            stack.extend(children.get(handle, ()))
        ends = [runs[h].finished for h in tree]
        if all(e is not None and now - _finished_at(e) > retention_s for e in ends):
            leaving.extend(tree)
    return leaving


def _finished_at(record: dict[str, Any]) -> float:
    try:
        return float(record.get("at") or 0.0)
    except (TypeError, ValueError):
        return 0.0


def archived_record(run: ReplayedRun) -> dict[str, Any]:
    end = run.finished or {}
    return {
        "v": FORMAT_VERSION,
        "type": "archived",
        "run": run.handle,
        "at": _finished_at(end),
        "spec": run.spec,
        "caller": run.caller,
        "owner": run.owner,
        "spawnedAt": run.spawned_at,
        "status": end.get("status"),
        "result": end.get("result"),
        "error": end.get("error"),
        "budgetExceeded": run.budget_exceeded
        or own_trip(end.get("error"), {k for k, a in LIMIT_ARGUMENTS.items() if run.spec.get(a) is not None}),
        **rounded(run.counters),
    }


def _line(record: dict[str, Any]) -> str:
    return json.dumps(record, ensure_ascii=False, separators=(",", ":")) + "\n"


def replace_durably(path: Path, records: list[dict[str, Any]]) -> None:
    """`path` holds `records` afterwards, or (after a crash) what it held before: never a mix."""
    fresh = path.with_name(path.name + ".compacting")
    with fresh.open("w", encoding="utf-8") as f:
        f.writelines(_line(r) for r in records)
        f.flush()
        os.fsync(f.fileno())
    os.replace(fresh, path)
    directory = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def read_records(path: Path, warn: bool = True) -> list[dict[str, Any]]:
    """The file's records in order; lines that are not JSON objects are skipped, with a warning
    unless `warn` is False."""
    if not path.exists():
        return []
    records = []
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                record = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError):
                record = None
            if not isinstance(record, dict):
                log.log(logging.WARNING if warn else logging.DEBUG,
                        "%s line %d is not a complete JSON record (torn write?); skipped", path, number)  # fmt: skip
                continue
            records.append(record)
    return records


def replay_records(records: list[dict[str, Any]], where: str, warn: bool = True) -> list[ReplayedRun]:
    """The runs the records tell of, by the rules the module gives; `where` names the store in
    warnings."""
    runs: dict[str, ReplayedRun] = {}
    for record in records:
        try:
            _fold(runs, record, where, warn)
        except (TypeError, ValueError, AttributeError) as e:
            log.log(logging.WARNING if warn else logging.DEBUG, "%s: %s record of run %r is malformed (%s); skipped",
                    where, record.get("type"), record.get("run"), e)  # fmt: skip
    return list(runs.values())


def _fold(runs: dict[str, ReplayedRun], record: dict[str, Any], where: str, warn: bool = True) -> None:
    """Applies one record; TypeError or ValueError when its fields are not of the documented types."""
    level = logging.WARNING if warn else logging.DEBUG
    kind, handle = record.get("type"), record.get("run")
    if not isinstance(handle, str):
        return
    if kind == "spawned":
        if handle in runs:
            log.log(level, "%s: run %s is spawned a second time; the first record stands", where, handle)
            return
        runs[handle] = ReplayedRun(
            handle=handle,
            spec=_object(record.get("spec") or {}, "spec"),
            caller=_text_or_none(record.get("caller"), "caller"),
            spawned_at=float(record.get("at") or 0.0),
            owner=record.get("owner") if isinstance(record.get("owner"), str) else None,
            traceparent=record.get("traceparent") if isinstance(record.get("traceparent"), str) else None,
        )
        return
    run = runs.get(handle)
    if run is None:
        log.log(level, "%s: %s record for run %s, which was never spawned; skipped", where, kind, handle)
        return
    if run.finished is not None:
        return
    if kind == "round":
        messages = record.get("messages") or []
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise TypeError("messages must be a list of message objects")
        run.rounds.append(list(messages))
        run.pending_turn, run.pending_results, run.sent = None, [], {}
    elif kind == "turn" and isinstance(record.get("message"), dict):
        run.pending_turn, run.pending_results, run.sent = record["message"], [], {}
    elif kind == "sent" and isinstance(record.get("call"), str) and run.pending_turn is not None:
        run.sent[record["call"]] = str(record.get("key") or "")
    elif kind == "call" and isinstance(record.get("message"), dict) and run.pending_turn is not None:
        run.pending_results.append(record["message"])
    elif kind == "approval" and isinstance(record.get("call"), str):
        run.decisions[record["call"]] = bool(record.get("allow"))
    elif kind == "asked" and isinstance(record.get("call"), str):
        run.deadlines[record["call"]] = float(record["deadline"])
    elif kind == "finished":
        run.finished = record
    else:
        return
    run.counters.update(read_counters(record))


def _object(value: Any, name: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise TypeError(f"{name} must be an object, not {type(value).__name__}")
    return dict(value)


def _text_or_none(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise TypeError(f"{name} must be a string or null, not {type(value).__name__}")
    return value
