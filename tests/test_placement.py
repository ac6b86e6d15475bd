"""GPU placement as pure logic: layouts, who gets which GPUs, and what each refusal says."""

from __future__ import annotations

import pytest

from kvroute.backends.gpus import Discovery, GpuInfo
from kvroute.backends.placement import (
    ParallelLayout,
    PlacementError,
    assign,
    gpu_env,
    gpu_list_problems,
    parallel_layout,
    placement_requested,
    plan_gpus,
    visible_gpus,
)

EIGHT = Discovery(
    tuple(GpuInfo(i, f"GPU-{i}aaa-{i}", "NVIDIA H100 80GB HBM3", 81559) for i in range(8)),
    "nvidia-smi",
)
NONE = Discovery((), "", ("NVML: pynvml is not installed", "nvidia-smi: not found on PATH"))
TP2 = ParallelLayout(tensor=2)


def layout(**sizes: int | None) -> ParallelLayout:
    keys = ("gpus_per_replica", "tensor", "pipeline", "data")
    return parallel_layout(**{k: sizes.get(k) for k in keys})


def problems_of(error: pytest.ExceptionInfo[PlacementError]) -> list[str]:
    return error.value.problems


# --- layouts -----------------------------------------------------------------------------


def test_gpus_per_replica_is_derived_from_the_parallel_sizes() -> None:
    assert layout().gpus_per_replica == 1
    assert layout(tensor=2) == ParallelLayout(2, 1, 1)
    assert layout(tensor=2, pipeline=2, data=2).gpus_per_replica == 8


def test_tensor_parallel_size_is_what_gpus_per_replica_leaves_over() -> None:
    assert layout(gpus_per_replica=4) == ParallelLayout(4, 1, 1)
    assert layout(gpus_per_replica=4, data=2) == ParallelLayout(2, 1, 2)
    assert layout(gpus_per_replica=8, pipeline=2, data=2) == ParallelLayout(2, 2, 2)
    assert layout(gpus_per_replica=2, tensor=2) == ParallelLayout(2, 1, 1)


def test_gpus_per_replica_that_disagrees_names_every_size() -> None:
    with pytest.raises(PlacementError) as err:
        layout(gpus_per_replica=4, tensor=2)
    assert problems_of(err) == [
        "launch.gpus_per_replica: 4 disagrees with launch.tensor_parallel_size 2 x "
        "launch.pipeline_parallel_size 1 x launch.data_parallel_size 1 = 2 (vLLM runs one "
        "worker per GPU); fix one, or leave gpus_per_replica out to derive it"
    ]


def test_gpus_per_replica_not_a_multiple_of_pipeline_and_data() -> None:
    with pytest.raises(PlacementError) as err:
        layout(gpus_per_replica=6, data=4)
    assert "launch.gpus_per_replica: 6 is not a multiple of" in problems_of(err)[0]


def test_sizes_below_one_are_each_named() -> None:
    with pytest.raises(PlacementError) as err:
        layout(gpus_per_replica=0, tensor=-1)
    assert problems_of(err) == [
        "launch.gpus_per_replica: must be >= 1, got 0",
        "launch.tensor_parallel_size: must be >= 1, got -1",
    ]


def test_describe_names_the_sizes_that_matter() -> None:
    assert ParallelLayout().describe() == "1 GPU per replica"
    assert TP2.describe() == "2 GPUs per replica (tensor_parallel_size 2)"
    assert ParallelLayout(2, 2, 1).describe() == (
        "4 GPUs per replica (tensor_parallel_size 2 x pipeline_parallel_size 2)"
    )


def test_no_gpu_key_means_no_placement() -> None:
    assert not placement_requested(None, None, None, None, None, None)
    assert placement_requested([0], None)
    assert placement_requested(None, None, 2)  # tensor_parallel_size alone: gpus auto
    assert placement_requested(None, 0.8)


# --- explicit lists, before any GPU is counted --------------------------------------------


def test_gpu_list_checks_need_duplicates_and_signs() -> None:
    assert gpu_list_problems([0, 1, 2, 3], 2, TP2) == []
    assert gpu_list_problems("auto", 64, TP2) == []
    assert gpu_list_problems([0, 1, 2], 2, TP2) == [
        "launch.gpus: lists 3 GPUs, but launch.count 2 x 2 GPUs per replica "
        "(tensor_parallel_size 2) needs 4"
    ]
    assert gpu_list_problems([0, 1, 1, -2], 2, TP2) == [
        "launch.gpus[3]: must be >= 0, got -2",
        "launch.gpus: lists GPU 1 more than once (each GPU goes to one replica)",
    ]
    assert gpu_list_problems("all", 1, TP2) == [
        "launch.gpus: must be a list of GPU indices or 'auto', got 'all'"
    ]
    assert "non-empty list" in gpu_list_problems([], 1, TP2)[0]


# --- assignment ----------------------------------------------------------------------------


def test_assign_keeps_a_replicas_gpus_neighbours() -> None:
    assert assign(4, 2, range(8)) == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert assign(2, 4, [7, 6, 5, 4, 3, 2, 1, 0]) == ((7, 6, 5, 4), (3, 2, 1, 0))
    assert assign(3, 2, range(8)) == ((0, 1), (2, 3), (4, 5))  # 6 and 7 stay free


def test_assign_refuses_too_few() -> None:
    with pytest.raises(PlacementError) as err:
        assign(4, 2, range(6))
    assert problems_of(err)[0].startswith("launch.gpus: 6 GPUs for launch.count 4 x 2")


