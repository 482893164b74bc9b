"""Scheme names the exporter accepts, which of them need calibration data, and typo suggestions.

Owns only names: it must never import torch or compressed-tensors (the CLI validates a job before any heavy
import). `tests/test_calibrate.py::test_scheme_lists_match_the_libraries` checks these lists against
compressed-tensors' presets and llm-compressor's `requires_calibration_data`, so they cannot drift silently.
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

# Presets with static activation scales: they need calibration data ([calibration] in the job).
CALIBRATED: tuple[str, ...] = ("FP8", "NVFP4")

# Presets whose weights have one scale per tensor: AWQ's duo scaling (llm-compressor's default) refuses them.
PER_TENSOR_WEIGHTS: tuple[str, ...] = ("FP8",)

SUPPORTED = DATA_FREE + CALIBRATED

def closest(name: str) -> str | None:
    """The supported scheme name nearest to `name`, for a 'did you mean' hint."""
    upper = name.upper()
    if upper in SUPPORTED:
        return upper
    hits = difflib.get_close_matches(upper, SUPPORTED, n=1, cutoff=0.5)
    return hits[0] if hits else None


def needs_calibration(scheme: str, method: str) -> bool:
    """Whether an export with this scheme and method runs calibration data through the model."""
    return method != "rtn" or scheme in CALIBRATED


def check(name: str) -> str | None:
    """None when `name` is supported, else a one-line reason with a suggestion."""
    if name in SUPPORTED:
        return None
    hint = closest(name)
    did_you_mean = f"did you mean {hint!r}? " if hint else ""
    return f"unknown scheme {name!r}; {did_you_mean}supported: {', '.join(SUPPORTED)}"
