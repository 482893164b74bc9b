"""The installed library versions: the one place both sides ask `importlib.metadata` which version is installed.

The journal's fingerprint, the warm parent's code stamp, the worker's Hello reply, the calibration check and the
backend's refusal messages all read versions through `installed`. Owns that lookup only; it never imports the
libraries themselves (metadata only: no torch import, no CUDA).
"""
from __future__ import annotations

from collections.abc import Iterable
from importlib.metadata import PackageNotFoundError, version


def installed(packages: Iterable[str], missing: str | None = "missing") -> dict[str, str | None]:
    """{distribution: installed version}, in the order given; `missing` for one that is not installed."""
    out: dict[str, str | None] = {}
    for pkg in packages:
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = missing
    return out
