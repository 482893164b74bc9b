"""A `[source] adapter` folder as the supervisor sees it: refused before any work when it cannot be merged exactly.

Checks, reading headers only (no torch, no peft): adapter_config.json is a plain LoRA (shared/lora.py's rules:
no DoRA, lora_bias, modules_to_save, layer_replication, target_parameters, trainable tokens, ...), every tensor
of adapter_model.safetensors is a LoRA A/B weight of a Linear the base checkpoint has, and the shapes fit that
weight (A [r, in], B [out, r], r as rank_pattern says). Also hashes the adapter's files for the fingerprint, so
a changed adapter is never mixed with shards of the old one. Owns validation only; the merge is the child's.
"""
from __future__ import annotations

import importlib.util
import os
import re

from safetensors import SafetensorError, safe_open

from shared import durable
from shared.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS, not_mergeable_key, split_key, unsupported
from supervisor.errors import SourceError
from supervisor.checks.source import read_json_object


def pattern_key(patterns, module: str) -> str:
    """PEFT's get_pattern_key (peft/utils/other.py, 0.21.2): the first pattern matching `(.*\\.)?(key)$`."""
    for key in patterns:
        if re.match(rf"(.*\.)?({key})$", module):
            return key
    return module


def inspect_adapter(folder: str, base_folder: str, base_files: list[str]) -> dict:
    """Validate the adapter against the base checkpoint; returns its fingerprint part {file: sha256}."""
    shown = folder
    if not os.path.isdir(folder):
        raise SourceError(f"[source] adapter {shown!r} is not a folder; point it at a PEFT LoRA adapter folder")
    if importlib.util.find_spec("peft") is None:
        raise SourceError("[source] adapter needs PEFT in this environment (the child merges with PEFT's own "
                          "code): pip install 'layerwise-supervisor[lora]'")
    config = _read_config(folder)
    problem = unsupported(config)
    if problem:
        raise SourceError(f"[source] adapter {shown!r}: {problem}")
    shapes = _adapter_shapes(folder)
    base = base_shapes(base_folder, base_files)
    pairs: dict[str, dict[str, list[int]]] = {}
    for key, shape in shapes.items():
        module, kind = split_key(key)
        if not kind:
            raise SourceError(f"[source] adapter {shown!r}: {not_mergeable_key(key)}")
        pairs.setdefault(module, {})[kind] = shape
    for module, pair in sorted(pairs.items()):
        _check_pair(shown, module, pair, base.get(module + ".weight"), config)
    return {fn: durable.hash_file(os.path.join(folder, fn)) for fn in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)}


def _read_config(folder: str) -> dict:
    return read_json_object(os.path.join(folder, ADAPTER_CONFIG), f"[source] adapter {ADAPTER_CONFIG}",
                            f"[source] adapter {folder!r} has no {ADAPTER_CONFIG}; save the adapter with PEFT's "
                            "save_pretrained")


def _adapter_shapes(folder: str) -> dict[str, list[int]]:
    path = os.path.join(folder, ADAPTER_WEIGHTS)
    if not os.path.isfile(path):
        raise SourceError(f"[source] adapter {folder!r} has no {ADAPTER_WEIGHTS} (pickle adapters are never "
                          "loaded); save the adapter with PEFT's save_pretrained (safe_serialization)")
    try:
        with safe_open(path, "np") as f:
            return {k: list(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as exc:
        raise SourceError(f"[source] adapter {ADAPTER_WEIGHTS} is not a valid safetensors file ({exc})") from exc


def base_shapes(folder: str, files: list[str]) -> dict[str, list[int]]:
    out = {}
    for fn in files:
        with safe_open(os.path.join(folder, fn), "np") as f:
            for k in f.keys():
                out[k] = list(f.get_slice(k).get_shape())
    return out


def _check_pair(shown: str, module: str, pair: dict, weight: list[int] | None, config: dict) -> None:
    where = f"[source] adapter {shown!r}: {module}"
    if set(pair) != {"lora_A", "lora_B"}:
        raise SourceError(f"{where} has only {', '.join(sorted(pair))}; the adapter file is incomplete")
    if weight is None:
        raise SourceError(f"{where} is not a weight of the base checkpoint; is this adapter for another model?")
    a, b = pair["lora_A"], pair["lora_B"]
    rank_pattern = config.get("rank_pattern") or {}
    r = rank_pattern.get(pattern_key(rank_pattern.keys(), module), config.get("r"))
    if len(weight) != 2 or len(a) != 2 or len(b) != 2 or a != [r, weight[1]] or b != [weight[0], r]:
        raise SourceError(f"{where}: A{a} B{b} with r={r} do not fit the base weight {weight} (expected "
                          f"A[r, in] B[out, r]); is this adapter for another model?")
