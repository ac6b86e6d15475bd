"""Warm start: a starting router loads a running one's prefix index (issue 36, README
"Several routers").

A running router answers ``GET /admin/index-snapshot?pool=NAME`` (admin key) with its pool's
index as ``kvcore/index_snapshot`` bytes. A router with ``warm_start.peers`` asks them in turn
at start, after its first probes and scrapes (so it knows its own model, tokenizer and block
size) and before it follows any KV events: it restores the snapshot's blocks of the replicas
it follows, and each of their subscribers takes live events from the snapshot's sequence
number on, replaying what it missed (router/kv_subscriber.py). A snapshot it cannot use (another
model, block size or tokenizer, damaged, a peer down) is logged and the next peer is asked; with
none left, the router starts cold, learning from the replicas' replay buffers and live events.
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

import aiohttp
from xxhash import xxh3_128_hexdigest

from kvroute.kvcore import index_snapshot
from kvroute.kvcore.index_snapshot import Identity, SnapshotError, SourceSeq
from kvroute.kvcore.tokenizer import BUILTIN, HFTokenizerFiles

from .config import WarmStartConfig, resolve_secret

if TYPE_CHECKING:
    from .pools import PoolRouting

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
    snap = index_snapshot.take(pool.index, identity(pool), sources, replicas, time.time())
    return index_snapshot.encode(snap)


async def warm_start(
    pools: list[PoolRouting], settings: WarmStartConfig, admin_key: str | None
) -> None:
    """Load each pool's index from the first peer that has a usable snapshot of it."""
    key = settings.api_key or admin_key
    headers = (
        {"Authorization": f"Bearer {resolve_secret(key, 'warm_start.api_key')}"} if key else {}
    )
    timeout = aiohttp.ClientTimeout(total=settings.timeout_s)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout) as http:
        for pool in pools:
            for peer in settings.peers:
                if await _load_from(http, peer, pool):
                    break
            else:
                log.warning(
                    "warm start: no usable index snapshot of pool %s from %s; starting cold",
                    pool.name,
                    ", ".join(settings.peers),
                )


async def _load_from(http: aiohttp.ClientSession, peer: str, pool: PoolRouting) -> bool:
    url = peer.rstrip("/") + PATH
    started = time.monotonic()
    try:
        async with http.get(url, params={"pool": pool.name}) as resp:
            if resp.status != 200:
                log.warning(
                    "warm start: %s answered HTTP %d: %s",
                    url,
                    resp.status,
                    (await resp.text())[:200],
                )
                return False
            data = await resp.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        log.warning("warm start: %s: %s", url, exc or type(exc).__name__)
        return False
    try:
        snap = index_snapshot.decode(data)
    except SnapshotError as exc:
        log.warning("warm start: the snapshot from %s is refused: %s", peer, exc)
        return False
    why = index_snapshot.refusal(snap.identity, identity(pool))
    if why is not None:
        log.warning(
            "warm start: the index snapshot of pool %s from %s is refused: %s",
            pool.name,
            peer,
            why,
        )
        return False
    # Only replicas this router follows, each with the seq its blocks reach.
    seqs = {s.replica: s.seq for s in snap.sources if s.replica in pool.subscribers}
    restored = index_snapshot.restore(snap, pool.index, seqs)
    for name, seq in seqs.items():
        pool.subscribers[name].resume_from(seq)
    log.info(
        "warm start: pool %s loaded %d blocks of %d replicas from %s (%.0f KiB, taken %.1f s "
        "ago) in %.2f s",
        pool.name,
        sum(restored.values()),
        len(seqs),
        peer,
        len(data) / 1024,
        max(0.0, time.time() - snap.taken_at),
        time.monotonic() - started,
    )
    return True
