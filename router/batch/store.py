"""The durable batch queue: files, jobs, request lines and results, in SQLite or PostgreSQL.

One SQL code path serves both (``SqlStore``): a store runs its statements on one dedicated
thread over a plain DB-API connection (stdlib ``sqlite3``, or psycopg's for PostgreSQL, in
pg_store.py), so the event loop never blocks on a commit and both databases are driven by the
very same statements; batch throughput is bounded by the replicas, not by this thread.

How a line is never run twice once its result is stored: a router *claims* pending lines
(state ``running``, its owner id, a lease it renews while it works), and *completes* one in a
single transaction that moves it to ``done`` only if it still holds it, and inserts its result
under the primary key (batch_id, line_no). A claimed line whose lease ran out (its router was
killed) is claimable again: it is re-run, which is safe because its result was never stored.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, TypeVar
from urllib.parse import unquote, urlsplit

from .model import TERMINAL, FileMeta, InputLine, Job, Result, Status

T = TypeVar("T")

# Renders a finished job's files: (line_no, custom_id, result or None) rows -> (output, errors).
Render = Callable[[list[tuple[int, str, Result | None]]], tuple[bytes | None, bytes | None]]


@dataclass(frozen=True, slots=True)
class Claim:
    """A line this router holds and must run."""

    batch_id: str
    line_no: int
    custom_id: str
    url: str
    body: bytes
    attempts: int


class Tx(Protocol):
    """One transaction: statements with ``?`` placeholders."""

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]: ...

    def count(self, sql: str, params: Sequence[Any] = ()) -> int: ...


class Db(Protocol):
    """A database connection used from the store's thread only."""

    blob: str  # the column type for bytes
    skip_locked: str  # how a claim skips lines another router is claiming now

    def connect(self) -> None: ...

    def close(self) -> None: ...

    def transaction(self) -> AbstractContextManager[Tx]: ...


class BatchStore(Protocol):
    """What the runner and the API ask of a store; both implementations are ``SqlStore``."""

    async def open(self) -> None: ...
    async def close(self) -> None: ...
    async def add_file(self, meta: FileMeta, content: bytes) -> None: ...
    async def file(self, file_id: str, tenant: str) -> FileMeta | None: ...
    async def file_content(self, file_id: str) -> bytes | None: ...
    async def files(
        self, limit: int, after: str | None, tenant: str
    ) -> tuple[list[FileMeta], bool]: ...
    async def create(self, job: Job, lines: list[InputLine]) -> None: ...
    async def job(self, batch_id: str, now: float, tenant: str | None = None) -> Job | None: ...
    async def jobs(
        self,
        limit: int,
        after: str | None,
        now: float,
        tenant: str,
        *,
        before: str | None = None,
        endpoints: Sequence[str] | None = None,
    ) -> tuple[list[Job], bool]: ...
    async def delete(self, batch_id: str, tenant: str) -> bool: ...
    async def unfinished(self, now: float) -> list[Job]: ...
    async def move(
        self,
        batch_id: str,
        sources: Sequence[Status],
        to: Status,
        now: float,
        ending: str | None = None,
    ) -> bool: ...
    async def claim(
        self, owner: str, n: int, now: float, lease_s: float, batch_id: str | None = None
    ) -> list[Claim]: ...
    async def renew(self, owner: str, now: float, lease_s: float) -> None: ...
    async def complete(self, owner: str, claim: Claim, result: Result) -> bool: ...
    async def release(self, owner: str, claim: Claim, not_before: float, failed: bool) -> None: ...
    async def finish(self, job: Job, final: Status, now: float, render: Render) -> bool: ...
    async def counts_by_status(self) -> dict[str, int]: ...


