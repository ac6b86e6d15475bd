"""``kvroute bench servers``: the relay each HTTP server serves, the paced stub, holding streams
open and the report. Timings are measured by the bench, not asserted here."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvroute.backends.process import free_ports
from kvroute.bench import servers
from kvroute.bench.harness.fleet import start_all, stub_argv
from kvroute.bench.loadgen import LoadResult
from kvroute.bench.server_app import SERVERS
from kvroute.cli import build_parser


@contextlib.contextmanager
def stubs(tmp_path: Path, *flags: str) -> Iterator[list[str]]:
    with contextlib.ExitStack() as stack:
        yield start_all(
            stack, "stub", lambda p: [*stub_argv(p, "m"), *flags], free_ports(2), tmp_path, 60
        )


def post(url: str, body: bytes) -> tuple[int, bytes]:
    request = urllib.request.Request(url, data=body, method="POST")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


@pytest.mark.parametrize("server", SERVERS)
def test_each_server_relays_answers_and_streams_and_refuses_bad_json(
    server: str, tmp_path: Path
) -> None:
    package = server.split("-")[0]
    assert importlib.util.find_spec(package), f"{package} is not installed: the test extra has it"
    with stubs(tmp_path) as ups, servers.running_server(server, ups, tmp_path, 60) as (url, _):
        status, body = post(url + "/v1/completions", servers.COMPLETION)
        assert status == 200 and json.loads(body)["choices"][0]["text"] == " ok" * 8
        status, body = post(url + "/v1/completions", servers.STREAMED)
        assert status == 200
        assert body.count(b'"text"') == 8 and body.endswith(b"data: [DONE]\n\n")
        status, body = post(url + "/v1/completions", b"[1, 2")
        assert status == 400 and b"not a JSON object" in body


def test_streams_held_open_through_a_server_all_complete_at_the_stub_pace(tmp_path: Path) -> None:
    options = servers.Options(tokens=3, token_interval_s=0.05, ramp_s=0.5, clients=2)
    pace = ["--paced-tokens", "3", "--token-interval", "0.05"]
    with (
        stubs(tmp_path, *pace) as ups,
        servers.running_server("aiohttp", ups, tmp_path, 60) as (url, pid),
    ):
        held = servers.hold_streams(url, pid, 40, options)
    assert (held.streams, held.completed, held.cut) == (40, 40, 0)
    assert held.peak_rss >= held.idle_rss > 0


def test_a_stream_is_complete_only_with_every_event_and_done() -> None:
    event = b'data: {"text": " ok"}\n\n'
    whole = b"HTTP/1.1 200 OK\r\n\r\n" + event * 3 + b"data: [DONE]\n\n"
    assert servers.stream_complete(whole, 3)
    assert not servers.stream_complete(whole, 4)  # an event missing
    assert not servers.stream_complete(whole.replace(b"data: [DONE]", b""), 3)  # cut
    assert not servers.stream_complete(whole.replace(b"200 OK", b"502 Bad Gateway"), 3)


def test_report_tables() -> None:
    def t(rps: float) -> servers.Throughput:
        return servers.Throughput(LoadResult(int(rps), 1.0, rps, 1.0, 4.0), 0.25)

    rows = [
        servers.ServerRow(
            "aiohttp", t(1000), t(500), [servers.Held(2000, 2000, 50 << 20, 80 << 20, 20, 4020)]
        ),
        servers.ServerRow(
            "uvicorn",
            t(1500),
            None,
            [servers.Held(3000, 2990, 50 << 20, 60 << 20, 20, 1020, {"timed out": 10})],
        ),
    ]
    table = servers.throughput_table(rows).splitlines()
    assert table[2] == "| aiohttp | 1000 | 4.00 | 0.250 | 1.00x | 500 | 4.00 | 0.250 | 1.00x |"
    assert table[3] == "| uvicorn | 1500 | 4.00 | 0.250 | 1.50x | - | - | - | - |"
    streams = servers.streams_table(rows).splitlines()
    # (80 - 50) MiB over the 2,000 streams open at the peak (4,000 more sockets): 15.4 KiB each
    assert streams[2] == "| aiohttp | 2,000 | 2,000 | 0 | 2,000 | 50.0 | 80.0 | 15.4 |"
    # Only 500 open at once: the growth is theirs, and why the others were cut is said.
    assert streams[3] == (
        "| uvicorn | 3,000 | 2,990 | 10 (timed out 10) | 500 | 50.0 | 60.0 | 20.5 |"
    )


def test_options_are_checked() -> None:
    args = build_parser().parse_args(["bench", "servers", "--servers", "aiohttp,uvicorn"])
    assert args.servers == ("aiohttp", "uvicorn") and args.streams == (2000, 10000)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "servers", "--servers", "aiohttp,nginx"])
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "servers", "--streams", "0"])
