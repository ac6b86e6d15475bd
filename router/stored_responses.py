"""Which replica holds each Responses answer, for a follow-up's ``previous_response_id``.

vLLM keeps a stored response, and the conversation behind it, in the memory of the server that
answered (with ``VLLM_ENABLE_RESPONSES_API_STORE=1``): a follow-up that names it must go there.
The router learns the id from each answer it relays (the body's, or the stream's first event)
and keeps the newest ones, bounded; the follow-up's route is pinned by ``RequestPipeline``.
"""

from __future__ import annotations

from collections import OrderedDict

# About 100 bytes each: 100,000 answers' ids is ~10 MB.
DEFAULT_MAX_ENTRIES = 100_000


class StoredResponses:
    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._replicas: OrderedDict[str, str] = OrderedDict()

    def __len__(self) -> int:
        return len(self._replicas)

    def remember(self, response_id: str, replica: str) -> None:
        replicas = self._replicas
        replicas[response_id] = replica
        replicas.move_to_end(response_id)
        if len(replicas) > self.max_entries:
            replicas.popitem(last=False)

    def lost(self, response_id: str) -> None:
        """This answer was finished on another replica (a resumed stream): no replica stores
        it; ``replica_of`` says "" for it."""
        self.remember(response_id, "")

    def replica_of(self, response_id: str) -> str | None:
        """The replica that answered with this id ("" when none stores it), while remembered
        (a lookup keeps it); None when not remembered."""
        replica = self._replicas.get(response_id)
        if replica is not None:
            self._replicas.move_to_end(response_id)
        return replica
