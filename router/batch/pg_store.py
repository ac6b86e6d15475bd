"""PostgreSQL for the batch store (``batch.store: postgresql://...``): several routers share
one batch queue. The statements are store.py's; this is the connection under them (psycopg 3,
used from the store's own thread)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg

from .store import Tx


class PostgresDb:
    blob = "BYTEA"
    # Routers claiming at once each skip the lines another is taking, instead of waiting.
    skip_locked = " FOR UPDATE OF l SKIP LOCKED"

    def __init__(self, url: str) -> None:
        self.url = url
        self._conn: psycopg.Connection[tuple[Any, ...]] | None = None

    def connect(self) -> None:
        # Autocommit: each transaction() block is its own BEGIN ... COMMIT.
        self._conn = psycopg.connect(self.url, connect_timeout=10, autocommit=True)

    def close(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    @contextmanager
    def transaction(self) -> Iterator[Tx]:
        if self._conn is None or self._conn.closed:
            self.connect()  # the server restarted or the connection dropped: a fresh one
        conn = self._conn
        assert conn is not None
        with conn.transaction(), conn.cursor() as cursor:
            yield _PostgresTx(cursor)


class _PostgresTx:
    def __init__(self, cursor: psycopg.Cursor[tuple[Any, ...]]) -> None:
        self._cursor = cursor

    def rows(self, sql: str, params: Sequence[Any] = ()) -> list[tuple[Any, ...]]:
        self._cursor.execute(_pg(sql), tuple(params))
        return self._cursor.fetchall() if self._cursor.description is not None else []

    def count(self, sql: str, params: Sequence[Any] = ()) -> int:
        self._cursor.execute(_pg(sql), tuple(params))
        return self._cursor.rowcount


_translated: dict[str, str] = {}


def _pg(sql: str) -> str:
    """store.py's ``?`` placeholders as psycopg's ``%s`` (the SQL has no other ? or %)."""
    out = _translated.get(sql)
    if out is None:
        out = _translated[sql] = sql.replace("?", "%s")
    return out