def _schema(blob: str) -> list[str]:
    return [
        f"""CREATE TABLE IF NOT EXISTS kvr_files (
            id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT NULL,
            bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL, seq BIGINT NOT NULL,
            content {blob} NOT NULL, tenant TEXT NOT NULL DEFAULT 'default')""",
        """CREATE TABLE IF NOT EXISTS kvr_batches (
            id TEXT PRIMARY KEY, seq BIGINT NOT NULL, endpoint TEXT NOT NULL,
            input_file_id TEXT NOT NULL, tenant TEXT NOT NULL, status TEXT NOT NULL,
            ending TEXT, created_at DOUBLE PRECISION NOT NULL,
            expires_at DOUBLE PRECISION NOT NULL, times TEXT NOT NULL, output_file_id TEXT,
            error_file_id TEXT, metadata TEXT, total INTEGER NOT NULL)""",
        f"""CREATE TABLE IF NOT EXISTS kvr_lines (
            batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, custom_id TEXT NOT NULL,
            url TEXT NOT NULL, body {blob} NOT NULL, state TEXT NOT NULL,
            owner TEXT, lease_until DOUBLE PRECISION NOT NULL DEFAULT 0,
            not_before DOUBLE PRECISION NOT NULL DEFAULT 0, attempts INTEGER NOT NULL DEFAULT 0,
            PRIMARY KEY (batch_id, line_no), UNIQUE (batch_id, custom_id))""",
        "CREATE INDEX IF NOT EXISTS kvr_lines_state ON kvr_lines (batch_id, state)",
        f"""CREATE TABLE IF NOT EXISTS kvr_results (
            batch_id TEXT NOT NULL, line_no INTEGER NOT NULL, ok INTEGER NOT NULL,
            status_code INTEGER, body {blob} NOT NULL, request_id TEXT NOT NULL,
            error_code TEXT, error_message TEXT, PRIMARY KEY (batch_id, line_no))""",
        "CREATE INDEX IF NOT EXISTS kvr_batches_status ON kvr_batches (status)",
    ]


_FILE_COLUMNS = "id, purpose, filename, bytes, created_at, tenant"
_JOB_COLUMNS = (
    "id, seq, endpoint, input_file_id, tenant, status, ending, created_at, expires_at, times, "
    "output_file_id, error_file_id, metadata, total"
)
# Per job: lines waiting (or held by a lapsed lease), lines held now, ok and failed outcomes,
# and of the failed, the lines that never ran.
_COUNTS = """
    SELECT l.batch_id,
      SUM(CASE WHEN l.state = 'pending' OR (l.state = 'running' AND l.lease_until < ?)
          THEN 1 ELSE 0 END),
      SUM(CASE WHEN l.state = 'running' AND l.lease_until >= ? THEN 1 ELSE 0 END),
      SUM(CASE WHEN r.ok = 1 THEN 1 ELSE 0 END),
      SUM(CASE WHEN r.ok = 0 OR l.state = 'skipped' THEN 1 ELSE 0 END),
      SUM(CASE WHEN l.state = 'skipped' THEN 1 ELSE 0 END)
    FROM kvr_lines l LEFT JOIN kvr_results r
      ON r.batch_id = l.batch_id AND r.line_no = l.line_no
    WHERE l.batch_id IN ({ids}) GROUP BY l.batch_id"""


