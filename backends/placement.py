"""GPU placement: which GPUs each launched replica gets (pure: no I/O, no environment read).

A replica of ``tensor_parallel_size`` x ``pipeline_parallel_size`` x ``data_parallel_size``
GPUs (vLLM runs one worker per GPU) gets that many GPUs of its own, in its own
``CUDA_VISIBLE_DEVICES``. What the machine has comes in as a ``Discovery`` (``gpus.py``) and the
router's own ``CUDA_VISIBLE_DEVICES`` as a string, so every rule here is tested without GPUs.

Problems are ``launch.<key>: reason`` lines, the config's vocabulary, so the CLI prints them as
config errors (exit 2) whether they were found on load or when the GPUs were counted.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from .gpus import Discovery, GpuInfo

AUTO = "auto"


class PlacementError(ValueError):
    """A placement that cannot be made; ``problems`` are ``launch.<key>: reason`` lines."""

    def __init__(self, *problems: str) -> None:
        self.problems = list(problems)
        super().__init__("; ".join(problems))


@dataclass(frozen=True)
class ParallelLayout:
    """How one replica spreads over its GPUs (vLLM's parallel sizes)."""

    tensor: int = 1
    pipeline: int = 1
    data: int = 1

    @property
    def gpus_per_replica(self) -> int:
        return self.tensor * self.pipeline * self.data

    def describe(self) -> str:
        """'2 GPUs per replica (tensor_parallel_size 2)': the sizes that are not 1."""
        sizes = [
            f"{name}_parallel_size {size}"
            for name, size in (
                ("tensor", self.tensor),
                ("pipeline", self.pipeline),
                ("data", self.data),
            )
            if size > 1
        ]
        n = self.gpus_per_replica
        return f"{n} GPU{'s' if n > 1 else ''} per replica" + (
            f" ({' x '.join(sizes)})" if sizes else ""
        )


def placement_requested(gpus: object, *sizes: object) -> bool:
    """Whether a launch section asks for GPUs: ``gpus`` given, or any other GPU key (the
    parallel sizes, the memory share: then ``gpus`` means auto). None of them: no placement,
    the replicas inherit kvroute's environment as they always have."""
    return gpus is not None or any(v is not None for v in sizes)


def parallel_layout(
    *,
    gpus_per_replica: int | None,
    tensor: int | None,
    pipeline: int | None,
    data: int | None,
) -> ParallelLayout:
    """The layout the keys give: ``gpus_per_replica`` is TP x PP x DP, either given to match
    or derived. With it given and ``tensor_parallel_size`` not, TP is what is left over (the
    usual meaning of "2 GPUs per replica" is TP 2)."""
    problems = [
        f"launch.{key}: must be >= 1, got {value}"
        for key, value in (
            ("gpus_per_replica", gpus_per_replica),
            ("tensor_parallel_size", tensor),
            ("pipeline_parallel_size", pipeline),
            ("data_parallel_size", data),
        )
        if value is not None and value < 1
    ]
    if problems:
        raise PlacementError(*problems)
    pp, dp = pipeline or 1, data or 1
    if gpus_per_replica is None:
        return ParallelLayout(tensor or 1, pp, dp)
    if tensor is None:
        if gpus_per_replica % (pp * dp):
            raise PlacementError(
                f"launch.gpus_per_replica: {gpus_per_replica} is not a multiple of "
                f"launch.pipeline_parallel_size {pp} x launch.data_parallel_size {dp} = {pp * dp}, "
                "so no tensor_parallel_size fills it"
            )
        return ParallelLayout(gpus_per_replica // (pp * dp), pp, dp)
    if tensor * pp * dp != gpus_per_replica:
        raise PlacementError(
            f"launch.gpus_per_replica: {gpus_per_replica} disagrees with "
            f"launch.tensor_parallel_size {tensor} x launch.pipeline_parallel_size {pp} x "
            f"launch.data_parallel_size {dp} = {tensor * pp * dp} (vLLM runs one worker per GPU); "
            "fix one, or leave gpus_per_replica out to derive it"
        )
    return ParallelLayout(tensor, pp, dp)


def gpu_list_problems(gpus: object, count: int, layout: ParallelLayout) -> list[str]:
    """What is wrong with ``launch.gpus`` before any GPU is counted: auto or a list of distinct
    indices, at least as many as the replicas need."""
    if isinstance(gpus, str):
        if gpus != AUTO:
            return [f"launch.gpus: must be a list of GPU indices or 'auto', got {gpus!r}"]
        return []
    if not isinstance(gpus, list) or not gpus:
        return [
            "launch.gpus: must be a non-empty list of GPU indices (as nvidia-smi numbers them) or 'auto'"
        ]
    problems = [f"launch.gpus[{i}]: must be >= 0, got {g}" for i, g in enumerate(gpus) if g < 0]
    duplicates = sorted({g for g in gpus if gpus.count(g) > 1})
    if duplicates:
        problems.append(
            f"launch.gpus: lists GPU {format_indices(duplicates)} more than once "
            "(each GPU goes to one replica)"
        )
    need = count * layout.gpus_per_replica
    if len(gpus) < need:
        problems.append(
            f"launch.gpus: lists {len(gpus)} GPU{'s' if len(gpus) > 1 else ''}, but "
            f"launch.count {count} x "
            f"{layout.describe()} needs {need}"
        )
    return problems


@dataclass(frozen=True)
class GpuPlan:
    """Each replica's GPUs, and what they were chosen from (for the dry run's GPU map)."""

    groups: tuple[tuple[int, ...], ...]
    layout: ParallelLayout
    pool: tuple[int, ...]  # the GPUs placement could use, in the order it used them
    discovery: Discovery
    listed: bool = False  # the pool is launch.gpus (not what auto found)
    # Set when kvroute's environment limits the GPUs it may use (see visible_gpus).
    cuda_visible_devices: str | None = None
    info: dict[int, GpuInfo] = field(default_factory=dict)  # by index, from discovery
    # GPUs placed before this plan for other model pools: GPU -> who uses it ("chat-vllm-0
    # as cuda:1"), left out of this one.
    taken: Mapping[int, str] = field(default_factory=dict)

    @property
    def checked(self) -> bool:
        """Whether the plan was checked against GPUs found on this machine."""
        return bool(self.discovery.gpus)


def plan_gpus(
    *,
    gpus: list[int] | str | None,
    count: int,
    layout: ParallelLayout,
    discovery: Discovery,
    cuda_visible_devices: str | None,
    require_hardware: bool,
    taken: Mapping[int, str] | None = None,
) -> GpuPlan:
    """Assign GPUs to ``count`` replicas; raise ``PlacementError`` naming the key.

    ``gpus`` None or "auto": the GPUs discovery found (and kvroute's environment lets it use).
    A list: those GPUs, checked against the machine when its GPUs could be listed; when none
    could, the list stands as a plan (a dry run on a laptop), unless ``require_hardware``.
    ``taken``: GPUs already placed for other model pools (one host, one inventory): auto
    leaves them out, a list may not name them.
    """
    taken = taken or {}
    problems = gpu_list_problems(gpus if gpus is not None else AUTO, count, layout)
    if problems:
        raise PlacementError(*problems)
    found = discovery.gpus
    visible = (
        visible_gpus(cuda_visible_devices, found) if cuda_visible_devices is not None else None
    )
    need = count * layout.gpus_per_replica
    if gpus is None or isinstance(gpus, str):
        if not found:
            raise PlacementError(
                f"launch.gpus: {AUTO}, but no GPUs were found ({discovery.why_none()}); to plan "
                "a fleet on a machine without them, list them: gpus: [0, 1, ...]"
            )
        present = [g.index for g in found]
        # Visible entries that name no GPU found here would fail in the replica: left out.
        pool = present if visible is None else [g for g in dict.fromkeys(visible) if g in present]
        placed = [g for g in pool if g in taken]
        pool = [g for g in pool if g not in taken]
        if len(pool) < need:
            seen = f"{len(found)} GPUs ({format_indices(present)}, by {discovery.source})"
            if visible is not None:
                seen += (
                    f", {len(pool) + len(placed)} of them visible through CUDA_VISIBLE_DEVICES="
                    f"{cuda_visible_devices} in kvroute's environment"
                )
            if placed:
                seen += f", {format_indices(placed)} placed for other pools already"
            raise PlacementError(
                f"launch.gpus: {AUTO} found {seen}, but launch.count {count} x "
                f"{layout.describe()} needs {need}"
            )
    else:
        pool = list(gpus)
        problems = []
        if found:
            present = [g.index for g in found]
            problems += [
                f"launch.gpus: GPU {g} is not on this machine ({discovery.source} lists "
                f"{format_indices(present)})"
                for g in pool
                if g not in present
            ]
        elif require_hardware:
            problems.append(
                f"launch.gpus: lists GPU{'s' if len(pool) > 1 else ''} {format_indices(pool)}, "
                "but no GPUs were found here "
                f"({discovery.why_none()}); `kvroute serve --dry-run` plans without them"
            )
        if visible is not None:
            problems += [
                f"launch.gpus: GPU {g} is hidden by CUDA_VISIBLE_DEVICES={cuda_visible_devices} "
                "in kvroute's environment"
                for g in pool
                if g not in visible
            ]
        problems += [
            f"launch.gpus: GPU {g} is placed for another pool already ({taken[g]}); each GPU "
            "goes to one replica"
            for g in pool
            if g in taken
        ]
        if problems:
            raise PlacementError(*problems)
    return GpuPlan(
        groups=assign(count, layout.gpus_per_replica, pool),
        layout=layout,
        pool=tuple(pool),
        discovery=discovery,
        listed=isinstance(gpus, list),
        cuda_visible_devices=cuda_visible_devices,
        info={g.index: g for g in found},
        taken=dict(taken),
    )


def visible_gpus(cuda_visible_devices: str, found: Sequence[GpuInfo]) -> list[int]:
    """The GPUs (nvidia-smi indices) kvroute's own ``CUDA_VISIBLE_DEVICES`` lets it use.

    Our choice: kvroute's ``CUDA_VISIBLE_DEVICES`` is the set it may hand out, read as a
    scheduler (Slurm, a job script) sets it, in nvidia-smi's numbering or as GPU UUIDs; each
    replica's own ``CUDA_VISIBLE_DEVICES`` then replaces it with the replica's share. As CUDA
    does, the list ends at the first entry that names no device, so "" or -1 hides them all.
    """
    visible: list[int] = []
    for entry in (e.strip() for e in cuda_visible_devices.split(",")):
        if entry.isdigit():
            visible.append(int(entry))
        elif entry.startswith("MIG-"):
            raise PlacementError(
                f"launch.gpus: CUDA_VISIBLE_DEVICES={cuda_visible_devices} in kvroute's "
                "environment names MIG instances; kvroute places whole GPUs: unset it, or run "
                "replicas on MIG instances as static replicas"
            )
        elif entry.startswith("GPU-"):
            # CUDA takes any unique prefix of a UUID.
            matches = [g.index for g in found if g.uuid.startswith(entry)]
            if len(matches) != 1:
                why = "matches no GPU found here" if not matches else "matches several GPUs"
                raise PlacementError(
                    f"launch.gpus: CUDA_VISIBLE_DEVICES entry {entry} in kvroute's environment "
                    f"{why}" + ("" if found else " (no GPUs were found to match UUIDs against)")
                )
            visible.append(matches[0])
        else:
            break
    return visible


def assign(count: int, per_replica: int, pool: Sequence[int]) -> tuple[tuple[int, ...], ...]:
    """``count`` groups of ``per_replica`` GPUs from ``pool``, neighbours together.

    A replica's GPUs talk all the time (tensor-parallel all-reduces): on NVSwitch machines any
    group is as good as another, on PCIe ones neighbouring indices share a switch or at least a
    NUMA node, so consecutive GPUs go to the same replica.
    """
    if count * per_replica > len(pool):
        raise PlacementError(
            f"launch.gpus: {len(pool)} GPUs for launch.count {count} x {per_replica} GPUs "
            f"per replica = {count * per_replica}"
        )
    return tuple(tuple(pool[i * per_replica : (i + 1) * per_replica]) for i in range(count))


def gpu_env(gpus: Sequence[int]) -> dict[str, str]:
    """The environment that gives a replica its GPUs; {} for none (the CPU default)."""
    if not gpus:
        return {}
    return {
        # CUDA numbers GPUs fastest first unless told otherwise; nvidia-smi, NVML and
        # launch.gpus number them in PCI bus order. This makes the two agree.
        "CUDA_DEVICE_ORDER": "PCI_BUS_ID",
        "CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in gpus),
    }


def format_indices(indices: Sequence[int]) -> str:
    """'0-7' for a run of consecutive indices, else '0,2,5'."""
    values = list(indices)
    if len(values) > 2 and values == list(range(values[0], values[0] + len(values))):
        return f"{values[0]}-{values[-1]}"
    return ",".join(str(v) for v in values)
