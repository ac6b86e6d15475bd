"""Warm start: a starting router loads a running one's prefix index (issue 36, README
"Several routers").

A running router answers ``GET /admin/index-snapshot?pool=NAME`` (admin key) with its pool's
index as ``kvcore/index_snapshot`` bytes; so does a running endpoint picker, on its metrics
port. A router with ``warm_start.peers`` asks them in turn
at start, after its first probes and scrapes (so it knows its own model, tokenizer and block
size) and before it follows any KV events: it restores the snapshot's blocks of the replicas
it follows, and each of their subscribers takes live events from the snapshot's sequence
number on, replaying what it missed (router/kv_subscriber.py). A snapshot it cannot use (another
model, block size or tokenizer, damaged, a peer down) is logged and the next peer is asked; with
none left, the router starts cold, learning from the replicas' replay buffers and live events.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from aiohttp import web
from xxhash import xxh3_128_hexdigest

from kvroute.kvcore import index_snapshot
from kvroute.kvcore.index_snapshot import Identity, SnapshotError, SourceSeq
from kvroute.kvcore.tokenizer import BUILTIN, HFTokenizerFiles

from . import errors
from .config import WarmStartConfig, resolve_secret

if TYPE_CHECKING:
    from .auth import Auth
    from .pools import PoolRouting, Pools

from .nats_link import quiet_errors

log = logging.getLogger(__name__)

PATH = "/admin/index-snapshot"
CONTENT_TYPE = "application/x-kvroute-index-snapshot"


def identity(pool: PoolRouting) -> Identity:
    """What this router's hashes for ``pool`` depend on, as far as it knows them now."""
    model = pool.model
    if model is None:  # the implicit pool: whatever its replicas serve
        served = sorted({m for s in pool.fleet.replicas for m in s.models or ()})
        model = ",".join(served) or None
    tok = pool.keys.tokenizer
    return Identity(
        pool=pool.name,
        model=model,
        block_size=pool.keys.known_block_size(),
        tokenizer=_tokenizer_identity(tok.spec, tok.tokenizer) if tok is not None else None,
    )


def _tokenizer_identity(spec: str, tok: object) -> str:
    if spec == BUILTIN:
        return BUILTIN
    if isinstance(tok, HFTokenizerFiles):
        return _file_digest(str(Path(tok.path) / "tokenizer.json"))
    return spec


@functools.lru_cache(maxsize=16)
def _file_digest(path: str) -> str:
    """The tokenizer by its vocabulary file's content, not its path: hosts differ in paths."""
    try:
        return "xxh3-128:" + xxh3_128_hexdigest(Path(path).read_bytes())
    except OSError:
        return path


def snapshot_bytes(pool: PoolRouting) -> bytes:
    """``pool``'s index and its sources' sequence numbers, taken in one step, encoded."""
    sources = [
        SourceSeq(name, sub.endpoint, sub.last_seq)
        for name, sub in pool.subscribers.items()
        if sub.last_seq is not None
    ]
    replicas = [s.replica for s in sources]
    snap = index_snapshot.take(
        pool.index, identity(pool), sources, replicas, time.time(), pool.fleet.replicas
    )
    return index_snapshot.encode(snap)


def snapshot_response(request: web.Request, auth: Auth, pools: Pools) -> web.Response:
    """``GET /admin/index-snapshot?pool=NAME`` (``kvroute serve``'s port, the picker's metrics
    port): a pool's index for a starting router or picker; a router of one pool may leave
    ``pool`` out. Admin key, as every /admin path."""
    try:
        auth.check_admin(request)
        name = request.query.get("pool")
        pool = pools.named(name) if name is not None else None
        if pool is None and (name is not None or len(pools) != 1):
            known = ", ".join(p.name for p in pools)
            raise errors.bad_request(f"pool: name one of this router's pools ({known})", "pool")
        pool = pool or pools.sole
    except errors.ApiError as exc:
        return exc.response()
    return web.Response(body=snapshot_bytes(pool), content_type=CONTENT_TYPE)


async def warm_start(
    pools: list[PoolRouting], settings: WarmStartConfig, admin_key: str | None
) -> None:
    """Load each pool's index from the first peer that has a usable snapshot of it, else from
    NATS (``warm_start.nats_url``)."""
    key = settings.api_key or admin_key
    headers = (
        {"Authorization": f"Bearer {resolve_secret(key, 'warm_start.api_key')}"} if key else {}
    )
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    cold = list(pools)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        for pool in pools:
            for peer in settings.peers:
                url = peer.rstrip("/") + PATH
                data = await _from_peer(http, url, pool)
                if data is not None and _load(data, url, pool):
                    cold.remove(pool)
                    break
    if cold and settings.nats_url is not None:
        cold = await _from_nats(cold, settings)
    for pool in cold:
        sources = [*settings.peers, *([settings.nats_url] if settings.nats_url else [])]
        log.warning(
            "warm start: no usable index snapshot of pool %s from %s; starting cold",
            pool.name,
            ", ".join(sources),
        )


