"""``python -m backends.reaper GRACE_S -- COMMAND...``: run a replica so that nothing it
starts outlives kvroute.

The reaper leads the replica's process group and is told (PR_SET_PDEATHSIG, set by the
launcher) when kvroute dies, even by SIGKILL. On that, or on a SIGTERM from kvroute, it
passes SIGTERM to the whole group (vLLM runs an API server plus engine-core workers), waits
up to GRACE_S, then SIGKILLs the group. When the replica exits by itself, the reaper
reports its exit code in the log and clears whatever the replica left in the group.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m backends.reaper GRACE_S -- COMMAND...", file=sys.stderr)
        return 2
    grace_s = float(argv[0])
    child = subprocess.Popen(argv[2:])
    group = os.getpgrp()
    deadline: float | None = None

    def stop(signum: int, frame: object) -> None:
        # Only note the request here: the main loop does the waiting.
        nonlocal deadline
        if deadline is None:
            deadline = time.monotonic() + grace_s
            signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal reaches us too
            os.killpg(group, signal.SIGTERM)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    while True:
        try:
            code = child.wait(timeout=0.1)
            break
        except subprocess.TimeoutExpired:
            if deadline is not None and time.monotonic() > deadline:
                print(
                    f"reaper: replica still running {grace_s:g}s after SIGTERM; killing",
                    file=sys.stderr,
                )
                break
    if deadline is None:
        print(f"reaper: replica exited with code {code}", file=sys.stderr, flush=True)
    sys.stderr.flush()
    os.killpg(group, signal.SIGKILL)  # whatever is left in the group, the reaper included
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
