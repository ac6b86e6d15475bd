"""``python -m backends.reaper GRACE_S -- COMMAND...``: run a replica so that nothing it
starts outlives kvroute.

The reaper leads the replica's process group and is told (PR_SET_PDEATHSIG, set by the
launcher) when kvroute dies, even by SIGKILL. On that, or on a SIGTERM from kvroute, it
passes SIGTERM to the whole group (vLLM runs an API server plus engine-core workers), waits
up to GRACE_S, then SIGKILLs the group. When the replica exits by itself, the reaper exits
with its code, so kvroute sees a crash as usual.
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

    def stop(signum: int, frame: object) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # the group signal below reaches us too
        os.killpg(group, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        os.killpg(group, signal.SIGKILL)  # whatever is left, the reaper included

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return child.wait()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
