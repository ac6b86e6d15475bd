"""Which NVIDIA GPUs this machine has: NVML first, then ``nvidia-smi``, else none.

NVML comes from ``pynvml`` (PyPI ``nvidia-ml-py``, the ``gpu`` extra; real vLLM installs it
too). Without it, or when NVML cannot start, ``nvidia-smi`` is asked for the same table. Finding
nothing is not an error here: only a config that asks for GPUs makes it one (see
``placement.py``), so a laptop can still plan a GPU fleet from an explicit ``gpus:`` list.

Both ways number GPUs as ``nvidia-smi`` shows them (PCI bus order), the numbering
``launch.gpus`` and the replicas' ``CUDA_VISIBLE_DEVICES`` use.
"""

from __future__ import annotations

import contextlib
import importlib
import subprocess
from dataclasses import dataclass
from typing import Any

NVIDIA_SMI_QUERY = (
    "--query-gpu=index,uuid,name,memory.total",
    "--format=csv,noheader,nounits",
)
# A wedged driver can leave nvidia-smi hanging; planning must not hang with it.
NVIDIA_SMI_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class GpuInfo:
    index: int  # nvidia-smi's index (PCI bus order)
    uuid: str = ""  # GPU-8c6f...; "" when unknown
    name: str = ""
    memory_mib: int | None = None


@dataclass(frozen=True)
class Discovery:
    """What discovery found, and how; ``tried`` says why each way found nothing."""

    gpus: tuple[GpuInfo, ...]
    source: str  # "NVML", "nvidia-smi", or "" when nothing was found
    tried: tuple[str, ...] = ()

    def why_none(self) -> str:
        return "; ".join(self.tried) or "no GPUs"


def discover_gpus(
    nvidia_smi: str = "nvidia-smi", timeout_s: float = NVIDIA_SMI_TIMEOUT_S
) -> Discovery:
    gpus, why_not_nvml = nvml_gpus()
    if gpus:
        return Discovery(gpus, "NVML")
    gpus, why_not_smi = nvidia_smi_gpus(nvidia_smi, timeout_s)
    if gpus:
        return Discovery(gpus, "nvidia-smi")
    return Discovery((), "", (f"NVML: {why_not_nvml}", f"nvidia-smi: {why_not_smi}"))


def nvml_gpus() -> tuple[tuple[GpuInfo, ...], str]:
    """The GPUs NVML lists, or () and why not."""
    try:
        # Imported by name, late: an optional dependency, and tests put a fake in sys.modules.
        nvml: Any = importlib.import_module("pynvml")
    except ImportError:
        return (), "pynvml is not installed (pip install nvidia-ml-py, or kvroute[gpu])"
    try:
        nvml.nvmlInit()
    except Exception as exc:  # NVMLError_* (no driver, no library), or ctypes' OSError
        return (), f"cannot start NVML: {_one_line(exc)}"
    try:
        gpus = []
        for i in range(nvml.nvmlDeviceGetCount()):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            gpus.append(
                GpuInfo(
                    index=i,
                    uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
                    name=_text(nvml.nvmlDeviceGetName(handle)),
                    memory_mib=int(nvml.nvmlDeviceGetMemoryInfo(handle).total) // (1 << 20),
                )
            )
    except Exception as exc:  # a GPU fallen off the bus, an NVMLError mid-way
        return (), f"NVML failed listing GPUs: {_one_line(exc)}"
    finally:
        # Nothing to undo if shutting down fails: the listing above stands or has failed.
        with contextlib.suppress(Exception):
            nvml.nvmlShutdown()
    return tuple(gpus), "" if gpus else "no GPUs"


def nvidia_smi_gpus(
    executable: str = "nvidia-smi", timeout_s: float = NVIDIA_SMI_TIMEOUT_S
) -> tuple[tuple[GpuInfo, ...], str]:
    """The GPUs ``nvidia-smi`` lists, or () and why not."""
    try:
        result = subprocess.run(
            [executable, *NVIDIA_SMI_QUERY],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        return (), "not found on PATH"
    except subprocess.TimeoutExpired:
        return (), f"no answer within {timeout_s:g}s"
    except OSError as exc:
        return (), f"cannot run it: {exc.strerror or exc}"
    if result.returncode != 0:
        # nvidia-smi prints its failures ("couldn't communicate with the NVIDIA driver") on stdout.
        said = _one_line(result.stdout.strip() or result.stderr.strip() or "no output")
        return (), f"exited with {result.returncode}: {said}"
    try:
        gpus = parse_nvidia_smi(result.stdout)
    except ValueError as exc:
        return (), str(exc)
    return gpus, "" if gpus else "no GPUs"


def parse_nvidia_smi(text: str) -> tuple[GpuInfo, ...]:
    """Parse ``index, uuid, name, memory.total`` lines (csv, noheader, nounits)."""
    gpus = []
    for line in text.splitlines():
        if not line.strip():
            continue
        cells = [c.strip() for c in line.split(",")]
        if len(cells) < 4 or not cells[0].isdigit():
            raise ValueError(f"unexpected output line {line.strip()!r}")
        memory = cells[-1]
        gpus.append(
            GpuInfo(
                index=int(cells[0]),
                uuid=cells[1],
                name=", ".join(cells[2:-1]),  # a name with a comma in it stays whole
                memory_mib=int(memory) if memory.isdigit() else None,  # "[N/A]" on some boards
            )
        )
    return tuple(gpus)


def _text(value: object) -> str:
    # nvidia-ml-py before 11.5 returns bytes, later versions str.
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _one_line(value: object) -> str:
    lines = str(value).strip().splitlines()
    return lines[0] if lines else type(value).__name__
