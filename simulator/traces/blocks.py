"""Block ids for prompts built from named segments (synthetic traces, the Azure reuse model).

A prompt is a list of segments ``(content_key, tokens)``: equal keys mean equal text. Cut into
``block_tokens`` blocks, each block is named by its parent block's id and the pieces of segments
it covers, so two prompts get equal first k ids exactly when their first k blocks hold the same
text after the same prefix: the chained (radix path) semantics of ``TraceRequest.block_ids``.
A ``Prompt`` is immutable and ``extend`` returns a new one, so a conversation's next turn costs
only its new text, however long the history.
"""

from __future__ import annotations

from collections.abc import Hashable, Iterable
from dataclasses import dataclass

Segment = tuple[Hashable, int]  # (content key, token count)
_Piece = tuple[Hashable, int, int]  # (content key, first token, end token) inside one block


class BlockIdAllocator:
    """Assigns ids to block contents; the same content after the same parent keeps its id."""

    def __init__(self, block_tokens: int) -> None:
        self.block_tokens = block_tokens
        self._ids: dict[tuple[int, tuple[_Piece, ...]], int] = {}

    def empty(self) -> Prompt:
        return Prompt(self, (), (), 0)

    def block_ids(self, segments: Iterable[Segment]) -> tuple[int, ...]:
        """Ids of the blocks of the prompt made of ``segments`` (the last block may be partial)."""
        return self.empty().extend(segments).block_ids()

    def number(self, parent: int, pieces: tuple[_Piece, ...]) -> int:
        key = (parent, pieces)
        found = self._ids.get(key)
        if found is None:
            found = self._ids[key] = len(self._ids)
        return found


@dataclass(frozen=True, slots=True)
class Prompt:
    """A prompt so far: ids of its whole blocks and the pieces of its partial last block."""

    blocks: BlockIdAllocator
    whole: tuple[int, ...]
    partial: tuple[_Piece, ...]
    tokens: int

    def extend(self, segments: Iterable[Segment]) -> Prompt:
        """This prompt followed by ``segments``."""
        size = self.blocks.block_tokens
        whole, pieces, tokens = list(self.whole), list(self.partial), self.tokens
        for key, length in segments:
            start = 0
            while start < length:
                take = min(size - tokens % size, length - start)
                pieces.append((key, start, start + take))
                start += take
                tokens += take
                if tokens % size == 0:
                    whole.append(self.blocks.number(whole[-1] if whole else -1, tuple(pieces)))
                    pieces = []
        return Prompt(self.blocks, tuple(whole), tuple(pieces), tokens)

    def block_ids(self) -> tuple[int, ...]:
        if not self.partial:
            return self.whole
        parent = self.whole[-1] if self.whole else -1
        return (*self.whole, self.blocks.number(parent, self.partial))
