"""supervisor.provenance: a `supervisor`, `shared` or `child` package that is not ours is refused in one line.

Each case runs the real console script in a subprocess whose PYTHONPATH puts an impostor in front of this
checkout, laid out the way pip leaves it: a package folder plus the owning distribution's .dist-info.
"""
import os
import shutil
import subprocess
import sys

import pytest

from tests.scenarios import cli

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CANARY = "raise SystemExit('impostor code ran')\n"


def _dist_info(site, name: str, version: str, package: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"  # as pip names it
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (info / "top_level.txt").write_text(f"{package}\n")
    (info / "RECORD").write_text(f"{package}/__init__.py,,\n")


def _run(site, *args, code: str | None = None):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), REPO])}
    cmd = [sys.executable, "-c", code] if code else [cli.SUPERVISOR, *args]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=60, cwd=site)


def test_supervisord_over_our_package_is_named(tmp_path):
    """PyPI's supervisor (supervisord) installed over ours replaces supervisor/__init__.py: one line, exit 2."""
    shutil.copytree(os.path.join(REPO, "supervisor"), tmp_path / "supervisor",
                    ignore=shutil.ignore_patterns("__pycache__"))
    (tmp_path / "supervisor" / "__init__.py").write_text("# this is a package\n")  # supervisord 4.2.5's
    _dist_info(tmp_path, "supervisor", "4.2.5", "supervisor")
    for args in (["--version"], ["status", str(tmp_path)]):
        proc = _run(tmp_path, *args)
        assert proc.returncode == 2, proc.stderr
        assert proc.stdout == "" and len(proc.stderr.splitlines()) == 1, proc.stderr
        assert proc.stderr.startswith(f"error: the 'supervisor' package imported from {tmp_path / 'supervisor'} "
                                      "is not layerwise-supervisor's: it belongs to supervisor 4.2.5 (supervisord")


@pytest.mark.parametrize("package", ["shared", "child"])
def test_a_foreign_sibling_package_is_refused_before_it_runs(tmp_path, package):
    """Another project's `shared` or `child` first on the path: named in one line, and its code never runs."""
    (tmp_path / package).mkdir()
    (tmp_path / package / "__init__.py").write_text(CANARY)
    _dist_info(tmp_path, f"other-{package}", "1.0", package)
    proc = _run(tmp_path, "status", str(tmp_path))
    assert proc.returncode == 2 and "impostor" not in proc.stderr, proc.stderr
    assert proc.stderr == (f"error: the '{package}' package imported from {tmp_path / package} is not "
                           f"layerwise-supervisor's: it belongs to other-{package} 1.0, which installs an import "
                           "package of the same name; install layerwise-supervisor into a virtualenv of its own "
                           "(README: Install)\n")
    api = _run(tmp_path, code="import supervisor\ntry:\n    supervisor.Supervisor\nexcept ImportError as e:\n"
                              "    print(type(e).__name__, e)")
    assert api.stdout.startswith(f"NameClash the '{package}' package imported from"), api.stdout + api.stderr


def test_our_own_packages_pass(tmp_path):
    """This checkout's three packages are accepted: --version names the folder they come from."""
    proc = _run(tmp_path, "--version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("supervisor ") and f"packages in {os.path.realpath(REPO)};" in proc.stdout
