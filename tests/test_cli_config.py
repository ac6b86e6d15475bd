"""``kvroute check-config`` and ``kvroute serve`` configuration, as a user sees them.

The commands run as real subprocesses of the installed ``kvroute`` script. They are all
started once per module, a few at a time, and each test reads its own result.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sysconfig
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvroute.cli import build_parser, config_from_args
from kvroute.policies import POLICIES
from kvroute.router.config import ConfigError, load_config

VALID_CONFIG = """\
listen:
  host: 0.0.0.0
  port: 9000
replicas:
  - url: http://127.0.0.1:8001
    name: a
  - url: http://127.0.0.1:8002
  - url: https://vllm-c.internal
policy:
  name: consistent_hash
  params: {eps: 0.5}
timeouts:
  connect_s: 3
  first_byte_s: 60
"""

# (id, file content, a fragment stderr must contain: the key path, or what is wrong with the file)
BAD_FILES: list[tuple[str, str | bytes | None, str]] = [
    ("unknown_top", "replica: []\n", "replica: unknown key (did you mean 'replicas'?)"),
    (
        "unknown_nested",
        "listen:\n  prot: 8000\n",
        "listen.prot: unknown key (did you mean 'port'?)",
    ),
    ("wrong_type", 'listen:\n  port: "x"\n', "listen.port: expected 'int', got 'str'"),
    ("missing_url", "replicas:\n  - name: a\n", "replicas[0].url: missing; this key is required"),
    ("no_scheme", "replicas:\n  - url: localhost:8001\n", "replicas[0].url:"),
    ("ftp", "replicas:\n  - url: http://a:1\n  - url: ftp://b:2\n", "replicas[1].url:"),
    ("with_path", "replicas:\n  - url: http://a:8001/v1\n", "replicas[0].url:"),
    (
        "duplicate_names",
        "replicas:\n  - {url: 'http://a:1', name: x}\n  - {url: 'http://b:1', name: x}\n",
        "replicas[1].name: duplicate replica name 'x'",
    ),
    (
        "negative_timeout",
        "timeouts:\n  idle_s: -1\n",
        "timeouts.idle_s: must be a finite number > 0",
    ),
    ("unknown_policy", "policy:\n  name: fastest\n", "policy.name: unknown policy 'fastest'"),
    (
        "bad_policy_param",
        "policy:\n  name: consistent_hash\n  params: {eps: lots}\n",
        "policy.params: policy parameter 'eps'",
    ),
    ("invalid_yaml", "listen: {port: 8000\n", "not valid YAML"),
    ("non_utf8", b"models: [caf\xe9]\n", "not UTF-8"),
    ("missing_file", None, "cannot read"),
]

# A typo next to a negative number and a bad URL: all three must be reported, in file order.
SEVERAL_PROBLEMS = """\
listen:
  prot: 8000
health:
  interval_s: -1
replicas:
  - url: localhost:8001
