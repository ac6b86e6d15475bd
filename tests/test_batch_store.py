"""The batch store's contract, run against SQLite and a real PostgreSQL server alike: a line is
claimed by one router at a time, its result stored once, a lapsed lease lets another router
take it, and a job ends once, with its files."""

from __future__ import annotations

import asyncio
import itertools
import json
import sqlite3
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from kvroute.router.batch.model import (
    FileMeta,
    InputLine,
    Job,
    Result,
    Status,
    render_files,
)
from kvroute.router.batch.store import BatchStore, SqliteDb, SqlStore, open_store

from .postgres import postgres_server

_ids = itertools.count(1)


@pytest.fixture(scope="module")
def pg_url() -> Iterator[str]:
    try:
        with postgres_server() as url:
            yield url
    except FileNotFoundError as exc:
        # The README's test command installs it: missing is a failure, as for Chromium.
        pytest.fail(str(exc))


@pytest.fixture(params=["sqlite", "postgresql"])
async def stores(
    request: pytest.FixtureRequest, tmp_path: Path
) -> AsyncIterator[tuple[BatchStore, BatchStore]]:
    """Two stores over one database: two routers sharing a batch queue."""
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'b.db'}"
    else:
        url = request.getfixturevalue("pg_url")
    a, b = open_store(url), open_store(url)
    await a.open()
    await b.open()
    yield a, b
    await a.close()
    await b.close()


def make_job(n: int, now: float = 1000.0, window: float = 100.0) -> tuple[Job, list[InputLine]]:
    i = next(_ids)
    job = Job(
        id=f"batch_t{i}_{id(object())}",
        endpoint="/v1/completions",
        input_file_id="file-x",
        created_at=now,
        expires_at=now + window,
        tenant="t",
        status=Status.IN_PROGRESS,
        seq=i,
    )
    lines = [
        InputLine(k, f"c{k}", "/v1/completions", json.dumps({"prompt": k}).encode())
        for k in range(1, n + 1)
    ]
    return job, lines


OK = Result(200, b'{"ok":1}', "rid")


