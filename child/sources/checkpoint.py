"""Sources of layer tensors: the `Source` interface, and the checkpoint on disk (mmap reads of one layer at a time).

The child asks a Source for "layer i's tensors" and never receives tensors over the pipe. `Checkpoint` is the
disk implementation; `child.sources.live.PoolSource` reads a live model's pool in shared memory, and
`child.sources.adapter.Merged` merges a LoRA adapter on top of either. `open_source` is the one place that picks them.
`meta` gives shapes and dtypes without data (what `supervisor plan` and the pre-export loader check work from).

Reads go through safetensors' `safe_open` (mmap), so several children share the page cache and nothing is ever
unpickled. Owns reading only: it never writes, and never resolves a file outside the checkpoint folder (the
supervisor refuses such sources before a child starts; this is the second line of defence).
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Collection
from typing import Protocol

from safetensors import safe_open

from shared import checkpoint, tensor_names
from shared.layout import SAFETENSORS_DTYPES


def _inside(folder: str, name: str) -> str:
    path = os.path.realpath(os.path.join(folder, name))
    if os.path.commonpath([path, os.path.realpath(folder)]) != os.path.realpath(folder):
        raise ValueError(f"checkpoint file {name!r} is outside the checkpoint folder")
    return path


class Source(Protocol):
    def layer_names(self, prefix: str, index: int) -> list[str]:
        """Names of layer `index`'s tensors (full checkpoint names, sorted)."""

    def non_layer_names(self, prefix: str, num_layers: int | None = None) -> list[str]:
        """Names of every tensor outside decoder layers 0..num_layers-1, sorted (layers past the count, such as
        DeepSeek's multi-token-prediction layer, belong here; None: outside every layer)."""

    def read(self, names: list[str]) -> dict:
        """name -> CPU tensor for `names`; callable from a prefetch thread."""

    def meta(self, names: list[str]) -> dict:
        """name -> meta tensor (the stored dtype and shape, no data) for `names`: read from headers only."""

    def nbytes(self, tensors: dict) -> int:
        """Bytes of `tensors` as read (for progress)."""

    def all_names(self) -> list[str]:
        """Every tensor name of the model, sorted (a torchao shard lists them all in its metadata)."""

    def digest(self, names: list[str]) -> str:
        """A hash of these tensors' source bytes when the source can change under the same fingerprint (a live
        model); "" when the fingerprint already covers them (files on disk)."""

    def trim(self) -> None:
        """Give back what the source keeps mapped for parts already exported (called after each part)."""


class NamedTensors:
    """What a Source derives from the names of its tensors (`_names`: any collection of every tensor name); reading
    the tensors is each Source's own."""

    _names: Collection[str]

    def layer_names(self, prefix: str, index: int) -> list[str]:
        return tensor_names.layer_names(self._names, prefix, index)

    def non_layer_names(self, prefix: str, num_layers: int | None = None) -> list[str]:
        return tensor_names.non_layer_names(self._names, prefix, num_layers)

    def all_names(self) -> list[str]:
        return sorted(self._names)

    def nbytes(self, tensors: dict) -> int:
        return sum(t.numel() * t.element_size() for t in tensors.values())


class Checkpoint(NamedTensors):
    def __init__(self, folder: str):
        self.folder = folder
        self.weight_map = checkpoint.weight_map(folder)  # tensor name -> file name
        self._names = self.weight_map.keys()

    def meta(self, names: list[str]) -> dict:
        import torch

        out = {}
        for fn, keys in sorted(self._by_file(names).items()):
            with safe_open(_inside(self.folder, fn), "pt", device="cpu") as f:
                for k in keys:
                    part = f.get_slice(k)
                    dtype = SAFETENSORS_DTYPES.get(part.get_dtype())
                    if dtype is None:
                        raise ValueError(f"tensor {k} has dtype {part.get_dtype()}, which this exporter cannot read")
                    out[k] = torch.empty(part.get_shape(), dtype=getattr(torch, dtype), device="meta")
        return out

    def _by_file(self, names: list[str]) -> dict[str, list[str]]:
        by_file: dict[str, list[str]] = defaultdict(list)
        for n in names:
            by_file[self.weight_map[n]].append(n)
        return by_file

    def read(self, names: list[str]):
        """name -> CPU tensor, as stored (dtype and shape of the checkpoint)."""
        out = {}
        for fn, keys in sorted(self._by_file(names).items()):
            with safe_open(_inside(self.folder, fn), "pt", device="cpu") as f:
                for k in keys:
                    out[k] = f.get_tensor(k)
        return out

    def digest(self, names: list[str]) -> str:
        return ""  # the fingerprint holds the files' sizes and mtimes

    def trim(self) -> None:
        pass  # each read opens and closes its files
