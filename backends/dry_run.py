"""What ``kvroute serve --dry-run`` shows: the GPU map and each replica's command and environment.

Nothing is started and nothing is made: no replica, no log directory, no KV-event socket
directory, no tiny model. Ports are ones free now (serve picks its own when it starts).
"""

from __future__ import annotations

import shlex
import tempfile
from pathlib import Path

from kvroute.kvcore.kv_events import rank_endpoint

from .launcher import LaunchSpec, ReplicaPlan, plan_replica, replica_ports
from .placement import GpuPlan, format_indices

# Stands for the private directory serve makes (mkdtemp) for the replicas' KV-event sockets.
KV_DIR_PLACEHOLDER = "kvroute-kv-XXXXXXXX"


def plan_fleet(spec: LaunchSpec) -> list[ReplicaPlan]:
    """Every replica ``LaunchedFleet(spec)`` would start, as it would start it."""
    kv_dir = Path(tempfile.gettempdir()) / KV_DIR_PLACEHOLDER
    return [
        plan_replica(spec, i, replica_ports(spec), kv_dir, build_model=False)
        for i in range(spec.count)
    ]


def describe_plan(
    spec: LaunchSpec, replicas: list[ReplicaPlan], gpus: GpuPlan | None, key: str = "launch"
) -> str:
    """``key``: the config's name for the launch section ('pools[1].launch' in a pool)."""
    lines = []
    per_replica = f", {gpus.layout.describe()}" if gpus is not None else ""
    lines.append(
        f"{spec.count} {spec.engine} replicas serving {spec.model!r}{per_replica}, "
        f"logs in {spec.log_dir}/"
    )
    lines.append("")
    lines += _gpu_map(replicas, gpus, key) if gpus is not None else ["GPUs: none (no GPU keys set)"]
    for replica in replicas:
        lines.append("")
        where = f", GPUs {','.join(map(str, replica.gpus))}" if replica.gpus else ""
        lines.append(f"{replica.name}: {replica.url}{where}, log {replica.log_path}")
        lines += _rank_lines(spec, replica)
        lines.append("  environment kvroute sets (on top of the one it inherits):")
        lines += [f"    {key}={shlex.quote(replica.env[key])}" for key in sorted(replica.env)]
        if not replica.env:
            lines.append("    (nothing)")
        lines.append("  command:")
        lines.append(f"    {shlex.join(replica.argv)}")
    lines.append("")
    lines += _notes(spec, gpus, key)
    return "\n".join(lines)


def _rank_lines(spec: LaunchSpec, replica: ReplicaPlan) -> list[str]:
    """A data-parallel replica's ranks: the router routes to each (X-data-parallel-rank) and
    hears each one's KV events where vLLM offsets them."""
    size = spec.data_parallel_size
    if size == 1:
        return []
    lines = [f"  {size} data-parallel ranks, each routed to as {replica.name}@dpK:"]
    for rank in range(size):
        events = ""
        if replica.kv is not None:
            events = (
                f", KV events {rank_endpoint(replica.kv.events, rank)}"
                f" (replay {rank_endpoint(replica.kv.replay, rank)})"
            )
        lines.append(f"    rank {rank}: header X-data-parallel-rank: {rank}{events}")
    return lines


def _gpu_map(replicas: list[ReplicaPlan], plan: GpuPlan, key: str) -> list[str]:
    owner = {gpu: (r.name, k) for r in replicas for k, gpu in enumerate(r.gpus)}
    if plan.checked:
        found = plan.discovery
        header = f"GPU map ({len(found.gpus)} GPUs found by {found.source}"
        if plan.cuda_visible_devices is not None:
            header += f"; kvroute's CUDA_VISIBLE_DEVICES={plan.cuda_visible_devices}"
        header += "):"
        # The GPUs placement drew from first, then the machine's others.
        shown = [*plan.pool, *sorted(set(plan.info) - set(plan.pool))]
    else:  # a plan for another machine: the note at the end says it was not checked
        header = f"GPU map ({key}.gpus {format_indices(list(plan.pool))}):"
        shown = [*plan.pool, *sorted(set(plan.taken) - set(plan.pool))]
    if plan.taken:  # the host's GPUs, shared by several pools: in index order
        shown = sorted(shown)
    rows = []
    for gpu in shown:
        info = plan.info.get(gpu)
        described = ""
        if info is not None:
            memory = f"{info.memory_mib} MiB" if info.memory_mib is not None else "? MiB"
            described = f"{info.name}, {memory}"
        if gpu in owner:
            name, local = owner[gpu]
            use = f"-> {name} as cuda:{local}"
        elif gpu in plan.taken:  # another pool's
            use = f"-> {plan.taken[gpu]}"
        elif gpu in plan.pool:
            use = "unused"
        else:
            use = f"not in {key}.gpus" if plan.listed else "hidden by CUDA_VISIBLE_DEVICES"
        rows.append((f"GPU {gpu}", described, use))
    width = [max(len(row[i]) for row in rows) for i in range(2)] if rows else [0, 0]
    described_any = any(row[1] for row in rows)
    return [header] + [
        "  "
        + "  ".join(
            [gpu.ljust(width[0]), *([described.ljust(width[1])] if described_any else []), use]
        )
        for gpu, described, use in rows
    ]


def _notes(spec: LaunchSpec, gpus: GpuPlan | None, key: str) -> list[str]:
    notes = []
    if gpus is not None and not gpus.checked:
        notes.append(
            f"GPUs: not checked against this machine, which has none ({gpus.discovery.why_none()})"
        )
    notes.append("ports: free now; serve picks free ones again when it starts")
    if spec.kv_events and spec.kv_events_bind == "ipc":
        notes.append(
            f"KV events: Unix sockets in a private directory serve makes ({KV_DIR_PLACEHOLDER} "
            "above) and removes on stop"
        )
    if spec.engine == "vllm" and spec.model_path and not Path(spec.model_path).exists():
        notes.append(
            f"{key}.model_path {spec.model_path}: not on this machine; it must be on the one "
            "that serves"
        )
    return ["notes:"] + [f"  {note}" for note in notes]
