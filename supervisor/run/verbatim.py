"""The non-layer part written by the supervisor itself, while the workers' libraries are still importing.

    Run._export ── part_to_copy(job, source) ─▶ Part: the non-layer tensors and where their bytes lie in the source
    copy thread (start):  safetensors' serialize_file(those bytes, mapped from the source files)
                            ─▶ OUT/.export/tmp/model-non-layer.safetensors.ahead.tmp, digest, fsync
                          wait for the export plan's verdict (Described, from a worker)
                          the plan keeps every tensor of the part as it is ─▶ rename into place ─▶ journaled (landed)
                          anything else (or a failed copy)              ─▶ tmp deleted ─▶ a worker exports the part

Why: a compressed-tensors export writes the non-layer tensors (embeddings, the final norm, an ignored lm_head)
unchanged (a calibrated one too, unless oneshot's offset-norm round trip rounds its final norm: Gemma), and on a large-vocabulary model they are a large share of the output (2.1 GB of the 9.1 GB of an
8B FP8 export). A worker's shard for that part is safetensors' serialization of the source tensors with the metadata
every shard has (shared.layout.SHARD_METADATA). The supervisor writes that same file through the same serializer
during the 5-15 s in which the warm parent imports torch and transformers and the disk is otherwise idle.

It is a guess until the export plan is judged: the file stays under a temporary name until the plan says that the part
keeps every one of its source tensors under its own name, dtype, shape and values and writes nothing else
(Part.differs; a calibrated worker names the tensors whose values it changes: PartPlan.rewritten).
Only then is it renamed into place and journaled, like a worker's shard, never before the verdict. A refused or
cancelled run deletes it; a crash leaves it in .export/tmp, which the next run clears.

The parts that qualify (part_to_copy): a checkpoint on disk without an adapter (a merge changes values under the same
names), format compressed-tensors, and lm_head in the ignore list (otherwise it is quantized); calibrated exports
too (measured on one H200: the 8B calibrated worker otherwise wrote the part after its last layer, 2.8 s).
Owns this copy only: it never imports torch, never quantizes, and journals only through the `settle` it is given.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
import threading
import time
from dataclasses import dataclass
from typing import Callable

from safetensors import TensorSpec, serialize_file

from shared import checkpoint, durable, layout, tensor_names
from shared.job import Job, effective_ignore, ignores_lm_head
from shared.messages import NON_LAYER, Described, LayerWritten

TMP_SUFFIX = ".ahead.tmp"
# Test-only: never copy ahead, so that a worker exports the non-layer part (fault injection aims at it there).
OFF_ENV = "SUPERVISOR_TEST_NO_COPY_AHEAD"


@dataclass(frozen=True)
class Tensor:
    name: str
    file: str  # relative to the source folder
    dtype: str  # torch's name for it, as safetensors.torch hands it to serialize_file
    shape: tuple[int, ...]
    start: int  # the first byte of its data, from the start of the file
    nbytes: int


@dataclass(frozen=True)
class Part:
    folder: str
    tensors: tuple[Tensor, ...]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def differs(self, described: Described) -> str:
        """Why the export plan does not write this part as the copy did ("" when it does): the plan must keep every
        one of the part's tensors under its own name, dtype and shape, quantize none, and write no other byte.
        The data-free backends pass a tensor they keep through untouched, so its bytes are the source's."""
        forecast = next((p for p in described.parts if p.index == NON_LAYER), None)
        if forecast is None:
            return "the export plan does not describe the non-layer part"
        if forecast.quantized:
            return f"the export plan quantizes {forecast.quantized[0]!r}"
        if forecast.rewritten:
            return f"the export rewrites {forecast.rewritten[0]!r} (calibration's offset-norm round trip)"
        if sorted(forecast.kept) != sorted(t.name for t in self.tensors):
            return "the export plan keeps other tensors in the non-layer part"
        if forecast.out_bytes != self.nbytes:
            return f"the export plan writes {forecast.out_bytes} bytes for the non-layer part, not {self.nbytes}"
        return ""

    def write(self, path: str) -> tuple[str, dict[str, float]]:
        """Write the part's shard at `path` (durable: fsynced, its pages handed back); its digest and stage seconds.
        The bytes are those safetensors.torch.save_file writes for the same tensors (the same serializer, given
        pointers into the source files mapped read-only)."""
        files = sorted({t.file for t in self.tensors})
        maps: dict[str, mmap.mmap] = {}
        views: dict[str, ctypes.Array] = {}
        t0 = time.perf_counter()
        try:
            for fn in files:
                with open(os.path.join(self.folder, fn), "rb") as f:
                    # a private mapping is writable from Python's side (ctypes needs that to give an address); it is
                    # never written, so its pages stay the page cache's
                    maps[fn] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
                views[fn] = (ctypes.c_char * len(maps[fn])).from_buffer(maps[fn])
            specs = {t.name: TensorSpec(dtype=t.dtype, shape=list(t.shape),
                                        data_ptr=ctypes.addressof(views[t.file]) + t.start, data_len=t.nbytes)
                     for t in self.tensors}
            serialize_file(specs, path, metadata=dict(layout.SHARD_METADATA))
            os.chmod(path, 0o644)  # as the worker's writer leaves its shards
            t1 = time.perf_counter()
            digest = self._digest(path, maps)
            t2 = time.perf_counter()
            durable.fsync_file(path, drop_cache=True)
            t3 = time.perf_counter()
        finally:
            views.clear()  # the buffer exports go first: a mapping with one alive cannot close
            for m in maps.values():
                m.close()
        return digest, {"copy": round(t1 - t0, 4), "hash": round(t2 - t1, 4), "sync": round(t3 - t2, 4)}

    def _digest(self, path: str, maps: dict[str, mmap.mmap]) -> str:
        """The digest of the file just written, its data hashed from the source's mapped bytes (as a worker's shard
        is hashed from its tensors' memory: shared.durable.digest_safetensors)."""
        by_name = {t.name: t for t in self.tensors}

        def data(name: str):
            t = by_name.get(name)
            return None if t is None else memoryview(maps[t.file])[t.start:t.start + t.nbytes]

        return durable.digest_safetensors(path, data)


