"""kvroute: a cache-aware router for fleets of vLLM replicas (this package is the outer ring).

Installed, every package of the repository lives under this one namespace: ``kvroute.kvcore``
and ``kvroute.policies`` (pure), ``kvroute.health``, ``kvroute.backends``, ``kvroute.router``
and ``kvroute.simulator`` (the middle ring), and here the tools that may import all of them and
that nothing imports: the CLI, bench, drill, demo and the load generator. docs/architecture.md.
"""
