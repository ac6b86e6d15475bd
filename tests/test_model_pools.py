"""Model pools (``pools:``): several models behind one router, each its own pool of replicas,
prefix index, tokenizer and policy; requests stay in their model's pool; GPUs are placed from
one inventory across pools. Asserted as a client and an operator see it."""

from __future__ import annotations

import asyncio
import os
import re
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvroute.backends.handle import ReplicaHandle
from kvroute.backends.process import free_ports
from kvroute.cli import main
from kvroute.kvcore.ledger import Route
from kvroute.policies import RouteRequest
from kvroute.router.config import config_from_dict
from kvroute.router.core import RoutingCore
from kvroute.router.loadboard import LoadBoard
from kvroute.router.pool_config import all_replicas
from kvroute.router.workers import WorkerContext, WorkerLoad

from .conftest import StartEmulated, StartRouter
from .gpu_fakes import fake_nvidia_smi
from .helpers import alive, children_of, replica_source, wait_until

ROOT = Path(__file__).parent.parent


def client_for(url: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=20)


async def get_json(url: str) -> Any:
    async with aiohttp.ClientSession() as http, http.get(url) as response:
        assert response.status == 200, await response.text()
        return await response.json()


async def served_by(client: openai.AsyncOpenAI, model: str, prompt: str) -> tuple[str, Any]:
    """(the replica that answered, the response) for one completion."""
    raw = await client.completions.with_raw_response.create(
        model=model, prompt=prompt, max_tokens=2
    )
    return raw.headers["x-kvroute-replica"], raw


def two_pools(alpha: list[dict[str, Any]], beta: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {"name": "chat", "model": "alpha", "replicas": alpha, "tokenizer": "builtin"},
        {
            "name": "code",
            "model": "beta",
            "replicas": beta,
            "tokenizer": "builtin",
            "policy": {"name": "round_robin"},
        },
    ]


