"""``kvroute bench overhead``: the pure helpers (wrk output, tables, command lines, rounds),
the process helper's clean-up, and a short run in rounds as a user runs it. Nothing here
asserts timings."""

from __future__ import annotations

import asyncio
import http.server
import itertools
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvroute.bench import overhead
from kvroute.bench.harness import host, processes, report
from kvroute.bench.loadgen import (
    MARKER,
    Load,
    LoadError,
    LoadResult,
    find_wrk,
    numbered,
    parse_wrk,
    run_wrk,
    wrk_script,
)
from kvroute.bench.overhead import TARGETS, Row
from kvroute.cli import build_parser

from .conftest import StartReplica, StartRouter
from .helpers import wait_until

WRK_OK = """\
Running 2s test @ http://127.0.0.1:9301/v1/completions
  2 threads and 32 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   840.29us  765.90us  12.15ms   90.25%
    Req/Sec    21.75k     9.48k   38.77k    65.00%
  Latency Distribution
     50%  653.00us
     75%    0.96ms
     90%    1.57ms
     99%    4.24ms
  86613 requests in 2.01s, 24.86MB read
Requests/sec:  43150.10
Transfer/sec:     12.39MB
"""

WRK_ERRORS = """\
Running 1s test @ http://127.0.0.1:9301/v1/nothere
  1 threads and 4 connections
  Thread Stats   Avg      Stdev     Max   +/- Stdev
    Latency   188.63us  280.19us   4.14ms   96.46%
    Req/Sec    26.22k     3.72k   32.01k    60.00%
  Latency Distribution
     50%  144.00us
     75%  189.00us
     90%  238.00us
     99%    1.73s
  26010 requests in 1.00m, 2.48MB read
  Socket errors: connect 1, read 2, write 3, timeout 4
  Non-2xx or 3xx responses: 26010
Requests/sec:  26003.76
Transfer/sec:      2.48MB
"""


def test_parse_wrk_reads_throughput_and_percentiles() -> None:
    r = parse_wrk(WRK_OK)
    assert r.requests == 86613
    assert r.duration_s == pytest.approx(2.01)
    assert r.requests_per_s == pytest.approx(43150.10)
    assert r.p50_ms == pytest.approx(0.653)
    assert r.p99_ms == pytest.approx(4.24)
    assert r.errors == 0


def test_parse_wrk_reads_errors_and_units() -> None:
    r = parse_wrk(WRK_ERRORS)
    assert r.non_2xx == 26010
    assert r.socket_errors == 10
    assert r.errors == 26020
    assert r.p99_ms == pytest.approx(1730.0)
    assert r.duration_s == pytest.approx(60.0)


def test_parse_wrk_rejects_other_output() -> None:
    with pytest.raises(LoadError):
        parse_wrk("unable to connect to 127.0.0.1:9301 Connection refused")
    without_latency = "\n".join(
        line for line in WRK_OK.splitlines() if "%" not in line or "Latency " in line
    )
    with pytest.raises(LoadError, match="--latency"):
        parse_wrk(without_latency)


def test_wrk_script_posts_the_body_verbatim() -> None:
    script = wrk_script(b'{"prompt": "a]]b"}')
    assert 'wrk.method = "POST"' in script
    assert 'wrk.headers["Content-Type"] = "application/json"' in script
    assert 'wrk.body = [=[{"prompt": "a]]b"}]=]' in script


def _row(name: str, rps: float, p99: float, non_2xx: int = 0) -> Row:
    result = LoadResult(
        requests=int(rps), duration_s=1.0, requests_per_s=rps, p50_ms=p99 / 2, p99_ms=p99,
        non_2xx=non_2xx,
    )  # fmt: skip
    cpu = 1000 / rps if name == "kvroute" else None  # one core's worth at rps
    return Row(TARGETS[name], result=result, cpu_ms_per_request=cpu)


def test_table_has_ratios_to_direct() -> None:
    rows = [
        _row("direct", 10000, 2.0),
        _row("kvroute", 2500, 8.0),
        Row(TARGETS["smg-ca"], error="skipped: smg not found"),
    ]
    table = overhead.format_table(rows).splitlines()
    assert table[0].startswith("| target | policy | req/s | p50 ms | p99 ms | errors |")
    assert table[2] == "| direct | - | 10000 | 1.00 | 2.00 | 0 | 1.00x | 1.00x | - | - |"
    assert "| kvroute | kv_aware (default) | 2500 |" in table[3]
    assert table[3].endswith("| 0.25x | 4.00x | 0.40 | 2500 |")  # its CPU per request
    assert table[4] == (
        "| smg-ca | cache_aware | - | - | - | skipped (see notes) | - | - | - | - |"
    )


