"""The soak's view of a ``kvroute serve`` process tree, read from /proc (Linux).

``kvroute serve`` with ``launch:`` has two kinds of children: replica reapers (each leads one
replica's process group, see ``kvroute.backends.reaper``) and the router's own helpers (the
tokenizer worker pool and multiprocessing's resource tracker). The router's resources are the
serve process plus its helpers; a replica is killed by SIGKILL to its reaper's group, as a
crashed machine would kill it, and the serve process's supervisor starts it again.
"""

from __future__ import annotations

import itertools
import signal
from dataclasses import dataclass

from kvroute.backends.process import signal_group
from kvroute.bench.harness.procs import children, cmdline, open_fds, rss_bytes

_REAPER_MODULE = "kvroute.backends.reaper"


def _port_of(argv: list[str]) -> int | None:
    """The ``--port`` a replica's command line listens on."""
    for flag, value in itertools.pairwise(argv):
        if flag == "--port" and value.isdigit():
            return int(value)
    return None


@dataclass(frozen=True)
class RouterTree:
    """``kvroute serve``'s process (``pid``) and what it started."""

    pid: int

    def _split(self) -> tuple[list[int], dict[int, int]]:
        helpers: list[int] = []
        replicas: dict[int, int] = {}  # replica port -> reaper pid (its process group)
        own = cmdline(self.pid)
        for child in children(self.pid):
            argv = cmdline(child)
            if _REAPER_MODULE in argv:
                port = _port_of(argv)
                if port is not None:
                    replicas[port] = child
            elif argv and argv != own:
                # A child with serve's own command line is a fork that has not exec'd yet (a
                # replica being restarted): its RSS and fds are serve's, counted twice.
                helpers.append(child)
        return helpers, replicas

    def router_pids(self) -> list[int]:
        """The router's own processes: serve and its helpers, not the replicas."""
        return [self.pid, *self._split()[0]]

    def replica_group(self, port: int) -> int | None:
        """The process group of the replica listening on ``port``, if it runs now."""
        return self._split()[1].get(port)

    def rss_bytes(self) -> int:
        return sum(rss_bytes(p) for p in self.router_pids())

    def open_fds(self) -> int:
        return sum(open_fds(p) for p in self.router_pids())

    def kill_replica(self, port: int) -> int | None:
        """SIGKILL the whole process group of the replica on ``port``; its pid, or None when no
        replica runs there now (it is still being restarted)."""
        group = self.replica_group(port)
        if group is None or not signal_group(group, signal.SIGKILL):
            return None
        return group
