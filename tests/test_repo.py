"""The repository keeps its promises to a new user."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).parent.parent


def _tests_section_command(page: Path) -> str:
    """The command in the bash block of a page's "## Tests" section."""
    section = page.read_text().split("## Tests", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S)
    assert command is not None, f"{page.name}'s Tests section has no command"
    return command.group(1).strip()


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    command = _tests_section_command(ROOT / "README.md")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command in ci_lines
    # ... as a new user runs it: in a virtual environment of its own, made fresh and activated
    # first, so that what the CI machine has installed outside it cannot make a test pass.
    at = ci_lines.index(command)
    before = "\n".join(ci_lines[:at])
    made = re.search(r'^python3 -m venv "\$(\w+)"$', before, re.M)
    assert made is not None, ".ci/run makes no virtual environment before the command"
    assert re.search(r"^\w+=\"\$\(mktemp -d\b", before, re.M), "the venv is not a fresh directory"
    assert f'source "${made.group(1)}/bin/activate"' in before.splitlines()


def test_the_contributing_page_shows_the_readme_test_command() -> None:
    """It says .ci/run runs exactly its line: the two pages must not drift apart (they did:
    the page lacked the docs build until 2026-12-07)."""
    assert _tests_section_command(ROOT / "docs" / "contributing.md") == _tests_section_command(
        ROOT / "README.md"
    )


# A home or work directory of some machine, or the folder beside the checkout on the dev machines:
# a user's clone has neither. (Written so that this file does not match itself.)
MACHINE_PATH = re.compile(r"(?<![\w.~-])/(?:work|root|home|Users)/|\.\./shared/")


def test_no_file_points_at_one_machines_paths() -> None:
    if (ROOT / ".git").exists():  # what would be committed: tracked, and untracked not ignored
        listed = subprocess.run(
            ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
            cwd=ROOT,
            capture_output=True,
            check=True,
        ).stdout.decode()
        names = list(filter(None, listed.split("\0")))
    else:  # an unpacked source archive: every file but build output
        skip = {"__pycache__", "build", "dist", "site", ".venv"}  # site: mkdocs build
        names = [
            p.relative_to(ROOT).as_posix()
            for p in ROOT.rglob("*")
            if not skip & set(p.relative_to(ROOT).parts) and ".egg-info" not in str(p)
        ]
    found = []
    for name in names:
        path = ROOT / name
        if path.is_symlink() or not path.is_file():  # kvroute/<name> links to the folders
            continue
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:  # binary test data
            continue
        found += [
            f"{name}:{number}: {line.strip()}"
            for number, line in enumerate(text.splitlines(), 1)
            if MACHINE_PATH.search(line)
        ]
    assert not found, "paths of one machine (use relative paths or --trace PATH):\n" + "\n".join(
        found
    )
