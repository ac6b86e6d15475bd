"""Judging the output-drift canary: which replica's greedy output left the fleet's (pure).

Every replica serving a model answers the same fixed prompts greedily (temperature 0) with the
top-2 logprobs of each output token. Replicas with the same weights and engine give the same
token ids, except where two candidate tokens are nearly tied: there a different batch or kernel
order can flip the choice (batch nondeterminism is real, on GPUs especially). So a replica is
judged at its first output position that differs from the reference continuation:

- ``drift``: the reference and the replica were both confident there (top-1 minus top-2
  logprob at least ``min_margin`` nats, for each side): the replica computes something else.
- ``near_tie``: either side was nearly tied there: reported, never quarantined.
- ``disagree``: there is no reference to judge by (too few replicas and no fingerprint, no
  majority) or the margin cannot be measured; reported, never quarantined.
- ``agree``: the same token ids throughout.

The reference is the majority continuation when at least ``quorum`` replicas answered and more
than half of them agree; else the fleet's recorded fingerprint, when as many replicas match it
as do not; else nothing. Either way only a minority is ever judged ``drift``. No I/O, no clock:
the runner (``canary.py``) fetches, this module decides.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

# Verdicts, best first; a replica's verdict over several prompts is its worst one.
AGREE = "agree"
NEAR_TIE = "near_tie"
DISAGREE = "disagree"
DRIFT = "drift"
ERROR = "error"  # the canary request itself failed: says nothing about the output
VERDICTS = (AGREE, NEAR_TIE, ERROR, DISAGREE, DRIFT)
_RANK = {v: i for i, v in enumerate(VERDICTS)}

# Fewer answering replicas than this have no majority to speak of (2 replicas that disagree
# cannot say which one is wrong).
QUORUM = 3


@dataclass(frozen=True, slots=True)
class CanaryResult:
    """One replica's greedy continuation of one prompt."""

    token_ids: tuple[int, ...]
    # Per output position, the top logprobs there, highest first (up to 2 are used).
    top_logprobs: tuple[tuple[float, ...], ...]
    text: str = ""

    def margin(self, position: int) -> float | None:
        """Top-1 minus top-2 logprob at ``position`` (nats); None when not measurable."""
        if position >= len(self.top_logprobs):
            return None
        top = self.top_logprobs[position]
        return top[0] - top[1] if len(top) >= 2 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "token_ids": list(self.token_ids),
            "top_logprobs": [list(top) for top in self.top_logprobs],
            "text": self.text,
        }

    @staticmethod
    def from_dict(raw: Mapping[str, Any]) -> CanaryResult:
        return CanaryResult(
            tuple(int(t) for t in raw["token_ids"]),
            tuple(tuple(float(x) for x in top) for top in raw["top_logprobs"]),
            str(raw.get("text", "")),
        )


@dataclass(frozen=True, slots=True)
class Divergence:
    """Where a replica's continuation first left the reference, and how sure both sides were."""

    prompt: str
    position: int  # 0-based output position of the first differing token
    expected: tuple[int, ...]  # the reference's token ids from ``position`` on
    got: tuple[int, ...]  # the replica's token ids from ``position`` on
    expected_margin: float | None  # the reference's top-1 minus top-2 logprob there (nats)
    got_margin: float | None  # the replica's own
    reference: str  # "majority", "fingerprint", or "replica NAME" (no reference: a peer)
    expected_text: str = ""  # both whole continuations, for people
    got_text: str = ""

    @property
    def margin(self) -> float | None:
        """The smaller of the two margins: a flip is a near-tie when either side was close."""
        if self.expected_margin is None or self.got_margin is None:
            return None
        return min(self.expected_margin, self.got_margin)

    def to_dict(self) -> dict[str, Any]:
        margin = self.margin
        return {
            "prompt": self.prompt,
            "position": self.position,
            "expected": list(self.expected),
            "got": list(self.got),
            "margin": None if margin is None else round(margin, 4),
            "expected_margin": _round(self.expected_margin),
            "got_margin": _round(self.got_margin),
            "reference": self.reference,
            "expected_text": self.expected_text,
            "got_text": self.got_text,
        }


@dataclass(frozen=True, slots=True)
class Verdict:
    result: str  # one of VERDICTS
    divergence: Divergence | None = None  # None for agree and error
    error: str | None = None  # why the canary request failed (ERROR only)


@dataclass(frozen=True, slots=True)
class PromptJudgement:
    """One prompt over one model's replicas."""

    verdicts: dict[str, Verdict]
    # What the fleet answered when it had an answer (majority or unanimous): the fingerprint
    # to record; None when the replicas gave no such answer.
    record: CanaryResult | None
    # The fleet as a whole (its majority, or all of it) now answers differently from the
    # recorded fingerprint: a deploy changed the output everywhere. Reported; nobody can be
    # quarantined for it.
    fleet_changed: bool