class SqlStore:
    def __init__(self, db: Db) -> None:
        self._db = db
        # One thread owns the connection: statements run in order, never on the event loop.
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvroute-batch-store")
        self._lock = threading.Lock()

    async def _run(self, fn: Callable[[Tx], T]) -> T:
        def in_thread() -> T:
            with self._lock, self._db.transaction() as tx:
                return fn(tx)

        return await asyncio.get_running_loop().run_in_executor(self._thread, in_thread)

    async def open(self) -> None:
        def setup() -> None:
            self._db.connect()
            with self._db.transaction() as tx:
                for statement in _schema(self._db.blob):
                    tx.count(statement)
            _add_file_tenants(self._db)

        await asyncio.get_running_loop().run_in_executor(self._thread, setup)

    async def close(self) -> None:
        await asyncio.get_running_loop().run_in_executor(self._thread, self._db.close)
        self._thread.shutdown(wait=False)

    # -- files -------------------------------------------------------------------------

    async def add_file(self, meta: FileMeta, content: bytes) -> None:
        def add(tx: Tx) -> None:
            _insert_file(tx, meta, content)

        await self._run(add)

    async def file(self, file_id: str, tenant: str) -> FileMeta | None:
        """The file, if it is ``tenant``'s (another tenant's files do not exist for it)."""

        def read(tx: Tx) -> FileMeta | None:
            rows = tx.rows(
                f"SELECT {_FILE_COLUMNS} FROM kvr_files WHERE id = ? AND tenant = ?",
                (file_id, tenant),
            )
            return FileMeta(*rows[0]) if rows else None

        return await self._run(read)

    async def file_content(self, file_id: str) -> bytes | None:
        def read(tx: Tx) -> bytes | None:
            rows = tx.rows("SELECT content FROM kvr_files WHERE id = ?", (file_id,))
            return bytes(rows[0][0]) if rows else None

        return await self._run(read)

    async def files(
        self, limit: int, after: str | None, tenant: str
    ) -> tuple[list[FileMeta], bool]:
        def read(tx: Tx) -> tuple[list[FileMeta], bool]:
            where, params = _after(tx, "kvr_files", after, tenant)
            rows = tx.rows(
                f"SELECT {_FILE_COLUMNS} FROM kvr_files{where} ORDER BY seq DESC, id DESC LIMIT ?",
                (*params, limit + 1),
            )
            return [FileMeta(*r) for r in rows[:limit]], len(rows) > limit

        return await self._run(read)

    # -- jobs --------------------------------------------------------------------------

    async def create(self, job: Job, lines: list[InputLine]) -> None:
        def insert(tx: Tx) -> None:
            tx.count(
                f"INSERT INTO kvr_batches ({_JOB_COLUMNS}) VALUES "
                "(?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job.id,
                    job.seq,
                    job.endpoint,
                    job.input_file_id,
                    job.tenant,
                    job.status.value,
                    job.ending,
                    job.created_at,
                    job.expires_at,
                    json.dumps(job.times),
                    job.output_file_id,
                    job.error_file_id,
                    json.dumps(job.metadata) if job.metadata is not None else None,
                    len(lines),
                ),
            )
            for line in lines:
                tx.count(
                    "INSERT INTO kvr_lines (batch_id, line_no, custom_id, url, body, state) "
                    "VALUES (?, ?, ?, ?, ?, 'pending')",
                    (job.id, line.line_no, line.custom_id, line.url, line.body),
                )

        await self._run(insert)

    async def job(self, batch_id: str, now: float, tenant: str | None = None) -> Job | None:
        """The job; with ``tenant``, only if it is that tenant's."""

        def read(tx: Tx) -> Job | None:
            rows = tx.rows(f"SELECT {_JOB_COLUMNS} FROM kvr_batches WHERE id = ?", (batch_id,))
            jobs = [_job(r) for r in rows if tenant is None or r[4] == tenant]
            return _with_counts(tx, jobs, now)[0] if jobs else None

        return await self._run(read)

    async def jobs(
        self,
        limit: int,
        after: str | None,
        now: float,
        tenant: str,
        *,
        before: str | None = None,
        endpoints: Sequence[str] | None = None,
    ) -> tuple[list[Job], bool]:
        """A page of ``tenant``'s jobs, newest first: the ``limit`` after the job ``after``
        (older ones), or with ``before``, the ``limit`` just before it (newer ones); only those
        calling one of ``endpoints`` when given. True when there are more beyond the page."""

        def read(tx: Tx) -> tuple[list[Job], bool]:
            if before is not None:
                where, params = _before(tx, "kvr_batches", before, tenant)
                order = "ASC"
            else:
                where, params = _after(tx, "kvr_batches", after, tenant)
                order = "DESC"
            if endpoints is not None:
                where += f" AND endpoint IN ({', '.join('?' for _ in endpoints)})"
                params = (*params, *endpoints)
            rows = tx.rows(
                f"SELECT {_JOB_COLUMNS} FROM kvr_batches{where} "
                f"ORDER BY seq {order}, id {order} LIMIT ?",
                (*params, limit + 1),
            )
            page = rows[:limit] if order == "DESC" else rows[:limit][::-1]
            return _with_counts(tx, [_job(r) for r in page], now), len(rows) > limit

        return await self._run(read)

    async def delete(self, batch_id: str, tenant: str) -> bool:
        """Remove ``tenant``'s ended job with its lines, results and output files; False when
        it has no such job, or the job has not ended."""
        ended = tuple(s.value for s in sorted(TERMINAL))

        def remove(tx: Tx) -> bool:
            rows = tx.rows(
                "SELECT output_file_id, error_file_id FROM kvr_batches WHERE id = ? "
                f"AND tenant = ? AND status IN ({', '.join('?' for _ in ended)})",
                (batch_id, tenant, *ended),
            )
            if not rows:
                return False
            for file_id in rows[0]:
                if file_id is not None:
                    tx.count("DELETE FROM kvr_files WHERE id = ?", (file_id,))
            for table, column in (("kvr_results", "batch_id"), ("kvr_lines", "batch_id"),
                                  ("kvr_batches", "id")):  # fmt: skip
                tx.count(f"DELETE FROM {table} WHERE {column} = ?", (batch_id,))
            return True

        return await self._run(remove)

    async def unfinished(self, now: float) -> list[Job]:
        terminal = ("failed", "completed", "expired", "cancelled")

        def read(tx: Tx) -> list[Job]:
            rows = tx.rows(
                f"SELECT {_JOB_COLUMNS} FROM kvr_batches WHERE status NOT IN (?, ?, ?, ?) "
                "ORDER BY expires_at",
                terminal,
            )
            return _with_counts(tx, [_job(r) for r in rows], now)

        return await self._run(read)

    async def counts_by_status(self) -> dict[str, int]:
        def read(tx: Tx) -> dict[str, int]:
            rows = tx.rows("SELECT status, COUNT(*) FROM kvr_batches GROUP BY status")
            return {status: int(n) for status, n in rows}

        return await self._run(read)

    async def move(
        self,
        batch_id: str,
        sources: Sequence[Status],
        to: Status,
        now: float,
        ending: str | None = None,
    ) -> bool:
        """``sources -> to`` if the job is in one of ``sources`` now (of several routers, one
        wins); stamps ``<to>_at``."""

        def update(tx: Tx) -> bool:
            marks = ", ".join("?" for _ in sources)
            rows = tx.rows(
                f"SELECT times FROM kvr_batches WHERE id = ? AND status IN ({marks})",
                (batch_id, *(s.value for s in sources)),
            )
            if not rows:
                return False
            times = json.loads(rows[0][0]) | {f"{to.value}_at": now}
            return (
                tx.count(
                    f"UPDATE kvr_batches SET status = ?, times = ?, ending = COALESCE(?, ending) "
                    f"WHERE id = ? AND status IN ({marks})",
                    (to.value, json.dumps(times), ending, batch_id, *(s.value for s in sources)),
                )
                == 1
            )

        return await self._run(update)

    # -- lines -------------------------------------------------------------------------

    async def claim(
        self, owner: str, n: int, now: float, lease_s: float, batch_id: str | None = None
    ) -> list[Claim]:
        """Up to ``n`` runnable lines of running jobs, earliest deadline first, now held by
        ``owner`` until ``now + lease_s`` (unless renewed)."""
        if n <= 0:
            return []
        only = " AND l.batch_id = ?" if batch_id is not None else ""
        sql = f"""
            UPDATE kvr_lines SET state = 'running', owner = ?, lease_until = ?
            WHERE (batch_id, line_no) IN (
              SELECT l.batch_id, l.line_no FROM kvr_lines l
              JOIN kvr_batches b ON b.id = l.batch_id
              WHERE b.status = 'in_progress'
                AND (l.state = 'pending' OR (l.state = 'running' AND l.lease_until < ?))
                AND l.not_before <= ?{only}
              ORDER BY b.expires_at, l.batch_id, l.line_no LIMIT ?{self._db.skip_locked})
            RETURNING batch_id, line_no, custom_id, url, body, attempts"""
        params: list[Any] = [owner, now + lease_s, now, now]
        if batch_id is not None:
            params.append(batch_id)
        params.append(n)

        def take(tx: Tx) -> list[Claim]:
            rows = tx.rows(sql, params)
            return sorted(
                (Claim(b, int(no), c, u, bytes(body), int(a)) for b, no, c, u, body, a in rows),
                key=lambda c: (c.batch_id, c.line_no),
            )

        return await self._run(take)

    async def renew(self, owner: str, now: float, lease_s: float) -> None:
        def update(tx: Tx) -> None:
            tx.count(
                "UPDATE kvr_lines SET lease_until = ? WHERE owner = ? AND state = 'running'",
                (now + lease_s, owner),
            )

        await self._run(update)

    async def complete(self, owner: str, claim: Claim, result: Result) -> bool:
        """Store a line's result, atomically with marking it done, if ``owner`` still holds
        it; False when it does not (its lease lapsed and another took it, or the job ended)."""

        def store(tx: Tx) -> bool:
            held = tx.count(
                "UPDATE kvr_lines SET state = 'done', owner = NULL "
                "WHERE batch_id = ? AND line_no = ? AND state = 'running' AND owner = ?",
                (claim.batch_id, claim.line_no, owner),
            )
            if held != 1:
                return False
            tx.count(
                "INSERT INTO kvr_results (batch_id, line_no, ok, status_code, body, request_id, "
                "error_code, error_message) VALUES (?, ?, ?, ?, ?, ?, ?, ?) "
                "ON CONFLICT (batch_id, line_no) DO NOTHING",
                (
                    claim.batch_id,
                    claim.line_no,
                    1 if result.ok else 0,
                    result.status_code,
                    result.body,
                    result.request_id,
                    result.error_code,
                    result.error_message,
                ),
            )
            return True

        return await self._run(store)

    async def release(self, owner: str, claim: Claim, not_before: float, failed: bool) -> None:
        """Give a held line back to the queue (preempted, cancelled, or to retry later)."""

        def update(tx: Tx) -> None:
            tx.count(
                "UPDATE kvr_lines SET state = 'pending', owner = NULL, lease_until = 0, "
                "not_before = ?, attempts = attempts + ? "
                "WHERE batch_id = ? AND line_no = ? AND state = 'running' AND owner = ?",
                (not_before, 1 if failed else 0, claim.batch_id, claim.line_no, owner),
            )

        await self._run(update)

    async def finish(self, job: Job, final: Status, now: float, render: Render) -> bool:
        """End a winding-down job: once no line is held under a live lease, the lines that
        never ran are closed, the output and error files written and the job moved to
        ``final``, all in one transaction. False while lines are still held (or another
        router ended it first)."""
        source = Status.CANCELLING if final == Status.CANCELLED else Status.FINALIZING

        def end(tx: Tx) -> bool:
            held = tx.rows(
                "SELECT COUNT(*) FROM kvr_lines WHERE batch_id = ? AND state = 'running' "
                "AND lease_until >= ?",
                (job.id, now),
            )
            status = tx.rows("SELECT status, times FROM kvr_batches WHERE id = ?", (job.id,))
            if held[0][0] or not status or status[0][0] != source.value:
                return False
            tx.count(
                "UPDATE kvr_lines SET state = 'skipped', owner = NULL "
                "WHERE batch_id = ? AND state IN ('pending', 'running')",
                (job.id,),
            )
            rows = tx.rows(
                "SELECT l.line_no, l.custom_id, r.status_code, r.body, r.request_id, "
                "r.error_code, r.error_message, r.ok FROM kvr_lines l LEFT JOIN kvr_results r "
                "ON r.batch_id = l.batch_id AND r.line_no = l.line_no "
                "WHERE l.batch_id = ? ORDER BY l.line_no",
                (job.id,),
            )
            outcomes = [
                (
                    int(no),
                    cid,
                    None if ok is None else Result(code, bytes(body), rid, ecode, emsg),
                )
                for no, cid, code, body, rid, ecode, emsg, ok in rows
            ]
            output, errors = render(outcomes)
            ids: list[str | None] = []
            for kind, content in (("output", output), ("errors", errors)):
                if content is None:
                    ids.append(None)
                    continue
                file_id = f"file-{job.id}-{kind}"
                meta = FileMeta(
                    file_id, "batch_output", f"{job.id}_{kind}.jsonl", len(content), now,
                    job.tenant,
                )  # fmt: skip
                _insert_file(tx, meta, content)
                ids.append(file_id)
            times = json.loads(status[0][1]) | {f"{final.value}_at": now}
            tx.count(
                "UPDATE kvr_batches SET status = ?, times = ?, output_file_id = ?, "
                "error_file_id = ? WHERE id = ? AND status = ?",
                (final.value, json.dumps(times), ids[0], ids[1], job.id, source.value),
            )
            return True

        return await self._run(end)


