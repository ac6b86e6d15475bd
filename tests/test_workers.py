"""Several router processes on one port: shared load, whole-router metrics, clean shutdown."""

from __future__ import annotations

import multiprocessing

from policies import ReplicaState
from router.loadboard import LoadBoard


def _add_load(board: LoadBoard) -> None:
    board.add(worker=1, replica=0, requests=3, tokens=300)
    board.add(worker=1, replica=1, requests=1, tokens=10)


def test_load_board_sums_every_workers_row_across_processes() -> None:
    board = LoadBoard(workers=2, replicas=2)
    board.add(worker=0, replica=0, requests=2, tokens=50)
    child = multiprocessing.get_context("fork").Process(target=_add_load, args=(board,))
    child.start()
    child.join()
    states = [ReplicaState("a"), ReplicaState("b")]
    board.totals_into(states)
    assert (states[0].in_flight, states[0].in_flight_tokens) == (5, 350)
    assert (states[1].in_flight, states[1].in_flight_tokens) == (1, 10)
    board.clear_row(1)
    board.totals_into(states)
    assert (states[0].in_flight, states[1].in_flight) == (2, 0)