def test_table_without_direct_has_no_ratios() -> None:
    table = overhead.format_table([_row("kvroute-rr", 100, 1.0, non_2xx=3)])
    assert table.splitlines()[2].endswith("| 3 (3 http, 0 socket) | - | - | - | - |")


def test_smg_ratio_line() -> None:
    rows = [_row("kvroute", 3000, 1.0), _row("kvroute-rr", 4000, 1.0), _row("smg-ca", 2000, 1.0)]
    line = overhead.smg_ratio_line(rows)
    assert line.startswith("kvroute/smg throughput ratio")
    assert "kv_aware (default) 1.50x" in line
    assert "round_robin 2.00x" in line
    assert "n/a" in overhead.smg_ratio_line(rows[:2])


def test_rounds_alternate_the_order_and_report_medians() -> None:
    targets = [TARGETS[n] for n in ("kvroute", "smg-ca", "vllm-router-rr")]
    assert overhead.round_order(targets, 0) == targets
    assert overhead.round_order(targets, 1) == targets[::-1]
    rounds = [
        [_row("kvroute", 900, 1.0), _row("smg-ca", 1000, 1.0)],
        [_row("smg-ca", 1000, 1.0), _row("kvroute", 1100, 1.0)],
        [_row("kvroute", 1000, 1.0), _row("smg-ca", 800, 1.0)],
    ]
    medians = overhead.median_rows(rounds)
    assert [(r.target.name, r.result.requests_per_s) for r in medians if r.result] == [
        ("kvroute", 1000),
        ("smg-ca", 1000),
    ]
    # The median of the per-round ratios (0.9, 1.1, 1.25), not the ratio of the medians (1.0).
    line = overhead.round_ratios_line(rounds)
    assert line == (
        "per-round ratios over 3 rounds (req/s): kvroute/smg-ca median 1.10x "
        "(rounds: 0.90, 1.10, 1.25)"
    )
    # A round without the peer's result does not count; without any pair: n/a.
    rounds[2][1] = Row(TARGETS["smg-ca"], error="failed: gone")
    assert "median 1.00x (rounds: 0.90, 1.10)" in overhead.round_ratios_line(rounds)
    assert "n/a" in overhead.round_ratios_line([[_row("direct", 10, 1.0)]] * 2)
    report = overhead.report(overhead.Context("d", "c", "m", "v", "l"), medians, [], rounds)
    assert "each target's row is its median round by req/s, of 3" in report
    assert "kvroute/smg throughput ratio" not in report  # one figure: the rounds'


