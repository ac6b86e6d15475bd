"""Prefill/decode pairs in the config: what pairs, what is refused and why, and what the
launched replicas of a pair are started with (as ``kvroute serve --dry-run`` shows them)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvroute.cli import main
from kvroute.kvcore import pd
from kvroute.router.config import ConfigError, config_from_dict
from kvroute.router.pool_config import pool_specs

ROOT = Path(__file__).parent.parent


def pair(**decode: Any) -> list[dict[str, Any]]:
    return [
        {
            "name": "llama-prefill",
            "model": "llama",
            "role": "prefill",
            "replicas": [{"url": "http://127.0.0.1:9101"}],
        },
        {
            "name": "llama-decode",
            "model": "llama",
            "role": "decode",
            "replicas": [{"url": "http://127.0.0.1:9201"}],
            **decode,
        },
    ]


def problems(pools: list[dict[str, Any]]) -> str:
    with pytest.raises(ConfigError) as caught:
        config_from_dict({"pools": pools})
    return str(caught.value)


def test_a_prefill_and_a_decode_pool_serve_one_model_as_a_pair() -> None:
    config = config_from_dict(
        {"pools": pair(disaggregate={"mode": "always", "min_uncached_tokens": 64})}
    )
    prefill, decode = pool_specs(config)
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert decode.disaggregate == pd.DisaggregationRule("always", 64)
    # Left out: conditional, 512 tokens.
    default = pool_specs(config_from_dict({"pools": pair()}))[1]
    assert default.disaggregate == pd.DisaggregationRule("conditional", 512)


@pytest.mark.parametrize(
    ("pools", "expected"),
    [
        (
            [{**pair()[0], "role": "prefil"}, pair()[1]],
            "pools[0].role: 'prefil' is not a role: prefill or decode",
        ),
        (pair()[:1], "pools[0].role: a role: prefill pool needs a role: decode pool"),
        (pair()[1:], "pools[0].role: a role: decode pool needs a role: prefill pool"),
        (
            [*pair(), {**pair()[0], "name": "second-prefill"}],
            "pools[2].model: 'llama' is already served by pools[0]",
        ),
        (
            [{**pair()[1], "role": None}, pair()[0]],
            "pools[1].model: 'llama' is already served by pools[0]",
        ),
        (
            pair(disaggregate={"mode": "sometimes"}),
            "pools[1].disaggregate.mode: 'sometimes' is not one of conditional, always, never",
        ),
        (
            pair(disaggregate={"min_uncached_tokens": -1}),
            "pools[1].disaggregate.min_uncached_tokens: must be >= 0, got -1",
        ),
        (
            [{**pair()[0], "disaggregate": {"mode": "always"}}, pair()[1]],
            "pools[0].disaggregate: only a role: decode pool has one",
        ),
        (
            [
                pair()[0],
                {
                    **pair()[1],
                    "launch": {"engine": "emulated"},
                    "kv_transfer_config": {"kv_connector": "LMCacheConnectorV1"},
                },
            ],
            "pools[1].kv_transfer_config.kv_connector: emulated replicas speak NixlConnector's "
            "protocol only, not 'LMCacheConnectorV1'",
        ),
        (
            pair(kv_transfer_config={"kv_role": "kv_both"}),
            "pools[1].kv_transfer_config.kv_connector: must name vLLM's KV connector",
        ),
    ],
)
def test_pairs_that_cannot_work_are_refused_naming_the_key(
    pools: list[dict[str, Any]], expected: str
) -> None:
    assert expected in problems(pools)


def test_launched_pair_replicas_run_a_kv_connector(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A pair's launched replicas get vLLM's --kv-transfer-config (NIXL, producer on prefill
    and consumer on decode, unless the pool says otherwise); an ordinary pool's do not."""
    raw = {
        "pools": [
            {
                "name": "p",
                "model": "m",
                "role": "prefill",
                "launch": {"engine": "vllm", "count": 1},
                "kv_transfer_config": {"kv_connector": "ExampleConnector", "kv_role": "kv_both"},
            },
            {"name": "d", "model": "m", "role": "decode", "launch": {"count": 2}},
            {"name": "other", "model": "x", "launch": {"count": 1}},
        ]
    }
    path = tmp_path / "pd.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["serve", "--config", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    sections = {part.split()[0]: part for part in out.split("== pool ")[1:]}
    assert "--kv-transfer-config" in sections["p"] and "ExampleConnector" in sections["p"]
    assert sections["d"].count("--kv-transfer-config") == 2
    assert "NixlConnector" in sections["d"] and "kv_consumer" in sections["d"]
    assert "--kv-transfer-config" not in sections["other"]


def test_the_example_pd_config_is_valid() -> None:
    config = config_from_dict(yaml.safe_load((ROOT / "configs" / "pd-emulated.yaml").read_text()))
    assert [s.role for s in pool_specs(config)] == ["prefill", "decode"]
