"""Finalize an export: the index built from the shards on disk, config.json, tokenizer and generation files,
and the done marker with every output file's digest.

Runs after every part is journaled; idempotent (a crash inside it is repaired by running it again, with identical
bytes). Owns the files outside the shards; it never writes a shard and never quantizes anything (config.json's
quantization_config comes from the child, which has the libraries loaded).
"""
from __future__ import annotations

import json
import os
import shutil

from shared import checkpoint, durable, layout
from shared.messages import NON_LAYER

# Weights and the index are produced by the export; config.json is rewritten with quantization_config.
_NOT_COPIED_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_NOT_COPIED = {"config.json", layout.INDEX, "pytorch_model.bin.index.json"}


def shard_files(num_layers: int) -> list[str]:
    return [layout.shard_name(i) for i in range(num_layers)] + [layout.shard_name(NON_LAYER)]


def complete(output: str, staged_config: str, source: str, shards: list[str]) -> None:
    """The files beside the shards, all made durable together (durable.replace_all: one folder commit, not one per
    file): config.json from the worker's staged copy, the index built from the shards' headers, the source's side
    files (tokenizer, generation config, chat template…: every top-level file that is not weights or config)."""
    index = layout.state_path(output, layout.TMP, layout.INDEX + ".tmp")
    with open(index, "wb") as f:
        f.write(_index(output, shards))
    pairs = [(staged_config, os.path.join(output, "config.json")), (index, os.path.join(output, layout.INDEX))]
    durable.replace_all(pairs + _staged_side_files(source, output))


def _index(output: str, files: list[str]) -> bytes:
    weight_map: dict[str, str] = {}
    total = 0
    for fn in files:
        for name, info in checkpoint.header(os.path.join(output, fn))[0].items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            total += end - start
            weight_map[name] = fn
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    return (json.dumps(index, indent=2, sort_keys=True) + "\n").encode()


def _staged_side_files(source: str, output: str) -> list[tuple[str, str]]:
    """Each side file copied to a temp file in the output's tmp folder: (temp, final name) pairs, not yet durable."""
    pairs = []
    for fn in sorted(os.listdir(source)):
        src = os.path.join(source, fn)
        if fn.startswith(".") or not os.path.isfile(src) or fn in _NOT_COPIED or fn.endswith(_NOT_COPIED_SUFFIXES):
            continue
        tmp = layout.state_path(output, layout.TMP, fn + ".copy")
        shutil.copyfile(src, tmp)
        pairs.append((tmp, os.path.join(output, fn)))
    return pairs


def output_files(output: str, known: dict[str, str]) -> dict[str, str]:
    """Every file of the export (outside .export) -> digest; `known` digests (the journaled shards) are reused."""
    out = {}
    for fn in sorted(os.listdir(output)):
        p = os.path.join(output, fn)
        if fn == layout.STATE_DIR or not os.path.isfile(p):
            continue
        out[fn] = known.get(fn) or durable.hash_file(p)
    return out


def write_done(output: str, files: dict[str, str]) -> None:
    data = (json.dumps({"files": files}, indent=2, sort_keys=True) + "\n").encode()
    durable.write_bytes(layout.state_path(output, layout.DONE), data)