def part_to_copy(job: Job, source) -> Part | None:
    """The non-layer part of `source` (supervisor.checks.source.SourceInfo) to copy ahead, or None when this export's
    non-layer part may not be written as it is (see the module docstring) or its tensors cannot be located."""
    if os.environ.get(OFF_ENV) == "1":
        return None
    if job.source is None or job.source.adapter or job.export.format != "compressed-tensors":
        return None
    if not ignores_lm_head(effective_ignore(job)):
        return None
    names = tensor_names.non_layer_names(source.tensor_names, source.layer_prefix, source.num_layers)
    if not names:
        return None
    try:
        where = _locate(source.path, names)
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None  # a layout this copy does not know: the worker reads it as usual
    return Part(source.path, tuple(where[n] for n in names)) if where is not None else None


def _locate(folder: str, names: list[str]) -> dict[str, Tensor] | None:
    """Where each tensor's bytes lie, read from the safetensors headers of the files the worker reads them from
    (shared.checkpoint.weight_map, as child.sources.checkpoint.Checkpoint); None when a dtype is not one safetensors.torch
    writes under a torch name."""
    weight_map = checkpoint.weight_map(folder)
    wanted: dict[str, list[str]] = {}
    for n in names:
        wanted.setdefault(weight_map[n], []).append(n)
    out = {}
    for fn, keys in wanted.items():
        header, head = checkpoint.header(os.path.join(folder, fn))
        for k in keys:
            info = header[k]
            dtype = layout.SAFETENSORS_DTYPES.get(info["dtype"])
            if dtype is None:
                return None
            begin, end = info["data_offsets"]
            out[k] = Tensor(k, fn, dtype, tuple(info["shape"]), len(head) + begin, end - begin)
    return out


class Copy:
    """The copy on a thread of its own: write, wait for the verdict, then settle(reply) with the part in place, or
    settle(None, why) for a worker to export it. `verdict()` blocks until the export plan is judged and returns it, or
    None when the run stops first (then nothing is settled). join() after the run has stopped."""

    def __init__(self, part: Part, output: str, verdict: Callable[[], Described | None],
                 settle: Callable[[LayerWritten | None, str], None]):
        self.part, self.output = part, output
        self._verdict, self._settle = verdict, settle
        self._thread = threading.Thread(target=self._run, name="copy-ahead", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def join(self) -> None:
        self._thread.join()  # bounded: one file's write; its verdict wait polls the run's end

    def _run(self) -> None:
        name = layout.shard_name(NON_LAYER)
        tmp = layout.state_path(self.output, layout.TMP, name + TMP_SUFFIX)
        try:
            digest, stages = self.part.write(tmp)
            why = ""
        except Exception as exc:  # noqa: BLE001 - a full disk, a source that moved: a worker meets it and reports it
            durable.unlink_quietly(tmp)
            digest, stages, why = "", {}, f"the copy failed: {exc}"
        described = self._verdict()
        if described is None:
            durable.unlink_quietly(tmp)
            return
        why = why or self.part.differs(described)
        if not why:
            dest = os.path.join(self.output, name)
            t = time.perf_counter()
            try:
                os.replace(tmp, dest)
                durable.fsync_dir(self.output)
                st = os.stat(dest)
            except OSError as exc:
                why = f"the copy could not be put in place: {exc}"
            else:
                stages["sync"] = round(stages["sync"] + time.perf_counter() - t, 4)
                self._settle(LayerWritten(index=NON_LAYER, file=name, digest=digest, nbytes=st.st_size,
                                          ino=st.st_ino, mtime_ns=st.st_mtime_ns, seconds=round(sum(stages.values()), 3),
                                          source_bytes=self.part.nbytes, stages=stages), "")
                return
        durable.unlink_quietly(tmp)
        self._settle(None, why)
