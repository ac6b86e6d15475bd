"""Loading the router's YAML config: what a valid file gives, and what each mistake says.

Every error must be a ``ConfigError`` whose message starts with the file, names the key path
and says why, so ``kvroute check-config`` can print it as one line.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvroute.router.config import Config, ConfigError, ListenConfig, load_config

FULL_CONFIG = """\
# A complete router config: every section, non-default values.
listen:
  host: 0.0.0.0
  port: 9000
models: [llama-3-8b, qwen-2.5-7b]
replicas:
  - url: http://10.0.0.1:8001
    name: gpu-a
  - url: https://vllm-b.internal:8443/
  - url: http://[::1]:8003
policy:
  name: consistent_hash
  params:
    eps: 0.5
    vnodes: 64
timeouts:
  connect_s: 2
  first_byte_s: 120.5
  idle_s: 30
limits:
  max_body_bytes: 1048576
  max_concurrent_requests: 256
health:
  path: /healthz
  interval_s: 1.5
  timeout_s: 0.5
metrics:
  enabled: false
decision_headers: false
"""


def write(tmp_path: Path, text: str | bytes, name: str = "kvroute.yaml") -> Path:
    path = tmp_path / name
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_text(text, encoding="utf-8")
    return path


def load_error(tmp_path: Path, text: str | bytes) -> str:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: "), message
    assert "\n" not in message, message
    return message


def test_full_config_loads_every_value(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, FULL_CONFIG))
    assert (config.listen.host, config.listen.port) == ("0.0.0.0", 9000)
    assert config.models == ["llama-3-8b", "qwen-2.5-7b"]
    assert [(r.url, r.name) for r in config.replicas] == [
        ("http://10.0.0.1:8001", "gpu-a"),
        ("https://vllm-b.internal:8443/", None),
        ("http://[::1]:8003", None),
    ]
    assert config.policy.name == "consistent_hash"
    assert config.policy.params == {"eps": 0.5, "vnodes": 64}
    assert (config.timeouts.connect_s, config.timeouts.first_byte_s, config.timeouts.idle_s) == (
        2.0,
        120.5,
        30.0,
    )
    assert config.limits.max_body_bytes == 1048576
    assert config.limits.max_concurrent_requests == 256
    assert (config.health.path, config.health.interval_s, config.health.timeout_s) == (
        "/healthz",
        1.5,
        0.5,
    )
    assert config.metrics.enabled is False
    assert config.decision_headers is False


def test_load_accepts_str_path(tmp_path: Path) -> None:
    assert load_config(str(write(tmp_path, "listen: {port: 1234}\n"))).listen.port == 1234


@pytest.mark.parametrize(
    "text", ["", "\n\n", "# only a comment\n", "---\n"], ids=["empty", "blank", "comment", "doc"]
)
def test_empty_file_means_defaults(tmp_path: Path, text: str) -> None:
    config = load_config(write(tmp_path, text))
    assert config == Config()
    assert (config.listen.host, config.listen.port) == ("127.0.0.1", 8000)
    assert config.replicas == []
    assert config.policy.name == "kv_aware"
    assert config.policy.params == {}


def test_partial_config_keeps_other_defaults(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "listen:\n  port: 8080\ntimeouts:\n  idle_s: 5\n"))
    assert config.listen == ListenConfig(host="127.0.0.1", port=8080)
    assert config.timeouts.idle_s == 5.0
    assert config.timeouts.connect_s == Config().timeouts.connect_s
    assert config.health == Config().health


def test_utf8_bom_is_accepted(tmp_path: Path) -> None:
    config = load_config(write(tmp_path, "\ufeffmodels: [modèle]\n"))
    assert config.models == ["modèle"]


BAD_CONFIGS = [
    # unknown keys
    (
        "unknown_top",
        "replica:\n  - url: http://a:1\n",
        ["replica: unknown key (did you mean 'replicas'?)"],
    ),
    ("unknown_nested", "listen:\n  prot: 8000\n", ["listen.prot: unknown key", "'port'?"]),
    (
        "unknown_in_list_item",
        "replicas:\n  - url: http://a:1\n  - url: http://b:1\n    nmae: b\n",
        ["replicas[1].nmae: unknown key (did you mean 'name'?)"],
    ),
    ("unknown_policy_key", "policy:\n  nme: random\n", ["policy.nme: unknown key", "'name'?"]),
    (
        "unknown_far_from_any",
        "health:\n  zzz: 1\n",
        ["health.zzz: unknown key (valid keys: path, interval_s, timeout_s, unhealthy_after)"],
    ),
    # wrong types
    ("port_str", 'listen:\n  port: "x"\n', ["listen.port", "expected 'int', got 'str'"]),
    ("port_float", "listen:\n  port: 80.5\n", ["listen.port", "expected 'int'"]),
    ("port_bool", "listen:\n  port: true\n", ["listen.port", "expected 'int', got 'bool'"]),
    ("host_int", "listen:\n  host: 12\n", ["listen.host", "expected 'str', got 'int'"]),
    ("timeout_str", "timeouts:\n  connect_s: fast\n", ["timeouts.connect_s", "expected 'float'"]),
    ("enabled_str", "metrics:\n  enabled: maybe\n", ["metrics.enabled", "expected 'bool'"]),
    ("replicas_str", "replicas: http://a:1\n", ["replicas", "expected 'array', got 'str'"]),
    ("replica_str", "replicas:\n  - http://a:1\n", ["replicas[0]", "expected 'object'"]),
    ("models_int", "models: [llama, 3]\n", ["models[1]", "expected 'str', got 'int'"]),
    ("params_list", "policy:\n  params: [1]\n", ["policy.params", "expected 'object'"]),
    ("top_list", "- a\n- b\n", ["top level", "expected 'object', got 'array'"]),
    ("top_scalar", "hello\n", ["top level", "expected 'object', got 'str'"]),
    # replicas
    ("missing_url", "replicas:\n  - name: a\n", ["replicas[0].url: missing; this key is required"]),
    (
        "no_scheme",
        "replicas:\n  - url: localhost:8000\n",
        ["replicas[0].url", "'localhost:8000'", "not an http(s) URL"],
    ),
    (
        "no_scheme_ip",
        "replicas:\n  - url: 10.0.0.1:8000\n",
        ["replicas[0].url", "'10.0.0.1:8000'", "not an http(s) URL"],
    ),
    (
        "ftp",
        "replicas:\n  - url: http://a:1\n  - url: ftp://b:21\n",
        ["replicas[1].url", "'ftp://b:21'", "not an http(s) URL"],
    ),
    ("no_host", "replicas:\n  - url: 'http://:8000'\n", ["replicas[0].url", "with a host"]),
    (
        "with_path",
        "replicas:\n  - url: http://a:8000/v1\n",
        ["replicas[0].url", "'http://a:8000/v1'", "base URL"],
    ),
    ("with_query", "replicas:\n  - url: http://a:8000?x=1\n", ["replicas[0].url", "base URL"]),
    ("bad_port", "replicas:\n  - url: http://a:99999\n", ["replicas[0].url", "Port out of range"]),
    (
        "duplicate_names",
        "replicas:\n  - url: http://a:1\n    name: gpu\n  - url: http://b:1\n    name: gpu\n",
        ["replicas[1].name", "duplicate replica name 'gpu'"],
    ),
    (
        "duplicate_derived_names",
        "replicas:\n  - url: http://a\n  - url: http://a:80/\n",
        ["replicas[1].name", "duplicate replica name 'a:80'"],
    ),
    # numbers out of range
    ("port_range", "listen:\n  port: 70000\n", ["listen.port", "0-65535", "70000"]),
    ("port_negative", "listen:\n  port: -1\n", ["listen.port", "0-65535"]),
    (
        "connect_negative",
        "timeouts:\n  connect_s: -1\n",
        ["timeouts.connect_s", "must be a finite number > 0"],
    ),
    ("first_byte_zero", "timeouts:\n  first_byte_s: 0\n", ["timeouts.first_byte_s", "> 0"]),
    (
        "idle_negative",
        "timeouts:\n  idle_s: -0.5\n",
        ["timeouts.idle_s", "must be a finite number > 0"],
    ),
    (
        "interval_zero",
        "health:\n  interval_s: 0\n",
        ["health.interval_s", "must be a finite number > 0"],
    ),
    (
        "probe_negative",
        "health:\n  timeout_s: -2\n",
        ["health.timeout_s", "must be a finite number > 0"],
    ),
    ("body_zero", "limits:\n  max_body_bytes: 0\n", ["limits.max_body_bytes", "must be > 0"]),
    (
        "concurrency_negative",
        "limits:\n  max_concurrent_requests: -1\n",
        ["limits.max_concurrent_requests", ">= 0"],
    ),
    ("health_path", "health:\n  path: healthz\n", ["health.path", "must start with '/'"]),
    ("empty_model", "models: [llama, '']\n", ["models[1]", "must not be empty"]),
    (
        "kv_events_bind",
        "launch:\n  kv_events_bind: public\n",
        ["launch.kv_events_bind: must be one of ipc, tcp, got 'public'"],
    ),
    # GPU placement
    (
        "gpus_per_replica_disagrees",
        "launch:\n  gpus_per_replica: 4\n  tensor_parallel_size: 2\n",
        [
            "launch.gpus_per_replica: 4 disagrees with launch.tensor_parallel_size 2 x "
            "launch.pipeline_parallel_size 1 x launch.data_parallel_size 1 = 2"
        ],
    ),
    (
        "gpus_list_too_short",
        "launch:\n  count: 4\n  gpus: [0, 1, 2, 3, 4, 5]\n  tensor_parallel_size: 2\n",
        [
            "launch.gpus: lists 6 GPUs, but launch.count 4 x 2 GPUs per replica "
            "(tensor_parallel_size 2) needs 8"
        ],
    ),
    ("gpus_word", "launch:\n  gpus: all\n", ["launch.gpus", "'auto'", "got 'all'"]),
    ("gpus_number", "launch:\n  gpus: 8\n", ["launch.gpus: expected"]),
    (
        "gpus_duplicate",
        "launch:\n  gpus: [0, 1, 1]\n",
        ["launch.gpus: lists GPU 1 more than once"],
    ),
    (
        "gpu_memory_utilization",
        "launch:\n  engine: vllm\n  gpus: [0, 1]\n  gpu_memory_utilization: 90\n",
        ["launch.gpu_memory_utilization", "at most 1, got 90.0"],
    ),
    (
        "data_parallel_with_ipc_kv_events",
        "launch:\n  engine: vllm\n  gpus: auto\n  data_parallel_size: 2\n",
        ["launch.data_parallel_size: 2 with launch.kv_events on", "launch.kv_events_bind: tcp"],
    ),
    (
        "replica_data_parallel_size",
        "replicas:\n  - url: http://h:1\n    data_parallel_size: 0\n",
        ["replicas[0].data_parallel_size: must be 1-1024", "got 0"],
    ),
    (
        "replica_data_parallel_rank",
        "replicas:\n  - url: http://h:1\n    data_parallel_size: 4\n    data_parallel_rank: 4\n",
        ["replicas[0].data_parallel_rank", "below data_parallel_size 4, got 4"],
    ),
    (
        "extra_args_owned_flag",
        "launch:\n  engine: vllm\n  extra_args: [--tensor_parallel_size=2]\n",
        ["launch.extra_args: --tensor-parallel-size is set by kvroute"],
    ),
    # policy
    (
        "policy_unknown",
        "policy:\n  name: fastest\n",
        ["policy.name", "unknown policy 'fastest'", "round_robin"],
    ),
    (
        "policy_unknown_param",
        "policy:\n  name: consistent_hash\n  params:\n    epsilon: 0.1\n",
        ["policy.params", "'epsilon'"],
    ),
    (
        "policy_param_type",
        "policy:\n  name: consistent_hash\n  params:\n    eps: lots\n",
        ["policy.params", "'eps'", "must be a number"],
    ),
    (
        "policy_param_range",
        "policy:\n  name: consistent_hash\n  params:\n    eps: -1\n",
        ["policy.params", "eps must be a finite number >= 0"],
    ),
    (
        "policy_param_default_name",  # no name: params are checked against the default policy
        "policy:\n  params:\n    epsilon: 1\n",
        ["policy.params", "'epsilon'"],
    ),
    (
        "port_0_with_workers",  # each worker would bind a free port of its own
        "listen:\n  port: 0\n  workers: 2\n",
        ["listen.port", "any free port", "listen.workers 2", "give the port they share"],
    ),
    (
        "policy_no_params",
        "policy:\n  name: round_robin\n  params:\n    seed: 1\n",
        ["policy.params", "'seed'", "accepted: none"],
    ),
]


@pytest.mark.parametrize(
    ("text", "fragments"), [(t, f) for _, t, f in BAD_CONFIGS], ids=[i for i, _, _ in BAD_CONFIGS]
)
def test_bad_config_names_key_and_reason(tmp_path: Path, text: str, fragments: list[str]) -> None:
    message = load_error(tmp_path, text)
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} not in {message!r}"


def test_every_problem_is_listed_with_its_key_path_in_file_order(tmp_path: Path) -> None:
    # A typo must not hide the negative number after it, nor a bad type the bad URL.
    path = write(
        tmp_path,
        "listen:\n  prot: 8000\nhealth:\n  interval_s: -1\nreplicas:\n  - url: ftp://a:1\n"
        "  - name: b\n  - url: http://c:1\n    nmae: c\nmodels: [llama, 3]\n",
    )
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems == [
        "listen.prot: unknown key (did you mean 'port'?)",
        "health.interval_s: must be a finite number > 0, got -1.0",
        "replicas[0].url: 'ftp://a:1' is not an http(s) URL with a host",
        "replicas[1].url: missing; this key is required",
        "replicas[2].nmae: unknown key (did you mean 'name'?)",
        "models[1]: expected 'str', got 'int'",
    ]
    lines = str(err.value).splitlines()
    assert lines[0] == f"{path}: 6 problems:"
    assert lines[1:] == [f"  {p}" for p in err.value.problems]


def test_a_bad_replica_does_not_shift_the_others_key_paths(tmp_path: Path) -> None:
    # The first replica fails its type check; the second's problem keeps its own index.
    path = write(tmp_path, "replicas:\n  - url: 12\n  - url: http://a:1/v1\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.problems == [
        "replicas[0].url: expected 'str', got 'int'",
        "replicas[1].url: 'http://a:1/v1' must be a base URL like http://host:port",
    ]


def test_key_path_comes_first(tmp_path: Path) -> None:
    path = write(tmp_path, 'listen:\n  port: "x"\n')
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: listen.port: expected 'int', got 'str'"


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope" / "kvroute.yaml"
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: cannot read: No such file or directory"


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as err:
        load_config(tmp_path)
    assert str(err.value).startswith(f"{tmp_path}: cannot read")


def test_invalid_yaml_says_so_with_position(tmp_path: Path) -> None:
    path = write(tmp_path, "listen:\n  port: 8000\n  host: [unclosed\n")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    message = str(err.value)
    assert message.startswith(f"{path}: not valid YAML")
    assert "line " in message


def test_invalid_yaml_message_is_one_line(tmp_path: Path) -> None:
    load_error(tmp_path, "listen: {port: 8000\n")


def test_non_utf8_file(tmp_path: Path) -> None:
    path = write(tmp_path, "listen:\n  host: caf\xe9\n".encode("latin-1"))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert str(err.value) == f"{path}: not UTF-8 text"


def test_malformed_ipv6_url_is_a_config_error(tmp_path: Path) -> None:
    message = load_error(tmp_path, "replicas:\n  - url: 'http://[::1'\n")
    assert "replicas[0].url" in message


def test_non_string_key_names_its_section(tmp_path: Path) -> None:
    message = load_error(tmp_path, "listen:\n  1: 2\n")
    assert f"{tmp_path / 'kvroute.yaml'}: listen" in message
    assert "`" not in message


def test_no_gpu_keys_leave_launch_as_it_was(tmp_path: Path) -> None:
    launch = load_config(write(tmp_path, "launch:\n  engine: vllm\n  block_size: 32\n")).launch
    assert launch is not None
    assert launch.gpus is None and launch.num_gpu_blocks is None  # 1024 at launch, as before
    message = load_error(tmp_path, "launch:\n  engine: vllm\n  block_size: 16\n")
    assert "launch.block_size: vLLM on CPU needs a multiple of 32, got 16" in message


def test_gpu_keys_load_and_lift_the_cpu_block_size_rule(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "launch:\n  engine: vllm\n  count: 2\n  gpus: [4, 5, 6, 7]\n  gpus_per_replica: 2\n"
        "  gpu_memory_utilization: 0.85\n  block_size: 16\n",
    )
    launch = load_config(path).launch
    assert launch is not None
    assert (launch.gpus, launch.gpus_per_replica, launch.tensor_parallel_size) == (
        [4, 5, 6, 7],
        2,
        None,  # derived at launch: 2
    )
    assert launch.gpu_memory_utilization == 0.85


@pytest.mark.parametrize(
    "path", sorted(Path(__file__).parent.parent.glob("configs/*.yaml")), ids=lambda p: p.name
)
def test_shipped_configs_are_valid(path: Path) -> None:
    config = load_config(path)
    assert config.replicas or config.launch or config.pools, f"{path.name} declares no replicas"
