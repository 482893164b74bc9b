"""The journal: the job's fingerprint, one append-only record per finished shard, and the resume plan.

`OUT/.export/journal.jsonl` holds JSON lines: a Header first (fingerprint + job), then a Shard record per
written shard (appended and fsynced only after the shard was renamed into place), then Finalized; a calibrated
export also an Arithmetic record (what its workers computed with) before its first layer. A calibrated
export's Shard record for layer i also names the boundary feeding layer i+1 (its file under .export/boundary,
digest and size), made durable before the record: one record makes both count, atomically; a calibrated group's
record (W ranks, each calibrating its own samples) names W boundaries, one per rank, the same way. A worker on its
own makes that boundary durable beside layer i+1: layer i's record comes without it, and once the boundary is
durable the record is appended again naming it (the latest record per layer counts), so the journal never names a
boundary that is not durable. A record counts
only when its line is complete: a torn last line (the supervisor died mid-write) is ignored and cut off before
the next append. A shard counts as done only if its file is on disk as journaled; anything else is redone, so the
output after any crash and re-run is byte-identical to an uninterrupted run.

"As journaled" has two strengths. Resume trusts a shard whose inode, mtime and size equal its record (the file
the child renamed into place was not replaced or touched since; checking costs one stat, not a read of the
whole export); a record without them, or a file that differs, is re-hashed. `verify` always re-hashes
every byte (`verify_shard(..., rehash=True)`). Digests are "algo:hex" strings (shared.durable).
Owns the journal file; it never writes shards and never talks to a child.
"""
from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import Container
from dataclasses import dataclass, field
from typing import Union

import msgspec

from shared import durable, layout
from shared.job import Job, effective_ignore, to_dict
from shared.messages import Boundary
from shared.versions import installed
from supervisor.errors import FingerprintMismatch, OutputError

JOURNAL_VERSION = 2
# Library versions decide the bytes of the output, so they are part of the fingerprint; ours too (how shards are
# laid out and named is ours).
_FINGERPRINT_PACKAGES = ("layerwise-supervisor", "torch", "transformers", "llmcompressor", "compressed-tensors",
                         "safetensors")


class Header(msgspec.Struct, tag=True, kw_only=True):
    version: int = JOURNAL_VERSION
    fingerprint: str
    job: dict
    num_layers: int
    created: float = 0.0
    world: int = 1  # a calibrated export's group size (ranks); part of its fingerprint when above 1


class Shard(msgspec.Struct, tag=True, kw_only=True):
    index: int
    file: str
    digest: str  # "algo:hex"
    nbytes: int
    seconds: float = 0.0
    ino: int = 0  # the file's identity when journaled (0: unknown, always re-hash)
    mtime_ns: int = 0
    # what the part cost and how good it is (supervisor report); defaults keep older journals readable
    source_bytes: int = 0  # bytes read from the source
    peak_rss: int = 0  # the worker's peak RSS while exporting it, bytes
    peak_gpu: int = 0  # the worker's peak GPU memory (torch allocator) while exporting it, bytes; 0 on CPU
    retries: int = 0  # failed attempts before the one that wrote it, in the run that wrote it
    quant_error: dict[str, float] = {}  # module -> relative error of its dequantized weight vs the source
    stages: dict[str, float] = {}  # seconds per stage in the worker (read, quantize, error, save, hash, sync, …)
    boundary: Boundary | None = None  # calibrated: the inputs of layer index+1, durable before this record
    boundaries: list[Boundary] = []  # a calibrated group's (W > 1): those inputs, one file per rank
    losses: dict[str, float] = {}  # calibrated: module -> the method's own loss (GPTQ's), from the rank that solved it
    ranks: dict[str, dict[str, float]] = {}  # calibrated: per rank, seconds per calibration stage (LayerWritten.ranks)
    source_digest: str = ""  # a live model's source tensors of this part; "" for a checkpoint on disk
    where: str = ""  # on a cluster: the node (and GPU) of the worker that wrote it; "" on this host


class Arithmetic(msgspec.Struct, tag=True, kw_only=True):
    """A calibrated export's workers as they ran (their Ready, shared.arithmetic), journaled once a run's workers are
    ready and before they export a layer, when the journal holds none or another: per rank, torch's thread count
    and the device's model. The latest is the one the folder's calibrated layers were computed with (a resume
    whose workers differ is refused while the journal holds a layer: supervisor.checks.calibration.check_arithmetic)."""

    threads: list[int] = []
    devices: list[str] = []


class Finalized(msgspec.Struct, tag=True, kw_only=True):
    files: dict[str, str] = {}  # every output file (outside .export) -> digest


