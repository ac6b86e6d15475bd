"""``pip install kvroute`` installs one top-level package, ``kvroute``, and it works from a wheel.

The required folders (router/, policies/, health/, backends/, simulator/) are other projects'
names on PyPI: installed at the top level they would shadow or be shadowed by those.
"""

from __future__ import annotations

import site as sitelib
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            out,
            ROOT,
        ],
        check=True,
        capture_output=True,
    )
    (built,) = out.glob("kvroute-*.whl")
    return built


def test_the_wheel_holds_only_the_kvroute_namespace(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {name.split("/", 1)[0] for name in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"kvroute"}
    for package in ("router", "policies", "health", "backends", "simulator", "kvcore"):
        assert f"kvroute/{package}/__init__.py" in names
    assert any(n.startswith("kvroute/kvcore/_speedups") and n.endswith(".so") for n in names)
    assert "kvroute/router/status_page.html" in names  # package data: the /status page
    assert len(names) == len(set(names))


def test_the_installed_wheel_imports_and_runs(wheel: Path, tmp_path: Path) -> None:
    # The venv's own site-packages for kvroute, first on the path, so the wheel's copy is the one
    # imported; the dependencies from this interpreter's site-packages, listed after it in a
    # .pth file. Not system_site_packages: inside a venv (a user's, or .ci/run's) that gives the
    # base interpreter's packages, not the ones the project was installed with. Paths a .pth adds
    # have their own .pth files left unread, so this checkout's editable install stays out.
    env = tmp_path / "env"
    venv.create(env, system_site_packages=False, with_pip=False)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
    )
    before = set(p.name for p in site.iterdir())
    subprocess.run(
        [sys.executable, "-m", "pip", "--python", python, "install", "--no-deps", wheel],
        check=True,
        capture_output=True,
    )
    added = {p.name for p in site.iterdir()} - before
    assert {a for a in added if not a.endswith(".dist-info")} == {"kvroute"}
    # Only now: pip, run by the venv's python, would see this checkout's kvroute through it.
    (site / "dependencies.pth").write_text("".join(f"{p}\n" for p in sitelib.getsitepackages()))
    code = (
        "import kvroute, kvroute.router.server, kvroute.simulator.fleet, kvroute.cli;"
        "from kvroute.router.status import page_html; assert b'kvroute status' in page_html();"
        "from kvroute.kvcore import block_hashing; print(kvroute.__file__, block_hashing.use_speedups())"
    )
    # Run away from the checkout: ``python -c`` puts the working directory first on the path.
    shown = subprocess.run(
        [python, "-c", code], check=True, capture_output=True, text=True, cwd=tmp_path
    )
    where, hashing = shown.stdout.split()
    assert Path(where).is_relative_to(site)
    assert hashing == "True"  # the C extension was built into the wheel and loads
    help_text = subprocess.run(
        [env / "bin" / "kvroute", "--help"],
        check=True,
        capture_output=True,
        text=True,
        cwd=tmp_path,
    ).stdout
    assert "serve" in help_text and "replay" in help_text
