"""Fake GPU tooling for tests without GPUs: an ``nvidia-smi`` script and a ``pynvml`` module."""

from __future__ import annotations

import shlex
import stat
from pathlib import Path

from kvroute.backends.gpus import NVIDIA_SMI_QUERY

# What `nvidia-smi --query-gpu=index,uuid,name,memory.total --format=csv,noheader,nounits`
# prints on an 8 x H100 machine (UUIDs shortened).
H100_TABLE = "".join(
    f"{i}, GPU-{i}c6f0d2a-0000-0000-0000-00000000000{i}, NVIDIA H100 80GB HBM3, 81559\n"
    for i in range(8)
)


def fake_nvidia_smi(bin_dir: Path, table: str = H100_TABLE, *, code: int = 0) -> Path:
    """An ``nvidia-smi`` that answers only the exact query kvroute makes, as the real one would.
    Shell builtins only: the tests run it with nothing else on PATH."""
    bin_dir.mkdir(parents=True, exist_ok=True)
    script = bin_dir / "nvidia-smi"
    expected = " ".join(NVIDIA_SMI_QUERY)
    script.write_text(
        "#!/bin/sh\n"
        f'if [ "$*" != "{expected}" ]; then echo "unexpected arguments: $*" >&2; exit 64; fi\n'
        f"printf '%s' {shlex.quote(table)}\n"
        f"exit {code}\n"
    )
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return script


DRIVER_MISSING = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running.\n"
)


def no_driver_pynvml(directory: Path) -> Path:
    """A ``pynvml`` package directory for PYTHONPATH whose NVML cannot start (no driver), so a
    child process takes the nvidia-smi path whatever is installed on the machine."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pynvml.py").write_text(
        "class NVMLError(Exception):\n    pass\n\n\n"
        "def nvmlInit():\n    raise NVMLError('Driver Not Loaded')\n"
    )
    return directory
