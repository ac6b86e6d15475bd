"""Replica health: circuit breakers (pure state machines), active probes and /metrics scrapes.

What "is this replica up, and how loaded does it say it is?" needs; async I/O, no routing.
"""
