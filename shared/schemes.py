"""Scheme names the exporter accepts, which of them need calibration data, and typo suggestions.

Owns only names: it must never import torch or compressed-tensors (the CLI validates a job before any heavy
import). `tests/test_schemes.py` checks these names against compressed-tensors' PRESET_SCHEMES and
llm-compressor's `requires_calibration_data`, so the lists cannot drift from the library silently.
"""
from __future__ import annotations

import difflib

# Data-free presets that are exported and tested end to end (output equal to llm-compressor's oneshot).
DATA_FREE: tuple[str, ...] = (
    "FP8_DYNAMIC",
    "FP8_BLOCK",
    "W8A8",
    "W8A16",
    "W4A16",
    "W4A16_ASYM",
    "NVFP4A16",
)

# Presets that need calibration data (activation scales): not supported yet.
CALIBRATED: tuple[str, ...] = ("FP8", "NVFP4")

SUPPORTED = DATA_FREE


def closest(name: str) -> str | None:
    """The supported scheme name nearest to `name`, for a 'did you mean' hint."""
    upper = name.upper()
    if upper in SUPPORTED:
        return upper
    hits = difflib.get_close_matches(upper, SUPPORTED + CALIBRATED, n=1, cutoff=0.5)
    return hits[0] if hits else None


def check(name: str) -> str | None:
    """None when `name` is supported, else a one-line reason with a suggestion."""
    if name in SUPPORTED:
        return None
    if name in CALIBRATED:
        return (f"scheme {name!r} needs calibration data, which this exporter does not support yet; "
                f"use one of {', '.join(SUPPORTED)}")
    hint = closest(name)
    did_you_mean = f"did you mean {hint!r}? " if hint else ""
    return f"unknown scheme {name!r}; {did_you_mean}supported: {', '.join(SUPPORTED)}"