async def test_a_claimed_line_is_held_once_and_its_result_stored_once(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, b = stores
    job, lines = make_job(5)
    await a.create(job, lines)
    first = await a.claim("A", 3, 1000.0, 10.0, batch_id=job.id)
    assert [c.line_no for c in first] == [1, 2, 3]
    second = await b.claim("B", 10, 1000.0, 10.0, batch_id=job.id)
    assert [c.line_no for c in second] == [4, 5]  # A's lines are held
    assert await b.claim("B", 10, 1000.0, 10.0, batch_id=job.id) == []
    assert await a.complete("A", first[0], OK)
    assert not await a.complete("A", first[0], OK)  # stored once
    assert not await b.complete("B", first[1], OK)  # not B's to complete
    stored = await a.job(job.id, 1000.0)
    assert stored is not None
    assert (stored.completed, stored.running, stored.pending) == (1, 4, 0)


async def test_a_lapsed_lease_lets_another_router_run_the_line_and_only_one_result_counts(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, b = stores
    job, lines = make_job(2)
    await a.create(job, lines)
    held = await a.claim("A", 2, 1000.0, 5.0, batch_id=job.id)
    await a.renew("A", 1003.0, 5.0)  # A is alive: held until 1008
    assert await b.claim("B", 2, 1006.0, 5.0, batch_id=job.id) == []
    # A was killed: its leases lapse and B takes both lines over.
    taken = await b.claim("B", 2, 1009.0, 5.0, batch_id=job.id)
    assert [c.line_no for c in taken] == [1, 2]
    assert not await a.complete("A", held[0], OK)  # A's late answer is not stored
    assert await b.complete("B", taken[0], OK)
    stored = await b.job(job.id, 1009.0)
    assert stored is not None and stored.completed == 1


async def test_a_released_line_waits_its_backoff_and_counts_the_attempt(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, _ = stores
    job, lines = make_job(1)
    await a.create(job, lines)
    (claim,) = await a.claim("A", 1, 1000.0, 10.0, batch_id=job.id)
    await a.release("A", claim, 1002.0, failed=True)
    assert await a.claim("A", 1, 1001.0, 10.0, batch_id=job.id) == []
    (again,) = await a.claim("A", 1, 1002.0, 10.0, batch_id=job.id)
    assert again.attempts == 1


async def test_routers_claiming_at_once_never_share_a_line(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, b = stores
    job, lines = make_job(60)
    await a.create(job, lines)
    got = await asyncio.gather(
        *(s.claim(o, 7, 1000.0, 10.0, batch_id=job.id) for s, o in [(a, "A"), (b, "B")] * 5)
    )
    numbers = [c.line_no for claims in got for c in claims]
    assert sorted(numbers) == list(range(1, 61))


async def test_one_router_moves_a_job_and_it_ends_once_with_its_files(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, b = stores
    job, lines = make_job(3)
    await a.create(job, lines)
    (first, second) = await a.claim("A", 2, 1000.0, 10.0, batch_id=job.id)
    await a.complete("A", first, OK)
    moved = await asyncio.gather(
        a.move(job.id, [Status.IN_PROGRESS], Status.CANCELLING, 1001.0),
        b.move(job.id, [Status.IN_PROGRESS], Status.CANCELLING, 1001.0),
    )
    assert sorted(moved) == [False, True]

    def render(rows: list[tuple[int, str, Result | None]]) -> tuple[bytes | None, bytes | None]:
        return render_files(job.id, Status.CANCELLED, rows)

    # Line 2 is still held under a live lease: not yet.
    assert not await a.finish(job, Status.CANCELLED, 1001.0, render)
    await a.release("A", second, 0.0, failed=False)
    assert await b.finish(job, Status.CANCELLED, 1002.0, render)
    assert not await a.finish(job, Status.CANCELLED, 1002.0, render)
    ended = await a.job(job.id, 1003.0)
    assert ended is not None and ended.status == Status.CANCELLED
    assert (ended.completed, ended.failed, ended.total) == (1, 2, 3)
    assert ended.times["cancelled_at"] == 1002.0
    assert ended.output_file_id is not None and ended.error_file_id is not None
    output = await a.file_content(ended.output_file_id)
    errors = await a.file_content(ended.error_file_id)
    assert output is not None and errors is not None
    assert [json.loads(x)["custom_id"] for x in output.splitlines()] == ["c1"]
    assert [json.loads(x)["custom_id"] for x in errors.splitlines()] == ["c2", "c3"]
    meta = await a.file(ended.error_file_id, "t")  # the job's tenant's, as its input was
    assert meta is not None and meta.purpose == "batch_output" and meta.bytes == len(errors)
    assert await a.file(ended.error_file_id, "someone-else") is None


async def test_jobs_and_files_page_newest_first(stores: tuple[BatchStore, BatchStore]) -> None:
    a, _ = stores
    made = []
    for _ in range(5):
        job, lines = make_job(1)
        await a.create(job, lines)
        made.append(job.id)
    page, more = await a.jobs(100, None, 1000.0, "t")
    mine = [j.id for j in page if j.id in made]
    assert mine == made[::-1]
    after = made[2]
    page, more = await a.jobs(1, after, 1000.0, "t")
    assert [j.id for j in page] == [made[1]] and more
    assert (await a.jobs(100, None, 1000.0, "someone-else"))[0] == []
    for k in range(3):
        meta = FileMeta(f"file-p{k}-{made[0]}", "batch", "f", 1, 2000.0 + k, "t")
        await a.add_file(meta, b"x")
    files, _ = await a.files(2, None, "t")
    assert [f.id for f in files] == [f"file-p2-{made[0]}", f"file-p1-{made[0]}"]
    assert (await a.files(2, None, "someone-else"))[0] == []


async def test_pages_before_a_job_only_of_some_endpoints(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, _ = stores
    tenant = f"t-pages-{next(_ids)}"  # its own tenant: the PostgreSQL database is shared
    made = []
    for k in range(4):
        job, lines = make_job(1)
        job.tenant = tenant
        job.endpoint = "/v1/messages" if k == 1 else job.endpoint
        await a.create(job, lines)
        made.append(job.id)
    ids = lambda page: [j.id for j in page]  # noqa: E731
    # Newest first; ``before`` is the page just newer than the job named.
    page, more = await a.jobs(2, None, 1000.0, tenant, before=made[0])
    assert ids(page) == [made[2], made[1]] and more
    page, more = await a.jobs(10, None, 1000.0, tenant, before=made[1])
    assert ids(page) == [made[3], made[2]] and not more
    page, more = await a.jobs(10, None, 1000.0, tenant, endpoints=("/v1/completions",))
    assert ids(page) == [made[3], made[2], made[0]] and not more
    page, _ = await a.jobs(10, made[3], 1000.0, tenant, endpoints=("/v1/messages",))
    assert ids(page) == [made[1]]


async def test_an_ended_job_is_deleted_with_its_lines_results_and_files(
    stores: tuple[BatchStore, BatchStore],
) -> None:
    a, _ = stores
    job, lines = make_job(2)
    assert not await a.delete(job.id, "t")  # no such job
    await a.create(job, lines)
    assert not await a.delete(job.id, "t")  # not ended
    for claim in await a.claim("A", 2, 1000.0, 10.0, batch_id=job.id):
        await a.complete("A", claim, OK)
    await a.move(job.id, [Status.IN_PROGRESS], Status.FINALIZING, 1001.0, Status.COMPLETED)

    def render(rows: list[tuple[int, str, Result | None]]) -> tuple[bytes | None, bytes | None]:
        return render_files(job.id, Status.COMPLETED, rows)

    assert await a.finish(job, Status.COMPLETED, 1002.0, render)
    ended = await a.job(job.id, 1003.0)
    assert ended is not None and ended.output_file_id is not None
    assert not await a.delete(job.id, "someone-else")
    assert await a.delete(job.id, "t")
    assert await a.job(job.id, 1003.0) is None
    assert await a.file_content(ended.output_file_id) is None
    assert await a.claim("A", 10, 1004.0, 10.0, batch_id=job.id) == []


async def test_a_store_made_before_files_had_tenants_gets_the_column(tmp_path: Path) -> None:
    """Its files stay readable, as the default tenant's."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.execute(
        "CREATE TABLE kvr_files (id TEXT PRIMARY KEY, purpose TEXT NOT NULL, filename TEXT NOT "
        "NULL, bytes BIGINT NOT NULL, created_at DOUBLE PRECISION NOT NULL, seq BIGINT NOT "
        "NULL, content BLOB NOT NULL)"
    )
    conn.execute("INSERT INTO kvr_files VALUES ('file-old', 'batch', 'a.jsonl', 1, 1.0, 1, x'7b')")
    conn.commit()
    conn.close()
    store = SqlStore(SqliteDb(path))
    await store.open()
    try:
        meta = await store.file("file-old", "default")
        assert meta is not None and meta.filename == "a.jsonl"
        assert await store.file("file-old", "acme") is None
    finally:
        await store.close()


async def test_sqlite_store_is_in_wal_mode(tmp_path: Path) -> None:
    store = SqlStore(SqliteDb(tmp_path / "b.db"))
    await store.open()
    await store.close()
    import sqlite3

    with sqlite3.connect(tmp_path / "b.db") as conn:
        assert conn.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