async def _from_peer(http: aiohttp.ClientSession, url: str, pool: PoolRouting) -> bytes | None:
    try:
        async with http.get(url, params={"pool": pool.name}) as resp:
            if resp.status != 200:
                text = (await resp.text())[:200]
                log.warning("warm start: %s answered HTTP %d: %s", url, resp.status, text)
                return None
            return await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("warm start: %s: %s", url, exc or type(exc).__name__)
        return None


async def _from_nats(pools: list[PoolRouting], settings: WarmStartConfig) -> list[PoolRouting]:
    """Load what the bucket holds for ``pools``; returns those still cold."""
    import nats
    from nats.js.errors import NotFoundError

    cold = list(pools)
    url = settings.nats_url
    assert url is not None
    try:
        async with asyncio.timeout(settings.timeout_s):
            client = await nats.connect(
                url, name="kvroute warm start", error_cb=quiet_errors, max_reconnect_attempts=0
            )
    except (TimeoutError, OSError, nats.errors.Error) as exc:
        log.warning("warm start: NATS %s: %s", settings.nats_url, str(exc) or type(exc).__name__)
        return cold
    try:
        async with asyncio.timeout(settings.timeout_s):
            store = await client.jetstream().object_store(settings.nats_bucket)
            for pool in pools:
                try:
                    result = await store.get(object_name(pool))
                except NotFoundError:
                    continue
                where = f"{settings.nats_url} {settings.nats_bucket}/{object_name(pool)}"
                if result.data and _load(result.data, where, pool, settings.max_age_s):
                    cold.remove(pool)
    except (TimeoutError, nats.errors.Error) as exc:
        log.warning("warm start: NATS bucket %s: %r", settings.nats_bucket, exc)
    finally:
        await client.close()
    return cold


def object_name(pool: PoolRouting) -> str:
    return f"pool-{pool.name}"


def _load(data: bytes, source: str, pool: PoolRouting, max_age_s: float | None = None) -> bool:
    """Restore ``data`` into ``pool`` if it is a snapshot this router can use."""
    started = time.monotonic()
    try:
        snap = index_snapshot.decode(data)
    except SnapshotError as exc:
        log.warning("warm start: the snapshot from %s is refused: %s", source, exc)
        return False
    why = index_snapshot.refusal(snap.identity, identity(pool))
    age = max(0.0, time.time() - snap.taken_at)
    if why is None and max_age_s is not None and age > max_age_s:
        why = f"taken {age:.0f} s ago, more than warm_start.max_age_s {max_age_s:g}"
    if why is not None:
        log.warning(
            "warm start: the index snapshot of pool %s from %s is refused: %s",
            pool.name,
            source,
            why,
        )
        return False
    # Only replicas this router follows, each with the seq its blocks reach.
    seqs = {s.replica: s.seq for s in snap.sources if s.replica in pool.subscribers}
    restored = index_snapshot.restore(snap, pool.index, seqs)
    for name, seq in seqs.items():
        pool.subscribers[name].resume_from(seq)
    lines = index_snapshot.restore_lines(snap, pool.fleet.replicas)
    log.info(
        "warm start: pool %s loaded %d blocks of %d replicas and the latency lines of %d from "
        "%s (%.0f KiB, taken %.1f s ago) in %.2f s",
        pool.name,
        sum(restored.values()),
        len(seqs),
        len(lines),
        source,
        len(data) / 1024,
        age,
        time.monotonic() - started,
    )
    return True


class SnapshotPublisher:
    """Puts each pool's snapshot in the NATS object store every ``publish_interval_s``."""

    def __init__(self, pools: list[PoolRouting], settings: WarmStartConfig) -> None:
        assert settings.nats_url is not None
        self.pools = pools
        self.settings = settings
        self.published = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="kvroute-snapshot-publisher")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        import nats
        from nats.js.api import ObjectStoreConfig
        from nats.js.errors import BucketNotFoundError

        s = self.settings
        assert s.nats_url is not None
        client = await nats.connect(
            s.nats_url,
            name="kvroute snapshot publisher",
            max_reconnect_attempts=-1,
            error_cb=quiet_errors,
        )
        try:
            js = client.jetstream()
            while True:
                try:
                    try:
                        store = await js.object_store(s.nats_bucket)
                    except BucketNotFoundError:
                        store = await js.create_object_store(
                            s.nats_bucket, ObjectStoreConfig(bucket=s.nats_bucket, ttl=s.max_age_s)
                        )
                    while True:
                        for pool in self.pools:
                            if any(sub.last_seq is not None for sub in pool.subscribers.values()):
                                await store.put(object_name(pool), snapshot_bytes(pool))
                                self.published += 1
                        await asyncio.sleep(s.publish_interval_s)
                except nats.errors.Error as exc:  # NATS down or the bucket gone: try again
                    log.warning("warm start: publishing to NATS failed: %s", exc)
                    await asyncio.sleep(s.publish_interval_s)
        finally:
            with contextlib.suppress(Exception):  # NATS may be gone by now: nothing to flush
                await client.close()
