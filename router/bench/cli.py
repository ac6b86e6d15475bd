"""``kvroute bench ...`` subcommands."""

from __future__ import annotations

import argparse


def add_bench(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("bench", help="Benchmarks (results go to BENCHMARKS.md).")
    bench_sub = p.add_subparsers(title="benchmarks", metavar="BENCHMARK", required=True)
    del bench_sub
