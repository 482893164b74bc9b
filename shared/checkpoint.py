"""A safetensors checkpoint folder as both sides read it without loading a tensor: a file's header, and which file
holds each tensor.

    header(path)        the 8-byte little-endian length, then the JSON header: (the header, those leading bytes)
    weight_map(folder)  tensor name -> file: the index's weight_map, else every *.safetensors file's own names
                        (files in name order, a later file winning a name both hold)

Owns reading these only; it never maps or loads tensor data and needs no dtype table (a header's data_offsets give
each tensor's exact span).
"""
from __future__ import annotations

import json
import os
import struct

from shared.layout import INDEX


def header(path: str) -> tuple[dict, bytes]:
    """The header of the safetensors file at `path`, and the bytes it takes at the file's start (its length field
    and the JSON): a tensor's data begins at len(those bytes) + its data_offsets[0]."""
    with open(path, "rb") as f:
        head = f.read(8)
        (n,) = struct.unpack("<Q", head)
        raw = f.read(n)
    return json.loads(raw), head + raw


def tensor_names(path: str) -> list[str]:
    """The names of the tensors in one safetensors file, in its header's order."""
    return [k for k in header(path)[0] if k != "__metadata__"]


def weight_map(folder: str) -> dict[str, str]:
    """Which file of `folder` holds each tensor (file names relative to the folder, as the index states them)."""
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            return dict(json.load(f)["weight_map"])
    out: dict[str, str] = {}
    for fn in sorted(os.listdir(folder)):
        if fn.endswith(".safetensors"):
            out.update(dict.fromkeys(tensor_names(os.path.join(folder, fn)), fn))
    return out
