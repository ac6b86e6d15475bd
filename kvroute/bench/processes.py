"""Moved to ``kvroute.bench.harness.processes``; this name stays for ``h2_attacks`` (being
changed elsewhere) until it imports the harness."""

from kvroute.bench.harness.processes import *  # noqa: F403