Record = Union[Header, Shard, Arithmetic, Finalized]
_encoder = msgspec.json.Encoder()
_decoder = msgspec.json.Decoder(Record)


def _versions(packages: tuple[str, ...] = _FINGERPRINT_PACKAGES) -> dict[str, str]:
    return installed(packages)


def fingerprint(job: Job, source_stats: list[tuple[str, int, int]], calibration: dict | None = None,
                extra: dict | None = None, device: str = "cpu") -> tuple[str, dict]:
    """A hash of everything that decides the output's bytes; also returns the parts, for messages.
    `calibration`: the data-dependent parts of a calibrated job (supervisor.checks.calibration); data-free jobs have
    none, so their fingerprints are what they were before calibration existed. `extra`: what else the source is
    made of (an adapter's file hashes, a live model's structure). `device`: the resolved device the layers are
    quantized on; its kind decides bytes too (on cuda compressed-tensors quantizes with a Triton kernel that divides
    by the scale in float32, on the CPU in the weight's bf16: FP8 and INT values can differ by one step), so an
    export started on a GPU is never resumed on the CPU or the other way round. CPU jobs leave it out (their
    fingerprints stay what they were)."""
    parts = {
        "source_files": [list(s) for s in source_stats],
        "scheme": job.export.scheme,
        "ignore": effective_ignore(job),
        "format": job.export.format,
        "versions": _versions(),
    }
    if job.export.format == "torchao":
        # Only for torchao jobs, so compressed-tensors fingerprints (and the outputs they resume) stay as they were.
        parts["torchao"] = job.export.torchao or {}
        parts["versions"] = _versions(_FINGERPRINT_PACKAGES + ("torchao",))
        # Shards written before every shard held every tensor's metadata entry (which vLLM needs) load in
        # transformers only: such an output is not resumed, so no folder mixes the two layouts.
        parts["torchao_shard_metadata"] = "every entry"
    if calibration is not None:
        parts["calibration"] = calibration
    elif not device.startswith("cpu"):
        parts["device"] = device.split(":")[0]  # calibrated jobs hold it in their calibration part already
    if extra:
        parts["source_extra"] = extra
    blob = json.dumps(parts, sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32], parts


@dataclass
class State:
    """What the journal says, after dropping a torn tail."""

    header: Header | None = None
    shards: dict[int, Shard] = field(default_factory=dict)  # latest record per index
    finalized: Finalized | None = None
    arithmetic: Arithmetic | None = None  # the latest: what the calibrated layers were computed with
    good_bytes: int = 0  # length of the journal up to the last complete record
    torn: bool = False


def path(output: str) -> str:
    return layout.state_path(output, layout.JOURNAL)


