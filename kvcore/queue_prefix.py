"""What a queued request's prompt finds in a prefix index: the admission queue's locality (tokens
one replica holds) and its cost by program (tokens no replica holds). Pure; the router's admission
(router/admission.py) and the simulated one (simulator/fleet/admission.py) both read it."""

from __future__ import annotations

from collections.abc import Sequence

from .fair_queue import Ticket
from .prefix_index import PrefixIndex


def held_on(index: PrefixIndex, replica: str, ticket: Ticket, now: float, tokens: int) -> int:
    """Leading prompt tokens ``replica`` holds of ``ticket`` (0 for one not tokenized yet)."""
    if not ticket.block_hashes:
        return 0
    match = index.match(ticket.block_hashes, now).get(replica)
    return match.blocks * tokens if match is not None else 0


def uncached(pools: Sequence[tuple[PrefixIndex, int]], ticket: Ticket, now: float) -> int:
    """Prompt tokens of ``ticket`` that no replica holds, by each (index, block tokens); all of
    them for one not tokenized yet."""
    if not ticket.block_hashes:
        return ticket.input_tokens
    held = 0
    for index, tokens in pools:
        found = index.match(ticket.block_hashes, now)
        if found:
            held = max(held, max(m.blocks for m in found.values()) * tokens)
    return max(0, ticket.input_tokens - held)
