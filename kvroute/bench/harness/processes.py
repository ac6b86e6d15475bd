"""Child processes for benchmarks and drills: start, wait until ready, stop for sure.

Every child starts in its own session (so its own process group), with the process-group
helpers of ``kvroute.backends.process`` (where ``free_ports`` is too). Stopping sends SIGTERM to
the whole group, waits a grace period, then SIGKILLs the group, so helper processes a child
may have spawned die with it. ``managed`` is a context manager: the group is stopped on normal
exit, on exceptions and on Ctrl-C alike.
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from kvroute.backends.process import spawn_group, stop_group

_POLL_S = 0.1
_LOG_TAIL_BYTES = 2000


class StartError(RuntimeError):
    """A child exited or did not become ready before its deadline."""


@dataclass
class Child:
    name: str
    argv: list[str]
    popen: subprocess.Popen[bytes]
    log_path: Path

    @property
    def pid(self) -> int:
        return self.popen.pid

    def log_tail(self, limit: int = _LOG_TAIL_BYTES) -> str:
        try:
            data = self.log_path.read_bytes()
        except OSError:
            return ""
        return data[-limit:].decode("utf-8", "replace").strip() or "(its log is empty)"


def http_status(url: str, timeout: float = 1.0) -> int | None:
    """The status of ``GET url``, or None when nothing answered."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)
    except (OSError, ValueError):
        return None


def start(
    name: str, argv: Sequence[str], log_dir: Path, env: dict[str, str] | None = None
) -> Child:
    """Start ``argv`` in a new process group, its stdout and stderr going to a log file."""
    log_path = log_dir / f"{name}.log"
    with log_path.open("wb") as log:
        popen = spawn_group(argv, stdout=log, env=env)
    return Child(name=name, argv=list(argv), popen=popen, log_path=log_path)


def wait_ready(child: Child, url: str, timeout_s: float) -> float:
    """Poll ``GET url`` until it answers 200; return the seconds it took.

    Raises StartError, with the end of the child's log, when the child exits first or the
    deadline passes.
    """
    started = time.monotonic()
    deadline = started + timeout_s
    last: int | None = None
    while time.monotonic() < deadline:
        code = child.popen.poll()
        if code is not None:
            raise StartError(f"{child.name} exited with status {code}:\n{child.log_tail()}")
        last = http_status(url, timeout=min(1.0, max(0.05, deadline - time.monotonic())))
        if last == 200:
            return time.monotonic() - started
        time.sleep(_POLL_S)
    seen = "no answer" if last is None else f"last status {last}"
    raise StartError(
        f"{child.name} not ready at {url} after {timeout_s:g} s ({seen}):\n{child.log_tail()}"
    )


def stop(child: Child, grace_s: float = 5.0) -> None:
    """SIGTERM the child's process group, wait up to ``grace_s``, then SIGKILL the group."""
    stop_group(child.popen, grace_s, reap_s=grace_s)


@contextlib.contextmanager
def managed(
    name: str,
    argv: Sequence[str],
    log_dir: Path,
    ready_url: str | None = None,
    timeout_s: float = 60.0,
    grace_s: float = 5.0,
) -> Iterator[Child]:
    """Start a child, wait for ``ready_url`` to answer 200 if given, and stop it on exit."""
    child = start(name, argv, log_dir)
    try:
        if ready_url is not None:
            wait_ready(child, ready_url, timeout_s)
        yield child
    finally:
        stop(child, grace_s)


@contextlib.contextmanager
def log_directory(prefix: str = "kvroute-bench-") -> Iterator[Path]:
    """A temporary directory for the children's logs, removed afterwards."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        yield Path(d)


@contextlib.contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Turn SIGTERM into SystemExit while inside, so ``finally`` blocks stop the children."""

    def _raise(signum: int, frame: object) -> None:
        raise SystemExit(128 + signum)

    try:
        previous = signal.signal(signal.SIGTERM, _raise)
    except ValueError:  # not the main thread: leave signals alone
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


@contextlib.contextmanager
def session(prefix: str = "kvroute-bench-", keep_in: str | None = None) -> Iterator[Path]:
    """A bench's run: SIGTERM ends it as Ctrl-C does (so the ``finally`` blocks stop every
    child), and a directory for the children's logs: ``keep_in`` (created, and kept) when
    given, else a temporary one named ``prefix...``, removed afterwards."""
    with sigterm_as_exit():
        if keep_in:
            path = Path(keep_in)
            path.mkdir(parents=True, exist_ok=True)
            yield path
        else:
            with log_directory(prefix) as path:
                yield path


def exit_status(bench: str, run: Callable[[], int], *errors: type[Exception]) -> int:
    """``run()``'s exit status; 2, the reason on stderr, when the bench could not run: a
    process did not become ready (StartError) or one of ``errors``."""
    caught: tuple[type[Exception], ...] = (StartError, *errors)
    try:
        return run()
    except caught as exc:
        print(f"kvroute bench {bench}: {exc}", file=sys.stderr)
        return 2
