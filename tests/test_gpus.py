"""GPU discovery without GPUs: a fake ``nvidia-smi`` on PATH and a fake ``pynvml`` module."""

from __future__ import annotations

import sys
import types
from pathlib import Path
from typing import Any

import pytest

from kvroute.backends.gpus import (
    GpuInfo,
    discover_gpus,
    nvidia_smi_gpus,
    parse_nvidia_smi,
)

from .gpu_fakes import DRIVER_MISSING, H100_TABLE, fake_nvidia_smi


class FakeNVMLError(Exception):
    pass


def fake_pynvml(gpus: list[tuple[bytes | str, bytes | str, int]] | None) -> types.ModuleType:
    """A ``pynvml`` with the calls kvroute makes; ``gpus`` None: the driver is not loaded."""
    module: Any = types.ModuleType("pynvml")
    module.NVMLError = FakeNVMLError
    module.calls = []

    def init() -> None:
        module.calls.append("init")
        if gpus is None:
            raise FakeNVMLError("Driver Not Loaded")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetCount = lambda: len(gpus or [])
    module.nvmlDeviceGetHandleByIndex = lambda i: ("handle", i)
    module.nvmlDeviceGetUUID = lambda h: (gpus or [])[h[1]][0]
    module.nvmlDeviceGetName = lambda h: (gpus or [])[h[1]][1]
    module.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(
        total=(gpus or [])[h[1]][2], free=0, used=0
    )
    return module  # type: ignore[no-any-return]


@pytest.fixture
def no_nvml(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import pynvml raises ImportError


def test_parse_nvidia_smi_table() -> None:
    gpus = parse_nvidia_smi(H100_TABLE)
    assert [g.index for g in gpus] == list(range(8))
    assert gpus[3] == GpuInfo(
        3, "GPU-3c6f0d2a-0000-0000-0000-000000000003", "NVIDIA H100 80GB HBM3", 81559
    )


def test_parse_nvidia_smi_odd_boards_and_bad_lines() -> None:
    (gpu,) = parse_nvidia_smi("\n0, GPU-a, NVIDIA A100-SXM4-40GB, Rev 2, [N/A]\n\n")
    assert (gpu.name, gpu.memory_mib) == ("NVIDIA A100-SXM4-40GB, Rev 2", None)
    with pytest.raises(ValueError, match="unexpected output line 'No devices were found'"):
        parse_nvidia_smi("No devices were found\n")


def test_nvidia_smi_on_path_is_used_without_nvml(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_nvml: None
) -> None:
    fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    found = discover_gpus()
    assert found.source == "nvidia-smi"
    assert [g.index for g in found.gpus] == list(range(8))
    assert found.gpus[0].name == "NVIDIA H100 80GB HBM3"


def test_no_gpus_anywhere_says_why_for_each_way(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, no_nvml: None
) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: no nvidia-smi
    found = discover_gpus()
    assert (found.gpus, found.source) == ((), "")
    assert found.why_none() == (
        "NVML: pynvml is not installed (pip install nvidia-ml-py, or kvroute[gpu]); "
        "nvidia-smi: not found on PATH"
    )


def test_failing_nvidia_smi_is_reported_in_its_own_words(tmp_path: Path) -> None:
    smi = fake_nvidia_smi(tmp_path, DRIVER_MISSING, code=9)
    assert nvidia_smi_gpus(str(smi)) == ((), f"exited with 9: {DRIVER_MISSING.strip()}")


def test_a_hanging_nvidia_smi_does_not_hang_discovery(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\nexec sleep 60\n")
    smi.chmod(0o755)
    assert nvidia_smi_gpus(str(smi), timeout_s=0.5) == ((), "no answer within 0.5s")


def test_nvml_is_asked_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    nvml = fake_pynvml(
        [(b"GPU-aaaa", b"NVIDIA H200", 150_754 << 20), ("GPU-bbbb", "NVIDIA H200", 150_754 << 20)]
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    fake_nvidia_smi(tmp_path / "bin", "0, GPU-other, Not This One, 1\n")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    found = discover_gpus()
    assert found.source == "NVML"
    assert found.gpus == (
        GpuInfo(0, "GPU-aaaa", "NVIDIA H200", 150_754),
        GpuInfo(1, "GPU-bbbb", "NVIDIA H200", 150_754),
    )
    assert nvml.calls == ["init", "shutdown"]


def test_nvml_that_cannot_start_falls_back_to_nvidia_smi(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", fake_pynvml(None))
    fake_nvidia_smi(tmp_path / "bin")
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    found = discover_gpus()
    assert found.source == "nvidia-smi" and len(found.gpus) == 8
    monkeypatch.setenv("PATH", str(tmp_path))  # and without nvidia-smi either:
    assert discover_gpus().why_none() == (
        "NVML: cannot start NVML: Driver Not Loaded; nvidia-smi: not found on PATH"
    )
