"""The one tokenizer entry point: prompts to token ids exactly as vLLM computes them.

``load_tokenizer`` gives HF tokenizer files read as vLLM reads them (``hf``, chat template
included) or the dependency-free built-in tokenizer of the emulated replica (``builtin``);
``prompt_blocks`` turns a prompt into what routing needs: its token count and block hashes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.tokenizer.builtin import BOS_ID, EOS_ID, UNK_ID, SimpleTokenizer
from kvroute.kvcore.tokenizer.hf import (
    BUILTIN,
    ChatTemplateError,
    Clock,
    HFTokenizerFiles,
    TokenizerError,
)

__all__ = [
    "BOS_ID",
    "BUILTIN",
    "EOS_ID",
    "UNK_ID",
    "ChatTemplateError",
    "Clock",
    "HFTokenizerFiles",
    "PromptBlocks",
    "SimpleTokenizer",
    "Tokenizer",
    "TokenizerError",
    "load_tokenizer",
    "prompt_blocks",
    "render_chat",
    "token_id_blocks",
]


class Tokenizer(Protocol):
    vocab_size: int

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, token_ids: Sequence[int]) -> str: ...

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool,
        continue_final_message: bool = False,
    ) -> str: ...


@dataclass(frozen=True, slots=True)
class PromptBlocks:
    """What routing needs from a prompt: its exact token count and full-block hashes; its ids
    too when asked (tokens sent once: ``routing.send_tokens``)."""

    tokens: int
    hashes: list[int]
    ids: Sequence[int] | None = None


def load_tokenizer(
    spec: str | None,
    vocab_size: int = 32000,
    clock: Clock | None = None,
    *,
    serial_batches: bool = False,
) -> Tokenizer:
    """``"builtin"`` or None (the emulated replica's own tokenizer), else HF tokenizer files
    (a directory or a ``tokenizer.json``) read exactly as vLLM reads them; ``clock`` is what
    a chat template's ``strftime_now`` reads (the caller's wall clock); ``serial_batches``:
    see ``HFTokenizerFiles``."""
    if spec is None or spec == BUILTIN:
        return SimpleTokenizer(vocab_size)
    return HFTokenizerFiles(spec, clock, serial_batches=serial_batches)


def prompt_blocks(
    tokenizer: Tokenizer,
    text: str,
    add_special_tokens: bool,
    block_size: int,
    extra_key: str | None,
    keep_ids: bool = False,
) -> PromptBlocks:
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return PromptBlocks(
        len(ids), block_hashes(ids, block_size, extra_key), ids if keep_ids else None
    )


def token_id_blocks(ids: Sequence[int], block_size: int, extra_key: str | None) -> PromptBlocks:
    return PromptBlocks(len(ids), block_hashes(ids, block_size, extra_key))


def render_chat(
    tok: Tokenizer,
    messages: list[dict[str, Any]],
    options: dict[str, Any],
    *,
    incremental: bool = True,
) -> str:
    """The chat template applied as vLLM applies it (raises ChatTemplateError); not
    ``incremental``: whole, whatever the tokenizer's render cache holds."""
    generation = bool(options.get("add_generation_prompt", True))
    continue_final = bool(options.get("continue_final_message", False))
    if isinstance(tok, HFTokenizerFiles):
        tools = options.get("tools")
        kwargs = options.get("chat_template_kwargs")
        return tok.apply_chat_template(
            messages,
            add_generation_prompt=generation,
            continue_final_message=continue_final,
            tools=tools if isinstance(tools, list) else None,
            template_kwargs=kwargs if isinstance(kwargs, dict) else None,
            documents=options.get("documents"),
            reasoning_effort=options.get("reasoning_effort"),
            incremental=incremental,
        )
    return tok.apply_chat_template(messages, generation, continue_final)
