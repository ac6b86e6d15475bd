"""Endpoint addresses as the gateway writes them: ``ip:port``, IPv6 bracketed."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit


def address(host: str, port: int) -> str:
    """``10.0.0.5:8000`` or ``[fd00::5]:8000`` (Envoy's override_host format)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def address_of_url(url: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or ""
    return address(host, parts.port or (443 if parts.scheme == "https" else 80))


def url_of_address(addr: str) -> str:
    return f"http://{addr}"


def host_of(addr: str) -> str:
    """The address without its port (a bare IP in a subset hint matches any port)."""
    if addr.startswith("["):
        return addr[1 : addr.index("]")]
    return addr.rpartition(":")[0] if addr.count(":") == 1 else addr


def parse_subset(entries: Iterable[str]) -> frozenset[str]:
    """A subset hint's entries: a list of ``ip:port`` or bare IPs, or comma-joined strings."""
    out: set[str] = set()
    for entry in entries:
        out.update(part.strip() for part in entry.split(",") if part.strip())
    return frozenset(out)


def in_subset(addr: str, subset: frozenset[str]) -> bool:
    if addr in subset:
        return True
    host = host_of(addr)
    return host in subset or f"[{host}]" in subset
