"""vLLM's NixlConnector, emulated: the replica's side of prefill/decode disaggregation.

Prefill side: a request with ``kv_transfer_params.do_remote_decode`` keeps its KV blocks held
when it finishes (not evictable), and its answer carries the ``kv_transfer_params`` that tell a
decode replica where they are: this engine's id, the block ids, and a side channel. The hold
ends when a decode replica reads the blocks, or after VLLM_NIXL_ABORT_REQUEST_TIMEOUT (480 s).

Decode side: a request with ``do_remote_prefill`` reads the prompt's blocks that its own prefix
cache lacks from the prefill replica, waits the modelled transfer time
(``kvcore.pd.transfer_s`` over the ``--kv-link``, times the replica's time scale), and enters
the engine with its prompt counted as computed: only the last prompt token runs, as in vLLM.
If the read fails (the prefill replica is gone, restarted, or no longer holds the blocks), it
logs why and computes the prompt itself: vLLM's default kv_load_failure_policy "recompute".

The side channel is the emulator's own HTTP port (NIXL's is a ZMQ socket plus RDMA reads):
``POST /kvroute/kv_read {"engine_id", "request_id", "block_ids"}`` answers 200 and releases
the hold when this engine still holds those blocks for that request, 404 otherwise. The read is
checked and the hold released when the transfer starts; the modelled time is then spent on the
decode side (a real prefill replica frees the blocks when the transfer ends, milliseconds later).
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import aiohttp
import msgspec

from kvroute.kvcore import pd
from kvroute.simulator.engine import Engine, EngineRequest

log = logging.getLogger(__name__)

KV_READ_PATH = "/kvroute/kv_read"
# A prefill replica that does not answer a read in this long is taken as failed.
KV_READ_TIMEOUT_S = 5.0


class KVRead(msgspec.Struct, kw_only=True):
    """The body of a decode replica's read (the emulator's stand-in for NIXL's)."""

    engine_id: str
    request_id: str
    block_ids: list[int]


class KVConnector:
    """One replica's NixlConnector: held blocks (prefill side), reads (decode side)."""

    def __init__(
        self,
        engine: Engine,
        link_bytes_per_s: float,
        time_scale: float,
        hold_timeout_s: float = pd.HOLD_TIMEOUT_S,
        side_channel_host: str | None = None,
    ) -> None:
        self.engine = engine
        self.engine_id = str(uuid.uuid4())  # vLLM's: fixed for the process, new on restart
        self._link = link_bytes_per_s
        self._time_scale = time_scale
        self._hold_timeout_s = hold_timeout_s
        self._side_channel_host = side_channel_host
        self._timers: dict[str, asyncio.TimerHandle] = {}
        self._session: aiohttp.ClientSession | None = None

    async def close(self) -> None:
        for timer in self._timers.values():
            timer.cancel()
        self._timers.clear()
        if self._session is not None:
            await self._session.close()

    # -- prefill side ----------------------------------------------------------------------

    def hold(
        self, request_id: str, block_ids: list[int], local_address: tuple[str, int]
    ) -> dict[str, Any]:
        """A finished request's blocks are held: time the hold out, and answer where they are.

        ``local_address``: the (host, port) the request came in on, which reaches this replica.
        """
        loop = asyncio.get_running_loop()
        self._timers[request_id] = loop.call_later(self._hold_timeout_s, self._expire, request_id)
        host, port = local_address
        return pd.KVTransferParams(
            do_remote_prefill=True,
            remote_engine_id=self.engine_id,
            remote_block_ids=block_ids,
            remote_host=self._side_channel_host or host,
            remote_port=port,
            remote_request_id=request_id,
            tp_size=1,
        ).to_json()

    def release(self, request_id: str) -> bool:
        """End a hold (read, or its answer never left): the blocks are freed, still cached."""
        timer = self._timers.pop(request_id, None)
        if timer is not None:
            timer.cancel()
        return self.engine.release_held(request_id)

    def _expire(self, request_id: str) -> None:
        self._timers.pop(request_id, None)
        if self.engine.release_held(request_id):
            log.warning(
                "request %s: no decode replica read its KV blocks in %.0f s; freed them",
                request_id,
                self._hold_timeout_s,
            )

    def serve_read(self, read: KVRead) -> str | None:
        """A decode replica reads a request's held blocks: the hold ends. None, or why the
        blocks cannot be read (the read then fails, and the decode replica recomputes)."""
        if read.engine_id != self.engine_id:
            return f"engine {read.engine_id} is not this replica's ({self.engine_id}): restarted?"
        held = self.engine.held_block_ids(read.request_id)
        if held is None:
            return (
                f"request {read.request_id} holds no KV blocks here (never held, already read, "
                "or timed out)"
            )
        missing = sorted(set(read.block_ids) - set(held))
        if missing:
            return f"request {read.request_id} does not hold blocks {missing[:8]}"
        self.release(read.request_id)
        return None

    # -- decode side -----------------------------------------------------------------------

    async def pull(self, params: pd.KVTransferParams, request: EngineRequest) -> int:
        """Read ``request``'s prompt KV from the prefill replica that ``params`` names and wait
        the modelled transfer; the prompt tokens now here (0: the read failed, compute them)."""
        prompt = len(request.prompt_token_ids)
        local = self.engine.cached_prompt_tokens(request)
        block_ids, problem = self._blocks_to_read(params, prompt, local)
        if not problem:
            problem = await self._read(params, block_ids)
        if problem:
            log.warning(
                "request %s: cannot read its KV from the prefill replica (%s); computing the "
                "prompt here",
                request.request_id,
                problem,
            )
            return 0
        seconds = pd.transfer_s(
            prompt - local, self.engine.config.latency.kv_bytes_per_token, self._link
        )
        await asyncio.sleep(seconds * self._time_scale)
        return prompt

    def _blocks_to_read(
        self, params: pd.KVTransferParams, prompt: int, local: int
    ) -> tuple[list[int], str | None]:
        """The remote blocks holding the prompt tokens from ``local`` on, or why there are none.

        Like NIXL's, blocks map one to one: both replicas use the same block size.
        """
        if not params.readable or params.remote_block_ids is None:
            # vLLM: "Got invalid KVTransferParams ... will not utilize KVTransfer".
            return [], f"kv_transfer_params lack what a read needs: {params.to_json()}"
        bs = self.engine.config.block_size
        needed = -(-prompt // bs)
        remote = params.remote_block_ids
        if len(remote) < needed:
            return [], f"{len(remote)} remote blocks, the {prompt}-token prompt needs {needed}"
        return remote[local // bs : needed], None

    async def _read(self, params: pd.KVTransferParams, block_ids: list[int]) -> str | None:
        """Read (and release) the blocks on the prefill replica; None, or what went wrong."""
        host = params.remote_host or ""
        url = f"http://{f'[{host}]' if ':' in host else host}:{params.remote_port}{KV_READ_PATH}"
        body = {
            "engine_id": params.remote_engine_id,
            "request_id": params.remote_request_id,
            "block_ids": block_ids,
        }
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=KV_READ_TIMEOUT_S)
            )
        try:
            async with self._session.post(url, json=body) as response:
                if response.status == 200:
                    return None
                return f"{url} answered {response.status}: {(await response.text())[:300]}"
        except (aiohttp.ClientError, TimeoutError, ValueError) as exc:  # ValueError: a bad URL
            return f"{url}: {type(exc).__name__}: {exc}"
