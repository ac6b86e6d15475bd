"""Benchmarks run by ``kvroute bench``: router overhead, prefix routing, index, tokenization,
replay speed and simulator fidelity; each prints its command and appends to BENCHMARKS.md.
"""
