"""Prefix reuse, decomposed for one request: what was there, what routing took, what was used.

Three figures, in prompt tokens:

* ``available``: the longest cached prefix the index knew on any eligible replica (the ones
  the policy ranked) when the request was routed;
* ``captured``: what the index expected the chosen replica to hold;
* ``confirmed``: what the engine says it reused (vLLM's ``usage.prompt_tokens_details.
  cached_tokens``); None when the response did not say.

and where the rest of the prompt went, by cause:

* ``workload = prompt - available``: no replica had it (a cold prompt, its new turn's tail);
* ``routing = available - captured``: a replica had it but the request went elsewhere (load won,
  or a retry moved it);
* ``index = captured - confirmed``: the index expected it but the engine did not reuse it (a
  wrong prediction, or the blocks were evicted meanwhile); unknown when ``confirmed`` is.

A vLLM engine always computes a prompt's last token, so it reuses at most the full blocks before
it: available and captured are counted up to that, or a fully cached prompt that ends on a block
boundary would show one block of index loss that no index could avoid. The engine may confirm
more than was captured (the index had not heard of a block): that is reuse nobody lost, and the
index loss is then 0, not negative.

The live router, the endpoint picker and (later) the simulator call ``decompose`` with what their
dispatch carries; nothing here looks the index up again. Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from kvroute.policies import RouteRequest


@dataclass(frozen=True, slots=True)
class Reuse:
    """One request's prefix reuse (tokens); see the module doc for the definitions."""

    prompt: int
    available: int
    captured: int
    confirmed: int | None  # None: the engine did not report it

    @property
    def lost_workload(self) -> int:
        return self.prompt - self.available

    @property
    def lost_routing(self) -> int:
        return self.available - self.captured

    @property
    def lost_index(self) -> int | None:
        if self.confirmed is None:
            return None
        return max(0, self.captured - self.confirmed)


def available_tokens(request: RouteRequest, eligible: Iterable[str]) -> int:
    """The longest prefix the index matched on any ``eligible`` replica (at most the prompt),
    as the request's ``prefix_tokens`` had it when it was routed."""
    prefix = request.prefix_tokens
    if not prefix:
        return 0
    best = max((prefix.get(replica, 0) for replica in eligible), default=0)
    return min(best, request.prompt_tokens)


def reusable(tokens: int, prompt_tokens: int, block_tokens: int) -> int:
    """``tokens`` of cached prefix, at most the full blocks before the prompt's last token:
    what an engine that computes the last token (vLLM) can reuse of it."""
    if block_tokens <= 0:
        return max(0, min(tokens, prompt_tokens - 1))
    return max(0, min(tokens, (prompt_tokens - 1) // block_tokens * block_tokens))


def indexed(request: RouteRequest, block_tokens: int) -> bool:
    """Whether the router looked this prompt up in the index at all. Without block hashes (no
    tokenizer, or a policy that reads no prefixes) ``available`` is unknown, not 0: such a
    request is not decomposed. A prompt too short for one full block has nothing to reuse."""
    return bool(request.block_hashes) or request.prompt_tokens <= block_tokens


def decompose(
    request: RouteRequest,
    eligible: Iterable[str],
    captured: int,
    confirmed: int | None,
    block_tokens: int,
) -> Reuse | None:
    """``request`` as it was routed, over the ``eligible`` (ranked) replicas, dispatched where
    the index expected ``captured`` tokens, the engine confirming ``confirmed``; None when the
    request was not looked up in the index (see ``indexed``)."""
    if not indexed(request, block_tokens):
        return None
    prompt = request.prompt_tokens
    available = reusable(available_tokens(request, eligible), prompt, block_tokens)
    # The chosen replica may lie outside ``eligible`` (a retry the gateway made elsewhere):
    # what it held still counts as available there.
    captured = reusable(captured, prompt, block_tokens)
    return Reuse(prompt, max(available, captured), captured, confirmed)
