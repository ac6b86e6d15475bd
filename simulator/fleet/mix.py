"""Mixed pools: replicas of several latency presets (GPU generations and shapes) in one fleet.

A mix is a list of (preset, count) pairs, e.g. ``llama-3.1-8b-h100*4,llama-3.1-8b-a100*4``.
A fleet of any size takes the mix's proportions (``apportion``), so ``kvroute plan --mix``
can size it: the kinds interleave, as a smooth weighted round robin deals them out.
"""

from __future__ import annotations

from collections import Counter

from kvroute.simulator.engine.latency import LatencyModel, latency_preset

Mix = tuple[tuple[str, int], ...]


def parse_mix(text: str) -> Mix:
    """``NAME*N,NAME*N,...`` (``*N`` may be left out for one; NAME may be ``NAME@SPEED``);
    a ValueError that says which part is wrong otherwise."""
    mix: list[tuple[str, int]] = []
    for part in text.split(","):
        name, star, count_text = part.strip().partition("*")
        try:
            count = int(count_text) if star else 1
        except ValueError:
            count = 0
        if count < 1:
            raise ValueError(f"{part.strip()!r}: expected PRESET*COUNT with COUNT >= 1")
        latency_preset(name)  # says which presets exist
        mix.append((name, count))
    if len({name for name, _ in mix}) != len(mix):
        raise ValueError(f"{text!r}: a preset appears twice (give its count once)")
    return tuple(mix)


def mix_size(mix: Mix) -> int:
    return sum(count for _, count in mix)


def apportion(mix: Mix, replicas: int) -> list[str]:
    """Each of ``replicas`` replicas' preset, in the mix's proportions (exact at the mix's own
    size and its multiples), the kinds interleaved."""
    total = mix_size(mix)
    current = [0] * len(mix)
    names: list[str] = []
    for _ in range(replicas):
        for k, (_, count) in enumerate(mix):
            current[k] += count
        best = max(range(len(mix)), key=lambda k: current[k])
        current[best] -= total
        names.append(mix[best][0])
    return names


def mix_models(mix: Mix, replicas: int) -> tuple[LatencyModel, ...]:
    return tuple(latency_preset(name) for name in apportion(mix, replicas))


def describe_counts(names: list[str]) -> str:
    """``4 x llama-3.1-8b-h100 + 4 x llama-3.1-8b-a100``, in order of first appearance."""
    counts = Counter(names)
    return " + ".join(f"{counts[name]} x {name}" for name in dict.fromkeys(names))
