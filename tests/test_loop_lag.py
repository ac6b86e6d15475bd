"""The router's event-loop lag on /metrics, and the open-file limit it raises at start."""

from __future__ import annotations

import logging
import resource
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import aiohttp
import pytest

from kvroute.kvcore.stats import MetricsPage, parse_metrics
from kvroute.router.fd_limit import needed_fds, raise_fd_limit

from .conftest import StartReplica, StartRouter

LAG = "kvroute_event_loop_lag_seconds"


async def test_metrics_show_how_late_the_event_loop_ran(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    r = await start_router([await start_replica("a")])
    pages: list[MetricsPage] = []

    async def scrape() -> MetricsPage:
        async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as resp:
            page = parse_metrics(await resp.text())
        pages.append(page)
        return page

    def over(page: MetricsPage, seconds: float) -> float:
        """Ticks later than ``seconds`` (a bucket bound)."""
        return page.sum(LAG + "_count") - page.sum(LAG + "_bucket", le=str(seconds))

    # A timer every 100 ms: the count grows on its own.
    deadline = time.monotonic() + 5
    while (await scrape()).sum(LAG + "_count") < 3:
        assert time.monotonic() < deadline, "the lag histogram did not count"
    before = pages[-1]

    # The stimulus: block the router's loop (this test's too) for 300 ms. The tick due within
    # it runs 200-300 ms late.
    time.sleep(0.3)
    while over(await scrape(), 0.1) == over(before, 0.1):
        assert time.monotonic() < deadline + 5, "the stall did not show"
    assert over(pages[-1], 0.1) - over(before, 0.1) >= 1  # (a busy box may add its own)
    assert over(pages[-1], 0.5) == over(before, 0.5)


def limits_after_raise(soft: int) -> list[str]:
    code = textwrap.dedent(
        """
        import resource
        from kvroute.router.fd_limit import raise_fd_limit
        print(raise_fd_limit(10), resource.getrlimit(resource.RLIMIT_NOFILE)[0])
        """
    )
    run = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        timeout=30,
        preexec_fn=lambda: resource.setrlimit(
            resource.RLIMIT_NOFILE, (soft, resource.getrlimit(resource.RLIMIT_NOFILE)[1])
        ),
    )
    assert run.returncode == 0, run.stderr
    return run.stdout.split()


def test_the_router_raises_its_soft_open_file_limit_to_the_hard_one() -> None:
    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    if hard == resource.RLIM_INFINITY:
        hard = int(Path("/proc/sys/fs/nr_open").read_text())
    assert limits_after_raise(256) == [str(hard), str(hard)]


def test_a_limit_too_low_for_the_streams_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    needed = needed_fds(max_concurrent_requests=10**7, max_queued_requests=0)
    with caplog.at_level(logging.WARNING, logger="kvroute.router.fd_limit"):
        limit = raise_fd_limit(needed)
    assert limit < needed
    assert "concurrent streams" in caplog.text and str(needed) in caplog.text
