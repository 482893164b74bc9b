"""The source checkpoint as the supervisor sees it: validation before any work, and its layer count.

Refuses, with a one-line message and before anything is written: a missing folder, no config.json, no
safetensors (a pickle-only checkpoint is never unpickled), an index whose weight_map points outside the folder,
a safetensors header that does not match its file, no decoder layers or an incomplete set of them (found from the
tensor names: shared/tensor_names.py). Remote code (`auto_map`) is never run unless the job allows it; without
that the child exports the checkpoint by tensor names (child/backends/name_only.py), as it does an unknown architecture.
Reads headers only (safetensors' own parser, via numpy): it never loads a tensor and never imports torch.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

from safetensors import SafetensorError, safe_open

from shared import tensor_names
from shared.layout import INDEX
from supervisor.errors import SourceError

PICKLE_WEIGHTS = ("pytorch_model.bin", "pytorch_model.bin.index.json", "model.pt", "consolidated.pth")


@dataclass
class SourceInfo:
    path: str  # absolute
    config: dict
    files: list[str]  # safetensors file names
    tensor_names: list[str]
    layer_prefix: str
    num_layers: int
    nbytes: int
    stats: list[tuple[str, int, int]] = field(default_factory=list)  # (name, size, mtime_ns), for the fingerprint


def inspect(path: str) -> SourceInfo:
    folder = os.path.abspath(os.path.expanduser(path))
    if not os.path.isdir(folder):
        raise SourceError(f"source {path!r} is not a folder; set [source] path to a Hugging Face checkpoint folder")
    config = _read_config(folder)
    files = _weight_files(folder, path)
    names: list[str] = []
    nbytes = 0
    for fn in files:
        keys, size = _check_header(folder, fn)
        names += keys
        nbytes += size
    prefix, num_layers = find_layers(names, config, path)
    stats = []
    for fn in sorted(set(files) | {"config.json"} | ({INDEX} if os.path.exists(os.path.join(folder, INDEX)) else set())):
        st = os.stat(os.path.join(folder, fn))
        stats.append((fn, st.st_size, st.st_mtime_ns))
    return SourceInfo(folder, config, files, names, prefix, num_layers, nbytes, stats)


def _read_config(folder: str) -> dict:
    return read_json_object(os.path.join(folder, "config.json"), "source config.json",
                            f"source {folder!r} has no config.json; point [source] path at a Hugging Face checkpoint")


def read_json_object(path: str, what: str, missing: str) -> dict:
    """The JSON object in path; SourceError(missing) if there is no such file, else "{what} cannot be read / is not
    a JSON object"."""
    if not os.path.isfile(path):
        raise SourceError(missing)
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError) as exc:
        raise SourceError(f"{what} cannot be read: {exc}") from exc
    if not isinstance(data, dict):
        raise SourceError(f"{what} is not a JSON object")
    return data


def _weight_files(folder: str, shown: str) -> list[str]:
    index = os.path.join(folder, INDEX)
    if os.path.exists(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise SourceError(f"{INDEX} in {shown!r} is not a valid index: {exc}") from exc
        for fn in files:
            if not isinstance(fn, str) or os.path.isabs(fn) or os.path.normpath(fn) != os.path.basename(fn):
                raise SourceError(f"{INDEX} in {shown!r} points outside the source folder ({fn!r}); refusing it")
            if not os.path.isfile(os.path.join(folder, fn)):
                raise SourceError(f"{INDEX} in {shown!r} names {fn!r}, which does not exist")
        return files
    files = sorted(fn for fn in os.listdir(folder) if fn.endswith(".safetensors"))
    if not files:
        pickled = [fn for fn in os.listdir(folder) if fn in PICKLE_WEIGHTS or fn.endswith((".bin", ".pt", ".pth"))]
        if pickled:
            raise SourceError(f"source {shown!r} has only pickle weights ({pickled[0]}), which are never loaded; "
                              "convert it to safetensors first")
        raise SourceError(f"source {shown!r} has no *.safetensors files")
    return files


def _check_header(folder: str, fn: str) -> tuple[list[str], int]:
    path = os.path.join(folder, fn)
    if os.path.islink(path) and os.path.commonpath([os.path.realpath(path), os.path.realpath(folder)]) \
            != os.path.realpath(folder):
        raise SourceError(f"source file {fn!r} is a link outside the source folder; refusing it")
    try:
        with safe_open(path, "np") as f:  # safetensors validates offsets against the file size
            keys = list(f.keys())
    except (SafetensorError, OSError, ValueError) as exc:
        raise SourceError(f"source file {fn!r} is not a valid safetensors file ({exc})") from exc
    return keys, os.path.getsize(path)


def find_layers(names: list[str], config: dict, shown: str) -> tuple[str, int]:
    found = tensor_names.find_layers(names, config)
    if found is None:
        raise SourceError(f"source {shown!r} has no decoder layers (no tensor name holds a layer number, like "
                          "'model.layers.N.*' or 'transformer.h.N.*')")
    prefix, indices = found
    expected = tensor_names.config_layers(config)
    count = len(indices) if expected is None else expected
    missing = sorted(set(range(count)) - indices)
    if missing:
        said = f"config says {expected} layers but " if expected is not None else ""
        raise SourceError(f"source {shown!r} {said}the weights hold layers {min(indices)}..{max(indices)} of "
                          f"{prefix!r} (missing e.g. {missing[:5]}); the checkpoint is incomplete")
    # layers past the stated count (DeepSeek's multi-token-prediction layer) travel with the non-layer part
    return prefix, count
