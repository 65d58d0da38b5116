"""The PostgreSQL run store: `[runtime] store = "postgresql://..."`, shared by several runtimes.

It holds journal.py's records, one row each, in the order written, and its `archived` records,
one row a run; replay and compaction are journal.py's own (`replay_records`, `plan_compaction`),
so a runtime restores the same runs from here as from runs.jsonl.

    luftpause_schema   (version)                          the schema's version, one row
    luftpause_records  (seq, key, run, type, record)      every record not archived, by seq
    luftpause_archive  (run, parent, ended_at, record)    archived runs, the first record a run
    luftpause_leases   (run, owner, expires, caller)      who drives each unfinished run (leases.py)
    luftpause_tasks    (task, run, ..., closed_status)    MCP tasks (tasks.py), for every runtime

The runtime creates the tables and migrates them itself at start (`MIGRATIONS`, applied in turn
under an advisory lock, so runtimes starting together migrate once); a database whose schema is
newer than the runtime knows is refused.

The driver is psycopg 3: the same libpq every PostgreSQL tool uses (its URLs, `PG*` variables,
TLS and `.pgpass` behave as with psql), a blocking API for the store's reads, which the runtime
already makes off the event loop (at start, and through `asyncio.to_thread` as the archive
does), and LISTEN/NOTIFY. asyncpg would have needed an event loop on every reader's thread.

Records are written as the journal file writes them (journal_writer.py): `append` queues a
record at once, and one thread writes everything queued in one transaction (group commit: a
commit, one WAL flush, for every record queued meanwhile), then wakes whoever waits in
`durable`. Each record carries a key of its own, so a batch sent again after a connection lost
at commit is not stored twice. While the database cannot be reached the thread tries again
every `RETRY_S`, holding the records in order: a run's next step waits for it, and nothing is
lost; spawn is refused meanwhile (`JournalError` naming the store), so that a client hears at
once that no new run can be kept.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any, TypeVar

import psycopg
from psycopg.conninfo import conninfo_to_dict
from psycopg.types.json import Json

from luftpause.runtime.archive import parent_of
from luftpause.runtime.journal import (
    Compaction,
    ReplayedRun,
    archived_record,
    plan_compaction,
    replay_records,
)
from luftpause.runtime.journal_writer import GroupCommit, JournalError
from luftpause.runtime.store import RunStore, StoreUnavailable

log = logging.getLogger(__name__)

T = TypeVar("T")
# A writer's batch: each record with its key.
Batch = list[tuple[str, dict[str, Any]]]

# How long a connection attempt may take before the store counts as unreachable.
CONNECT_TIMEOUT_S = 5
# How often the writer tries the database again while it cannot be reached.
RETRY_S = 1.0
# Archived trees deeper than this are cut there on reading (only a damaged archive has any).
MAX_TREE_DEPTH = 10_000
# The advisory lock that runtimes starting together take to migrate and compact one at a time.
START_LOCK = 0x6C756674  # "luft"

MIGRATIONS: tuple[str, ...] = (
    # 1: records and the archive.
    """
    CREATE TABLE luftpause_records (
        seq bigserial PRIMARY KEY,
        key text NOT NULL UNIQUE,
        run text NOT NULL,
        type text NOT NULL,
        record json NOT NULL
    );
    CREATE INDEX luftpause_records_run ON luftpause_records (run, seq);
    CREATE TABLE luftpause_archive (
        run text PRIMARY KEY,
        parent text,
        ended_at double precision NOT NULL,
        record json NOT NULL
    );
    CREATE INDEX luftpause_archive_parent ON luftpause_archive (parent);
    CREATE INDEX luftpause_archive_ended_at ON luftpause_archive (ended_at);
    """,
    # 2: leases, one row a run that has not finished: which runtime drives it, until when.
    """
    CREATE TABLE luftpause_leases (
        run text PRIMARY KEY,
        owner text NOT NULL,
        expires timestamptz NOT NULL
    );
    CREATE INDEX luftpause_leases_expires ON luftpause_leases (expires);
    CREATE INDEX luftpause_leases_owner ON luftpause_leases (owner);
    """,
    # 3: MCP tasks (tasks.py), so that tasks/* answers on any runtime.
    """
    CREATE TABLE luftpause_tasks (
        task text PRIMARY KEY,
        run text NOT NULL,
        created_at double precision NOT NULL,
        updated_at double precision NOT NULL,
        closed_status text,
        closed_message text
    );
    CREATE INDEX luftpause_tasks_closed ON luftpause_tasks (updated_at) WHERE closed_status IS NOT NULL;
    """,
    # 4: each unfinished run's caller beside its lease, so that `[runtime] max_running_per_caller`
    # counts the caller's runs on every runtime (`running_elsewhere`); the runs already leased
    # take theirs from their spawn records.
    """
    ALTER TABLE luftpause_leases ADD COLUMN caller text;
    UPDATE luftpause_leases l SET caller = r.record->>'caller'
        FROM luftpause_records r WHERE r.run = l.run AND r.type = 'spawned';
    CREATE INDEX luftpause_leases_caller ON luftpause_leases (caller, owner);
    """,
    # 5: the runs spawned under a run, whichever runtime drives them (`children`), so that a
    # budget counts what its subtree spends on every runtime; archived runs have their `parent`.
    """
    CREATE INDEX luftpause_records_parent ON luftpause_records ((record->'spec'->>'parent'))
        WHERE type = 'spawned';
    """,
)
# Told "<record type> <handle>" when a run finishes or an approval is decided (leases.py listens).
CHANNEL = "luftpause_runs"
NOTIFIED = ("finished", "approval")
SCHEMA_VERSION = len(MIGRATIONS)

INSERT = (
    "INSERT INTO luftpause_records (key, run, type, record) VALUES (%(key)s, %(run)s, %(type)s, %(record)s) "
    "ON CONFLICT (key) DO NOTHING"
)
# A record of a run this runtime drives: in only while the run's lease is its own. The lease row is
# locked (FOR SHARE) until the record's transaction commits, so a runtime taking the lease over
# waits for it and then reads the record; one taken first leaves the record out.
FENCED_INSERT = (
    "INSERT INTO luftpause_records (key, run, type, record) SELECT %(key)s, %(run)s, %(type)s, %(record)s "
    "WHERE EXISTS (SELECT 1 FROM luftpause_leases WHERE run = %(run)s AND owner = %(owner)s FOR SHARE) "
    "ON CONFLICT (key) DO NOTHING"
)
# Who holds a run's lease, the row locked as above: asked before a `sent` record goes in, since a
# call must not leave from a runtime that no longer drives its run (tool calls are at most once).
LEASE_HOLDER = "SELECT owner FROM luftpause_leases WHERE run = %s FOR SHARE"


def described(url: str) -> str:
    """The URL as a person may see it: without its password. ValueError when it is no URL libpq reads."""
    try:
        parts = conninfo_to_dict(url)
    except psycopg.ProgrammingError as e:
        raise ValueError(str(e).strip()) from None
    user = f"{parts['user']}@" if parts.get("user") else ""
    port = f":{parts['port']}" if parts.get("port") else ""
    return f"postgresql://{user}{parts.get('host') or 'localhost'}{port}/{parts.get('dbname') or ''}"


def reason_of(error: BaseException) -> str:
    """What libpq said, on one line."""
    return " ".join(str(error).split()) or type(error).__name__


def unreachable(where: str, error: BaseException) -> str:
    return (
        f"the run store {where} ([runtime] store) cannot be reached: {reason_of(error)}. "
        "Start PostgreSQL or fix the URL (host, port, user, password, database)"
    )


def refused_spawn(unreachable: str) -> str:
    return f"{unreachable}; spawn is refused until it is back (running runs wait for it and go on)"


def migrate(conn: psycopg.Connection[Any]) -> int:
    """Creates or upgrades the tables to `SCHEMA_VERSION`; returns the version found."""
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (START_LOCK,))
        conn.execute("CREATE TABLE IF NOT EXISTS luftpause_schema (version integer NOT NULL)")
        row = conn.execute("SELECT version FROM luftpause_schema").fetchone()
        found = row[0] if row else 0
        if found > SCHEMA_VERSION:
            raise StoreUnavailable(
                f"the run store's tables are at schema version {found}, newer than this runtime "
                f"knows ({SCHEMA_VERSION}): run a luftpause at least as new as the one that wrote them"
            )
        for version in range(found + 1, SCHEMA_VERSION + 1):
            conn.execute(MIGRATIONS[version - 1])
        if row is None:
            conn.execute("INSERT INTO luftpause_schema (version) VALUES (%s)", (SCHEMA_VERSION,))
        elif found < SCHEMA_VERSION:
            conn.execute("UPDATE luftpause_schema SET version = %s", (SCHEMA_VERSION,))
    if found < SCHEMA_VERSION:
        log.info("run store: schema migrated from version %d to %d", found, SCHEMA_VERSION)
    return found


class PostgresStore(RunStore):
    """The run store in PostgreSQL: records through the writer thread, reads on a connection of
    their own (one at a time, under a lock)."""

    shared = True

    def __init__(self, url: str, owner: str | None = None, lease_s: float = 15.0) -> None:
        # Who this runtime is in the leases: the same across its restarts (its host and state
        # directory, which one runtime at a time holds), so that it takes its own runs back at once.
        self.owner = owner or f"{socket.gethostname()}:{os.getpid()}"
        self.lease_s = lease_s
        # The runs whose leases this runtime holds, as far as it knows: their records go in only
        # while the lease is still its own (a runtime that lost one writes nothing for its run).
        self.leased: set[str] = set()
        # Runs of the batch being written whose `sent` record was refused: another runtime took
        # their leases (`_write`, `_committed`).
        self._refused: set[str] = set()
        try:
            self.where = described(url)
        except ValueError as e:
            raise StoreUnavailable(
                f"[runtime] store is not a PostgreSQL URL libpq can read ({e}): write it as "
                '"postgresql://user:password@host:5432/database"'
            ) from None
        self.url = url
        self._lock = threading.Lock()
        self._reader = self.connect()
        migrate(self._reader)
        # Record keys: unique to this process, in order.
        self._prefix = uuid.uuid4().hex[:12]
        self._numbers = itertools.count()
        self.writer = PostgresWriter(self.connect, self._write, self._committed, self.where)

    def connect(self) -> psycopg.Connection[Any]:
        """A new connection, autocommit; StoreUnavailable saying why when there is none."""
        try:
            return psycopg.connect(self.url, autocommit=True, connect_timeout=CONNECT_TIMEOUT_S)
        except psycopg.OperationalError as e:
            raise StoreUnavailable(unreachable(self.where, e)) from None

    def read(self, work: Callable[[psycopg.Connection[Any]], T]) -> T:
        """`work` done on the reader's connection, once more on a new one if that was lost (a
        database restarted since); JournalError when the store cannot be reached."""
        with self._lock:
            for attempt in (1, 2):
                try:
                    if self._reader.closed or self._reader.broken:
                        self._reader = self.connect()
                    return work(self._reader)
                except StoreUnavailable as e:
                    raise JournalError(str(e)) from None
                except psycopg.OperationalError as e:
                    self._reader.close()
                    if attempt == 2:
                        raise JournalError(unreachable(self.where, e)) from None
        raise AssertionError("unreachable")

    # -- writing ----------------------------------------------------------------------------------

    def append(self, record_type: str, run: str, **fields: Any) -> dict[str, Any]:
        record = self.new_record(record_type, run, **fields)
        if record_type == "spawned" and self.writer.unreachable is not None:
            raise JournalError(refused_spawn(self.writer.unreachable))
        self.writer.append(f"{self._prefix}-{next(self._numbers)}", record)
        return record

    def _write(self, conn: psycopg.Connection[Any], batch: Batch) -> None:
        """Stores one batch, in one transaction (the writer's). A record of a run this runtime
        holds goes in only while its lease is this runtime's; a spawn takes the run's lease, and
        an end lets it go. A run's end and an approval decided are notified on `CHANNEL`: another
        runtime may drive the run (a cancel, an approval) or wait on it (an await)."""
        self._refused = set()
        with conn.pipeline(), conn.cursor() as cur:
            for key, r in batch:
                if "task" in r:
                    _write_task(cur, r)
                    continue
                run, kind = r["run"], r["type"]
                row = {"key": key, "run": run, "type": kind, "record": Json(r), "owner": self.owner}
                if kind == "sent":
                    holder = cur.execute(LEASE_HOLDER, (run,)).fetchone()
                    if holder is None or holder[0] != self.owner:
                        self._refused.add(run)  # the call is not sent (`holds`)
                        continue
                    cur.execute(INSERT, row)
                    continue
                fenced = kind != "spawned" and not (kind in NOTIFIED and run not in self.leased)
                cur.execute(FENCED_INSERT if fenced else INSERT, row)
                if kind == "spawned":
                    cur.execute(
                        "INSERT INTO luftpause_leases (run, owner, expires, caller) "
                        "VALUES (%(run)s, %(owner)s, now() + make_interval(secs => %(lease)s), %(caller)s) "
                        "ON CONFLICT (run) DO NOTHING",
                        {**row, "lease": self.lease_s, "caller": r.get("caller")},
                    )
                elif kind == "finished":
                    cur.execute("DELETE FROM luftpause_leases WHERE run = %s", (run,))
                if kind in NOTIFIED:
                    cur.execute("SELECT pg_notify(%s, %s)", (CHANNEL, f"{kind} {run}"))

    def append_task(self, record: dict[str, Any]) -> None:
        """Queues a task's record (tasks.py: `created` or `closed`), in order with the runs'."""
        self.writer.append(f"{self._prefix}-{next(self._numbers)}", record)

    def task(self, task_id: str) -> dict[str, Any] | None:
        """A task as the store has it: task, run, created_at, updated_at, closed_status,
        closed_message; None when it has none (never made, or trimmed)."""
        row = self.read(
            lambda conn: conn.execute(
                "SELECT task, run, created_at, updated_at, closed_status, closed_message "
                "FROM luftpause_tasks WHERE task = %s",
                (task_id,),
            ).fetchone()
        )
        keys = ("task", "run", "created_at", "updated_at", "closed_status", "closed_message")
        return dict(zip(keys, row, strict=True)) if row else None

    def trim_tasks(self, retention_s: float, now: float) -> int:
        """Drops the tasks that ended more than `retention_s` before `now`; how many."""
        return self.read(
            lambda conn: (
                conn.execute(
                    "DELETE FROM luftpause_tasks WHERE closed_status IS NOT NULL AND updated_at < %s",
                    (now - retention_s,),
                ).rowcount
            )
        )

    def _committed(self, batch: Batch) -> None:
        """After a batch's commit: the leases its spawns took and its ends let go, and those
        found held by another runtime."""
        self.leased -= self._refused
        for _, r in batch:
            if "task" in r:
                continue
            if r["type"] == "spawned":
                self.leased.add(r["run"])
            elif r["type"] == "finished":
                self.leased.discard(r["run"])

    async def durable(self) -> None:
        await self.writer.durable()

    def holds(self, handle: str) -> bool:
        return handle in self.leased

    async def durable_spawn(self) -> None:
        """Waits for the spawn's record as `durable` does, but refuses the spawn (JournalError)
        as soon as the writer finds the database unreachable, within its connect timeout."""
        future = self.writer.waiter()
        while future is not None and not future.done():
            await asyncio.wait({future}, timeout=RETRY_S)
            if not future.done() and self.writer.unreachable is not None:
                raise JournalError(refused_spawn(self.writer.unreachable))
        if future is not None:
            future.result()

    def close(self) -> None:
        try:
            self.writer.close()
        finally:
            with self._lock:
                self._reader.close()

    # -- reading ----------------------------------------------------------------------------------

    def records(self) -> list[dict[str, Any]]:
        self.writer.flush()
        return self.read(
            lambda conn: [r for (r,) in conn.execute("SELECT record FROM luftpause_records ORDER BY seq")]
        )

    def replay(self, warn: bool = True) -> list[ReplayedRun]:
        return replay_records(self.records(), self.where, warn)

    def recent(self, since: float) -> list[str]:
        return self.read(
            lambda conn: [
                h
                for (h,) in conn.execute(
                    "SELECT s.run FROM luftpause_records s WHERE s.type = 'spawned' AND NOT EXISTS "
                    "(SELECT 1 FROM luftpause_records f WHERE f.run = s.run AND f.type = 'finished' "
                    "AND (f.record->>'at')::float8 < %s) ORDER BY s.seq",
                    (since,),
                )
            ]
        )

    def spawned_record(self, handle: str) -> dict[str, Any] | None:
        return self._record(
            "SELECT record FROM luftpause_records WHERE run = %s AND type = 'spawned'", handle
        )

    def _record(self, query: str, handle: str) -> dict[str, Any] | None:
        """The one record `query` selects for the run `handle`, or None."""
        row = self.read(lambda conn: conn.execute(query, (handle,)).fetchone())
        return row[0] if row else None

    def running_elsewhere(self, caller: str | None, at_most: int) -> int:
        # A run is running from its spawn until its end, whoever drives it: its lease row lives
        # as long (a dead runtime's runs count until another takes them and ends them).
        # Two ranges of the (caller, owner) index, below and above this runtime's name, so that
        # its own runs are not read at all; no further than `at_most`: the refusal needs no more.
        match = "caller IS NULL" if caller is None else "caller = %(caller)s"

        def count(conn: psycopg.Connection[Any]) -> int:
            row = conn.execute(
                f"SELECT count(*) FROM (SELECT 1 FROM luftpause_leases WHERE {match} "
                "AND (owner < %(owner)s OR owner > %(owner)s) LIMIT %(at_most)s) theirs",
                {"caller": caller, "owner": self.owner, "at_most": at_most},
            ).fetchone()
            return int(row[0]) if row else 0

        try:
            return self.read(count)
        except JournalError as e:
            raise JournalError(refused_spawn(str(e))) from None

    def children(self, parents: list[str]) -> list[tuple[str, str]]:
        if not parents:
            return []
        return self.read(
            lambda conn: [
                (parent, child)
                for parent, child in conn.execute(
                    "SELECT record->'spec'->>'parent', run FROM luftpause_records "
                    "WHERE type = 'spawned' AND record->'spec'->>'parent' = ANY(%(parents)s) "
                    "UNION ALL SELECT parent, run FROM luftpause_archive WHERE parent = ANY(%(parents)s)",
                    {"parents": parents},
                )
                if child != parent
            ]
        )

    def load(self, handles: list[str]) -> list[ReplayedRun]:
        if not handles:
            return []
        records = self.read(
            lambda conn: [
                r
                for (r,) in conn.execute(
                    "SELECT record FROM luftpause_records WHERE run = ANY(%s) ORDER BY seq", (handles,)
                )
            ]
        )
        return replay_records(records, self.where, warn=False)

    # -- leases -----------------------------------------------------------------------------------

    def take(self, handles: list[str]) -> set[str]:
        """Takes the leases of these unfinished runs where none is held, or the holder's expired,
        or the holder is this runtime (before a restart); the runs taken."""
        taken = self.read(
            lambda conn: {
                h
                for (h,) in conn.execute(
                    "INSERT INTO luftpause_leases (run, owner, expires) "
                    "SELECT h, %(owner)s, now() + make_interval(secs => %(lease)s) FROM unnest(%(runs)s::text[]) h "
                    "ON CONFLICT (run) DO UPDATE SET owner = excluded.owner, expires = excluded.expires "
                    "WHERE luftpause_leases.expires < now() OR luftpause_leases.owner = excluded.owner "
                    "RETURNING run",
                    {"owner": self.owner, "lease": self.lease_s, "runs": handles},
                )
            }
        )
        self.leased |= taken
        return taken

    def renew(self) -> set[str]:
        """Renews every lease this runtime holds; returns the runs whose leases it held and holds
        no more (another runtime took them once they expired, or a run was ended elsewhere)."""
        held = set(self.leased)
        renewed = self.read(
            lambda conn: {
                h
                for (h,) in conn.execute(
                    "UPDATE luftpause_leases SET expires = now() + make_interval(secs => %s) "
                    "WHERE owner = %s RETURNING run",
                    (self.lease_s, self.owner),
                )
            }
        )
        lost = held - renewed
        self.leased -= lost
        return lost

    def release(self) -> None:
        """Lets go of every lease this runtime holds (it stops, its loops stopped): another runtime
        takes its runs at its keeper's next round instead of once the leases expire."""
        self.read(
            lambda conn: conn.execute(
                "UPDATE luftpause_leases SET expires = now() WHERE owner = %s", (self.owner,)
            )
        )
        self.leased.clear()

    def take_expired(self) -> list[str]:
        """Takes the lease of every run whose holder has not renewed it in time; the runs taken."""
        taken = self.read(
            lambda conn: [
                h
                for (h,) in conn.execute(
                    "UPDATE luftpause_leases SET owner = %s, expires = now() + make_interval(secs => %s) "
                    "WHERE expires < now() RETURNING run",
                    (self.owner, self.lease_s),
                )
            ]
        )
        self.leased |= set(taken)
        return taken

    def listen(self, heard: Callable[[str | None, str | None], None], stopping: threading.Event) -> None:
        """Calls `heard(kind, handle)` for each notification on `CHANNEL`, and `heard(None, None)`
        after a connection lost and made again (whatever was notified meanwhile is lost), until
        `stopping` is set. Blocking: run it on a thread of its own."""
        conn: psycopg.Connection[Any] | None = None
        while not stopping.is_set():
            try:
                if conn is None:
                    conn = self.connect()
                    conn.execute(f"LISTEN {CHANNEL}")
                    heard(None, None)
                for note in conn.notifies(timeout=RETRY_S):
                    kind, _, handle = note.payload.partition(" ")
                    heard(kind, handle)
            except (StoreUnavailable, psycopg.OperationalError) as e:
                log.warning("listening to the run store: %s; trying again in %g s", reason_of(e), RETRY_S)
                if conn is not None:
                    conn.close()
                    conn = None
                stopping.wait(RETRY_S)
        if conn is not None:
            conn.close()

    def compact(
        self, retention_s: float, now: float | None = None, archive_retention_s: float | None = None
    ) -> int:
        """journal.py's compaction, in one transaction: what it drops is deleted by seq, so the
        records other runtimes write meanwhile stay."""
        now = time.time() if now is None else now
        if archive_retention_s is not None:
            self.trim_archive(archive_retention_s, now)
        self.writer.flush()

        def compacted(conn: psycopg.Connection[Any]) -> tuple[Compaction, int]:
            with conn.transaction():
                conn.execute("SELECT pg_advisory_xact_lock(%s)", (START_LOCK,))
                rows = conn.execute("SELECT seq, record FROM luftpause_records ORDER BY seq").fetchall()
                records = [r for _, r in rows]
                handles = list({r.get("run") for r in records if isinstance(r.get("run"), str)})
                archived = {
                    h
                    for (h,) in conn.execute(
                        "SELECT run FROM luftpause_archive WHERE run = ANY(%s)", (handles,)
                    )
                }
                plan = plan_compaction(records, archived, retention_s, now, self.where)
                if not plan.unchanged:
                    self._insert_archived(conn, plan.archive)
                    kept = {id(r) for r in plan.kept}
                    dropped = [seq for seq, r in rows if id(r) not in kept]
                    conn.execute("DELETE FROM luftpause_records WHERE seq = ANY(%s)", (dropped,))
            return plan, len(records)

        plan, before = self.read(compacted)
        if plan.unchanged:
            return 0
        log.info(
            "run store compacted: %d records kept of %d, %d runs archived",
            len(plan.kept),
            before,
            len(plan.archive),
        )
        return len(plan.archive)

    # -- the archive ------------------------------------------------------------------------------

    @staticmethod
    def _insert_archived(conn: psycopg.Connection[Any], records: list[dict[str, Any]]) -> None:
        with conn.cursor() as cur:
            cur.executemany(
                "INSERT INTO luftpause_archive (run, parent, ended_at, record) VALUES (%s, %s, %s, %s) "
                "ON CONFLICT (run) DO NOTHING",
                [(r["run"], parent_of(r), float(r.get("at") or 0.0), Json(r)) for r in records],
            )

    def archive(self, runs: list[ReplayedRun]) -> None:
        """Stores the runs in the archive and drops their records, in one transaction."""
        records = [archived_record(r) for r in runs]

        def insert(conn: psycopg.Connection[Any]) -> None:
            # Their records leave with them: a fleet whose runtimes seldom restart (compaction is
            # at start) would otherwise keep every record ever written.
            with conn.transaction():
                self._insert_archived(conn, records)
                conn.execute(
                    "DELETE FROM luftpause_records WHERE run = ANY(%s)", ([r["run"] for r in records],)
                )

        self.read(insert)

    def archived(self, handle: str) -> dict[str, Any] | None:
        return self._record("SELECT record FROM luftpause_archive WHERE run = %s", handle)

    def archived_trees(self, handles: list[str]) -> dict[str, list[dict[str, Any]]]:
        if not handles:
            return {}
        rows = self.read(
            lambda conn: conn.execute(
                """
                WITH RECURSIVE tree (root, run, depth) AS (
                    SELECT run, run, 0 FROM luftpause_archive WHERE run = ANY(%s)
                    UNION ALL
                    SELECT t.root, a.run, t.depth + 1 FROM luftpause_archive a
                    JOIN tree t ON a.parent = t.run WHERE t.depth < %s
                )
                SELECT t.root, a.record FROM tree t JOIN luftpause_archive a ON a.run = t.run
                ORDER BY t.root, t.depth, a.ended_at
                """,
                (handles, MAX_TREE_DEPTH),
            ).fetchall()
        )
        out: dict[str, list[dict[str, Any]]] = {}
        seen: set[tuple[str, str]] = set()
        for root, record in rows:
            if (root, record["run"]) not in seen:
                seen.add((root, record["run"]))
                out.setdefault(root, []).append(record)
        return out

    def trim_archive(self, retention_s: float, now: float) -> int:
        """Drops every archived tree whose last run ended more than `retention_s` before `now`."""

        def trim(conn: psycopg.Connection[Any]) -> int:
            (oldest,) = conn.execute("SELECT min(ended_at) FROM luftpause_archive").fetchone() or (None,)
            if oldest is None or now - oldest <= retention_s:
                return 0
            return conn.execute(
                """
                WITH RECURSIVE tree (root, run, depth) AS (
                    SELECT a.run, a.run, 0 FROM luftpause_archive a
                    WHERE a.parent IS NULL OR NOT EXISTS (SELECT 1 FROM luftpause_archive p WHERE p.run = a.parent)
                    UNION ALL
                    SELECT t.root, c.run, t.depth + 1 FROM luftpause_archive c
                    JOIN tree t ON c.parent = t.run WHERE t.depth < %s
                ), ends AS (
                    SELECT t.root, max(a.ended_at) AS ended FROM tree t
                    JOIN luftpause_archive a ON a.run = t.run GROUP BY t.root
                )
                DELETE FROM luftpause_archive WHERE run IN (
                    SELECT t.run FROM tree t JOIN ends e ON e.root = t.root WHERE e.ended < %s
                )
                """,
                (MAX_TREE_DEPTH, now - retention_s),
            ).rowcount

        dropped = self.read(trim)
        if dropped:
            log.info("archive trimmed: %d runs that ended more than %.0f s ago dropped", dropped, retention_s)
        return dropped


def _write_task(cur: psycopg.Cursor[Any], record: dict[str, Any]) -> None:
    """A task's record, as its row: made once, closed once (the first close stands)."""
    if record["type"] == "created":
        cur.execute(
            "INSERT INTO luftpause_tasks (task, run, created_at, updated_at) VALUES (%s, %s, %s, %s) "
            "ON CONFLICT (task) DO NOTHING",
            (record["task"], record["run"], record["at"], record["at"]),
        )
    elif record["type"] == "closed":
        cur.execute(
            "UPDATE luftpause_tasks SET closed_status = %s, closed_message = %s, updated_at = %s "
            "WHERE task = %s AND closed_status IS NULL",
            (record["status"], record.get("message"), record["at"], record["task"]),
        )


class PostgresWriter(GroupCommit):
    """Writes queued records to PostgreSQL from one thread, a transaction a batch, in order."""

    def __init__(
        self,
        connect: Callable[[], psycopg.Connection[Any]],
        write: Callable[[psycopg.Connection[Any], Batch], None],
        committed: Callable[[Batch], None],
        where: str,
    ) -> None:
        super().__init__()
        self._connect, self._write, self._after, self.where = connect, write, committed, where
        self._conn: psycopg.Connection[Any] | None = None
        # Set while the database cannot be reached: why, as the client is told.
        self.unreachable: str | None = None
        self._thread = threading.Thread(target=self._run, name="store-writer", daemon=True)
        self._thread.start()

    def append(self, key: str, record: dict[str, Any]) -> None:
        with self._cond:
            if self._failed is not None:
                raise self._failed
            if self._closing:
                raise JournalError(f"the run store {self.where} is closed (the runtime is stopping)")
            self._queue.append((key, record))
            self._appended += 1
            self._cond.notify_all()

    async def durable(self) -> None:
        """Returns once every record appended so far is stored; waits while the store is down."""
        future = self.waiter()
        if future is not None:
            await future

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join(timeout=30)
        if self._conn is not None:
            self._conn.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._work():
                    return
                batch: Batch = list(self._queue)
            try:
                if self._conn is None or self._conn.closed or self._conn.broken:
                    self._conn = self._connect()
                with self._conn.transaction():
                    self._write(self._conn, batch)
            except (StoreUnavailable, psycopg.OperationalError) as e:
                message = str(e) if isinstance(e, StoreUnavailable) else unreachable(self.where, e)
                if self.unreachable is None:
                    log.error(
                        "%s; %d records wait to be written, trying every %g s", message, len(batch), RETRY_S
                    )
                self.unreachable = message
                if self._conn is not None:
                    self._conn.close()
                    self._conn = None
                with self._cond:
                    if self._closing:
                        self._fail(JournalError(f"{message}; the runtime stopped with records unwritten"))
                        return
                    self._cond.wait(RETRY_S)
                continue
            except psycopg.Error as e:
                self._fail(JournalError(f"the run store {self.where} refused a record: {reason_of(e)}"))
                return
            self._after(batch)
            if self.unreachable is not None:
                log.warning("the run store %s is back; %d records written", self.where, len(batch))
                self.unreachable = None
            with self._cond:
                del self._queue[: len(batch)]
                self._committed(self._durable + len(batch))
