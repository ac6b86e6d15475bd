"""backends/tiny_model.py: deterministic, cached, offline; a tokenizer with a chat template."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

from kvroute.backends import tiny_model
from kvroute.backends.tiny_model import (
    MARKER_NAME,
    add_make_tiny_model_command,
    is_complete,
    make_tiny_model,
)

for _package in ("torch", "transformers", "tokenizers"):
    pytest.importorskip(_package, reason="needs the vllm extra: pip install -e '.[vllm]'")


def file_bytes(directory: Path) -> dict[str, bytes]:
    return {
        p.name: p.read_bytes() for p in sorted(directory.iterdir()) if not p.name.startswith(".")
    }


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


def test_builds_a_complete_model(model_dir: Path) -> None:
    names = set(file_bytes(model_dir))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert MARKER_NAME in names
    assert is_complete(model_dir)
    assert not is_complete(model_dir, seed=1)


def test_build_is_deterministic(model_dir: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "elsewhere")
    assert file_bytes(again) == file_bytes(model_dir)


def test_second_call_is_a_cache_hit(model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()}

    def no_build(*args: object) -> None:
        raise AssertionError("rebuilt a complete model")

    monkeypatch.setattr(tiny_model, "_build", no_build)
    assert make_tiny_model(model_dir) == model_dir
    assert {p.name: p.stat().st_mtime_ns for p in model_dir.iterdir()} == before


def test_damaged_or_other_seed_is_rebuilt(tmp_path: Path, model_dir: Path) -> None:
    target = tmp_path / "model"
    make_tiny_model(target, seed=7)
    assert file_bytes(target)["model.safetensors"] != file_bytes(model_dir)["model.safetensors"]
    (target / "tokenizer.json").write_text("{}")
    assert not is_complete(target, seed=7)
    make_tiny_model(target)  # seed 0 now, over the damaged seed-7 build
    assert file_bytes(target) == file_bytes(model_dir)


def test_model_shape(model_dir: Path) -> None:
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir)
    assert config.model_type == "llama"
    assert config.hidden_size // config.num_attention_heads == 64  # CPU kernels reject 16
    assert config.head_dim == 64


def test_tokenizer_special_tokens(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    assert (tok.bos_token, tok.eos_token, tok.unk_token) == ("<s>", "</s>", "<unk>")
    ids = tok("Hello world, the router sends each request to a replica.")["input_ids"]
    assert ids[0] == tok.bos_token_id
    assert tok.decode(ids, skip_special_tokens=True) == (
        "Hello world, the router sends each request to a replica."
    )
    # Byte-level: any text round-trips, unknown scripts included.
    assert tok.decode(tok("é 😀 日本")["input_ids"], skip_special_tokens=True) == "é 😀 日本"


def test_chat_template_renders_turns(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Bye"},
    ]
    turns = "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\nHello.</s>\n<|user|>\nBye</s>\n"
    assert tok.apply_chat_template(messages, tokenize=False) == turns
    assert (
        tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        == turns + "<|assistant|>\n"
    )
    ids = tok.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, return_dict=False
    )
    assert ids[:2] == [tok.bos_token_id, tok.convert_tokens_to_ids("<|system|>")]
    assert ids.count(tok.bos_token_id) == 1  # the template's <s> is not doubled
    with pytest.raises(Exception, match="Unsupported role"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def test_missing_packages_give_install_hint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(RuntimeError, match=r"pip install -e '\.\[vllm\]'"):
        make_tiny_model(tmp_path / "model")


def test_command(model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser(prog="kvroute")
    add_make_tiny_model_command(parser.add_subparsers())
    args = parser.parse_args(["make-tiny-model", str(model_dir), "--seed", "0"])
    assert args.func(args) == 0
    assert "reused" in capsys.readouterr().out

    with pytest.raises(SystemExit):
        parser.parse_args(["make-tiny-model", "--help"])
    help_text = capsys.readouterr().out
    assert "DIR" in help_text and "--seed" in help_text and "--force" in help_text
