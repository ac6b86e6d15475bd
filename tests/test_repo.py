"""The repository keeps its promises to a new user."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def test_ci_runs_the_readme_test_command_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Tests", 1)[1]
    command = re.search(r"```bash\n(.+?)\n```", section, re.S)
    assert command is not None, "README's Tests section has no command"
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert command.group(1).strip() in ci_lines
