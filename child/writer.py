"""Durable shard writes: safetensors into the attempt's own temp file under OUT/.export/tmp, then fsync.

The worker stages a shard and never gives it its final name: the supervisor moves it there (rename, fsync the
folder) once it has taken the attempt's reply, and only for the attempt it is waiting on (shared/messages.py,
Fencing). So a shard is visible at its final name only complete, and only from the attempt that counts. Its digest is computed from the bytes it was
written from (the header read back from the file, then each tensor's memory in file order), not by re-reading
the file: the hash costs a pass over memory, not a second pass over the disk.
Owns writing one staged shard; it never decides what goes in it, never names a final file and never touches the
journal (the supervisor's).
"""
from __future__ import annotations

import json
import os
import re
import struct
import time
from dataclasses import dataclass
from typing import Callable

import torch
from safetensors import SafetensorError
from safetensors.torch import save_file

from shared import durable
from shared.layout import SHARD_METADATA

# safetensors (Rust) reports a failed write as SafetensorError with the errno only in its text, e.g.
# "Error while serializing: I/O error: No space left on device (os error 28)" (measured, safetensors 0.8).
_OS_ERROR = re.compile(r"\(os error (\d+)\)")


@dataclass
class Written:
    digest: str  # "algo:hex" of the file's bytes
    nbytes: int
    ino: int  # the file's identity (a rename keeps it): resume trusts a shard whose (ino, mtime_ns, size) match
    mtime_ns: int


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
        save_file(tensors, path, metadata=metadata)
        _sort_metadata(path)
    except SafetensorError as exc:
        # Make it the OSError it is, so a full disk (ENOSPC) reaches the supervisor as such and is not retried.
        m = _OS_ERROR.search(str(exc))
        if m is None:
            raise
        code = int(m.group(1))
        raise OSError(code, os.strerror(code), path) from exc


def _bytes_of(t: torch.Tensor) -> memoryview:
    # raw little-endian bytes as safetensors writes them; reshape(-1) because a 0-dim tensor cannot be viewed
    return memoryview(t.reshape(-1).view(torch.uint8).numpy())


def digest_written(path: str, tensors: dict, algo: str = durable.ALGO) -> str:
    """The digest of the safetensors file at `path`, which was just written from `tensors`: hashed from their
    memory (shared.durable.digest_safetensors), not by reading the file back."""
    return durable.digest_safetensors(path, lambda name: _bytes_of(tensors[name]) if name in tensors else None, algo)


def stage_shard(tensors: dict, path: str, checkpoint: Callable[[str], None] = lambda stage: None,
                metadata: dict[str, str] | None = None, timings: dict[str, float] | None = None) -> Written:
    """Write `tensors` with `metadata` in its header as the complete, fsynced file `path` (the attempt's staged
    name, layout.staged_name). `checkpoint(stage)` is the fault-injection hook ("write_tmp": written, not synced;
    "staged": synced, the reply not sent); `timings` (if given) gets the seconds spent in "save", "hash" and "sync"."""
    timings = {} if timings is None else timings
    os.makedirs(os.path.dirname(path), exist_ok=True)
    tensors = {k: v.contiguous() for k, v in tensors.items()}
    try:
        t0 = time.perf_counter()
        _save(tensors, path, SHARD_METADATA if metadata is None else metadata)
        os.chmod(path, 0o644)  # safetensors creates 0600 files; shards are meant to be shared like any checkpoint
        t1 = time.perf_counter()
        digest = digest_written(path, tensors)
        t2 = time.perf_counter()
        checkpoint("write_tmp")
        durable.fsync_file(path, drop_cache=True)  # measured: the next shard's save 0.09 -> 0.015 s (docs)
        timings.update(save=t1 - t0, hash=t2 - t1, sync=time.perf_counter() - t2)
    except BaseException:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    checkpoint("staged")
    st = os.stat(path)
    return Written(digest=digest, nbytes=st.st_size, ino=st.st_ino, mtime_ns=st.st_mtime_ns)
