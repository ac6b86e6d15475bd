"""The drift canary's judgement (health/drift.py): majority, near-ties, quorum, fingerprint."""

from __future__ import annotations

from kvroute.health.canary import parse_completion
from kvroute.health.drift import (
    AGREE,
    DISAGREE,
    DRIFT,
    ERROR,
    NEAR_TIE,
    CanaryResult,
    Verdict,
    first_divergence,
    judge_prompt,
    worst,
)

P = "The capital of France is"
MIN_MARGIN = 0.5


def result(ids: list[int], margins: list[float] | None = None) -> CanaryResult:
    """Token ids with, per position, a top-1 of -0.1 and a top-2 ``margin`` below it (3 nats
    unless given)."""
    margins = margins or [3.0] * len(ids)
    return CanaryResult(tuple(ids), tuple((-0.1, -0.1 - m) for m in margins))


GOOD = [5, 6, 7, 8]


def test_first_divergence() -> None:
    assert first_divergence((1, 2, 3), (1, 2, 3)) is None
    assert first_divergence((1, 2, 3), (1, 9, 3)) == 1
    assert first_divergence((1, 2), (1, 2, 3)) == 2  # one ended early


def test_a_confident_minority_drifts_and_is_located() -> None:
    results = {"a": result(GOOD), "b": result(GOOD), "c": result([5, 6, 99, 100])}
    judged = judge_prompt(P, results, MIN_MARGIN)
    assert judged.verdicts["a"].result == AGREE
    assert judged.verdicts["b"].result == AGREE
    verdict = judged.verdicts["c"]
    assert verdict.result == DRIFT
    d = verdict.divergence
    assert d is not None
    assert (d.position, d.expected, d.got) == (2, (7, 8), (99, 100))
    assert d.margin == 3.0 and d.reference == "majority"
    assert judged.record is not None and judged.record.token_ids == tuple(GOOD)


def test_a_near_tie_on_either_side_is_reported_not_drift() -> None:
    # The majority was nearly tied where c flipped: batch nondeterminism, not drift.
    tied = result(GOOD, [3.0, 3.0, 0.1, 3.0])
    judged = judge_prompt(P, {"a": tied, "b": tied, "c": result([5, 6, 99, 8])}, MIN_MARGIN)
    assert judged.verdicts["c"].result == NEAR_TIE
    assert judged.verdicts["c"].divergence is not None
    # The replica itself was nearly tied there.
    flipped = result([5, 6, 99, 8], [3.0, 3.0, 0.2, 3.0])
    judged = judge_prompt(P, {"a": result(GOOD), "b": result(GOOD), "c": flipped}, MIN_MARGIN)
    assert judged.verdicts["c"].result == NEAR_TIE


def test_the_majority_margin_is_its_least_confident_member() -> None:
    # One majority replica was nearly tied at position 2: the reference counts as tied there.
    a = result(GOOD)
    b = result(GOOD, [3.0, 3.0, 0.05, 3.0])
    judged = judge_prompt(P, {"a": a, "b": b, "c": result([5, 6, 99, 8])}, MIN_MARGIN)
    assert judged.verdicts["c"].result == NEAR_TIE


def test_a_margin_exactly_at_the_threshold_counts_as_confident() -> None:
    at = result([5, 6, 99, 8], [3.0, 3.0, MIN_MARGIN, 3.0])
    judged = judge_prompt(P, {"a": result(GOOD), "b": result(GOOD), "c": at}, MIN_MARGIN)
    assert judged.verdicts["c"].result == DRIFT


def test_no_majority_means_no_drift() -> None:
    # Three replicas, three answers: nobody to believe.
    results = {"a": result(GOOD), "b": result([5, 1, 1, 1]), "c": result([5, 2, 2, 2])}
    judged = judge_prompt(P, results, MIN_MARGIN)
    assert {v.result for v in judged.verdicts.values()} == {DISAGREE}
    assert judged.record is None
    # Two against two.
    results = {"a": result(GOOD), "b": result(GOOD), "c": result([9, 9]), "d": result([9, 9])}
    judged = judge_prompt(P, results, MIN_MARGIN)
    assert DRIFT not in {v.result for v in judged.verdicts.values()}


def test_two_replicas_without_a_fingerprint_are_reported_never_quarantined() -> None:
    judged = judge_prompt(P, {"a": result(GOOD), "b": result([5, 6, 99, 8])}, MIN_MARGIN)
    assert judged.verdicts["a"].result == DISAGREE
    assert judged.verdicts["b"].result == DISAGREE
    divergence = judged.verdicts["b"].divergence
    assert divergence is not None and divergence.reference == "replica a"
    assert judged.verdicts["a"].divergence is not None
    # ... and a near-tie between two replicas is a near-tie.
    flipped = result([5, 6, 99, 8], [3.0, 3.0, 0.1, 3.0])
    judged = judge_prompt(P, {"a": result(GOOD), "b": flipped}, MIN_MARGIN)
    assert judged.verdicts["b"].result == NEAR_TIE