def first_divergence(a: tuple[int, ...], b: tuple[int, ...]) -> int | None:
    """The first position where ``a`` and ``b`` differ (a length difference counts); None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare(
    prompt: str,
    reference: CanaryResult,
    got: CanaryResult,
    min_margin: float,
    reference_name: str,
    *,
    may_drift: bool = True,
) -> Verdict:
    """``got`` judged against ``reference``. ``may_drift`` False: a confident difference is only
    ``disagree`` (the reference is one peer, not the fleet)."""
    position = first_divergence(reference.token_ids, got.token_ids)
    if position is None:
        return Verdict(AGREE)
    divergence = Divergence(
        prompt=prompt,
        position=position,
        expected=reference.token_ids[position:],
        got=got.token_ids[position:],
        expected_margin=reference.margin(position),
        got_margin=got.margin(position),
        reference=reference_name,
        expected_text=reference.text,
        got_text=got.text,
    )
    margin = divergence.margin
    if margin is None:
        # A continuation that ended early or came without logprobs: nothing to weigh.
        return Verdict(DISAGREE, divergence)
    if margin < min_margin:
        return Verdict(NEAR_TIE, divergence)
    return Verdict(DRIFT if may_drift else DISAGREE, divergence)


def judge_prompt(
    prompt: str,
    results: Mapping[str, CanaryResult | str],
    min_margin: float,
    fingerprint: CanaryResult | None = None,
    quorum: int = QUORUM,
) -> PromptJudgement:
    """Verdicts for one prompt; ``results`` maps each replica to its answer or, as a string,
    why its request failed."""
    verdicts: dict[str, Verdict] = {
        name: Verdict(ERROR, error=r) for name, r in results.items() if isinstance(r, str)
    }
    answered = {name: r for name, r in sorted(results.items()) if isinstance(r, CanaryResult)}
    if not answered:
        return PromptJudgement(verdicts, None, False)
    counts = Counter(r.token_ids for r in answered.values())
    # Most common first; among equals the one a sorted replica name gave first (deterministic).
    top, top_count = counts.most_common(1)[0]
    n = len(answered)
    holders = [name for name, r in answered.items() if r.token_ids == top]

    if top_count == n or (n >= quorum and 2 * top_count > n):
        # Unanimous, or a true majority: it is the fleet's answer (and its new fingerprint).
        reference = _merged(answered[h] for h in holders)
        changed = fingerprint is not None and fingerprint.token_ids != top
        source = "majority"
        for name, result in answered.items():
            verdicts[name] = compare(prompt, reference, result, min_margin, source)
        return PromptJudgement(verdicts, reference, changed)

    if fingerprint is not None:
        matching = [name for name, r in answered.items() if r.token_ids == fingerprint.token_ids]
        if matching and 2 * len(matching) >= n:
            # No majority of its own (two replicas, or a split): the recorded fingerprint
            # breaks the tie, as long as it is not against most of the replicas.
            for name, result in answered.items():
                verdicts[name] = compare(prompt, fingerprint, result, min_margin, "fingerprint")
            return PromptJudgement(verdicts, None, False)

    # Nobody to believe: each replica is compared with the most common answer (its holders with
    # the first replica that differs), reported, never quarantined.
    dissenter = next(name for name in answered if answered[name].token_ids != top)
    pivot = answered[holders[0]]
    for name, result in answered.items():
        if result.token_ids == top:
            other, other_name = answered[dissenter], dissenter
        else:
            other, other_name = pivot, holders[0]
        verdicts[name] = compare(
            prompt, other, result, min_margin, f"replica {other_name}", may_drift=False
        )
    return PromptJudgement(verdicts, None, False)


def worst(verdicts: list[Verdict]) -> Verdict:
    """A replica's verdict over several prompts: its worst, the first of equals."""
    if not verdicts:
        return Verdict(AGREE)
    return max(verdicts, key=lambda v: _RANK[v.result])


def _merged(results: Iterable[CanaryResult]) -> CanaryResult:
    """Identical continuations as one, each position's logprobs the least confident holder's
    (so a near-tie anywhere among the majority counts as one; unmeasured counts as least)."""
    holders = list(results)
    first = holders[0]
    if len(holders) == 1:
        return first
    tops = []
    for position in range(len(first.token_ids)):
        least = min(holders, key=lambda r: _or_minus_inf(r.margin(position)))
        tops.append(least.top_logprobs[position] if position < len(least.top_logprobs) else ())
    return CanaryResult(first.token_ids, tuple(tops), first.text)


def _or_minus_inf(value: float | None) -> float:
    return float("-inf") if value is None else value


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


@dataclass(slots=True)
class DriftState:
    """What the canary knows of one replica (``ReplicaHandle.drift``): read by /admin/replicas
    and /status. Times are Unix seconds."""

    # Out of rotation for confident drift (``ReplicaState.quarantined`` is the routing flag).
    quarantined: bool = False
    quarantined_at: float | None = None
    # The divergence that quarantined it; kept while it is quarantined.
    quarantine: Divergence | None = None
    # The last round that reached the replica: its verdict (None before any), when, and its
    # first divergence (drift, near_tie or disagree; None when it agreed or failed).
    last_result: str | None = None
    checked_at: float | None = None
    last_divergence: Divergence | None = None
    last_error: str | None = None  # why its last canary request failed (result "error")

    def to_dict(self) -> dict[str, Any]:
        return {
            "quarantined": self.quarantined,
            "quarantined_at": self.quarantined_at,
            "quarantine": self.quarantine.to_dict() if self.quarantine else None,
            "last_result": self.last_result,
            "checked_at": self.checked_at,
            "last_divergence": self.last_divergence.to_dict() if self.last_divergence else None,
            "last_error": self.last_error,
        }
