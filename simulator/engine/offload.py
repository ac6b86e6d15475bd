"""KV offload tiers per GPU node (vLLM's OffloadingConnector: CPU, then disk), as presets.

Assumptions, not reference figures (reference/roofline.md has none for host memory or disks);
the same as ``kvroute plan --kv`` prints (simulator/capacity.py):

* host DRAM: 2 TB per 8-GPU HGX H100/H200 node, of which ``HOST_KV_SHARE`` holds KV (the rest:
  the OS, pinned staging buffers, the serving processes); loads over one PCIe Gen5 x16 link per
  GPU at ``PCIE_EFFICIENCY`` of its 64 GB/s.
* local NVMe: 8 x 3.84 TB per node (the DGX H100 data-cache drives), ~6.5 GB/s read each; a
  block on disk is promoted to host memory, then loaded to the GPU (vLLM's tiering manager).

A replica of ``g`` GPUs gets ``g / 8`` of its node.
"""

from __future__ import annotations

import math

from .config import OffloadTier
from .latency import LatencyModel

GPUS_PER_NODE = 8
HOST_BYTES_PER_NODE = 2e12
HOST_KV_SHARE = 0.8
PCIE_BYTES_PER_S = 64e9
PCIE_EFFICIENCY = 0.8
NVME_BYTES_PER_NODE = 8 * 3.84e12
NVME_READ_BYTES_PER_S = 8 * 6.5e9

TIER_PRESETS = ("none", "cpu", "cpu+disk")


def offload_tiers(
    preset: str,
    latency: LatencyModel,
    block_size: int,
    cpu_tokens: int | None = None,
    disk_tokens: int | None = None,
) -> tuple[OffloadTier, ...]:
    """The tiers below the GPU of one replica of ``latency``'s shape: ``preset`` one of
    TIER_PRESETS; ``cpu_tokens``/``disk_tokens`` override a tier's size (in KV tokens)."""
    if preset not in TIER_PRESETS:
        raise ValueError(f"KV tiers must be one of {', '.join(TIER_PRESETS)}, got {preset!r}")
    if preset == "none":
        return ()
    share = latency.num_gpus / GPUS_PER_NODE
    per_block = latency.kv_bytes_per_token * block_size
    pcie = PCIE_BYTES_PER_S * PCIE_EFFICIENCY * latency.num_gpus
    cpu_blocks = _blocks(
        cpu_tokens, block_size, HOST_BYTES_PER_NODE * HOST_KV_SHARE * share / per_block
    )
    tiers = [OffloadTier("CPU", cpu_blocks, pcie)]
    if preset == "cpu+disk":
        disk_blocks = _blocks(disk_tokens, block_size, NVME_BYTES_PER_NODE * share / per_block)
        # Promoted to host memory, then loaded: the slower link sets the pace of the stream.
        tiers.append(OffloadTier("STORAGE", disk_blocks, min(pcie, NVME_READ_BYTES_PER_S * share)))
    return tuple(tiers)


def _blocks(tokens: int | None, block_size: int, default: float) -> int:
    if tokens is not None:
        if tokens < block_size:
            raise ValueError(f"a KV tier must hold at least one block ({block_size} tokens)")
        return tokens // block_size
    return max(1, int(default))


def cpu_offload(
    size_gib: float | None, latency: LatencyModel, block_size: int
) -> tuple[OffloadTier, ...]:
    """vLLM's ``--kv-offloading-size GIB`` (native CPU backend): a CPU tier of that many GiB
    over all the replica's GPUs, loaded at the node preset's PCIe speed; None: no tier."""
    if size_gib is None:
        return ()
    if not (math.isfinite(size_gib) and size_gib > 0):
        raise ValueError(f"--kv-offloading-size must be a number of GiB > 0, got {size_gib}")
    blocks = int(size_gib * 2**30 // (latency.kv_bytes_per_token * block_size))
    if blocks < 1:
        raise ValueError(f"--kv-offloading-size {size_gib} GiB holds not one KV block")
    return (OffloadTier("CPU", blocks, PCIE_BYTES_PER_S * PCIE_EFFICIENCY * latency.num_gpus),)
