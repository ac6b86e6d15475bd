"""``kvroute sweep``: a grid of simulated replays (policies x fleet sizes x KV capacities x
rates) run in parallel on Ray, collected into one table and one plot.

One Ray task per cell runs ``kvroute replay``'s own code in its worker process
(``simulator.sweep_cell``) and returns the files the replay wrote; this process (the driver)
writes them under --out. So workers on other machines (--ray-address) need kvroute installed,
but neither the trace (it travels as bytes) nor the output directory. Cells already done with
the same parameters are skipped: a sweep killed half-way and run again does the rest. Bad grid
input fails before Ray starts.
"""

from __future__ import annotations

import argparse
import hashlib
import logging
import os
import shlex
import sys
from collections import deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from kvroute.policies import POLICIES
from kvroute.policies.registry import policy_parameters
from kvroute.simulator.cli_replay import (
    EXIT_USAGE,
    UsageError,
    add_cell_args,
    check_replay,
    policy_name,
    policy_object,
    positive_float,
    positive_int,
    replay_args,
    wrapped,
)
from kvroute.simulator.sweep_cell import CellOutput, TraceFile, run_cell
from kvroute.simulator.sweep_grid import (
    Cell,
    cell_record,
    cell_status,
    grid,
    read_summary,
    write_cell,
)
from kvroute.simulator.sweep_table import markdown_table, table_rows, write_results

EXIT_CELLS_FAILED = 1
PRESET_CAPACITY = "preset"
# The local Ray's shared-memory store holds traces and cells' outputs (a few MB each).
LOCAL_OBJECT_STORE_BYTES = 512 * 1024 * 1024
# Sweep-only arguments, and the replay's that a cell sets itself.
_NOT_REPLAY = {"func", "out", "quiet", "command", "trace"}
# The sweep's own flags, each with a value (no abbreviations: the parser allows none).
_SWEEP_FLAGS = {
    "--out",
    "--policies",
    "--replicas",
    "--capacity",
    "--rate-scale",
    "--ray-address",
    "--max-parallel",
}


def _listed(item: Callable[[str], Any], text: str) -> list[Any]:
    values = [item(part.strip()) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"expected a comma-separated list, got {text!r}")
    return values


def _capacity(text: str) -> int | None:
    return None if text == PRESET_CAPACITY else positive_int(text)


def add_sweep_command(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "sweep",
        help="Replay a trace through a grid of simulated fleets in parallel on Ray; one table.",
        description=wrapped(
            "Run `kvroute replay` for every combination of --policies, --replicas, --capacity "
            "and --rate-scale, one Ray task per cell, in parallel: on a local Ray started for "
            "the sweep (one task per CPU), or on the cluster at --ray-address. Each cell's "
            "summary.json, cell.json (its parameters), report.md and plots land in "
            "DIR/<cell>/; then one table of all cells goes to stdout and DIR/sweep.md, every "
            "figure of every summary to DIR/sweep.csv, and hit rate and TTFT p99 against fleet "
            "size to DIR/sweep.png. Run again, it skips cells already done with the same "
            "parameters, so an interrupted sweep resumes. The other flags are the replay's, "
            "given to every cell."
        ),
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,  # so that _replay_command knows every flag by its full name
    )
    p.add_argument("--out", required=True, metavar="DIR", help="Where the cells and table go.")
    p.add_argument(
        "--policies",
        dest="grid_policies",
        required=True,
        type=lambda t: _listed(policy_name, t),
        metavar="P1,P2",
        help=f"Routing policies: {', '.join(sorted(POLICIES))}.",
    )
    p.add_argument(
        "--replicas",
        dest="grid_replicas",
        required=True,
        type=lambda t: _listed(positive_int, t),
        metavar="N1,N2",
        help="Fleet sizes, e.g. 8,64,200.",
    )
    p.add_argument(
        "--capacity",
        dest="grid_capacities",
        type=lambda t: _listed(_capacity, t),
        default=[None],
        metavar="T1,T2",
        help="KV cache per replica in tokens, or 'preset' for the preset's GPU memory less "
        "weights (default: preset).",
    )
    p.add_argument(
        "--rate-scale",
        dest="grid_rates",
        type=lambda t: _listed(positive_float, t),
        default=[1.0],
        metavar="K1,K2",
        help="Multiples of the trace's arrival rate, e.g. 1,10 (default 1).",
    )
    p.add_argument(
        "--ray-address",
        metavar="ADDR",
        help="An existing Ray cluster (as ray.init takes it: auto, HOST:PORT, ray://HOST:PORT); "
        "default: a local Ray for this sweep. Its nodes need kvroute installed.",
    )
    p.add_argument(
        "--max-parallel",
        type=positive_int,
        metavar="N",
        help="Cells running at once (default: the cluster's CPUs).",
    )
    add_cell_args(p)
    p.set_defaults(func=_cmd_sweep)


