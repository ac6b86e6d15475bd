"""Benchmarks run by ``kvroute bench``."""
