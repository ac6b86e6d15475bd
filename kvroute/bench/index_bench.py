"""``kvroute bench index``: the prefix index's ingest rate, lookup latency and memory.

A synthetic fleet: every replica's cache is a set of chains (prompts) of ``--chain-blocks``
blocks, stored as BlockStored events of ``--event-blocks`` blocks each (each event chains to the
previous one's last engine hash, as vLLM's do). A ``--shared`` fraction of each replica's chains
comes from a pool of hot prompts held by ``--copies`` replicas on average (each copy stored to a
random depth), the rest are unique to the replica: the unique part is the memory worst case, the
hot part makes lookups match many replicas at once (copies of a hot prompt share their common
prefix, so ~20 replicas match a lookup). Lookups are 128-block prompts drawn from the hot pool
with a random divergence point, plus a few predicted entries, timed one by one; each prompt is
hashed (timed apart) right before its lookup, as the router does, and the garbage collector is
set as the router sets it (``runner.settle_heap``). ``--no-speedups`` runs hashing and the
lookup loops on the pure-Python twins of the C extension, to compare.

Memory is the RSS delta of this process (VmRSS, after ``gc.collect()``) from an empty index to
the full one, divided by (block, replica) entries; it includes allocator slack and dict
over-allocation, so it is what a router process really pays.
"""

from __future__ import annotations

import argparse
import gc
import platform
import random
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from kvroute.bench.argtypes import add_report_args, fraction, non_negative_int, positive_int
from kvroute.bench.harness import procs
from kvroute.bench.harness.host import (
    cpu_count,
    load_average,
    python_version,
    record,
    utc_stamp,
)
from kvroute.bench.harness.report import reproduce_command, section_head
from kvroute.kvcore import block_hashing, index_snapshot, packed_runs
from kvroute.kvcore.block_hashing import block_hashes
from kvroute.kvcore.prefix_index import PrefixIndex
from kvroute.kvcore.stats import percentile

TARGET_BYTES_PER_ENTRY = 2**30 / 5_000_000
TARGET_P99_US = 50.0
TARGET_INGEST = 500_000.0


@dataclass
class Options:
    entries: int = 5_000_000
    replicas: int = 200
    block_size: int = 16
    chain_blocks: int = 128
    event_blocks: int = 16
    shared: float = 0.5
    copies: int = 20
    lookups: int = 2000
    predictions: int = 500
    seed: int = 0
    speedups: bool = True
    output_md: str = "BENCHMARKS.md"
    record: bool = True


@dataclass
class Result:
    entries: int
    blocks: int
    replicas: int
    ingest_blocks: int
    ingest_s: float
    build_s: float
    rss_delta: int
    lookup_us: list[float]
    hash_us: list[float]
    # A CPU-only loop of about FLOOR_US (a lookup's usual median), timed right after each
    # lookup: what the machine alone does to a p99 (shared VMs stretch a few percent of any
    # short task several times over).
    floor_us: list[float]
    matched_replicas: float
    speedups: bool  # whether hashing and the lookup loops ran in C (kvcore/_speedups.c)
    # Warm start (kvcore/index_snapshot.py): the whole index taken and encoded, its size, and
    # decoded and restored into an empty index (what a starting router does).
    snapshot_s: float = 0.0
    snapshot_bytes: int = 0
    restore_s: float = 0.0
    restored_equal: bool = False  # the restored index matched every lookup prompt alike

    @property
    def ingest_rate(self) -> float:
        return self.ingest_blocks / self.ingest_s if self.ingest_s else 0.0

    @property
    def bytes_per_entry(self) -> float:
        return self.rss_delta / self.entries if self.entries else 0.0


def rss_bytes() -> int:
    """Current resident set size (VmRSS) of this process."""
    current = procs.rss_bytes("self")
    if current:
        return current
    import resource  # fallback: peak, not current (macOS reports bytes, Linux KiB)

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


def chain_tokens(doc: int, blocks: int, block_size: int) -> list[int]:
    """Distinct, cheap token ids for document ``doc`` (equal docs give equal tokens)."""
    start = (doc * 7919 * blocks * block_size) % (2**32 - blocks * block_size)
    return list(range(start, start + blocks * block_size))


@contextmanager
def router_heap() -> Iterator[None]:
    """The garbage collector as the router runs it (``runner.settle_heap``: the startup heap
    frozen, young collections every 20,000 allocations), put back as it was afterwards, so the
    bench pays the collections the router pays: the index fills after the freeze, as there.
    """
    from kvroute.router.runner import settle_heap  # the server's imports: only when a bench runs

    thresholds = gc.get_threshold()
    settle_heap()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)


FLOOR_US = 10.0


def spin(n: int) -> int:
    """Pure CPU work, no memory beyond a few ints: the noise floor's task."""
    total = 0
    for k in range(n):
        total += k
    return total


