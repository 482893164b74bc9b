"""Durable shard writes: safetensors into a temp file under OUT/.export/tmp, fsync, rename, fsync the folder.

A shard is visible at its final name only once it is complete; its sha256 is computed from the bytes on disk.
Owns writing one shard; it never decides what goes in it and never touches the journal (the supervisor's).
"""
from __future__ import annotations

import json
import os
import re
import struct
from typing import Callable

from safetensors import SafetensorError
from safetensors.torch import save_file

from shared import durable

# safetensors writes this metadata too when transformers saves; keep it so shards look like any HF shard.
METADATA = {"format": "pt"}
# safetensors (Rust) reports a failed write as SafetensorError with the errno only in its text, e.g.
# "Error while serializing: I/O error: No space left on device (os error 28)" (measured, safetensors 0.8).
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


def _sort_metadata(path: str) -> None:
    """Rewrite the header of the safetensors file at `path` in place with `__metadata__` in sorted key order.

    safetensors 0.8's save_file keeps the metadata in a Rust HashMap, so its key order differs in each process
    (measured: three runs, three orders). A shard with more than one metadata key (torchao: one per tensor) would
    then differ byte-wise between an uninterrupted run and a resumed one. Only the order changes: the header
    keeps its length (safetensors pads it with spaces to 8 bytes), so the tensor data is not touched.
    """
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header.get("__metadata__")
        if not meta or len(meta) < 2:
            return
        header["__metadata__"] = dict(sorted(meta.items()))
        # serde_json's compact form: no spaces, non-ASCII as UTF-8, so the same content has the same length
        raw = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
        if len(raw) > n:
            raise RuntimeError(f"{path}: re-encoded safetensors header is longer than the original ({len(raw)} > {n})")
        f.seek(8)
        f.write(raw.ljust(n, b" "))


def _save(tensors: dict, path: str, metadata: dict[str, str]) -> None:
    try:
        save_file({k: v.contiguous() for k, v in tensors.items()}, path, metadata=metadata)
        _sort_metadata(path)
    except SafetensorError as exc:
        # Make it the OSError it is, so a full disk (ENOSPC) reaches the supervisor as such and is not retried.
        m = _OS_ERROR.search(str(exc))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), path) from exc


def write_shard(tensors: dict, output: str, tmp_dir: str, name: str,
                checkpoint: Callable[[str], None] = lambda stage: None,
                metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write `tensors` as OUT/name with `metadata` in its header; returns (sha256, size). `checkpoint(stage)` is
    the fault-injection hook."""
    os.makedirs(tmp_dir, exist_ok=True)
    tmp = os.path.join(tmp_dir, name + ".tmp")
    try:
        _save(tensors, tmp, METADATA if metadata is None else metadata)
        os.chmod(tmp, 0o644)  # safetensors creates 0600 files; shards are meant to be shared like any checkpoint
        checkpoint("write_tmp")
        dest = os.path.join(output, name)
        durable.replace(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    checkpoint("after_rename")
    # The hash re-reads the shard (from the page cache). Hashing serialized bytes instead (safetensors.torch.save)
    # would hold a second copy of the shard in memory, which a huge MoE layer cannot afford.
    return durable.sha256_file(dest), os.path.getsize(dest)
