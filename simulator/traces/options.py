"""``key=value,key=value`` option lists (synthetic specs, per-format options), typed by their defaults."""

from __future__ import annotations

from collections.abc import Mapping

from .errors import TraceError

OptionValue = int | float | str


def parse_options(
    text: str, defaults: Mapping[str, OptionValue], *, where: str
) -> dict[str, OptionValue]:
    """``text`` parsed over ``defaults``: each value takes its default's type (int, float or str).

    Unknown keys, repeated keys and values of the wrong type raise a TraceError naming
    ``where`` and the key; an empty ``text`` returns the defaults.
    """
    values: dict[str, OptionValue] = dict(defaults)
    seen: set[str] = set()
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        key, sep, raw = item.partition("=")
        key, raw = key.strip(), raw.strip()
        if not sep or not key:
            raise TraceError(f"{where}: expected key=value, got {item!r}")
        if key not in defaults:
            known = ", ".join(sorted(defaults))
            raise TraceError(f"{where}: unknown option {key!r} (known: {known})")
        if key in seen:
            raise TraceError(f"{where}: option {key!r} given twice")
        seen.add(key)
        values[key] = _convert(raw, defaults[key], where=f"{where}: option {key!r}")
    return values


def _convert(raw: str, default: OptionValue, *, where: str) -> OptionValue:
    if isinstance(default, str):
        return raw
    try:
        if isinstance(default, int):
            return int(raw)
        return float(raw)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise TraceError(f"{where} must be {kind}, got {raw!r}") from None


def require(condition: bool, where: str, why: str) -> None:
    """Raise a TraceError ``where: why`` unless ``condition`` holds."""
    if not condition:
        raise TraceError(f"{where}: {why}")