def test_two_replicas_agreeing_record_a_fingerprint_that_then_breaks_ties() -> None:
    judged = judge_prompt(P, {"a": result(GOOD), "b": result(GOOD)}, MIN_MARGIN)
    assert {v.result for v in judged.verdicts.values()} == {AGREE}
    fingerprint = judged.record
    assert fingerprint is not None
    # Later b restarts and answers otherwise, confidently: the fingerprint says a is right.
    judged = judge_prompt(
        P, {"a": result(GOOD), "b": result([5, 6, 99, 8])}, MIN_MARGIN, fingerprint
    )
    assert judged.verdicts["a"].result == AGREE
    assert judged.verdicts["b"].result == DRIFT
    divergence = judged.verdicts["b"].divergence
    assert divergence is not None and divergence.reference == "fingerprint"
    assert judged.record is None  # a split fleet records nothing


def test_the_fingerprint_never_outvotes_most_replicas() -> None:
    fingerprint = result(GOOD)
    results = {"a": result(GOOD), "b": result([1, 1, 1, 1]), "c": result([2, 2, 2, 2])}
    judged = judge_prompt(P, results, MIN_MARGIN, fingerprint)
    assert DRIFT not in {v.result for v in judged.verdicts.values()}


def test_a_fleet_wide_change_is_reported_and_recorded_not_quarantined() -> None:
    old = result(GOOD)
    new = result([1, 2, 3, 4])
    judged = judge_prompt(P, {"a": new, "b": new}, MIN_MARGIN, old)
    assert judged.fleet_changed
    assert {v.result for v in judged.verdicts.values()} == {AGREE}
    assert judged.record is not None and judged.record.token_ids == new.token_ids
    # A majority that moved, too.
    judged = judge_prompt(P, {"a": new, "b": new, "c": old}, MIN_MARGIN, old)
    assert judged.fleet_changed and judged.verdicts["c"].result == DRIFT


def test_a_single_replica_is_compared_with_nothing_but_the_fingerprint() -> None:
    judged = judge_prompt(P, {"a": result(GOOD)}, MIN_MARGIN)
    assert judged.verdicts["a"].result == AGREE and judged.record is not None


def test_failed_requests_are_errors_and_do_not_vote() -> None:
    results: dict[str, CanaryResult | str] = {
        "a": result(GOOD),
        "b": result(GOOD),
        "c": result([5, 6, 99, 8]),
        "d": "connection refused to d:1",
    }
    judged = judge_prompt(P, results, MIN_MARGIN)
    assert judged.verdicts["d"] == Verdict(ERROR, error="connection refused to d:1")
    assert judged.verdicts["c"].result == DRIFT  # 2 of 3 answers are still a majority
    # Two answers left of three replicas: no quorum.
    results["a"] = "timeout"
    judged = judge_prompt(P, results, MIN_MARGIN)
    assert judged.verdicts["c"].result == DISAGREE


def test_an_unmeasurable_margin_is_not_drift() -> None:
    short = CanaryResult((5, 6), ((-0.1, -3.0), (-0.1, -3.0)))  # ended early
    judged = judge_prompt(P, {"a": result(GOOD), "b": result(GOOD), "c": short}, MIN_MARGIN)
    assert judged.verdicts["c"].result == DISAGREE
    no_top2 = CanaryResult((5, 6, 99, 8), ((-0.1,),) * 4)
    judged = judge_prompt(P, {"a": result(GOOD), "b": result(GOOD), "c": no_top2}, MIN_MARGIN)
    assert judged.verdicts["c"].result == DISAGREE


def test_worst_verdict_over_prompts() -> None:
    assert worst([]).result == AGREE
    assert worst([Verdict(AGREE), Verdict(NEAR_TIE), Verdict(AGREE)]).result == NEAR_TIE
    assert worst([Verdict(DRIFT), Verdict(ERROR), Verdict(DISAGREE)]).result == DRIFT
    assert worst([Verdict(ERROR), Verdict(AGREE)]).result == ERROR


def test_fingerprint_round_trips() -> None:
    r = CanaryResult((1, 2), ((-0.1, -2.0), (-0.2, -0.3)), "text")
    assert CanaryResult.from_dict(r.to_dict()) == r


def test_parse_vllm_completion_with_token_id_spelling() -> None:
    body = {
        "choices": [
            {
                "text": "ab",
                "logprobs": {
                    "tokens": ["token_id:7", "token_id:9"],
                    "token_logprobs": [-0.1, -0.2],
                    "top_logprobs": [
                        {"token_id:7": -0.1, "token_id:3": -2.5},
                        {"token_id:4": -1.9, "token_id:9": -0.2, "token_id:1": -4.0},
                    ],
                    "text_offset": [0, 1],
                },
            }
        ]
    }
    parsed = parse_completion(body)
    assert parsed.token_ids == (7, 9)
    assert parsed.top_logprobs == ((-0.1, -2.5), (-0.2, -1.9))
    margin = parsed.margin(1)
    assert margin is not None and abs(margin - 1.7) < 1e-9
    body["choices"][0]["token_ids"] = [70, 90]  # vLLM's return_token_ids wins
    assert parse_completion(body).token_ids == (70, 90)
