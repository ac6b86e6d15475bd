"""A tiny randomly initialised Llama with its own BPE tokenizer, built locally.

Real vLLM replicas in tests and demos need a model, and nothing can be downloaded, so
``make_tiny_model`` builds one: deterministically from a seed, offline, in about a second.
Its output text is noise, which is fine: the router cares about tokens, blocks and timing.

- tokenizer: a byte-level BPE trained with ``tokenizers`` on generated English-like text,
  wrapped as ``transformers.PreTrainedTokenizerFast`` with ``<s>``/``</s>``/``<unk>``,
  a ``<s>`` prepended when special tokens are added, and a chat template with
  ``<|system|>``/``<|user|>``/``<|assistant|>`` turns, each ended by ``</s>``.
- model: a 2-layer ``LlamaForCausalLM`` with head_dim 64 (the CPU attention kernels
  reject head_dim 16), bfloat16, weights from ``torch.manual_seed(seed)``.

A marker file records the version of this builder, the seed and a digest of every file, so a
directory that already holds a complete model of the same build is reused as it is.
torch, transformers and tokenizers come with the ``vllm`` extra and are imported lazily.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import os
import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

# Bump when anything below changes what is written: a directory built by another
# version is rebuilt instead of reused.
BUILDER_VERSION = 2
MARKER_NAME = "kvroute-tiny-model.json"
_LOCK_NAME = ".kvroute-tiny-model.lock"

VOCAB_SIZE = 1024
HIDDEN_SIZE = 128
INTERMEDIATE_SIZE = 256
NUM_LAYERS = 2
NUM_HEADS = 2  # head_dim = 128 / 2 = 64
NUM_KV_HEADS = 1
MAX_POSITION_EMBEDDINGS = 4096

BOS, EOS, UNK = "<s>", "</s>", "<unk>"
ROLE_TOKENS = ("<|system|>", "<|user|>", "<|assistant|>")
# One turn: "<|role|>\n" content "</s>\n"; a generation prompt opens an assistant turn.
# Only the three roles exist: anything else is an error, as with most real templates.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    # Retrieved documents and a reasoning switch, as RAG and reasoning models' templates have
    # them: what vLLM passes from a request's documents / reasoning_effort must show.
    "{% if documents %}{{ '<|system|>\\n' }}{% for doc in documents %}"
    "{{ (doc['title'] ~ ': ' if doc['title'] is defined else '') ~ doc['text'] ~ '\\n' }}"
    "{% endfor %}{{ eos_token + '\\n' }}{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('Unsupported role: ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + eos_token + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}"
    "{% if enable_thinking is defined and not enable_thinking %}{{ 'think none\\n' }}"
    "{% elif reasoning_effort is defined and reasoning_effort %}"
    "{{ 'think ' ~ reasoning_effort ~ '\\n' }}{% endif %}"
    "{% endif %}"
)

_INSTALL_HINT = "install with pip install -e '.[vllm]'"

# Common English words, so real prompts tokenize into plausible pieces.
_COMMON_TEXT = """
the of and to a in is it you that he was for on are with as I his they be at one have this from
or had by hot word but what some we can out other were all there when up use your how said an
each she which do their time if will way about many then them write would like so these her
long make thing see him two has look more day could go come did number sound no most people my
over know water than call first who may down side been now find any new work part take get
place made live where after back little only round man year came show every good me give our
under name very through just form sentence great think say help low line differ turn cause much
mean before move right boy old too same tell does set three want air well also play small end
put home read hand port large spell add even land here must big high such follow act why ask
men change went light kind off need house picture try us again animal point mother world near
build self earth father head stand own page should country found answer school grow study still
learn plant cover food sun four between state keep eye never last let thought city tree cross
farm hard start might story saw far sea draw left late run while press close night real life
few north open seem together next white children begin got walk example ease paper group always
music those both mark often letter until mile river car feet care second book carry took
science eat room friend began idea fish mountain stop once base hear horse cut sure watch color
face wood main enough plain girl usual young ready above ever red list though feel talk bird
soon body dog family direct pose leave song measure door product black short numeral class wind
question happen complete ship area half rock order fire south problem piece told knew pass
since top whole king space heard best hour better true during hundred five remember step early
hold west ground interest reach fast verb sing listen six table travel less morning ten simple
several vowel toward war lay against pattern slow center love person money serve appear road
map rain rule govern pull cold notice voice unit power town fine certain fly fall lead cry dark
machine note wait plan figure star box noun field rest correct able pound done beauty drive
stood contain front teach week final gave green oh quick develop ocean warm free minute strong
special mind behind clear tail produce fact street inch multiply nothing course stay wheel full
force blue object decide surface deep moon island foot system busy test record boat common gold
possible plane stead dry wonder laugh thousand ago ran check game shape equate miss brought
heat snow tire bring yes distant fill east paint language among model cache token block router
request replica server prompt answer stream event prefix
"""
_COMMON_WORDS = _COMMON_TEXT.split()
_SYLLABLES = [c + v for c in "bcdfghklmnprstvwz" for v in "aeiou"]
_PUNCT = [".", ".", ".", ",", ",", "?", "!", ":", ";"]


def make_tiny_lora(directory: Path, base: Path, *, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter for the tiny model in ``directory`` (PEFT layout, as vLLM's
    ``--lora-modules`` and ``/v1/load_lora_adapter`` read it): random ``lora_A``/``lora_B`` on
    every layer's ``q_proj`` and ``v_proj``, deterministic for a seed, a few hundred KB."""
    _require_packages()
    import torch
    from safetensors.torch import save_file

    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    head_dim = HIDDEN_SIZE // NUM_HEADS
    outputs = {"q_proj": HIDDEN_SIZE, "v_proj": NUM_KV_HEADS * head_dim}
    tensors = {}
    for layer in range(NUM_LAYERS):
        for module, out in outputs.items():
            name = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            a = torch.randn(rank, HIDDEN_SIZE, generator=generator) * 0.05
            tensors[f"{name}.lora_A.weight"] = a
            tensors[f"{name}.lora_B.weight"] = torch.randn(out, rank, generator=generator) * 0.05
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "bias": "none",
        "target_modules": list(outputs),
        "base_model_name_or_path": str(base),
        "fan_in_fan_out": False,
        "inference_mode": True,
    }
    (directory / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return directory


def make_tiny_model(directory: Path, *, seed: int = 0, force: bool = False) -> Path:
    """Build (or reuse) the tiny model in ``directory`` and return the directory.

    Deterministic: the same seed and builder version give byte-identical files. If the
    directory already holds a complete model of the same build it is returned as it is
    (unless ``force``). Concurrent callers are serialised by a lock file in the directory.
    """
    directory = Path(directory).expanduser().resolve()
    directory.mkdir(parents=True, exist_ok=True)
    with _locked(directory / _LOCK_NAME):
        if not force and is_complete(directory, seed=seed):
            return directory
        _require_packages()
        with tempfile.TemporaryDirectory(prefix=".build-", dir=directory) as tmp:
            staging = Path(tmp)
            _build(staging, seed)
            files = sorted(p.name for p in staging.iterdir() if p.is_file())
            digests = {name: _sha256(staging / name) for name in files}
            # Drop the old marker first: a crash midway leaves no marker, so no false reuse.
            (directory / MARKER_NAME).unlink(missing_ok=True)
            for name in files:
                os.replace(staging / name, directory / name)
        marker = {"builder_version": BUILDER_VERSION, "seed": seed, "files": digests}
        tmp_marker = directory / (MARKER_NAME + ".tmp")
        tmp_marker.write_text(json.dumps(marker, indent=2, sort_keys=True) + "\n")
        os.replace(tmp_marker, directory / MARKER_NAME)
    return directory


def is_complete(directory: Path, *, seed: int = 0) -> bool:
    """True if ``directory`` holds every file of a model built by this version with ``seed``."""
    try:
        marker = json.loads((Path(directory) / MARKER_NAME).read_text())
    except (OSError, ValueError):
        return False
    if not isinstance(marker, dict):
        return False
    if marker.get("builder_version") != BUILDER_VERSION or marker.get("seed") != seed:
        return False
    files = marker.get("files")
    if not isinstance(files, dict) or "config.json" not in files:
        return False
    for name, digest in files.items():
        path = Path(directory) / name
        if not path.is_file() or _sha256(path) != digest:
            return False
    return True


def training_text(seed: int, sentences: int = 4000) -> list[str]:
    """Generated English-like lines (common words, made-up words, numbers, punctuation)."""
    rng = random.Random(f"kvroute-tiny-model-text-{seed}")
    lines = []
    for _ in range(sentences):
        words = []
        for _ in range(rng.randint(4, 18)):
            roll = rng.random()
            if roll < 0.75:
                word = rng.choice(_COMMON_WORDS)
            elif roll < 0.92:
                word = "".join(rng.choice(_SYLLABLES) for _ in range(rng.randint(1, 4)))
            else:
                word = str(rng.randint(0, 9999))
            words.append(word)
        words[0] = words[0].capitalize()
        sentence = " ".join(words)
        if rng.random() < 0.3:
            cut = rng.randint(1, len(sentence))
            sentence = sentence[:cut] + rng.choice(_PUNCT) + sentence[cut:]
        lines.append(sentence + rng.choice(_PUNCT))
    return lines


def _build(out: Path, seed: int) -> None:
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # type: ignore[no-untyped-call]
    _build_tokenizer(seed).save_pretrained(out)
    _build_model(seed).save_pretrained(out)
    _normalise_files(out)


def _build_tokenizer(seed: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = [UNK, BOS, EOS, *ROLE_TOKENS]
    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(training_text(seed), trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A:0", pair=f"{BOS} $A:0 {BOS} $B:1", special_tokens=[(BOS, bos_id)]
    )
    return PreTrainedTokenizerFast(  # type: ignore[no-untyped-call]
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        additional_special_tokens=list(ROLE_TOKENS),
        chat_template=CHAT_TEMPLATE,
        model_max_length=MAX_POSITION_EMBEDDINGS,
        clean_up_tokenization_spaces=False,
    )


def _build_model(seed: int) -> Any:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=HIDDEN_SIZE,
        intermediate_size=INTERMEDIATE_SIZE,
        num_hidden_layers=NUM_LAYERS,
        num_attention_heads=NUM_HEADS,
        num_key_value_heads=NUM_KV_HEADS,
        head_dim=HIDDEN_SIZE // NUM_HEADS,
        max_position_embeddings=MAX_POSITION_EMBEDDINGS,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=None,
        tie_word_embeddings=True,
        # vLLM on x86 CPUs runs bfloat16 whatever the checkpoint says; storing it so
        # avoids a downcast (and a warning per tensor) at every start.
        dtype="bfloat16",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)  # type: ignore[no-untyped-call]
    return model.to(torch.bfloat16)  # type: ignore[arg-type]


def _normalise_files(out: Path) -> None:
    """Files readable by all, nothing depending on the build's path or time, and the
    tokenizer class named by its long-standing alias so older transformers load it too."""
    config = out / "tokenizer_config.json"
    data = json.loads(config.read_text())
    data.pop("name_or_path", None)
    data["tokenizer_class"] = "PreTrainedTokenizerFast"
    config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    for path in out.iterdir():
        path.chmod(0o644)


def _require_packages() -> None:
    missing = []
    for name in ("torch", "transformers", "tokenizers"):
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    if missing:
        raise RuntimeError(f"building the tiny model needs {', '.join(missing)}: {_INSTALL_HINT}")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def add_make_tiny_model_command(
    subparsers: argparse._SubParsersAction[argparse.ArgumentParser],
) -> None:
    """Register ``kvroute make-tiny-model DIR [--seed N] [--force]``."""
    p = subparsers.add_parser(
        "make-tiny-model",
        help="Build a tiny random Llama (with its tokenizer) for real vLLM replicas, offline.",
        description=(
            "Build a tiny randomly initialised Llama (2 layers, hidden 128, head_dim 64, "
            f"{VOCAB_SIZE}-token byte-level BPE tokenizer with <s>/</s>/<unk> and a chat "
            "template) into DIR, deterministically and without network access. vLLM serves "
            "it with `python -m vllm.entrypoints.openai.api_server --model DIR`; its output "
            "is noise, but tokens, KV blocks, prefix caching and timing are real. A DIR that "
            "already holds the same build is reused. Needs torch, transformers and "
            f"tokenizers ({_INSTALL_HINT})."
        ),
    )
    p.add_argument("directory", metavar="DIR", type=Path, help="Where to write the model.")
    p.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed for the weights and the tokenizer's training text (default 0).",
    )
    p.add_argument(
        "--force", action="store_true", help="Rebuild even if DIR already holds this build."
    )
    p.set_defaults(func=_cmd_make_tiny_model)


def _cmd_make_tiny_model(args: argparse.Namespace) -> int:
    import sys
    import time

    start = time.monotonic()
    try:
        reused = not args.force and is_complete(args.directory, seed=args.seed)
        path = make_tiny_model(args.directory, seed=args.seed, force=args.force)
    except RuntimeError as exc:
        print(f"kvroute: {exc}", file=sys.stderr)
        return 1
    size = sum(p.stat().st_size for p in path.iterdir() if p.is_file())
    what = "reused" if reused else f"built in {time.monotonic() - start:.1f} s"
    print(f"{path}: tiny model {what} ({size / 1e6:.1f} MB, seed {args.seed})")
    return 0


__all__ = [
    "BUILDER_VERSION",
    "CHAT_TEMPLATE",
    "MARKER_NAME",
    "add_make_tiny_model_command",
    "is_complete",
    "make_tiny_model",
]