def _cmd_sweep(args: argparse.Namespace) -> int:
    try:
        return _sweep(args)
    except UsageError as exc:
        print(f"kvroute sweep: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _sweep(args: argparse.Namespace) -> int:
    try:
        cells = grid(args.grid_policies, args.grid_replicas, args.grid_capacities, args.grid_rates)
    except ValueError as exc:
        raise UsageError(str(exc)) from None
    trace = _trace_file(args)
    shared = _check(args, cells)
    cell_args = {
        cell: _cell_args(shared, args.trace, cell, _replay_command(sys.argv[1:], cell, args.out))
        for cell in cells
    }
    records = {
        cell: cell_record(cell, _parameters(cell_args[cell], shared, trace)) for cell in cells
    }
    status = {cell: cell_status(args.out, cell, records[cell]) for cell in cells}
    todo = [cell for cell in cells if status[cell] != "done"]
    _say_resume(args.out, cells, status)
    failed: dict[Cell, str] = {}
    for cell, output in _run_on_ray([(cell, cell_args[cell]) for cell in todo], trace, args):
        if output.error is not None:
            failed[cell] = output.error
            print(f"{cell.name}: FAILED: {output.error}", file=sys.stderr)
            continue
        write_cell(args.out, cell, records[cell], output.files)
        status[cell] = "done"
        summary = read_summary(args.out, cell)
        finished = sum(status[c] == "done" for c in todo) + len(failed)
        print(
            f"[{finished}/{len(todo)}] {cell.name}: hit rate "
            f"{_fmt(summary['prefix_hit_rate'], '.1%')}, TTFT p99 "
            f"{_fmt(summary['ttft_p99_s'], '.3f')} s, {summary['wall_s']:.1f} s",
            file=sys.stderr,
        )
    finished_cells = [cell for cell in cells if status[cell] == "done"]
    if finished_cells:
        rows = table_rows(finished_cells, [read_summary(args.out, c) for c in finished_cells])
        print(markdown_table(rows), end="")
        paths = write_results(args.out, rows)
        print(f"wrote {', '.join(paths)}", file=sys.stderr)
    if failed:
        print(
            f"{len(failed)} of {len(cells)} cells failed (run the sweep again to retry them): "
            + ", ".join(cell.name for cell in failed),
            file=sys.stderr,
        )
        return EXIT_CELLS_FAILED
    return 0


def _cells(n: int) -> str:
    return f"{n} cell" if n == 1 else f"{n} cells"


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _trace_file(args: argparse.Namespace) -> TraceFile | None:
    """The trace's bytes for the workers; None for a generator spec (--format synthetic)."""
    if (args.format or "").partition(":")[0].strip().lower() == "synthetic":
        return None
    try:
        with open(args.trace, "rb") as f:
            return TraceFile(os.path.basename(args.trace), f.read())
    except OSError as exc:
        raise UsageError(f"cannot read trace {args.trace}: {exc.strerror or exc}") from None


def _check(args: argparse.Namespace, cells: Sequence[Cell]) -> dict[str, Any]:
    """The replay arguments every cell shares, after checking the grid as a replay would:
    the trace, each KV capacity with the smallest fleet (--fail), each --policy-param
    taken by some policy of the grid (each cell gets those its policy takes)."""
    defaults = vars(replay_args())
    shared = {k: v for k, v in vars(args).items() if k in defaults and k not in _NOT_REPLAY}
    smallest = min(cell.replicas for cell in cells)
    for capacity in dict.fromkeys(cell.kv_capacity_tokens for cell in cells):
        check_replay(
            replay_args(
                **shared,
                trace=args.trace,
                replicas=smallest,
                kv_capacity_tokens=capacity,
                rate_scale=cells[0].rate_scale,
                compare=args.grid_policies,
            )
        )
    try:
        os.makedirs(args.out, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"cannot create {args.out}: {exc.strerror or exc}") from None
    return shared


def _cell_args(
    shared: dict[str, Any], trace: str, cell: Cell, command: str | None
) -> argparse.Namespace:
    accepted = policy_parameters(cell.policy)
    return replay_args(
        **{**shared, "policy_param": [(k, v) for k, v in shared["policy_param"] if k in accepted]},
        trace=trace,
        policy=cell.policy,
        replicas=cell.replicas,
        kv_capacity_tokens=cell.kv_capacity_tokens,
        rate_scale=cell.rate_scale,
        command=command,
    )


def _replay_command(argv: Sequence[str], cell: Cell, out: str) -> str | None:
    """The ``kvroute replay`` command that reproduces one cell (its report.md quotes it): the
    sweep's command line less the grid's and Ray's flags, plus the cell's. None when this
    process was not started as ``kvroute sweep`` (then the replay quotes its own argv)."""
    if "sweep" not in argv:
        return None
    at = list(argv).index("sweep")
    words = [*argv[:at], "replay"]
    rest = iter(argv[at + 1 :])
    for word in rest:
        flag, eq, _ = word.partition("=")
        if flag in _SWEEP_FLAGS:
            if not eq:
                next(rest, None)  # its value
            continue
        words.append(word)
    words += ["--policy", cell.policy, "--replicas", str(cell.replicas)]
    if cell.kv_capacity_tokens is not None:
        words += ["--kv-capacity-tokens", str(cell.kv_capacity_tokens)]
    if cell.rate_scale != 1:
        words += ["--rate-scale", f"{cell.rate_scale:g}"]
    words += ["--out", os.path.join(out, cell.name)]
    return "kvroute " + shlex.join(words)


def _parameters(
    args: argparse.Namespace, shared: Mapping[str, Any], trace: TraceFile | None
) -> dict[str, Any]:
    """What a cell's result depends on besides the cell: the flags the sweep passed on (its
    policy's --policy-param only; not --no-plots), the trace by content (a moved trace
    resumes, a changed one runs again), the policy's every parameter, defaults included (a
    default changed since is a change), and kvroute's version."""
    params = {k: getattr(args, k) for k in shared if k != "no_plots"}
    params["policy"] = policy_object(args.policy, args.seed, args.policy_param).describe()
    params["kvroute"] = _kvroute_version()
    params["trace"] = (
        {"name": trace.name, "sha256": hashlib.sha256(trace.data).hexdigest()}
        if trace is not None
        else args.trace
    )
    return params


def _kvroute_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvroute")
    except PackageNotFoundError:  # a source tree not installed
        return "unknown"


def _say_resume(out: str, cells: Sequence[Cell], status: Mapping[Cell, str]) -> None:
    done = sum(s == "done" for s in status.values())
    stale = sum(s == "stale" for s in status.values())
    if done == len(cells):
        print(f"all {len(cells)} cells already done in {out}: nothing to run", file=sys.stderr)
        return
    if done:
        print(
            f"resuming: {done} of {len(cells)} cells already done in {out} (skipped), "
            f"running the other {len(cells) - done}",
            file=sys.stderr,
        )
    if stale:
        print(
            f"{_cells(stale)} in {out} ran with other parameters: running again",
            file=sys.stderr,
        )


def _run_on_ray(
    work: Sequence[tuple[Cell, argparse.Namespace]],
    trace: TraceFile | None,
    args: argparse.Namespace,
) -> Iterator[tuple[Cell, CellOutput]]:
    """Run each cell as a Ray task, at most --max-parallel at once, yielding each as it
    finishes (so a sweep killed half-way has written what finished). Nothing to run: no Ray."""
    if not work:
        return
    try:
        import ray
    except ImportError:
        raise UsageError("kvroute sweep runs on Ray: pip install 'kvroute[sweep]'") from None
    started = not ray.is_initialized()  # a program that called ray.init keeps its Ray
    where = (args.ray_address or "a local Ray") if started else "this program's Ray"
    print(f"starting {_cells(len(work))} on {where}", file=sys.stderr)
    if started:
        if args.ray_address:
            ray.init(address=args.ray_address, logging_level=logging.ERROR, log_to_driver=False)
        else:
            ray.init(
                num_cpus=os.cpu_count(),
                include_dashboard=False,
                object_store_memory=LOCAL_OBJECT_STORE_BYTES,
                logging_level=logging.ERROR,
                log_to_driver=False,  # a cell's output comes back as its files
            )
    try:
        cpus = ray.cluster_resources().get("CPU", 1)  # type: ignore[no-untyped-call]
        limit = args.max_parallel or max(1, int(cpus))
        task = ray.remote(num_cpus=1)(run_cell)
        trace_ref = ray.put(trace)  # once, not once per task
        queue = deque(work)
        pending: dict[Any, Cell] = {}
        while queue or pending:
            while queue and len(pending) < limit:
                cell, cell_args = queue.popleft()
                pending[task.remote(cell_args, trace_ref)] = cell
            ready, _ = ray.wait(list(pending), num_returns=1)
            for ref in ready:
                cell = pending.pop(ref)
                try:
                    output = ray.get(ref)
                except ray.exceptions.RayError as exc:  # the worker crashed or raised
                    lines = str(exc).strip().splitlines()
                    output = CellOutput({}, lines[-1] if lines else type(exc).__name__)
                yield cell, output
    finally:
        if started:
            ray.shutdown()