def test_rounds_run_every_target_each_round_as_a_user_runs_it(tmp_path: Path) -> None:
    out = tmp_path / "bench.md"
    argv = [
        sys.executable, "-m", "kvroute.cli", "bench", "overhead", "--targets", "direct,kvroute-rr",
        "--rounds", "2", "--duration", "1", "--warmup", "0", "--concurrency", "2",
        "--loadgen", "builtin", "--output-md", str(out),
    ]  # fmt: skip
    done = subprocess.run(argv, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stdout + done.stderr
    progress = [line.split(" ...")[0] for line in done.stdout.splitlines() if " ... " in line]
    assert progress == [
        "[round 1/2 1/2] direct",
        "[round 1/2 2/2] kvroute-rr",
        "[round 2/2 1/2] kvroute-rr",
        "[round 2/2 2/2] direct",
    ]
    text = out.read_text()
    assert "each target's row is its median round by req/s, of 2" in text
    assert sum(line.startswith("| kvroute-rr |") for line in text.splitlines()) == 1
    refused = subprocess.run(
        [*argv[:5], "--rounds", "2", "--profile", str(tmp_path / "p")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2 and "--profile records one round" in refused.stderr


def test_reproduce_command_keeps_the_arguments() -> None:
    argv = ["--log-level", "info", "bench", "overhead", "--targets", "direct,smg-ca", "--x", "a b"]
    assert (
        report.reproduce_command(argv, "overhead")
        == "kvroute bench overhead --targets direct,smg-ca --x 'a b'"
    )
    # Where the report went is no part of reproducing it (and a path names a machine).
    argv = ["bench", "soak", "--output-md", "/srv/x.md", "--rate", "4", "--output-md=y.md"]
    assert report.reproduce_command([*argv, "--no-record"], "soak") == (
        "kvroute bench soak --rate 4"
    )


def test_launch_commands() -> None:
    ups = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    kv = overhead.launch_for(TARGETS["kvroute"], ups, 8000, 9000, "")
    assert kv.ready_path == "/ready"
    assert "--policy" not in kv.argv
    assert kv.argv[kv.argv.index("serve") :][:5] == [
        "serve",
        "--replica",
        ups[0],
        "--replica",
        ups[1],
    ]
    rr = overhead.launch_for(TARGETS["kvroute-rr"], ups, 8000, 9000, "")
    assert rr.argv[rr.argv.index("--policy") + 1] == "round_robin"

    vr = overhead.launch_for(TARGETS["vllm-router-ca"], ups, 8000, 9000, "/bin/vllm-router")
    assert vr.ready_path == "/health"
    assert vr.argv[0] == "/bin/vllm-router"
    for flag, value in (
        ("--policy", "cache_aware"),
        ("--prometheus-port", "9000"),
        ("--worker-startup-check-interval", "1"),
        ("--log-level", "error"),
    ):
        assert vr.argv[vr.argv.index(flag) + 1] == value

    smg = overhead.launch_for(TARGETS["smg-ca"], ups, 8000, 9000, "/bin/smg")
    assert smg.argv[:2] == ["/bin/smg", "launch"]
    assert smg.ready_path == "/readiness"
    assert "--disable-tokenizer-autoload" in smg.argv
    assert smg.argv[smg.argv.index("--shutdown-grace-period-secs") + 1] == "0"
    assert smg.argv[smg.argv.index("--prometheus-host") + 1] == "127.0.0.1"


def test_record_writes_the_header_once(tmp_path: Path) -> None:
    path = tmp_path / "BENCHMARKS.md"
    host.record(path, "## one\n")
    host.record(path, "## two\n")
    text = path.read_text()
    assert text.count("# Benchmarks") == 1
    assert text.index("## one") < text.index("## two")


def test_targets_option() -> None:
    args = build_parser().parse_args(["bench", "overhead", "--targets", "direct,smg-ca"])
    assert args.targets == ("direct", "smg-ca")
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "overhead", "--targets", "direct,nope"])


def test_missing_peer_is_skipped_with_a_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(overhead, "find_executable", lambda name, peer_bin_dir: None)
    options = overhead.Options(peer_bin_dir=str(tmp_path))
    reason = overhead.skip_reason(TARGETS["smg-ca"], options)
    assert reason is not None and "pip install -e '.[bench]'" in reason
    assert overhead.skip_reason(TARGETS["direct"], options) is None


def _running(pid: int) -> bool:
    """Whether ``pid`` exists and is not a zombie (not ours to reap: init will)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[-1].split()[0] != "Z"


def _read_pid(path: Path, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        text = path.read_text().strip() if path.exists() else ""
        if text:
            return int(text)
        time.sleep(0.01)
    raise AssertionError(f"no pid in {path} after {timeout_s} s")


def test_managed_kills_the_whole_group(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild.pid"
    script = f"sleep 60 & echo $! > {pid_file}; wait"
    with processes.managed("sh", ["sh", "-c", script], tmp_path, grace_s=2) as child:
        grandchild = _read_pid(pid_file)
        assert child.popen.poll() is None
        assert _running(grandchild)
    assert child.popen.poll() is not None
    # Signalled with its group; on a loaded machine it may take a moment to go.
    deadline = time.monotonic() + 10
    while _running(grandchild) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _running(grandchild)


def test_wait_ready_reports_an_early_exit(tmp_path: Path) -> None:
    with (
        pytest.raises(processes.StartError, match="boom"),
        processes.managed(
            "bad", ["sh", "-c", "echo boom; exit 3"], tmp_path, "http://127.0.0.1:9/", 10
        ),
    ):
        pass


async def test_agent_conversations_grow_turn_by_turn_and_are_measured_after_their_first_turn() -> (
    None
):
    import json as jsonlib

    from aiohttp import web

    from kvroute.backends.process import free_ports
    from kvroute.bench.loadgen import COLD_TURNS_ALONE, Conversations, _conversations

    seen: list[dict[str, object]] = []

    async def chat(request: web.Request) -> web.Response:
        seen.append(jsonlib.loads(await request.read()))
        return web.json_response({"choices": [{"message": {"content": "ok"}}]})

    app = web.Application(client_max_size=1 << 24)
    app.router.add_post("/v1/chat/completions", chat)
    runner = web.AppRunner(app)
    await runner.setup()
    (port,) = free_ports(1)
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        spec = Conversations(
            f"http://127.0.0.1:{port}/v1/chat/completions", "m", 3, 2, 20_000, 1_000
        )
        # Requests sent in the window count: 0.5 s of it passed once on the loaded CI box
        # (2026-12-07) with every connection still inside a turn sent before it.
        done = await _conversations(spec, warmup_s=0.1, duration_s=3.0)
    finally:
        await runner.cleanup()
    assert done.load.requests > 0 and done.load.errors == 0
    assert done.mean_body_bytes > 20_000
    # First, new conversations' first turns one at a time, each seen once and never again.
    alone = {body["messages"][0]["content"] for body in seen[:COLD_TURNS_ALONE]}  # type: ignore[index]
    assert len(alone) == COLD_TURNS_ALONE and done.cold_turn_alone_ms > 0
    by_system: dict[object, list[list[dict[str, str]]]] = {}
    for body in seen[COLD_TURNS_ALONE:]:
        messages = body["messages"]
        assert isinstance(messages, list)
        by_system.setdefault(messages[0]["content"], []).append(messages)
    assert len(by_system) == 3  # three conversations
    for turns in by_system.values():
        for before, after in itertools.pairwise(turns):
            # Each turn resends the history: the last one, its reply, then one new user message.
            assert after[: len(before)] == before
            assert [m["role"] for m in after[len(before) :]] == ["assistant", "user"]
    # Only turns after every conversation's first one were measured.
    assert done.load.requests <= len(seen) - COLD_TURNS_ALONE - 3


async def test_status_viewers_hold_the_status_page_open_while_measured(
    start_replica: StartReplica, start_router: StartRouter
) -> None:
    """kvroute-status's A/B: two /status pages stream the status document while the load runs."""
    assert TARGETS["kvroute-status"].status_viewers == 2
    a = await start_replica("a")
    r = await start_router([a])
    viewers = overhead.StatusViewers(r.url, 2)
    viewers.__enter__()
    try:
        await wait_until(lambda: viewers.events >= 4, timeout_s=10, what="4 status documents")
    finally:
        # Off the event loop: the router under test runs on it, and a viewer leaves only once
        # its next document arrives (the bench's router is another process).
        await asyncio.to_thread(viewers.__exit__, None, None, None)
    assert all(not t.is_alive() for t in viewers._threads)


def test_chat_1k_sends_each_request_its_own_chat_of_about_a_kilobyte() -> None:
    options = overhead.Options(workload="chat-1k")
    path, body = overhead.fixed_request(options)
    assert path == "/v1/chat/completions"
    first, second = (json.loads(numbered(body, n)) for n in (7, 8))
    user = first["messages"][-1]
    assert user["role"] == "user" and user["content"].startswith("7 ")
    assert 1000 <= len(user["content"]) < 1100
    assert first["messages"][:-1] == second["messages"][:-1]
    assert first != second  # no prompt repeats: nothing for a text cache to reuse
    args = build_parser().parse_args(["bench", "overhead", "--workload", "chat-1k"])
    assert args.workload == "chat-1k"
    assert "chat-1k workload" in overhead.load_line(options, "wrk")


def test_wrk_script_numbers_each_request_where_the_body_says() -> None:
    script = wrk_script(b'{"x": "' + MARKER + b' a]]b"}')
    assert "function request()" in script and "thread:set('tid', made)" in script
    assert 'wrk.format(nil, nil, nil, [[{"x": "]] .. tid .. \'-\' .. count .. [=[ a]]b"}]=])' in (
        script
    )


def test_wrk_sends_distinct_numbered_bodies(tmp_path: Path) -> None:
    seen: list[bytes] = []

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            seen.append(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/v1/chat/completions"
        body = overhead.chat_body("m", stream=False)
        wrk = find_wrk()
        assert wrk, "wrk is not installed: apt-get install wrk (the README's test command does)"
        result = run_wrk(wrk, Load(url, body, concurrency=2, duration_s=2, threads=2))
    finally:
        server.shutdown()
    assert result.requests > 10 and result.errors == 0
    users = [json.loads(b)["messages"][-1]["content"] for b in seen]
    numbers = [u.split(" ", 1)[0] for u in users]
    assert len(set(numbers)) == len(numbers)  # every request its own prompt
    assert {n.split("-")[0] for n in numbers} == {"1", "2"}  # both wrk threads numbered