def _insert_file(tx: Tx, meta: FileMeta, content: bytes) -> None:
    tx.count(
        "INSERT INTO kvr_files (id, purpose, filename, bytes, created_at, seq, content, tenant) "
        "VALUES (?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (id) DO NOTHING",
        (
            meta.id,
            meta.purpose,
            meta.filename,
            meta.bytes,
            meta.created_at,
            int(meta.created_at * 1e6),
            content,
            meta.tenant,
        ),
    )


def _add_file_tenants(db: Db) -> None:
    """A store made before files had tenants gets the column (its files: the default
    tenant's). Its own transaction: where the probe fails, PostgreSQL aborts the one it is in."""
    try:
        with db.transaction() as tx:
            tx.rows("SELECT tenant FROM kvr_files WHERE 1 = 0")
    except Exception:
        with db.transaction() as tx:
            tx.count("ALTER TABLE kvr_files ADD COLUMN tenant TEXT NOT NULL DEFAULT 'default'")


def _after(tx: Tx, table: str, after: str | None, tenant: str) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause of ``tenant``'s page that starts after the object ``after`` (newest
    first)."""
    if after is None:
        return " WHERE tenant = ?", (tenant,)
    rows = tx.rows(f"SELECT seq FROM {table} WHERE id = ? AND tenant = ?", (after, tenant))
    if not rows:
        return " WHERE 1 = 0", ()
    seq = rows[0][0]
    return " WHERE tenant = ? AND (seq < ? OR (seq = ? AND id < ?))", (tenant, seq, seq, after)


def _before(tx: Tx, table: str, before: str, tenant: str) -> tuple[str, tuple[Any, ...]]:
    """The WHERE clause of ``tenant``'s objects newer than ``before`` (read oldest first)."""
    rows = tx.rows(f"SELECT seq FROM {table} WHERE id = ? AND tenant = ?", (before, tenant))
    if not rows:
        return " WHERE 1 = 0", ()
    seq = rows[0][0]
    return " WHERE tenant = ? AND (seq > ? OR (seq = ? AND id > ?))", (tenant, seq, seq, before)