"""
SEVERAL_PROBLEMS_OUT = [
    "  listen.prot: unknown key (did you mean 'port'?)",
    "  health.interval_s: must be a finite number > 0, got -1.0",
    "  replicas[0].url: 'localhost:8001' is not an http(s) URL with a host",
]
REPO = Path(__file__).resolve().parent.parent

SERVE_FLAGS = ["--config", "--replica", "--policy", "--host", "--port", "--model"]


@dataclass(frozen=True)
class Result:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str


def kvroute() -> str:
    script = Path(sysconfig.get_path("scripts")) / "kvroute"
    found = str(script) if script.exists() else shutil.which("kvroute")
    assert found, "the kvroute console script is not installed (pip install -e .)"
    return found


def run_all(jobs: dict[str, list[str]], cwd: Path) -> dict[str, Result]:
    def run(argv: list[str]) -> Result:
        proc = subprocess.run(
            argv,
            capture_output=True,
            text=True,
            encoding="utf-8",
            errors="replace",
            cwd=cwd,
            timeout=60,
        )
        return Result(argv, proc.returncode, proc.stdout, proc.stderr)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(run, argv) for name, argv in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cli")


@pytest.fixture(scope="module")
def results(workdir: Path) -> dict[str, Result]:
    exe = kvroute()
    jobs: dict[str, list[str]] = {}
    for case_id, content, _ in BAD_FILES:
        path = workdir / f"{case_id}.yaml"
        if isinstance(content, bytes):
            path.write_bytes(content)
        elif content is not None:
            path.write_text(content, encoding="utf-8")
        jobs[case_id] = [exe, "check-config", str(path)]
    valid = workdir / "valid.yaml"
    valid.write_text(VALID_CONFIG, encoding="utf-8")
    jobs["valid"] = [exe, "check-config", str(valid)]
    ipv6 = workdir / "ipv6.yaml"
    ipv6.write_text("replicas:\n  - url: 'http://[::1'\n", encoding="utf-8")
    jobs["ipv6"] = [exe, "check-config", str(ipv6)]
    several = workdir / "several.yaml"
    several.write_text(SEVERAL_PROBLEMS, encoding="utf-8")
    jobs["several"] = [exe, "check-config", str(several)]
    jobs["serve_several"] = [exe, "serve", "--config", str(several), "--port", "0"]
    jobs["launching"] = [exe, "check-config", str(REPO / "configs" / "emulated-fleet.yaml")]
    jobs["help"] = [exe, "--help"]
    jobs["serve_help"] = [exe, "serve", "--help"]
    jobs["check_config_help"] = [exe, "check-config", "--help"]
    # Both fail while building the config, before anything listens.
    jobs["serve_no_replicas"] = [exe, "serve", "--port", "0"]
    jobs["serve_bad_replica"] = [exe, "serve", "--replica", "ftp://a:1", "--port", "0"]
    return run_all(jobs, workdir)


def assert_config_error(result: Result, fragment: str) -> None:
    assert result.returncode == 2, result
    assert "Traceback" not in result.stderr, result.stderr
    assert fragment in result.stderr, result.stderr
    assert result.stderr.startswith("kvroute: config error: "), result.stderr
    assert result.stdout == ""


def test_check_config_valid_file(results: dict[str, Result], workdir: Path) -> None:
    result = results["valid"]
    assert result.returncode == 0, result
    assert result.stderr == ""
    line = result.stdout.strip()
    assert "\n" not in line
    assert line.startswith(f"{workdir / 'valid.yaml'}: OK")
    assert "3 replicas" in line
    assert "consistent_hash" in line
    assert "0.0.0.0:9000" in line


@pytest.mark.parametrize(
    ("case_id", "fragment"), [(c, f) for c, _, f in BAD_FILES], ids=[c for c, _, _ in BAD_FILES]
)
def test_check_config_bad_file(results: dict[str, Result], case_id: str, fragment: str) -> None:
    result = results[case_id]
    assert_config_error(result, fragment)
    assert f"{case_id}.yaml" in result.stderr  # says which file


@pytest.mark.parametrize("case_id", [c for c, _, _ in BAD_FILES if c != "invalid_yaml"])
def test_check_config_error_is_one_line(results: dict[str, Result], case_id: str) -> None:
    assert len(results[case_id].stderr.strip().splitlines()) == 1, results[case_id].stderr


def test_check_config_invalid_yaml_error_is_one_line(results: dict[str, Result]) -> None:
    assert len(results["invalid_yaml"].stderr.strip().splitlines()) == 1


def test_check_config_lists_every_problem(results: dict[str, Result], workdir: Path) -> None:
    result = results["several"]
    assert_config_error(result, "")
    lines = result.stderr.strip().splitlines()
    assert lines[0] == f"kvroute: config error: {workdir / 'several.yaml'}: 3 problems:"
    assert lines[1:] == SEVERAL_PROBLEMS_OUT


def test_serve_with_a_bad_config_prints_the_same_list(results: dict[str, Result]) -> None:
    serve, check = results["serve_several"], results["several"]
    assert_config_error(serve, "3 problems")
    assert serve.stderr == check.stderr


def test_check_config_counts_launched_replicas(results: dict[str, Result]) -> None:
    result = results["launching"]
    assert result.returncode == 0, result
    assert "OK (4 launched replicas, engine emulated, policy kv_aware" in result.stdout


def test_check_config_malformed_ipv6_url(results: dict[str, Result]) -> None:
    assert_config_error(results["ipv6"], "replicas[0].url")


def test_help_lists_commands(results: dict[str, Result]) -> None:
    result = results["help"]
    assert result.returncode == 0, result
    for command in ("serve", "check-config"):
        assert command in result.stdout


def test_serve_help_mentions_every_flag_and_policy(results: dict[str, Result]) -> None:
    result = results["serve_help"]
    assert result.returncode == 0, result
    for flag in SERVE_FLAGS:
        assert flag in result.stdout, flag
    for name in POLICIES:
        assert name in result.stdout, name


def test_check_config_help(results: dict[str, Result]) -> None:
    result = results["check_config_help"]
    assert result.returncode == 0, result
    assert "FILE" in result.stdout


def test_serve_without_replicas_exits_2(results: dict[str, Result]) -> None:
    assert_config_error(results["serve_no_replicas"], "no replicas")
    assert "--replica" in results["serve_no_replicas"].stderr


def test_serve_with_bad_replica_flag_exits_2(results: dict[str, Result]) -> None:
    assert_config_error(results["serve_bad_replica"], "replicas[0].url")


# --- config_from_args: flags over the file ---------------------------------------------------


def serve_args(*argv: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *argv])


@pytest.fixture
def config_file(tmp_path: Path) -> Path:
    path = tmp_path / "kvroute.yaml"
    path.write_text(VALID_CONFIG, encoding="utf-8")
    return path


def test_no_flags_gives_the_file(config_file: Path) -> None:
    assert config_from_args(serve_args("--config", str(config_file))) == load_config(config_file)


def test_flags_override_the_file(config_file: Path) -> None:
    config = config_from_args(
        serve_args(
            "--config",
            str(config_file),
            "--replica",
            "http://10.0.0.9:7001",
            "--replica",
            "http://10.0.0.9:7002",
            "--policy",
            "round_robin",
            "--port",
            "9100",
            "--host",
            "::",
            "--model",
            "llama",
            "--model",
            "qwen",
        )
    )
    # The replica list is replaced, not merged.
    assert [r.url for r in config.replicas] == ["http://10.0.0.9:7001", "http://10.0.0.9:7002"]
    # A different policy drops the file's params (they belong to the file's policy).
    assert (config.policy.name, config.policy.params) == ("round_robin", {})
    assert (config.listen.host, config.listen.port) == ("::", 9100)
    assert config.models == ["llama", "qwen"]
    # What no flag touches comes from the file.
    assert config.timeouts.connect_s == 3.0
    assert config.timeouts.first_byte_s == 60.0


def test_only_port_flag_keeps_the_rest_of_the_file(config_file: Path) -> None:
    from_file = load_config(config_file)
    config = config_from_args(serve_args("--config", str(config_file), "--port", "9200"))
    assert config.listen.port == 9200
    assert config.listen.host == from_file.listen.host
    assert config.replicas == from_file.replicas
    assert config.policy == from_file.policy


def test_same_policy_flag_keeps_file_params(config_file: Path) -> None:
    config = config_from_args(
        serve_args("--config", str(config_file), "--policy", "consistent_hash")
    )
    assert config.policy.params == {"eps": 0.5}


def test_flags_without_file(tmp_path: Path) -> None:
    config = config_from_args(serve_args("--replica", "http://127.0.0.1:8001"))
    assert [r.url for r in config.replicas] == ["http://127.0.0.1:8001"]
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8000)
    assert config.policy.name == "kv_aware"


def test_serve_with_no_replicas_raises(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no replicas"):
        config_from_args(serve_args())
    no_replicas = tmp_path / "no-replicas.yaml"
    no_replicas.write_text("listen:\n  port: 9000\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="no replicas"):
        config_from_args(serve_args("--config", str(no_replicas)))


@pytest.mark.parametrize(
    ("argv", "fragment"),
    [
        (["--replica", "localhost:8001"], "replicas[0].url"),
        (["--replica", "http://a:1", "--replica", "http://a:1/"], "replicas[1].name"),
        (["--replica", "http://a:1", "--port", "70000"], "listen.port"),
    ],
)
def test_bad_flags_raise_config_error_with_key(argv: list[str], fragment: str) -> None:
    with pytest.raises(ConfigError) as err:
        config_from_args(serve_args(*argv))
    assert fragment in str(err.value)


def test_bad_config_file_raises_config_error(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("listen:\n  prot: 1\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="prot"):
        config_from_args(serve_args("--config", str(bad), "--replica", "http://a:1"))


def test_policy_flag_rejects_unknown_policy(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        serve_args("--replica", "http://a:1", "--policy", "fastest")
    assert exc.value.code == 2
    assert "fastest" in capsys.readouterr().err
