"""What every ``kvroute bench`` shares: starting fleets and routers, sampling a process tree's
CPU and memory, reading /metrics, and writing the report.

* ``processes``: a child in its own process group, ready when its URL answers, stopped for sure
  (the group SIGTERMed, then SIGKILLed); ``session`` for a run's log directory and SIGTERM.
* ``fleet``: command lines (stubs, emulated replicas, ``kvroute serve``, the peer routers) and
  starting them on free ports, each waited for, all stopped with an ``ExitStack``.
* ``procs``: /proc readers (RSS, open fds, CPU of a process, a tree, a group, the machine).
* ``sampling``: counters sampled in a thread, read afterwards for any window (``Sampler``,
  ``CpuSampler``).
* ``metrics``: a /metrics page, fetched (urllib or aiohttp) and parsed.
* ``host``: what a report says of the machine (CPUs, load, versions), the date, and appending a
  section to the Markdown file (``--output-md``).
* ``report``: the report's text, pure: the command that reproduces a run, a section's head,
  ratios, milliseconds, error cells.

docs/contributing.md says how to write a bench on it.
"""
