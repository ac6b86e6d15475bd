"""A rolling upgrade gated by the output-drift canary: a replacement whose answers differ from
the fleet's never enters rotation, stops the rollout and gives its slot back to the previous
arguments; one that answers alike goes on."""

from __future__ import annotations

from .helpers import wait_until
from .test_rollout import StartFleet, _rollout_done, start_fleet  # noqa: F401 (the fixture)

CANARY = {"enabled": True, "interval_s": 30.0, "max_tokens": 8}


async def test_a_replacement_that_drifts_fails_the_rollout_and_stays_out_of_rotation(
    start_fleet: StartFleet,  # noqa: F811
) -> None:
    fleet = await start_fleet(3, canary=CANARY)
    before = fleet.names()
    # The new arguments make the replica's greedy answers differ from token 2 on.
    await fleet.admin("POST", "/admin/rollout", {"args": ["--drift", "2"]}, expect=202)
    progress = await _rollout_done(fleet, 120)
    assert progress["state"] == "failed", progress
    assert "drift canary" in progress["error"], progress
    assert progress["replaced"] == []  # the first step failed: nothing more was replaced
    # The failed step costs no capacity: its replica runs the previous arguments again.
    assert "runs its previous arguments again" in progress["error"], progress
    assert sorted(fleet.names()) == sorted(before)
    await wait_until(
        lambda: all(h.state.healthy and not h.state.draining for h in fleet.router.replicas.values()),
        30, "every replica back in rotation",
    )  # fmt: skip
    assert all("--drift" not in r.process.argv for r in fleet.launched.replicas)
    # The fleet's own arguments change only when a rollout completes.
    assert "--drift" not in fleet.launched.spec.extra_args


async def test_a_replacement_that_answers_alike_passes_the_canary(
    start_fleet: StartFleet,  # noqa: F811
) -> None:
    fleet = await start_fleet(3, canary=CANARY)
    await fleet.admin("POST", "/admin/rollout", {"args": ["--max-num-seqs", "12"]}, expect=202)
    progress = await _rollout_done(fleet, 180)
    assert progress["state"] == "done", progress
    assert len(progress["replaced"]) == 3
    replicas = fleet.router.replicas.values()
    assert all(h.state.healthy and not h.state.draining for h in replicas)
    assert all(not h.drift.quarantined for h in replicas)