def _job(row: tuple[Any, ...]) -> Job:
    (id_, seq, endpoint, file_id, tenant, status, ending, created, expires, times, out, err,
     metadata, total) = row  # fmt: skip
    return Job(
        id=id_,
        endpoint=endpoint,
        input_file_id=file_id,
        created_at=float(created),
        expires_at=float(expires),
        tenant=tenant,
        status=Status(status),
        ending=ending,
        times=json.loads(times),
        output_file_id=out,
        error_file_id=err,
        metadata=json.loads(metadata) if metadata is not None else None,
        total=int(total),
        seq=int(seq),
    )


def _with_counts(tx: Tx, jobs: list[Job], now: float) -> list[Job]:
    if not jobs:
        return jobs
    by_id = {job.id: job for job in jobs}
    ids = ", ".join("?" for _ in jobs)
    for batch_id, pending, running, ok, failed, skipped in tx.rows(
        _COUNTS.format(ids=ids), (now, now, *by_id)
    ):
        job = by_id[batch_id]
        job.pending, job.running = int(pending or 0), int(running or 0)
        job.completed, job.failed = int(ok or 0), int(failed or 0)
        job.skipped = int(skipped or 0)
    return jobs


# -- SQLite --------------------------------------------------------------------------------


class SqliteDb:
    blob = "BLOB"
    skip_locked = ""  # SQLite has one writer at a time: a claim is atomic as it is

    def __init__(self, path: Path) -> None:
        self.path = path
        self._conn: sqlite3.Connection | None = None

    def connect(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Autocommit mode: transactions are begun explicitly (BEGIN IMMEDIATE, below).
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        # FULL: a stored result survives a crash of the machine too, not only of the router.
        conn.execute("PRAGMA synchronous=FULL")
        # Several worker processes share the file: wait for the writer instead of failing.
        conn.execute("PRAGMA busy_timeout=10000")
        self._conn = conn

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        conn = self._conn
        assert conn is not None, "the store is not open"
        # IMMEDIATE takes the write lock up front: no deadlock upgrading a read to a write.
        conn.execute("BEGIN IMMEDIATE")
        try:
            yield _SqliteTx(conn)
        except BaseException:
            conn.execute("ROLLBACK")
            raise
        conn.execute("COMMIT")


class _SqliteTx:
    def __init__(self, conn: sqlite3.Connection) -> None:
        self._conn = conn

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        return self._conn.execute(sql, tuple(params)).fetchall()

    def count(self, sql: str, params: Sequence[Any] = ()) -> int:
        return self._conn.execute(sql, tuple(params)).rowcount


class StoreUrlError(ValueError):
    pass


def default_store_url() -> str:
    """Where batches live unless batch.store says: the user's state directory (XDG)."""
    return "sqlite:///" + str(Path("~/.local/state/kvroute/batches.sqlite3").expanduser())


def store_path(url: str) -> Path:
    """The file of a ``sqlite:///PATH`` URL (``sqlite:///rel`` relative, ``sqlite:////abs``
    absolute, as SQLAlchemy reads them; ``~`` expands)."""
    parts = urlsplit(url)
    if parts.scheme != "sqlite" or parts.netloc or not parts.path.startswith("/"):
        raise StoreUrlError("must be sqlite:///PATH or postgresql://USER@HOST:PORT/DB")
    path = unquote(parts.path[1:])
    if not path:
        raise StoreUrlError("sqlite:/// needs a file path after it")
    return Path(path).expanduser()


def check_store_url(url: str) -> None:
    """StoreUrlError (why) for a batch.store value that names no usable store."""
    scheme = urlsplit(url).scheme
    if scheme in ("postgresql", "postgres"):
        return
    store_path(url)


def redacted(url: str) -> str:
    """A store URL fit for a log line: without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@", 1)
    return parts._replace(netloc=netloc).geturl()


def open_store(url: str) -> BatchStore:
    """The store a batch.store URL names (not opened yet)."""
    if urlsplit(url).scheme in ("postgresql", "postgres"):
        from .pg_store import PostgresDb  # psycopg is needed only for PostgreSQL

        return SqlStore(PostgresDb(url))
    return SqlStore(SqliteDb(store_path(url)))
