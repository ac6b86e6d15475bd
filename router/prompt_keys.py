"""A request's prompt as the prefix index keys it: exact token count and block hashes.

Owns what that needs and may change while the router runs: the tokenizer (configured, or
discovered from a replica's model directory), the KV block size (configured, seen in KV
events, or scraped), and the LoRA adapters the replicas serve (vLLM keys an adapter's blocks
by its name).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from kvroute.kvcore.block_hashing import extra_key
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.tokenizer import (
    ChatTemplateError,
    PromptBlocks,
    TokenizerError,
    token_id_blocks,
)

from .config import RoutingConfig
from .openai_request import CHARS_PER_TOKEN, ParsedRequest
from .prompt_tokenizer import PromptTokenizer

log = logging.getLogger(__name__)

# Block size assumed until one is configured, seen in a KV event or scraped (vLLM's GPU default).
FALLBACK_BLOCK_SIZE = 16


def rendered_messages(parsed: ParsedRequest, tokenizer: PromptTokenizer) -> list[dict[str, Any]]:
    """The conversation the replica renders: an agent request's with its inline system
    messages merged into the first where this template requires system-first (as vLLM does)."""
    assert parsed.messages is not None
    if parsed.merged_messages is not None and tokenizer.needs_system_first():
        return parsed.merged_messages
    return parsed.messages


class PromptKeys:
    def __init__(
        self,
        routing: RoutingConfig,
        index: PrefixIndex,
        wanted: bool = True,
        for_token_path: bool = False,
    ) -> None:
        self._routing = routing
        self._index = index
        # Whether prompts are tokenized: when the policy reads prefixes, or (``tokens_wanted``)
        # when some replica takes token ids (routing.send_tokens).
        self.reads_prefixes = wanted
        self.wanted = wanted
        # A tokenizer (and its worker pool) is loaded only where prompts may be tokenized:
        # the policy reads prefixes, or routing.send_tokens may send them as token ids.
        self.loads_tokenizer = wanted or for_token_path
        # Checked at config load when given; a launched model directory may lack one.
        self.tokenizer = (
            self._load(routing.tokenizer) if routing.tokenizer and self.loads_tokenizer else None
        )
        self._scraped_block_size: int | None = None
        self._block_size_warned = False
        self.lora_adapters: frozenset[str] = frozenset()  # from the replicas' /v1/models

    def _load(self, spec: str) -> PromptTokenizer | None:
        routing = self._routing
        try:
            return PromptTokenizer(
                spec,
                routing.tokenize_inline_chars,
                routing.tokenizer_processes,
                routing.tokenizer_cache_mb << 20,
            )
        except TokenizerError as exc:
            log.warning("cannot use the tokenizer at %s (routing on load alone): %s", spec, exc)
            return None

    def start(self) -> None:
        if self.tokenizer is not None:
            self.tokenizer.start()

    @property
    def warming(self) -> bool:
        """Its tokenizer is still loading in the worker pool (PromptTokenizer.warming)."""
        return self.tokenizer is not None and self.tokenizer.warming

    def close(self) -> None:
        if self.tokenizer is not None:
            self.tokenizer.close()

    def discover(self, model_roots: Iterable[Iterable[str]]) -> None:
        """No tokenizer configured: use the model directory a replica on this host reports.

        vLLM lists the path it loaded the model from as ``root`` in /v1/models; when that is a
        local directory with tokenizer files, it is exactly the tokenizer the replica uses.
        """
        if (
            not self.loads_tokenizer
            or self.tokenizer is not None
            or self._routing.tokenizer is not None
        ):
            return
        for roots in model_roots:
            for root in roots:
                if not (Path(root) / "tokenizer.json").is_file():
                    continue
                self.tokenizer = self._load(root)
                if self.tokenizer is None:
                    continue
                self.tokenizer.start()
                log.info("tokenizing prompts with the tokenizer in %s (from /v1/models)", root)
                return

    def tokens_wanted(self, wanted: bool) -> None:
        """Some replica takes token ids (routing.send_tokens), or none does any more: with a
        policy that reads no prefixes, prompts are tokenized only while one does."""
        self.wanted = self.reads_prefixes or (wanted and self.loads_tokenizer)

    def block_size(self) -> int:
        """The replicas' KV block size: configured, else seen in events, else scraped."""
        return (
            self._routing.block_size
            or self._index.block_size
            or self._scraped_block_size
            or FALLBACK_BLOCK_SIZE
        )

    def known_block_size(self) -> int | None:
        """``block_size`` without the fallback: None until configured, seen or scraped."""
        return self._routing.block_size or self._index.block_size or self._scraped_block_size

    def on_scraped_block_size(self, replica_id: str, block_size: int) -> None:
        if self._scraped_block_size is None:
            self._scraped_block_size = block_size
        in_use = self.block_size()
        if block_size != in_use and not self._block_size_warned:
            self._block_size_warned = True
            log.warning(
                "replica %s reports KV block size %d but the router cuts prompts into blocks "
                "of %d: no prefix will match there (set routing.block_size to the replicas')",
                replica_id,
                block_size,
                in_use,
            )

    async def blocks(self, parsed: ParsedRequest, keep_ids: bool = False) -> PromptBlocks | None:
        """The prompt's exact token count and block hashes (and a chat's ids when
        ``keep_ids``); None when they cannot be known or the policy has no use for them."""
        if not self.wanted:
            return None
        block_size = self.block_size()
        # vLLM keys a LoRA request's blocks by the adapter's name (the request's model) and
        # the first block by the cache salt too; its KV events say so, the index keys alike.
        lora = parsed.model if parsed.model in self.lora_adapters else None
        key = extra_key(lora, parsed.cache_salt)
        if parsed.prompt_ids is not None:
            try:
                return token_id_blocks(parsed.prompt_ids, block_size, key)
            except OverflowError:
                return None  # ids beyond uint32: the replica will reject the request
        tokenizer = self.tokenizer
        if tokenizer is None:
            return None
        if parsed.messages is not None:
            try:
                return await tokenizer.chat_blocks(
                    rendered_messages(parsed, tokenizer),
                    parsed.chat_options or {},
                    parsed.prompt_tokens * CHARS_PER_TOKEN,
                    parsed.add_special_tokens,
                    block_size,
                    key,
                    keep_ids,
                )
            except ChatTemplateError as exc:
                # The replica renders the template too and gives the client its own error.
                log.debug("chat template: %s", exc)
                return None
        if parsed.prompt_text is None:
            return None
        return await tokenizer.blocks(
            parsed.prompt_text, parsed.add_special_tokens, block_size, key
        )
