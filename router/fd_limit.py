"""The router's open-file limit: every stream holds two sockets (client and replica).

Python keeps the soft RLIMIT_NOFILE it inherits, often 1,024, which caps a router at about 500
streams however much memory it has. The router raises its soft limit to the hard limit at start
(what nginx's ``worker_rlimit_nofile`` and Go's runtime do) and says so when even the hard
limit leaves less room than it needs.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)

# Descriptors that are not streams: the listening socket, probes, scrapes, KV-event sockets,
# log files, the interpreter's own.
OVERHEAD_FDS = 256
# With no concurrency limit configured, room for this many streams is what the router asks for.
DEFAULT_STREAMS = 5_000


def needed_fds(max_concurrent_requests: int, max_queued_requests: int) -> int:
    """Descriptors for the configured limits: two per request in flight, one per queued."""
    streams = max_concurrent_requests or DEFAULT_STREAMS
    return 2 * streams + max_queued_requests + OVERHEAD_FDS


def raise_fd_limit(needed: int) -> int:
    """Raise the soft open-file limit to the hard one; return the soft limit now in force.

    Logs a warning when the result is below ``needed`` (only an administrator can raise the
    hard limit: ``ulimit -Hn``, systemd's ``LimitNOFILE``, the container runtime).
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    # Linux refuses a NOFILE limit above fs.nr_open: "unlimited" means that much.
    unlimited = resource.RLIM_INFINITY
    soft, target = (_nr_open() if n == unlimited else n for n in (soft, hard))
    # Some systems refuse the hard limit itself (macOS: "unlimited", but a kernel maximum
    # lower than nr_open): then ask for what is needed.
    for wanted in dict.fromkeys((target, min(target, needed))):
        if soft >= wanted:
            break
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open-file limit from %d to %d: %s", soft, wanted, exc)
            continue
        log.info("open-file limit raised from %d to %d", soft, wanted)
        soft = wanted
        break
    if soft < needed:
        log.warning(
            "open-file limit is %d, below the %d the router needs for about %d concurrent "
            "streams (two sockets each); raise the hard limit (ulimit -Hn, systemd LimitNOFILE) "
            "or set limits.max_concurrent_requests",
            soft,
            needed,
            (needed - OVERHEAD_FDS) // 2,
        )
    return soft


def _nr_open() -> int:
    try:
        with open("/proc/sys/fs/nr_open") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 1 << 20
