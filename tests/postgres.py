"""A private PostgreSQL server for tests: Debian's postgresql package, a fresh cluster in a
temporary directory on a free port, trust auth on 127.0.0.1, stopped at the end.

initdb refuses to run as root: as root, the cluster belongs to the ``postgres`` user that the
package creates, and its commands run through ``runuser``.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from kvroute.backends.process import free_ports

INSTALL_HINT = "PostgreSQL is not installed: apt-get install -y postgresql"


def pg_bin(name: str) -> str | None:
    """A PostgreSQL server binary: on PATH, else Debian's versioned directory (newest)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob.glob(f"/usr/lib/postgresql/*/bin/{name}"))
    return candidates[-1] if candidates else None


def _as_owner(cmd: list[str]) -> list[str]:
    return ["runuser", "-u", "postgres", "--", *cmd] if os.geteuid() == 0 else cmd


@contextmanager
def postgres_server() -> Iterator[str]:
    """Start a cluster; yields its URL (database ``postgres``, user ``kvroute``)."""
    initdb, pg_ctl = pg_bin("initdb"), pg_bin("pg_ctl")
    if initdb is None or pg_ctl is None:
        raise FileNotFoundError(INSTALL_HINT)
    root = Path(tempfile.mkdtemp(prefix="kvroute-pg-"))
    data = root / "data"
    if os.geteuid() == 0:
        shutil.chown(root, "postgres", "postgres")
    (port,) = free_ports(1, "127.0.0.1")
    run = {"check": True, "capture_output": True, "timeout": 120}
    subprocess.run(
        _as_owner([initdb, "-D", str(data), "-U", "kvroute", "--auth=trust", "-E", "UTF8"]), **run
    )
    options = f"-p {port} -k {root} -c listen_addresses=127.0.0.1 -c fsync=off"
    subprocess.run(
        _as_owner([pg_ctl, "-D", str(data), "-o", options, "-l", str(root / "log"), "-w", "start"]),
        **run,
    )
    try:
        yield f"postgresql://kvroute@127.0.0.1:{port}/postgres"
    finally:
        subprocess.run(
            _as_owner([pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"]),
            capture_output=True,
            timeout=60,
        )
        shutil.rmtree(root, ignore_errors=True)