def read(output: str) -> State:
    st = State()
    try:
        with open(path(output), "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return st
    pos = 0
    for line in data.splitlines(keepends=True):
        if not line.endswith(b"\n"):
            st.torn = True
            break
        try:
            rec = _decoder.decode(line)
        except (msgspec.DecodeError, msgspec.ValidationError):
            st.torn = True  # a torn write that happened to end in a newline byte; nothing after it counts
            break
        pos += len(line)
        match rec:
            case Header():
                st.header = rec
            case Shard():
                prev = st.shards.get(rec.index)
                if prev is None or prev.digest != rec.digest:
                    st.finalized = None  # a shard redone after finalize means finalize must run again
                st.shards[rec.index] = rec  # (the same bytes under a new file identity leave it final)
            case Arithmetic():
                st.arithmetic = rec
            case Finalized():
                st.finalized = rec
    st.good_bytes = pos
    return st


class Journal:
    """Appends records durably (write, fsync). Open it only while holding the output lock."""

    def __init__(self, output: str, state: State):
        self._path = path(output)
        if state.torn:
            with open(self._path, "r+b") as f:
                f.truncate(state.good_bytes)
                os.fsync(f.fileno())
        self._f = open(self._path, "ab")

    def append(self, rec: Record) -> None:
        self._f.write(_encoder.encode(rec) + b"\n")
        self._f.flush()
        os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()


def start(output: str, job: Job, fp: str, num_layers: int, world: int = 1) -> Journal:
    """Create the journal with its header (the state folder must exist)."""
    header = Header(fingerprint=fp, job=to_dict(job), num_layers=num_layers, created=time.time(), world=world)
    durable.write_bytes(path(output), _encoder.encode(header) + b"\n")
    return Journal(output, State(header=header))


def check_owner(output: str, fp: str, parts: dict) -> State:
    """Refuse an output folder that holds something other than an export of this job."""
    shown = output
    if not os.path.exists(output):
        return State()
    if not os.path.isdir(output):
        raise OutputError(f"output {shown!r} exists and is not a folder; choose another [export] output")
    entries = [e for e in os.listdir(output)]
    st = read(output)
    if st.header is None:
        if entries:
            raise OutputError(f"output {shown!r} is not empty and holds no export; choose an empty or new folder")
        return st
    if st.header.fingerprint != fp:
        old = st.header.job.get("export", {})
        raise FingerprintMismatch(
            f"output {shown!r} holds an export of a different job (scheme {old.get('scheme')}, "
            f"source {(st.header.job.get('source') or {}).get('path', 'a live model')}, or changed source files, "
            f"calibration data or settings, device kind, library versions); "
            f"delete the folder to start fresh, or choose another [export] output")
    return st


def not_shards(files: dict[str, str], shards: dict[int, Shard]) -> dict[str, str]:
    """The finalized files that are not these shards (those are verified against their own records)."""
    hashed = {r.file for r in shards.values()}
    return {fn: sha for fn, sha in files.items() if fn not in hashed}


def verify_shard(output: str, rec: Shard, *, rehash: bool = False) -> str | None:
    """None if the shard on disk matches its record, else why not. Without `rehash`, a file whose inode, mtime
    and size are the journaled ones is trusted without reading it."""
    p = os.path.join(output, rec.file)
    try:
        st = os.stat(p)
    except FileNotFoundError:
        return "missing"
    if st.st_size != rec.nbytes:
        return f"size {st.st_size} != journaled {rec.nbytes}"
    if not rehash and rec.ino and (st.st_ino, st.st_mtime_ns) == (rec.ino, rec.mtime_ns):
        return None
    if not durable.matches(p, rec.digest):
        return "digest differs from the journal"
    return None


def restat(output: str, rec: Shard) -> Shard:
    """`rec` with the file's current inode and mtime (the same object when they are unchanged)."""
    st = os.stat(os.path.join(output, rec.file))
    if (st.st_ino, st.st_mtime_ns) == (rec.ino, rec.mtime_ns):
        return rec
    return msgspec.structs.replace(rec, ino=st.st_ino, mtime_ns=st.st_mtime_ns)


def calibrated_start(st: State, num_layers: int, good: Container[int]) -> int:
    """The first layer a calibrated export redoes, from the journal alone: after the longest run of good shards
    0..k-1 (`good`: the journaled parts taken as intact), at the newest boundary one of them names. A boundary is
    journaled only once durable, which can be a layer after its shard (shared/messages.py, Boundary durability):
    then the last good layer is redone from the boundary before it."""
    k = 0
    while k < num_layers and k in good:
        k += 1
    if k == num_layers:
        return k
    return next((j for j in range(k, 0, -1) if boundaries(st.shards[j - 1])), 0)


def calibrated_resume(output: str, st: State, num_layers: int, good: Container[int],
                      world: int = 1) -> tuple[int, list[Boundary] | None]:
    """Where a calibrated export continues: (first layer to export, the journaled boundaries feeding it: one, or
    one per rank of a group of `world`).

    Layers run in order and each needs the previous one's outputs, so resume continues at calibrated_start, from the
    boundary named there, which must be on disk with its digest (re-hashed here: the boundary is small next to the
    export, and a damaged one would silently change every later layer). A boundary that fails its hash is never
    trusted: only the newest one is kept, so the inputs are recomputed from layer 0."""
    k = calibrated_start(st, num_layers, good)
    if k == 0 or k == num_layers:
        return k, None
    bs = boundaries(st.shards[k - 1])
    if len(bs) != world or any(b.feeds != k for b in bs) or verify_files(output, {b.file: b.digest for b in bs}):
        return 0, None
    return k, bs


def boundaries(rec: Shard) -> list[Boundary]:
    """The inputs of layer rec.index + 1 that a calibrated record names: one file, or one per rank of a group."""
    return list(rec.boundaries) if rec.boundaries else [rec.boundary] if rec.boundary is not None else []


def prune_boundaries(output: str, keep: list[Boundary] | None) -> None:
    """Delete every boundary file but those in `keep` (the journaled ones the next layer needs)."""
    folder = layout.state_path(output, layout.BOUNDARY)
    if not os.path.isdir(folder):
        return
    keep_names = {os.path.basename(b.file) for b in keep or []}
    for fn in os.listdir(folder):
        if fn not in keep_names:
            os.unlink(os.path.join(folder, fn))


def verify_files(output: str, files: dict[str, str]) -> dict[str, str]:
    """file -> problem for each of `files` (name -> digest) that is missing or differs on disk."""
    problems = {}
    for fn, digest in files.items():
        p = os.path.join(output, fn)
        if not os.path.isfile(p):
            problems[fn] = "missing"
        elif not durable.matches(p, digest):
            problems[fn] = "digest differs from the journal"
    return problems