async def test_each_model_is_served_by_its_pool_alone(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    alpha = [await start_emulated(model="alpha") for _ in range(2)]
    beta = [await start_emulated(model="beta") for _ in range(2)]
    r = await start_router(
        [],
        pools=two_pools(
            [replica_source(rep, f"alpha-{i}") for i, rep in enumerate(alpha)],
            [replica_source(rep, f"beta-{i}") for i, rep in enumerate(beta)],
        ),
    )
    await wait_until(lambda: r.router.registry.in_rotation() == 4, 10, "all four replicas")
    client = client_for(r.url)

    models = await client.models.list()
    assert [m.id for m in models.data] == ["alpha", "beta"]

    seen: dict[str, set[str]] = {"alpha": set(), "beta": set()}
    for i in range(6):
        for model in seen:
            replica, raw = await served_by(client, model, f"request {i} for {model}")
            seen[model].add(replica)
            assert raw.parse().model == model  # answered by a replica serving it
        chat = await client.chat.completions.with_raw_response.create(
            model="beta", messages=[{"role": "user", "content": f"chat {i}"}], max_tokens=2
        )
        seen["beta"].add(chat.headers["x-kvroute-replica"])
    assert seen["alpha"] <= {"alpha-0", "alpha-1"} and seen["alpha"]
    assert seen["beta"] == {"beta-0", "beta-1"}  # round robin: the pool's own policy

    # Each pool keys prompts in its own index: a prompt routed in "chat" is a cache hit there
    # next time, and nothing any "code" replica is predicted to hold.
    prompt = "a long shared system prompt for the cache " * 12
    home, _ = await served_by(client, "alpha", prompt)
    again, raw = await served_by(client, "alpha", prompt)
    assert again == home and raw.headers["x-kvroute-reason"] == "kv_affinity"
    assert int(raw.headers["x-kvroute-prefix-hit-tokens"]) >= 16 * 6
    _, raw = await served_by(client, "beta", prompt)
    assert raw.headers["x-kvroute-prefix-available-tokens"] == "0"

    rows = (await get_json(r.url + "/admin/replicas"))["replicas"]
    assert {row["name"]: row["pool"] for row in rows} == {
        "alpha-0": "chat",
        "alpha-1": "chat",
        "beta-0": "code",
        "beta-1": "code",
    }
    async with aiohttp.ClientSession() as http, http.get(r.url + "/metrics") as response:
        metrics = await response.text()
    assert 'kvroute_replica_pool{pool="code",replica="beta-1"} 1.0' in metrics
    assert 'kvroute_model_pool{model="beta",policy="round_robin",pool="code"} 1.0' in metrics
    status = await get_json(r.url + "/status/events")
    router = status["router"]
    assert router["policy"] == "chat: kv_aware, code: round_robin"
    assert [p["model"] for p in router["pools"]] == ["alpha", "beta"]


async def test_an_unknown_model_is_the_openai_404(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    alpha, beta = await start_emulated(model="alpha"), await start_emulated(model="beta")
    r = await start_router(
        [], pools=two_pools([replica_source(alpha, "a")], [replica_source(beta, "b")])
    )
    client = client_for(r.url)
    with pytest.raises(openai.NotFoundError) as caught:
        await client.completions.create(model="gamma", prompt="hi", max_tokens=2)
    error = caught.value
    assert error.status_code == 404
    assert error.code == "model_not_found" and error.param == "model"
    assert error.type == "invalid_request_error"
    assert error.body == {  # the router's own, as for any unknown model
        "message": "The model 'gamma' does not exist. Available: alpha, beta.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    with pytest.raises(openai.NotFoundError):
        await client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        )


async def test_an_admin_adds_a_replica_to_the_pool_it_names(
    start_emulated: StartEmulated, start_router: StartRouter
) -> None:
    alpha, beta = await start_emulated(model="alpha"), await start_emulated(model="beta")
    r = await start_router(
        [], pools=two_pools([replica_source(alpha, "a")], [replica_source(beta, "b")])
    )
    extra = await start_emulated(model="beta")
    async with aiohttp.ClientSession() as http:
        async with http.post(r.url + "/admin/replicas", json={"url": extra.url}) as response:
            assert response.status == 400
            message = (await response.json())["error"]["message"]
            assert message == "pool: this router serves 2 model pools (chat, code): say which"
        body = {"url": extra.url, "name": "b2", "pool": "code"}
        async with http.post(r.url + "/admin/replicas", json=body) as response:
            assert response.status == 201, await response.text()
            assert (await response.json())["pool"] == "code"
    await wait_until(lambda: r.router.registry.in_rotation() == 3, 10, "the new replica")
    client = client_for(r.url)
    beta_seen = {(await served_by(client, "beta", f"b {i}"))[0] for i in range(4)}
    alpha_seen = {(await served_by(client, "alpha", f"a {i}"))[0] for i in range(4)}
    assert beta_seen == {"b", "b2"}
    assert alpha_seen == {"a"}


# -- serve: static and launched replicas in pools ----------------------------------------


async def _ready(url: str, replicas: int) -> bool:
    try:
        rows = (await get_json(url + "/admin/replicas"))["replicas"]
    except (aiohttp.ClientError, AssertionError):
        return False
    return len(rows) == replicas and all(row["healthy"] for row in rows)


async def test_serve_mixes_listed_and_launched_replicas_in_pools(
    tmp_path: Path, start_emulated: StartEmulated
) -> None:
    static_alpha, static_beta = (
        await start_emulated(model="alpha"),
        await start_emulated(model="beta"),
    )
    (port,) = free_ports(1)
    config = tmp_path / "pools.yaml"
    config.write_text(
        f"listen: {{port: {port}}}\n"
        "pools:\n"
        "  - name: mixed\n    model: alpha\n    policy: {name: round_robin}\n"
        f"    replicas: [{{url: '{static_alpha.url}', name: alpha-static}}]\n"
        "    launch: {engine: emulated, count: 1, block_size: 16, num_gpu_blocks: 128, "
        f"preset: tiny-cpu, log_dir: '{tmp_path / 'logs'}'}}\n"
        "  - name: solo\n    model: beta\n    tokenizer: builtin\n"
        f"    replicas: [{{url: '{static_beta.url}', name: beta-static}}]\n"
    )
    router = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "kvroute.cli", "serve", "--config", str(config),
        stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not await _ready(url, 3):  # polled: starting a replica takes seconds
            assert router.returncode is None, "the router exited"
            assert loop.time() < deadline, "the router and its replicas were not ready in 60s"
            await asyncio.sleep(0.1)
        client = client_for(url)
        alpha_seen = {(await served_by(client, "alpha", f"a {i}"))[0] for i in range(4)}
        beta_seen = {(await served_by(client, "beta", f"b {i}"))[0] for i in range(4)}
        assert alpha_seen == {"alpha-static", "mixed-emulated-0"}
        assert beta_seen == {"beta-static"}
        rows = (await get_json(url + "/admin/replicas"))["replicas"]
        assert {row["name"]: row["pool"] for row in rows} == {
            "alpha-static": "mixed",
            "mixed-emulated-0": "mixed",
            "beta-static": "solo",
        }
        assert (tmp_path / "logs" / "mixed-emulated-0.log").exists()
        reapers = [p for p in children_of(router.pid) if b"reaper" in _cmdline(p)]
        assert len(reapers) == 1
        # Removing the pool's launched replica drains it, then stops its process.
        async with aiohttp.ClientSession() as http:
            removed = url + "/admin/replicas/mixed-emulated-0?drain_timeout_s=1"
            async with http.delete(removed) as response:
                assert response.status == 200, await response.text()
        await wait_until(lambda: not alive(reapers[0]), 15, "the removed replica's process")
        alpha_seen = {(await served_by(client, "alpha", f"c {i}"))[0] for i in range(3)}
        assert alpha_seen == {"alpha-static"}
        await _launch_and_roll_out_in_a_pool(url)
    finally:
        if router.returncode is None:
            router.send_signal(signal.SIGTERM)
        _, stderr = await asyncio.wait_for(router.communicate(), 30)
    text = stderr.decode()
    assert router.returncode == 0, text
    assert "Traceback" not in text
    assert "kvroute: pool mixed: starting 1 emulated replicas" in text
    await wait_until(lambda: not any(alive(p) for p in reapers), 10, "the launched replica to stop")


async def _launch_and_roll_out_in_a_pool(url: str) -> None:
    """Launching one more replica and a rollout act on a pool's own launched replicas."""
    async with aiohttp.ClientSession() as http:
        add = url + "/admin/replicas"
        async with http.post(add, json={"launch": True, "pool": "solo"}) as response:
            assert response.status == 409
            assert "pool solo launched no replicas" in (await response.json())["error"]["message"]
        # Only "mixed" launches replicas: no need to name it.
        async with http.post(add, json={"launch": True}) as response:
            assert response.status == 201, await response.text()
            row = await response.json()
        assert (row["name"], row["pool"], row["healthy"]) == ("mixed-emulated-0", "mixed", True)
        body = {"pool": "mixed", "args": ["--seed", "7"], "drain_timeout_s": 1}
        async with http.post(url + "/admin/rollout", json=body) as response:
            assert response.status == 202, await response.text()
        rollout: dict[str, Any] = {}

        async def rollout_done() -> bool:
            nonlocal rollout
            rollout = (await get_json(url + "/admin/rollout"))["rollout"]
            return rollout["state"] not in ("running", "paused")

        loop = asyncio.get_running_loop()
        deadline = loop.time() + 60
        while not await rollout_done():
            assert loop.time() < deadline, f"the rollout did not end in 60s: {rollout}"
            await asyncio.sleep(0.1)
    assert rollout["state"] == "done", rollout
    assert rollout["pool"] == "mixed"
    assert [r["name"] for r in rollout["replaced"]] == ["mixed-emulated-0"]
    assert rollout["args"] == ["--seed", "7"]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# -- config errors --------------------------------------------------------------------------

STATIC = "replicas: [{url: 'http://127.0.0.1:9001'}]"
OTHER_STATIC = "replicas: [{url: 'http://127.0.0.1:9002'}]"


@pytest.mark.parametrize(
    ("pools", "line"),
    [
        (
            f"  - {{name: a, model: m, {STATIC}}}\n  - {{name: b, model: m, {OTHER_STATIC}}}\n",
            "pools[1].model: 'm' is already served by pools[0]; each model name is served by "
            "one pool, or by one role: prefill and one role: decode pool",
        ),
        (
            f"  - {{name: a, model: m, tokenzier: builtin, {STATIC}}}\n",
            "pools[0].tokenzier: unknown key (did you mean 'tokenizer'?)",
        ),
        (
            "  - {name: a, model: m}\n",
            "pools[0]: no replicas: give replicas: (running replicas' URLs) or launch: (replicas "
            "kvroute starts), or both",
        ),
        (
            "  - {name: a, model: m, launch: {gpus: [0, 1]}}\n"
            "  - {name: b, model: n, launch: {gpus: [1, 2]}}\n",
            "pools[1].launch.gpus: GPU 1 is listed by pools[0].launch.gpus too; each GPU goes to "
            "one pool",
        ),
        (
            "  - {name: a, model: m, launch: {model: other}}\n",
            "pools[0].launch.model: 'other' differs from pools[0].model 'm'; leave it out (the "
            "pool's model is the name its replicas serve)",
        ),
    ],
    ids=["duplicate-model", "unknown-key", "no-replicas", "gpu-in-two-pools", "launch-model"],
)
def test_a_pools_config_error_is_one_line_naming_the_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], pools: str, line: str
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text("pools:\n" + pools)
    assert main(["check-config", str(path)]) == 2
    assert capsys.readouterr().err == f"kvroute: config error: {path}: {line}\n"


def test_top_level_replicas_beside_pools_are_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(
        f"replicas: [{{url: 'http://127.0.0.1:9000'}}]\npools:\n  - {{name: a, model: m, {STATIC}}}\n"
    )
    assert main(["serve", "--config", str(path), "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err == (
        f"kvroute: config error: {path}: replicas: not with pools: list each replica under its "
        "pool (pools[N].replicas)\n"
    )


# -- dry run: one GPU inventory across pools ------------------------------------------------


@pytest.fixture
def four_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    table = "".join(f"{i}, GPU-{i}f00, NVIDIA L4, 23034\n" for i in range(4))
    fake_nvidia_smi(tmp_path / "bin", table)
    monkeypatch.setenv("PATH", str(tmp_path / "bin"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _pools_with_gpus(tmp_path: Path, code_count: int) -> Path:
    path = tmp_path / "pools.yaml"
    path.write_text(
        "pools:\n"
        "  - name: chat\n    model: llama\n"
        f"    launch: {{engine: vllm, count: 1, tensor_parallel_size: 2, gpus: auto, block_size: 16, log_dir: '{tmp_path / 'logs'}'}}\n"
        "  - name: code\n    model: coder\n"
        f"    launch: {{engine: vllm, count: {code_count}, gpus: auto, block_size: 16, log_dir: '{tmp_path / 'logs'}'}}\n"
    )
    return path


def test_dry_run_places_every_pool_on_gpus_of_its_own(
    tmp_path: Path, four_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pools_with_gpus(tmp_path, code_count=2)
    assert main(["serve", "--config", str(config), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(
        "router on 127.0.0.1:8000 in front of 2 model pools: chat ('llama'), code ('coder')\n"
    )
    assert "== pool chat serving 'llama' (policy kv_aware" in out
    assert "== pool code serving 'coder' (policy kv_aware" in out
    # The code pool's map shows the whole host: chat's GPUs, then its own.
    code_map = out.split("== pool code")[1]
    for line in (
        "  GPU 0  NVIDIA L4, 23034 MiB  -> chat-vllm-0 as cuda:0\n",
        "  GPU 1  NVIDIA L4, 23034 MiB  -> chat-vllm-0 as cuda:1\n",
        "  GPU 2  NVIDIA L4, 23034 MiB  -> code-vllm-0 as cuda:0\n",
        "  GPU 3  NVIDIA L4, 23034 MiB  -> code-vllm-1 as cuda:0\n",
    ):
        assert line in code_map
    commands = _commands(out)
    assert set(commands) == {"chat-vllm-0", "code-vllm-0", "code-vllm-1"}
    visible = {name: env["CUDA_VISIBLE_DEVICES"] for name, (env, _) in commands.items()}
    assert visible == {"chat-vllm-0": "0,1", "code-vllm-0": "2", "code-vllm-1": "3"}
    served = {
        name: argv[argv.index("--served-model-name") + 1] for name, (_, argv) in commands.items()
    }
    assert served == {"chat-vllm-0": "llama", "code-vllm-0": "coder", "code-vllm-1": "coder"}
    assert not (tmp_path / "logs").exists()


def test_dry_run_refuses_pools_wanting_more_gpus_than_the_host_has(
    tmp_path: Path, four_gpus: None, capsys: pytest.CaptureFixture[str]
) -> None:
    config = _pools_with_gpus(tmp_path, code_count=3)
    assert main(["serve", "--config", str(config), "--dry-run"]) == 2
    assert capsys.readouterr().err == (
        f"kvroute: config error: {config}: pools[1].launch.gpus: auto found 4 GPUs (0-3, by "
        "nvidia-smi), 0,1 placed for other pools already, but pools[1].launch.count 3 x 1 GPU "
        "per replica needs 3\n"
    )


def _commands(out: str) -> dict[str, tuple[dict[str, str], list[str]]]:
    """{replica: (environment kvroute sets, argv)} from the dry run's per-replica blocks."""
    blocks: dict[str, tuple[dict[str, str], list[str]]] = {}
    name = None
    lines = iter(out.splitlines())
    for line in lines:
        if re.match(r"^[\w.-]+: http://", line):
            name = line.split(":", 1)[0]
            blocks[name] = ({}, [])
        elif name and line.startswith("    ") and "=" in line and not blocks[name][1]:
            key, value = line.strip().split("=", 1)
            blocks[name][0][key] = shlex.split(value)[0]
        elif name and line == "  command:":
            blocks[name][1].extend(shlex.split(next(lines)))
    return blocks


def test_the_shipped_pools_example_plans_without_gpus(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    monkeypatch.chdir(tmp_path)
    assert main(["serve", "--config", str(ROOT / "configs" / "pools.yaml"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    commands = _commands(out)
    visible = [env["CUDA_VISIBLE_DEVICES"] for env, _ in commands.values()]
    assert visible == ["0,1", "2,3", "4", "5", "6", "7"]
    assert "== pool big serving 'llama-3.1-70b-instruct'" in out
    assert "2 listed replicas; the pool launches none" in out
    assert not os.path.exists(tmp_path / "kvroute-logs")


# -- several worker processes: one load board, pool after pool ----------------------------


class _NoHooks:
    def ejected(self, handle: ReplicaHandle, kind: str) -> None:
        pass

    def abandon_waiting(self, handle: ReplicaHandle, why: str) -> int:
        return 0

    async def responds(self, handle: ReplicaHandle) -> bool:
        return True


def test_workers_share_each_pools_load_on_its_own_rows(tmp_path: Path) -> None:
    """With --workers, each worker routes by every worker's load: a request in flight on a
    replica of the second pool counts there, for the other worker, and nowhere else."""
    config = config_from_dict(
        {
            "pools": [
                {"name": "chat", "model": "alpha", "replicas": [
                    {"url": "http://127.0.0.1:9001", "name": "a0"},
                    {"url": "http://127.0.0.1:9002", "name": "a1"},
                ]},
                {"name": "code", "model": "beta", "replicas": [
                    {"url": "http://127.0.0.1:9003", "name": "b0"},
                    {"url": "http://127.0.0.1:9004", "name": "b1"},
                ]},
            ],
            "listen": {"workers": 2},
        }
    )  # fmt: skip
    board = LoadBoard(2, len(all_replicas(config)))
    cores = [
        RoutingCore(config, _NoHooks(), WorkerLoad(WorkerContext(i, 2, board, tmp_path)))
        for i in range(2)
    ]
    code = cores[1].pools.named("code")
    assert code is not None
    request = RouteRequest(100, 10, "beta")
    code.ledger.dispatch(Route(request, ("b1",), "test"), "b1", 0.0)

    seen = cores[0].pools.named("code")
    assert seen is not None
    for state in seen.fleet.replicas:
        state.healthy = True  # as its first probe would find
    route = seen.ledger.route(request, 0.0, 16)  # reads the board's totals first
    in_flight = {s.replica_id: s.in_flight for s in seen.fleet.replicas}
    assert in_flight == {"b0": 0, "b1": 1}
    assert route.ranked[0] == "b0"  # the idle one
    WorkerLoad(WorkerContext(0, 2, board, tmp_path)).totals_into(cores[0].fleet.replicas)
    assert {s.replica_id: s.in_flight for s in cores[0].fleet.replicas} == {
        "a0": 0,
        "a1": 0,
        "b0": 0,
        "b1": 1,
    }


def test_the_endpoint_picker_refuses_pools(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "pools.yaml"
    path.write_text(f"pools:\n  - {{name: a, model: m, {STATIC}}}\n")
    assert main(["epp", "--config", str(path)]) == 2
    assert capsys.readouterr().err == (
        "kvroute: config error: pools: the endpoint picker routes one pool of pods (one "
        "InferencePool); run one picker per model, each with its replicas at the top level\n"
    )