def test_gpu_env_is_empty_without_gpus_and_pci_ordered_with() -> None:
    assert gpu_env(()) == {}
    assert gpu_env((4, 5)) == {"CUDA_DEVICE_ORDER": "PCI_BUS_ID", "CUDA_VISIBLE_DEVICES": "4,5"}


# --- plans against a machine ---------------------------------------------------------------


def plan(
    gpus: list[int] | str | None,
    count: int = 4,
    found: Discovery = EIGHT,
    visible: str | None = None,
    require_hardware: bool = True,
    shape: ParallelLayout = TP2,
) -> tuple[tuple[int, ...], ...]:
    return plan_gpus(
        gpus=gpus,
        count=count,
        layout=shape,
        discovery=found,
        cuda_visible_devices=visible,
        require_hardware=require_hardware,
    ).groups


def refusal(**kwargs: object) -> list[str]:
    with pytest.raises(PlacementError) as err:
        plan(**kwargs)  # type: ignore[arg-type]
    return problems_of(err)


def test_auto_shares_out_what_was_found() -> None:
    assert plan("auto") == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan(None, count=2) == ((0, 1), (2, 3))  # gpus left out: auto


def test_auto_asking_for_more_gpus_than_exist_names_the_keys() -> None:
    assert refusal(gpus="auto", count=5) == [
        "launch.gpus: auto found 8 GPUs (0-7, by nvidia-smi), but launch.count 5 x 2 GPUs "
        "per replica (tensor_parallel_size 2) needs 10"
    ]


def test_auto_without_gpus_says_what_was_tried() -> None:
    assert refusal(gpus="auto", found=NONE, require_hardware=False) == [
        "launch.gpus: auto, but no GPUs were found (NVML: pynvml is not installed; "
        "nvidia-smi: not found on PATH); to plan a fleet on a machine without them, list "
        "them: gpus: [0, 1, ...]"
    ]


def test_an_explicit_list_is_checked_against_the_machine() -> None:
    assert plan([7, 6, 5, 4], count=2) == ((7, 6), (5, 4))
    assert refusal(gpus=[6, 7, 8, 9], count=2) == [
        "launch.gpus: GPU 8 is not on this machine (nvidia-smi lists 0-7)",
        "launch.gpus: GPU 9 is not on this machine (nvidia-smi lists 0-7)",
    ]


def test_an_explicit_list_is_a_plan_where_no_gpu_is_found_unless_hardware_is_required() -> None:
    assert plan(list(range(8)), found=NONE, require_hardware=False) == (
        (0, 1),
        (2, 3),
        (4, 5),
        (6, 7),
    )
    (problem,) = refusal(gpus=[0, 1], count=1, found=NONE, require_hardware=True)
    assert problem.startswith("launch.gpus: lists GPUs 0,1, but no GPUs were found here")
    assert "kvroute serve --dry-run" in problem


# --- kvroute's own CUDA_VISIBLE_DEVICES ----------------------------------------------------


def test_auto_takes_only_the_gpus_kvroute_may_see() -> None:
    assert plan("auto", count=2, visible="4,5,6,7") == ((4, 5), (6, 7))
    # An entry naming no GPU here, or one twice, gives nothing more to hand out.
    assert plan("auto", count=1, visible="9,6,6,7") == ((6, 7),)
    assert refusal(gpus="auto", count=4, visible="4,5,6,7") == [
        "launch.gpus: auto found 8 GPUs (0-7, by nvidia-smi), 4 of them visible through "
        "CUDA_VISIBLE_DEVICES=4,5,6,7 in kvroute's environment, but launch.count 4 x 2 GPUs "
        "per replica (tensor_parallel_size 2) needs 8"
    ]


def test_an_explicit_list_must_stay_within_kvroutes_visible_gpus() -> None:
    assert plan([2, 3], count=1, visible="0,1,2,3") == ((2, 3),)
    assert refusal(gpus=[3, 4], count=1, visible="0,1,2,3") == [
        "launch.gpus: GPU 4 is hidden by CUDA_VISIBLE_DEVICES=0,1,2,3 in kvroute's environment"
    ]


def test_visible_gpus_reads_indices_and_uuid_prefixes_and_stops_as_cuda_does() -> None:
    found = EIGHT.gpus
    assert visible_gpus("3, 1", found) == [3, 1]
    assert visible_gpus("GPU-5aaa,GPU-2", found) == [5, 2]
    assert visible_gpus("", found) == []
    assert visible_gpus("-1", found) == []
    assert visible_gpus("0,1,-1,3", found) == [0, 1]


def test_visible_gpus_refuses_mig_and_unknown_uuids() -> None:
    with pytest.raises(PlacementError, match="MIG instances"):
        visible_gpus("MIG-4f3b7c1e-aaaa", EIGHT.gpus)
    with pytest.raises(PlacementError, match="GPU-ffff in kvroute's environment matches no GPU"):
        visible_gpus("GPU-ffff", EIGHT.gpus)
    with pytest.raises(PlacementError, match="no GPUs were found to match UUIDs against"):
        visible_gpus("GPU-1aaa", ())


def test_hidden_gpus_leave_auto_nothing() -> None:
    (problem,) = refusal(gpus="auto", count=1, visible="-1")
    assert "0 of them visible through CUDA_VISIBLE_DEVICES=-1" in problem