def calibrate_spin(target_us: float) -> int:
    """Loop iterations that take about ``target_us`` here (the median of 200 timings)."""
    n = 1000
    times = []
    for _ in range(200):
        t0 = time.perf_counter()
        spin(n)
        times.append(time.perf_counter() - t0)
    per_iteration_us = sorted(times)[100] * 1e6 / n
    return max(1, round(target_us / per_iteration_us))


def run_index_bench(options: Options) -> Result:
    speedups = block_hashing.use_speedups(options.speedups)
    if packed_runs.use_speedups(options.speedups) != speedups:  # pragma: no cover
        raise RuntimeError("kvroute.kvcore._speedups is half built")
    try:
        with router_heap():
            return _run_index_bench(options, speedups)
    finally:  # back to the default
        block_hashing.use_speedups()
        packed_runs.use_speedups()


def _run_index_bench(options: Options, speedups: bool) -> Result:
    o = options
    rng = random.Random(o.seed)
    getrandbits = rng.getrandbits
    per_replica = max(1, o.entries // o.replicas)
    chains_per_replica = max(1, -(-per_replica // o.chain_blocks))
    hot_docs = max(1, round(chains_per_replica * o.replicas * o.shared / max(1, o.copies)))
    names = [f"replica-{i:03d}" for i in range(o.replicas)]
    bs, eb = o.block_size, o.event_blocks

    gc.collect()
    idx = PrefixIndex()
    rss0 = rss_bytes()
    build_start = time.perf_counter()
    ingest_s = 0.0
    ingested = 0
    unique_doc = hot_docs  # unique documents are numbered after the hot ones
    perf = time.perf_counter
    for r, name in enumerate(names):
        stored = 0
        # Hot prompts without replacement: a replica does not cache the same prompt twice.
        hot = rng.sample(range(hot_docs), min(hot_docs, round(chains_per_replica * o.shared)))
        while stored < per_replica:
            if hot and rng.random() < o.shared:
                doc = hot.pop()
                depth = eb * rng.randint(max(1, o.chain_blocks // (2 * eb)), o.chain_blocks // eb)
            else:
                doc = unique_doc
                unique_doc += 1
                depth = o.chain_blocks
            depth = max(1, min(depth, per_replica - stored))
            # The doc's full chain cut at the depth: copies stored to different depths share
            # their common prefix, as the hot pool is meant to.
            tokens = chain_tokens(doc, o.chain_blocks, bs)[: depth * bs]
            engine = [getrandbits(64) for _ in range(depth)]
            events = [
                (engine[i : i + eb], engine[i - 1] if i else None, tokens[i * bs : (i + eb) * bs])
                for i in range(0, depth, eb)
            ]
            apply = idx.apply_stored
            added = 0
            t0 = perf()
            for hashes, parent, toks in events:
                added += apply(name, hashes, parent, toks, bs)
            ingest_s += perf() - t0
            ingested += depth
            stored += depth
        if r % 20 == 19:
            print(f"  {r + 1}/{o.replicas} replicas, {idx.entries:,} entries", file=sys.stderr)
    build_s = time.perf_counter() - build_start
    gc.collect()
    rss_delta = rss_bytes() - rss0

    # Lookups: hot prompts with a random divergence point, some predicted on random replicas.
    # Each is hashed and matched (each timed) in turn, as the router hashes a request's token
    # ids and matches the hashes.
    prompts: list[list[int]] = []
    for _ in range(min(o.lookups, 2000)):
        doc = rng.randrange(hot_docs)
        tokens = chain_tokens(doc, o.chain_blocks, bs)
        cut = rng.randint(o.chain_blocks // 2, o.chain_blocks)
        tokens[cut * bs :] = [getrandbits(31) for _ in range((o.chain_blocks - cut) * bs)]
        prompts.append(tokens)
    for tokens in prompts[: o.predictions]:
        hashes = block_hashes(tokens, bs)
        idx.predict(names[rng.randrange(o.replicas)], hashes, now=0.0, ttl_s=1e9)
    hash_us: list[float] = []
    lookup_us: list[float] = []
    floor_us: list[float] = []
    matched = 0
    match = idx.match
    spins = calibrate_spin(FLOOR_US)
    for i in range(o.lookups):
        tokens = prompts[i % len(prompts)]
        t0 = perf()
        hashes = block_hashes(tokens, bs)
        t1 = perf()
        m = match(hashes, 1.0)
        t2 = perf()
        spin(spins)
        t3 = perf()
        hash_us.append((t1 - t0) * 1e6)
        lookup_us.append((t2 - t1) * 1e6)
        floor_us.append((t3 - t2) * 1e6)
        matched += len(m)
    snapshot_s, snapshot_bytes, restore_s, equal = _snapshot_round_trip(idx, prompts, bs)
    return Result(
        entries=idx.entries,
        blocks=idx.blocks,
        replicas=o.replicas,
        ingest_blocks=ingested,
        ingest_s=ingest_s,
        build_s=build_s,
        rss_delta=rss_delta,
        lookup_us=lookup_us,
        hash_us=hash_us,
        floor_us=floor_us,
        matched_replicas=matched / max(1, o.lookups),
        speedups=speedups,
        snapshot_s=snapshot_s,
        snapshot_bytes=snapshot_bytes,
        restore_s=restore_s,
        restored_equal=equal,
    )


def _snapshot_round_trip(
    idx: PrefixIndex, prompts: list[list[int]], bs: int
) -> tuple[float, int, float, bool]:
    """Seconds to take and encode ``idx``'s snapshot, its bytes, seconds to decode and restore
    it into an empty index, and whether that index matches the prompts as ``idx`` does."""
    identity = index_snapshot.Identity(pool="bench", block_size=bs)
    t0 = time.perf_counter()
    snap = index_snapshot.take(idx, identity, [], idx.replicas, 0.0)
    data = index_snapshot.encode(snap)
    t1 = time.perf_counter()
    del snap
    fresh = PrefixIndex()
    index_snapshot.restore(index_snapshot.decode(data), fresh, idx.replicas)
    t2 = time.perf_counter()
    # Predictions are not in a snapshot: what events confirmed is compared.
    equal = all(
        {r: m.confirmed for r, m in fresh.match(h, 1.0).items()}
        == {r: m.confirmed for r, m in idx.match(h, 1.0).items() if m.confirmed}
        for h in (block_hashes(p, bs) for p in prompts[:200])
    )
    return t1 - t0, len(data), t2 - t1, equal


def format_table(res: Result, o: Options) -> str:
    def ok(good: bool) -> str:
        return "yes" if good else "NO"

    # Each the sample nearest the percentile's position (kvcore.stats, method "nearest").
    p50, p99 = (percentile(res.lookup_us, q, method="nearest") for q in (0.5, 0.99))
    floor50, floor99 = (percentile(res.floor_us, q, method="nearest") for q in (0.5, 0.99))
    hash50, hash99 = (percentile(res.hash_us, q, method="nearest") for q in (0.5, 0.99))
    rows = [
        ("(block, replica) entries", f"{res.entries:,}", "5,000,000", ""),
        ("distinct blocks / replicas", f"{res.blocks:,} / {res.replicas}", "- / 200", ""),
        (
            "ingest, blocks/s (incl. router hashing)",
            f"{res.ingest_rate:,.0f}",
            f">= {TARGET_INGEST:,.0f}",
            ok(res.ingest_rate >= TARGET_INGEST),
        ),
        (
            f"lookup p50 / p99 / max, us ({o.chain_blocks}-block prompt)",
            f"{p50:.1f} / {p99:.1f} / {max(res.lookup_us, default=0):.1f}",
            f"p99 <= {TARGET_P99_US:.0f}",
            ok(p99 <= TARGET_P99_US),
        ),
        (
            f"noise floor p50 / p99, us (a ~{FLOOR_US:.0f} us CPU-only loop after each lookup)",
            f"{floor50:.1f} / {floor99:.1f}",
            "",
            "",
        ),
        ("replicas matched per lookup (mean)", f"{res.matched_replicas:.1f}", "", ""),
        (
            f"hashing p50 / p99, us ({o.chain_blocks}-block prompt)",
            f"{hash50:.1f} / {hash99:.1f}",
            "",
            "",
        ),
        (
            "memory, bytes per entry (RSS delta)",
            f"{res.bytes_per_entry:.0f} ({res.rss_delta / 2**20:,.0f} MiB)",
            f"<= {TARGET_BYTES_PER_ENTRY:.0f} (1 GiB / 5M)",
            ok(res.bytes_per_entry <= TARGET_BYTES_PER_ENTRY),
        ),
        ("build time, s", f"{res.build_s:.1f}", "", ""),
        (
            "warm start: snapshot taken and encoded, s / MiB",
            f"{res.snapshot_s:.2f} / {res.snapshot_bytes / 2**20:.0f}",
            "",
            "",
        ),
        (
            "warm start: decoded and restored, s (matches equal)",
            f"{res.restore_s:.2f} ({ok(res.restored_equal)})",
            "",
            "",
        ),
    ]
    lines = ["| metric | value | target | met |", "|---|--:|--:|:-:|"]
    lines += [f"| {a} | {b} | {c} | {d} |" for a, b, c, d in rows]
    return "\n".join(lines)


def markdown_section(command: str, date: str, res: Result, o: Options) -> str:
    lines = [
        *section_head(f"Prefix index, {date}", command),
        f"- machine: {cpu_count()} CPUs (nproc), {platform.machine()}, load average before run "
        f"{load_average()}; {python_version()}",
        f"- workload: {o.replicas} replicas, {o.entries:,} target entries, chains of "
        f"{o.chain_blocks} blocks of {o.block_size} tokens in BlockStored events of "
        f"{o.event_blocks} blocks; {o.shared:.0%} of chains from a hot pool held by ~{o.copies} "
        f"replicas each (random depth), the rest unique; {o.lookups} timed lookups of hot "
        f"prompts with a random divergence point, {o.predictions} of them also predicted",
        "- memory is the process RSS delta (VmRSS after gc.collect()) from empty to full index",
        "- hashing and lookup loops: "
        + (
            "C (kvcore/_speedups.c)"
            if res.speedups
            else "pure Python" + ("" if o.speedups else " (--no-speedups)")
        ),
        "- garbage collector as the router sets it (runner.settle_heap); each lookup's prompt is "
        "hashed right before it is looked up, as in the router",
        "",
        format_table(res, o),
    ]
    return "\n".join(lines) + "\n"


# --- CLI ---------------------------------------------------------------------------------------


def add_index_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``kvroute bench index`` on the ``bench`` subparsers."""
    d = Options()
    p = sub.add_parser(
        "index",
        help="Prefix index: ingest rate, lookup p50/p99 and memory per entry (in process).",
        description=(
            "Fill a PrefixIndex with synthetic BlockStored events for N replicas up to a number "
            "of (block, replica) entries, then time lookups of 128-block prompts. Prints ingest "
            "blocks/s (router hashing included), lookup p50/p99, hashing time and memory per "
            "entry (process RSS delta), with the command that reproduces it, and appends the "
            "table to BENCHMARKS.md. The full size (5M entries, 200 replicas) needs ~1.5 GiB "
            "and a minute or so; --entries 200000 runs in seconds."
        ),
    )
    p.add_argument(
        "--entries",
        type=positive_int,
        default=d.entries,
        help=f"(block, replica) entries to index (default {d.entries:,}).",
    )
    p.add_argument(
        "--replicas", type=positive_int, default=d.replicas, help="Replicas (default 200)."
    )
    p.add_argument(
        "--block-size", type=positive_int, default=d.block_size, help="Tokens per block (16)."
    )
    p.add_argument(
        "--chain-blocks",
        type=positive_int,
        default=d.chain_blocks,
        help="Blocks per prompt, stored and looked up (default 128).",
    )
    p.add_argument(
        "--event-blocks",
        type=positive_int,
        default=d.event_blocks,
        help="Blocks per BlockStored event (default 16).",
    )
    p.add_argument(
        "--shared",
        type=fraction,
        default=d.shared,
        help="Fraction of each replica's chains taken from the hot pool (default 0.5).",
    )
    p.add_argument(
        "--copies",
        type=positive_int,
        default=d.copies,
        help="Mean replicas holding each hot prompt (default 20).",
    )
    p.add_argument(
        "--lookups", type=positive_int, default=d.lookups, help="Timed lookups (default 2000)."
    )
    p.add_argument(
        "--predictions",
        type=non_negative_int,
        default=d.predictions,
        help="Lookup prompts also predicted on a random replica (default 500).",
    )
    p.add_argument("--seed", type=int, default=d.seed, help="Random seed (default 0).")
    p.add_argument(
        "--no-speedups",
        action="store_true",
        help="Hash and look up on the pure-Python twins of the C extension kvcore/_speedups.c "
        "(what runs where it is not built), to compare.",
    )
    add_report_args(p)
    p.set_defaults(func=_cmd_index)


def _cmd_index(args: argparse.Namespace) -> int:
    options = Options(
        entries=args.entries,
        replicas=args.replicas,
        block_size=args.block_size,
        chain_blocks=args.chain_blocks,
        event_blocks=args.event_blocks,
        shared=args.shared,
        copies=args.copies,
        lookups=args.lookups,
        predictions=args.predictions,
        seed=args.seed,
        speedups=not args.no_speedups,
        output_md=args.output_md,
        record=not args.no_record,
    )
    return run_and_report(options, sys.argv[1:])


def run_and_report(options: Options, argv: Sequence[str]) -> int:
    # The command as given, --output-md included (this bench has always quoted it whole).
    command = reproduce_command(argv, "index", report_args=True)
    date = utc_stamp()
    print(f"$ {command}", file=sys.stderr)
    res = run_index_bench(options)
    section = markdown_section(command, date, res, options)
    print(section)
    if options.record:
        record(Path(options.output_md), section)
        print(f"appended to {options.output_md}", file=sys.stderr)
    return 0
