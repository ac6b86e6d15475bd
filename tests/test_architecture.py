"""The rings keep their promises (docs/architecture.md); import-linter checks the imports."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent
SOURCE_DIRS = ("kvcore", "policies", "health", "backends", "router", "simulator")

# Load accounting and predictions: only the dispatch ledger changes them. The prefix index
# defines predict/unpredict; its bench fills an index directly to time it.
BOOKKEEPING = re.compile(
    r"\b(in_flight|in_flight_tokens|prefilling|prefill_tokens)\s*[-+]=|\.(un)?predict\("
)
ALLOWED = {"kvcore/ledger.py", "kvroute/bench/index_bench.py"}


def sources() -> list[Path]:
    files = [p for d in SOURCE_DIRS for p in (ROOT / d).rglob("*.py")]
    files += [p for p in (ROOT / "kvroute").rglob("*.py") if not p.is_symlink()]
    return [p for p in files if not any(part.is_symlink() for part in p.parents)]


def test_only_the_dispatch_ledger_keeps_load_and_predictions() -> None:
    found = []
    for path in sources():
        name = path.relative_to(ROOT).as_posix()
        if name in ALLOWED or name.startswith("kvroute/router/"):
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if BOOKKEEPING.search(code) and "def " not in code:
                found.append(f"{name}:{number}: {line.strip()}")
    assert not found, "load or predictions changed outside kvcore/ledger.py:\n" + "\n".join(found)


def test_the_bookkeeping_check_sees_the_ledger() -> None:
    ledger = (ROOT / "kvcore" / "ledger.py").read_text()
    assert len(BOOKKEEPING.findall(ledger)) >= 10  # the pattern matches what it looks for


def test_every_package_says_its_job() -> None:
    for init in ROOT.glob("*/__init__.py"):
        if init.parent.name == "tests":
            continue
        text = init.read_text()
        assert text.startswith('"""') and len(text.split('"""')[1].strip()) > 40, init
