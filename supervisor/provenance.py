"""Provenance of the code that runs: the import packages `supervisor`, `child` and `shared` must be ours.

This distribution (layerwise-supervisor) installs three top-level import packages with common names. PyPI's
`supervisor` (supervisord) installs an import package named `supervisor` too: in one environment the two write
into the same folder and whichever was installed last owns `supervisor/__init__.py` (and `events.py`); a
`shared` or `child` package from another project, or an earlier PYTHONPATH entry, would be imported in place of
ours just as silently. Each of our packages' `__init__.py` carries the line `__distribution__ =
"layerwise-supervisor"`; `check()` verifies that the three packages Python resolves carry it and sit side by
side (the child, started as `python -P -m child`, resolves `child` and `shared` from the same path), and raises
NameClash naming the distribution that owns the impostor otherwise. The CLI and `supervisor.__getattr__` call it
before anything imports `shared` or starts a child.

Owns that check and the version line. Standard library only, and it never imports a package it checks (an
impostor's code must not run because we looked at it).
"""
from __future__ import annotations

import importlib.util
import os
import sys
from importlib import metadata

from supervisor.errors import NameClash

DISTRIBUTION = "layerwise-supervisor"
PACKAGES = ("supervisor", "child", "shared")
MARKER = f'__distribution__ = "{DISTRIBUTION}"'
# What the better-known owners of our package names are, for the error message.
_KNOWN = {"supervisor": "supervisord, the process control system"}


def _init_file(name: str) -> str | None:
    """The __init__.py that `import name` runs (or ran); None for a namespace package or nothing at all."""
    module = sys.modules.get(name)
    if module is not None:
        return getattr(module, "__file__", None)
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None and spec.has_location else None


def _carries_marker(init_file: str) -> bool:
    try:
        with open(init_file, encoding="utf-8", errors="replace") as f:
            return MARKER in f.read(4096)
    except OSError:
        return False


def _owners(name: str) -> list[str]:
    """'dist version (what it is)' for every installed distribution other than ours that provides `name`."""
    out = []
    for dist in sorted(set(metadata.packages_distributions().get(name, [])) - {DISTRIBUTION}):
        try:
            ver = metadata.version(dist)
        except metadata.PackageNotFoundError:
            ver = "?"
        known = _KNOWN.get(dist.lower())
        out.append(f"{dist} {ver}" + (f" ({known})" if known else ""))
    return out


def _not_ours(name: str, init_file: str | None) -> NameClash:
    where = os.path.dirname(init_file) if init_file else "a folder without __init__.py"
    owners = _owners(name)
    who = (f"it belongs to {', '.join(owners)}, which installs an import package of the same name" if owners else
           "another package of that name comes first on sys.path, or this install is damaged")
    return NameClash(f"the '{name}' package imported from {where} is not {DISTRIBUTION}'s: {who}; install "
                     f"{DISTRIBUTION} into a virtualenv of its own (README: Install)")


def root() -> str:
    """The folder holding our three packages; raises NameClash if any of them is not ours or not beside the others."""
    found = None
    for name in PACKAGES:
        init_file = _init_file(name)
        if init_file is None or not _carries_marker(init_file):
            raise _not_ours(name, init_file)
        here = os.path.dirname(os.path.dirname(os.path.realpath(init_file)))
        if found is None:
            found = here
        elif here != found:
            raise NameClash(f"'{name}' is imported from {here} but 'supervisor' from {found}: two copies of "
                            f"{DISTRIBUTION} are visible (check PYTHONPATH); keep one")
    return found


def check() -> None:
    """Raise NameClash unless `supervisor`, `child` and `shared` as Python resolves them are this distribution's."""
    root()


def version_line() -> str:
    """`supervisor --version`: our version, where the packages are imported from, the Python running them."""
    try:
        ver = metadata.version(DISTRIBUTION)
    except metadata.PackageNotFoundError:
        ver = "(not installed)"
    py = ".".join(map(str, sys.version_info[:3]))
    return f"supervisor {ver} ({DISTRIBUTION}; packages in {root()}; Python {py})"
