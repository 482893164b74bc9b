"""Calibration activations at a layer boundary: every sample's hidden states entering one decoder layer.

    BoundaryWriter (filled while the layer propagates)        Activations (what the next layer reads)
      put(j, hidden) in sample order ─▶ in RAM: copied into one   in RAM: one flat host buffer, views per sample
        flat host buffer (pinned on a GPU: asynchronous DMA);     on disk: one sample read back at a time (pread)
        on disk: a thread appends the bytes to a temp file and  load(path, digest): refuses a file whose hash differs
        hashes them meanwhile
      commit(dest): fsync, rename, fsync the folder ─▶ Activations + (digest, size) for the journal (sync=False:
        rename only: the quality measurement's boundaries, which a resume re-hashes and can remake)
      spares=FOLDER: the temp file is a spent boundary file the supervisor kept there, rewritten in place (its
        blocks are allocated already: durable.take_spare), cut to size and fdatasynced
      commit_later(dest) (in RAM): Activations at once; a thread writes the buffer to the temp file (past the page
        cache where it can: durable.write_direct), hashes, fsyncs and renames it while the next layer computes
        ─▶ PendingWrite.wait -> (digest, size) once durable (sync=False: WRITERS threads write its parts at once
        into the page cache while that thread hashes it; no fsync)
      stream=True (with later, sync=False): the file is written while the samples come, each sample as soon as its
        (asynchronous) copy into the host buffer has landed, and commit_later only finishes it: the write has the
        layer that makes the samples and the next one to run beside, not the next one alone

The file (state under OUT/.export/boundary/, never part of the output): b"LWBOUND1", the JSON header's length
(u64 little-endian), the JSON header {"feeds", "dtype", "shapes"} padded with spaces to end on a 4 KiB block (so
the samples can be written with O_DIRECT; files of earlier versions, unpadded, read the same), then every sample's
bytes in sample order (C order, no padding between them). Why not safetensors: its writer needs every tensor in
memory at once, and a boundary may exceed the RAM budget (`resources.activation_ram_gb`); this layout is written and
read one sample at a time.

Owns the files' format and I/O only: it never decides which layer a boundary feeds or when one is deleted (the
supervisor, which owns the journal, does), and never keeps a sample it was handed after `commit`. A buffer handed
to commit_later must not be written to (nor given back for reuse) before its PendingWrite has ended.
"""
from __future__ import annotations

import concurrent.futures
import json
import math
import mmap
import os
import queue
import struct
import threading
from typing import Callable

import torch

from shared import durable

MAGIC = b"LWBOUND1"
SYNC_EVERY = 256 << 20
WRITERS = 4  # threads writing a file that is not fsynced (the quality measurement's): page-cache copies in parallel
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class BoundaryCorrupt(ValueError):
    """A boundary file does not match its journaled hash (or is not a boundary file at all)."""


def _dtype_name(dtype: torch.dtype) -> str:
    for name, d in _DTYPES.items():
        if d == dtype:
            return name
    raise TypeError(f"activations of dtype {dtype} cannot be stored in a boundary file")


def _header(feeds: int, shapes: list[tuple[int, ...]], dtype: torch.dtype) -> bytes:
    body = json.dumps({"feeds": feeds, "dtype": _dtype_name(dtype), "shapes": [list(s) for s in shapes]},
                      sort_keys=True, separators=(",", ":")).encode()
    # padded with spaces (still the same JSON) so the samples start on a 4 KiB block: written with O_DIRECT
    body += b" " * (-(len(MAGIC) + 8 + len(body)) % durable.DIRECT_ALIGN)
    return MAGIC + struct.pack("<Q", len(body)) + body


def _bytes_of(t: torch.Tensor):
    # t: contiguous CPU tensor -> a writable byte view of its memory (numpy has no bfloat16, uint8 it has)
    return t.reshape(-1).view(torch.uint8).numpy()


class Activations:
    """The hidden states of every calibration sample entering layer `feeds` (CPU tensors, one per sample)."""

    def __init__(self, feeds: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, *,
                 flat: torch.Tensor | None = None, path: str | None = None, data_offset: int = 0):
        self.feeds, self.shapes, self.dtype = feeds, [tuple(s) for s in shapes], dtype
        self._numel = [math.prod(s) for s in self.shapes]
        self._start = [0]
        for n in self._numel:
            self._start.append(self._start[-1] + n)
        self._flat = flat  # RAM: every sample back to back
        self._fd = os.open(path, os.O_RDONLY) if flat is None and path is not None else None
        self._data_offset = data_offset

    def __len__(self) -> int:
        return len(self.shapes)

    @property
    def nbytes(self) -> int:
        return self._start[-1] * self.dtype.itemsize

    @property
    def in_ram(self) -> bool:
        return self._flat is not None

    def get(self, j: int) -> torch.Tensor:
        """Sample j's hidden states (a view in RAM mode, a fresh tensor read from the file in disk mode)."""
        if self._flat is not None:
            return self._flat[self._start[j]:self._start[j + 1]].view(self.shapes[j])
        t = torch.empty(self._numel[j], dtype=self.dtype)
        _pread_into(self._fd, _bytes_of(t), self._data_offset + self._start[j] * self.dtype.itemsize)
        return t.view(self.shapes[j])

    @property
    def numel(self) -> int:
        return self._start[-1]

    def to_device(self, device: torch.device):
        """Every sample on `device`, in order (a generator). From pinned host memory to a GPU, the next sample's
        copy runs on a stream of its own while the caller computes with this one (the caller's stream waits for
        each copy, and the allocator keeps each sample until that stream is done with it); otherwise each is
        copied when asked for. The same values either way."""
        n = len(self)
        if device.type != "cuda" or self._flat is None or not self._flat.is_pinned():
            for j in range(n):
                yield self.get(j).to(device, non_blocking=True)
            return
        copies, compute = side_stream(device, "to-device"), torch.cuda.current_stream(device)

        def send(j: int):
            src = self.get(j)
            # allocated from the caller's stream's memory (no pool of another stream grows); the copy starts once
            # what that stream has queued so far is done (whatever used this memory before), beside what follows
            t = torch.empty(src.shape, dtype=src.dtype, device=device)
            copies.wait_stream(compute)
            with torch.cuda.stream(copies):
                t.copy_(src, non_blocking=True)
            return t, copies.record_event()

        ahead = send(0) if n else None
        for j in range(n):
            t, ready = ahead
            compute.wait_event(ready)
            if j + 1 < n:
                ahead = send(j + 1)  # queued before the caller's work on sample j: it runs beside that work
            yield t

    def close(self) -> torch.Tensor | None:
        """Release the file or the memory; returns the RAM buffer, which the next boundary may reuse."""
        flat, self._flat = self._flat, None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        return flat

    @classmethod
    def load(cls, path: str, digest: str, feeds: int, in_ram: bool, pin: bool = False) -> "Activations":
        """Open a committed boundary file after checking its digest; `in_ram` reads it whole into host memory
        (hashing what it read, so the file is read once)."""
        with open(path, "rb") as f:
            head = f.read(len(MAGIC) + 8)
            if len(head) < len(MAGIC) + 8 or head[:len(MAGIC)] != MAGIC:
                raise BoundaryCorrupt(f"{path} is not a boundary file")
            (n,) = struct.unpack("<Q", head[len(MAGIC):])
            body = f.read(n)
            meta = json.loads(body)
        if meta["feeds"] != feeds:
            raise BoundaryCorrupt(f"{path} holds the inputs of layer {meta['feeds']}, not of layer {feeds}")
        offset = len(MAGIC) + 8 + n
        acts = cls(feeds, meta["shapes"], _DTYPES[meta["dtype"]], path=path, data_offset=offset)
        corrupt = BoundaryCorrupt(f"boundary {os.path.basename(path)} does not match its journaled digest")
        if not in_ram:
            if not durable.matches(path, digest):
                acts.close()
                raise corrupt
            return acts
        flat = host_buffer(acts.numel, acts.dtype, pin)
        _pread_into(acts._fd, _bytes_of(flat), offset)
        size = os.fstat(acts._fd).st_size
        acts.close()
        h = durable.hasher(durable.algo_of(digest))
        for part in (head, body, _bytes_of(flat)):
            h.update(part)
        got = h.hexdigest()
        if size != offset + flat.numel() * flat.element_size() or got != digest.split(":", 1)[-1]:
            raise corrupt
        return cls(feeds, acts.shapes, acts.dtype, flat=flat)


class BoundaryWriter:
    """Builds one boundary, sample by sample in order; `commit` makes it durable and returns the Activations."""

    def __init__(self, feeds: int, shapes: list[tuple[int, ...]], dtype: torch.dtype, *, tmp_path: str | None,
                 keep_in_ram: bool, buffer: torch.Tensor | concurrent.futures.Future | None = None,
                 pin: bool = False, later: bool = False,
                 sync: bool = True, stream: bool = False, spares: str | None = None):
        """`buffer`: a released RAM buffer to reuse (fresh host memory costs a page fault per 4 KiB on first
        touch, ~1.6 GB/s measured), or a Future of one being made (host_buffer_meanwhile), waited for only when the
        boundary is kept in RAM; `pin`: allocate page-locked memory for faster copies to and from a GPU.
        `later` (in RAM): no file is written while the samples come (one is after them, by commit_later, or none
        without `tmp_path`), so the samples are copied into pinned memory without waiting; otherwise a thread writes
        the file while the samples come, as on disk.
        `sync` False: the file is written and renamed but never fsynced (it survives any process's death in the
        page cache, not a machine's crash: the caller re-hashes it before trusting it after one).
        `stream` (with `later` and without `sync`): each sample is written as soon as it is in the host buffer (see
        the module docstring); commit_later then waits only for what is left.
        `spares`: a folder of spent boundary files (durable.take_spare): the file is one of them rewritten in place
        where there is one (about twice as fast to make durable as a fresh one), cut to its size and fdatasynced."""
        if tmp_path is None and not keep_in_ram:
            raise ValueError("a boundary needs a file or RAM")
        self.feeds, self.shapes, self.dtype = feeds, [tuple(s) for s in shapes], dtype
        self._layout = Activations(feeds, shapes, dtype)  # offsets only
        self._flat = None
        if keep_in_ram:
            if isinstance(buffer, concurrent.futures.Future):
                buffer = buffer.result()  # bounded: one host buffer's allocation (host_buffer_meanwhile)
            fits = buffer is not None and buffer.dtype == dtype and buffer.numel() == self._layout.numel
            self._flat = buffer if fits else host_buffer(self._layout.numel, dtype, pin)
        self._next = 0
        self._tmp = tmp_path
        self._spares = spares
        self._reused = False  # the temp file is a spare rewritten in place
        self._hash = durable.hasher()
        self._sync = sync
        self._size = 0
        self._synced = 0
        self._error: BaseException | None = None
        self._fd = None
        self._queue: queue.Queue = queue.Queue(maxsize=4)
        self._thread = None
        self._later = later and self._flat is not None
        self._async = self._later and self._flat.is_pinned()  # device -> pinned host: DMA, no wait per sample
        self._copies = None  # the CUDA stream of those copies: beside the layer's kernels, not between them
        self._held: list = []  # (device tensor, its copy's event): the last sample's, until the caller's stream waits
        self._head = _header(feeds, self.shapes, dtype)
        self._data_offset = len(self._head)
        self._stream = stream and self._later and not sync and tmp_path is not None
        if self._stream:  # written while the layer makes the samples, each one once its copy has landed
            self._flat_ref = self._flat  # the writer's hold on the buffer until the file is complete
            self._queue = queue.Queue()  # (sample, CUDA event or None): never blocks put()
            self._open()
            self._thread = threading.Thread(target=self._drain_streamed, name="boundary-stream", daemon=True)
            self._thread.start()
        elif tmp_path is not None and not self._later:  # written while the layer propagates
            self._open()
            self._thread = threading.Thread(target=self._drain, name="boundary-writer", daemon=True)
            self._thread.start()

    @property
    def later(self) -> bool:
        """Made for commit_later (held in RAM, a file to write afterwards)."""
        return self._later and self._tmp is not None

    @property
    def has_file(self) -> bool:
        """Made with a file to write (else held in RAM only: commit(None))."""
        return self._tmp is not None

    def _open(self) -> None:
        size = self._data_offset + self._layout.nbytes
        self._reused = self._spares is not None and durable.take_spare(self._spares, self._tmp, size)
        self._fd = os.open(self._tmp, os.O_WRONLY | os.O_CREAT | (0 if self._reused else os.O_TRUNC), 0o644)
        self._write(memoryview(self._head))

    def _seal(self) -> None:
        """Every byte written: a spare's tail beyond them cut off; with `sync`, the file on disk (a spare of the same
        size changes no metadata a read needs, so fdatasync; fdatasync also carries a size that changed)."""
        if self._reused and os.fstat(self._fd).st_size != self._size:
            os.ftruncate(self._fd, self._size)
        if self._sync:
            (os.fdatasync if self._reused else os.fsync)(self._fd)

    def put(self, j: int, hidden: torch.Tensor) -> None:
        """Sample j's output hidden states (any device); samples must come in order 0, 1, ..."""
        if j != self._next or tuple(hidden.shape) != self.shapes[j] or hidden.dtype != self.dtype:
            raise ValueError(f"boundary sample {j}: expected #{self._next} {self.shapes[self._next]} {self.dtype}, "
                             f"got {tuple(hidden.shape)} {hidden.dtype}")
        self._raise_if_failed()
        self._next += 1
        landed = None  # the event of an asynchronous copy into the host buffer
        if self._flat is not None:
            dest = self._flat[self._layout._start[j]:self._layout._start[j + 1]]
            # device -> host straight into place; into pinned memory asynchronously when the file comes later
            # (_complete() waits for it before anything reads the buffer)
            if self._async and hidden.is_cuda:
                # on a stream of its own, after everything queued so far (the sample's forward): the copy engine
                # moves sample j while the next sample computes. `hidden` is held until the caller's stream has
                # waited for its copy (queued after the next sample's work), and only then given back to that
                # stream's memory: no block waits on another stream's event, no pool grows
                compute = torch.cuda.current_stream(hidden.device)
                self._copies = side_stream(hidden.device, "to-host")
                self._copies.wait_stream(compute)
                with torch.cuda.stream(self._copies):
                    dest.copy_(hidden.reshape(-1), non_blocking=True)
                landed = self._copies.record_event()
                self._held.append((hidden, landed))
                if len(self._held) > 1:
                    compute.wait_event(self._held.pop(0)[1])
            else:
                dest.copy_(hidden.reshape(-1))
            buf = dest
        else:
            buf = hidden.reshape(-1).to("cpu").contiguous()
        if self._stream:  # the writer waits for this copy (landed), not for the whole stream
            self._queue.put((j, landed))
        elif self._thread is not None:
            self._queue.put(buf)

    def _complete(self) -> None:
        """Every sample of this boundary is in the host buffer (the asynchronous copies have landed)."""
        if self._copies is not None:
            self._copies.synchronize()
        self._held.clear()

    def commit(self, dest: str | None) -> tuple[Activations, str, int]:
        """Finish: dest None keeps the data where it is (RAM, or the temp file), else the temp file is fsynced and
        renamed to dest durably. Returns (activations, digest of the file ("algo:hex"), file size)."""
        if self._next != len(self.shapes):
            raise ValueError(f"boundary has {self._next} of {len(self.shapes)} samples")
        self._complete()
        self._finish_thread()
        self._raise_if_failed()
        if self._later and self._tmp is not None and not self._stream:  # the file is written now, from the buffer
            self._open()
            self._write_flat(self._flat)
        path = self._tmp
        if self._fd is not None:
            self._seal()
            os.close(self._fd)
            self._fd = None
            if dest is not None:
                self._place(dest)
                path = dest
        if self._flat is not None:
            acts = Activations(self.feeds, self.shapes, self.dtype, flat=self._flat)
        else:
            acts = Activations(self.feeds, self.shapes, self.dtype, path=path, data_offset=self._data_offset)
        self._flat = None
        return acts, f"{durable.ALGO}:{self._hash.hexdigest()}", self._size

    def commit_later(self, dest: str, before_sync: Callable[[], None] = lambda: None
                     ) -> tuple[Activations, "PendingWrite"]:
        """In RAM: the Activations now; the file written from the buffer, fsynced and renamed to `dest` by a thread
        (`before_sync()` called there first: a fault point for tests). The buffer is read-only until the
        PendingWrite has ended (wait or abort)."""
        if self._next != len(self.shapes):
            raise ValueError(f"boundary has {self._next} of {len(self.shapes)} samples")
        if not self._later or self._tmp is None:
            raise ValueError("commit_later needs a boundary made with later=True, held in RAM, and a temp file")
        self._complete()
        flat, self._flat = self._flat, None
        return Activations(self.feeds, self.shapes, self.dtype, flat=flat), PendingWrite(self, dest, flat, before_sync)

    def peek(self) -> Activations | None:
        """Every sample, once all have come and are held in RAM, as Activations over the same memory (None
        otherwise): read-only, for a reader beside the commit, which still makes them durable and hands them over."""
        if self._flat is None or self._next != len(self.shapes):
            return None
        self._complete()
        return Activations(self.feeds, self.shapes, self.dtype, flat=self._flat)

    def _finish_thread(self) -> None:
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join()  # bounded: the writer drains a finite queue (and its writes) and exits on None
            self._thread = None

    def _place(self, dest: str) -> None:
        """The finished (sealed) temp file at `dest`: durably (the folder fsynced), or only renamed without `sync`."""
        if self._sync:
            durable.place(self._tmp, dest)
        else:
            os.replace(self._tmp, dest)

    def _write_flat(self, buffer: torch.Tensor) -> None:
        flat = _bytes_of(buffer)
        if not self._sync:  # no disk to wait for: the copies into the page cache are the cost, in parallel
            self._write_parallel(flat)
            return
        # to be fsynced: past the page cache where the filesystem allows (O_DIRECT, several threads; the buffer and
        # the samples' offset are 4 KiB-aligned), hashed meanwhile
        durable.write_direct(self._fd, self._tmp, flat, self._size, self._hash.update)
        self._size += len(flat)

    def _write_parallel(self, flat) -> None:
        # WRITERS threads each write (pwrite) a contiguous part at its offset while this thread hashes the whole
        # buffer in order (xxh3 at ~25 GB/s: never the slower side); the file is the one _write would have made
        base, n = self._size, len(flat)
        step = -(-n // WRITERS) if n else 1
        with concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix="boundary-part") as pool:
            parts = [pool.submit(durable.pwrite_all, self._fd, memoryview(flat[a:a + step]), base + a)
                     for a in range(0, n, step)]
            self._hash.update(memoryview(flat))
            for part in parts:
                part.result()  # bounded: one part's writes into the page cache
        self._size += n

    def abort(self) -> None:
        """Drop a boundary that will not be committed (the layer failed); removes the temp file."""
        if self._copies is not None:  # no copy still writes into the buffer, or reads a sample, once dropped
            self._copies.synchronize()
        self._held.clear()
        if self._thread is not None:
            self._error = self._error or RuntimeError("aborted")
            while self._thread.is_alive():
                try:
                    self._queue.put(None, timeout=0.1)
                except queue.Full:
                    continue
                self._thread.join()  # bounded: the thread exits on the None just queued
            self._thread = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        if self._tmp is not None:
            try:
                os.unlink(self._tmp)
            except FileNotFoundError:
                pass
        self._flat = None

    # ---- the writer thread: append and hash while the main thread computes the next sample ----------------
    def _drain(self) -> None:
        while True:
            buf = self._queue.get()  # bounded: commit/abort end it with None
            if buf is None:
                return
            if self._error is not None:
                continue  # keep draining so put() never blocks on a dead writer
            try:
                self._write(memoryview(_bytes_of(buf)))
                if self._sync and self._size - self._synced >= SYNC_EVERY:
                    # start the disk writing now, beside the computation, instead of all of it at commit's fsync
                    # (with much RAM the kernel would otherwise hold gigabytes of dirty pages until then)
                    os.fdatasync(self._fd)
                    self._synced = self._size
            except BaseException as exc:  # noqa: BLE001 - reported by put()/commit() on the main thread
                self._error = exc

    def _drain_streamed(self) -> None:
        # stream=True: each sample, once its copy into the host buffer has landed, is hashed here (in sample order:
        # the digest is the one _write would make) and written at its offset by one of WRITERS threads
        pool = concurrent.futures.ThreadPoolExecutor(WRITERS, thread_name_prefix="boundary-part")
        parts = []
        try:
            while True:
                item = self._queue.get()  # bounded: commit_later's PendingWrite or abort end it with None
                if item is None:
                    break
                if self._error is not None:
                    continue  # keep draining: the boundary is being dropped
                j, landed = item
                try:
                    if landed is not None:
                        landed.synchronize()
                    lo, hi = self._layout._start[j], self._layout._start[j + 1]
                    data = memoryview(_bytes_of(self._flat_ref[lo:hi]))
                    parts.append(pool.submit(durable.pwrite_all, self._fd, data,
                                             self._data_offset + lo * self.dtype.itemsize))
                    self._hash.update(data)
                    self._size += len(data)
                except BaseException as exc:  # noqa: BLE001 - reported by commit_later's PendingWrite or put()
                    self._error = exc
            for part in parts:
                try:
                    part.result()  # bounded: one sample's write into the page cache
                except BaseException as exc:  # noqa: BLE001
                    self._error = self._error or exc
        finally:
            pool.shutdown(wait=True)
            self._flat_ref = None

    def _write(self, data: memoryview) -> None:
        self._hash.update(data)
        while len(data):
            n = os.write(self._fd, data)
            data = data[n:]
            self._size += n

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error


class PendingWrite:
    """A boundary file being written from its RAM buffer in the background (BoundaryWriter.commit_later)."""

    def __init__(self, writer: BoundaryWriter, dest: str, flat: torch.Tensor, before_sync: Callable[[], None]):
        self._writer, self._dest, self._flat, self._before_sync = writer, dest, flat, before_sync
        self._result: tuple[str, int] | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="boundary-durable", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        w = self._writer
        try:
            if w._stream:  # the samples are being written already: what is left of them
                w._finish_thread()
                w._raise_if_failed()
            else:
                w._open()
                w._write_flat(self._flat)
            self._before_sync()
            w._seal()
            if w._sync:
                # read back only on a resume: leave no 2 GB of page cache behind (where the file went through it:
                # a filesystem without O_DIRECT)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(w._fd, 0, 0, os.POSIX_FADV_DONTNEED)
            os.close(w._fd)
            w._fd = None
            w._place(self._dest)
            self._result = (f"{durable.ALGO}:{w._hash.hexdigest()}", w._size)
        except BaseException as exc:  # noqa: BLE001 - raised by wait() on the caller's thread
            self._error = exc

    def wait(self) -> tuple[str, int]:
        """Block until the file is durable at its name; its (digest, size). Raises what the write raised. No deadline
        of its own, as for the synchronous fsync it replaces: the heartbeats go on, `resources.part_timeout` bounds
        the layer (and the write had the whole next layer's time to finish)."""
        self._thread.join()  # bounded: one file's write and fsync (see the docstring)
        self._flat = None
        if self._error is not None:
            self._writer.abort()
            raise self._error
        return self._result

    def abort(self) -> None:
        """Wait for the thread, then remove what it wrote (a failed or dropped layer's next inputs). A streamed
        write still under way skips the samples it has not started."""
        if self._writer._stream:
            self._writer._error = self._writer._error or RuntimeError("aborted")
        self._thread.join()  # bounded: one file's write and fsync
        self._flat = None
        self._writer.abort()
        if self._result is not None:
            durable.unlink_quietly(self._dest)


def host_buffer(numel: int, dtype: torch.dtype, pin: bool) -> torch.Tensor:
    """Host memory for one boundary; page-locked when `pin` (copies to and from a GPU at full speed), registered
    rather than cudaHostAlloc'd (child.staging.pinned_host_buffer: about 4x faster to make, 2.1 GB per boundary at
    the 8B shape); the caller reuses a released one where it can (BoundaryWriter's `buffer`)."""
    if not pin:  # mapped: page-aligned, so its file is written with O_DIRECT (durable.write_direct)
        nbytes = numel * dtype.itemsize
        mapping = mmap.mmap(-1, max(nbytes, 1), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        return torch.frombuffer(mapping, dtype=torch.uint8)[:nbytes].view(dtype)
    from child.staging import pinned_host_buffer

    return pinned_host_buffer(numel * dtype.itemsize).view(dtype)


def host_buffer_meanwhile(numel: int, dtype: torch.dtype, device: torch.device) -> concurrent.futures.Future:
    """A pinned host_buffer made on a thread of its own (`device` current there) while the caller goes on: the
    first layer's outputs need one as large as its inputs, and making it (page faults, registration: ~0.2 s per
    GB) need not wait for the layer. A Future of the buffer."""
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="boundary-alloc")

    def make():
        with torch.cuda.device(device):
            return host_buffer(numel, dtype, True)

    future = pool.submit(make)
    pool.shutdown(wait=False)  # the thread ends with its one task
    return future


_SIDE_STREAMS: dict = {}


def side_stream(device: torch.device, purpose: str) -> "torch.cuda.Stream":
    """One CUDA stream per device and purpose for the process's life (copies beside the compute)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, purpose)
    if key not in _SIDE_STREAMS:
        _SIDE_STREAMS[key] = torch.cuda.Stream(index)
    return _SIDE_STREAMS[key]


def _pread_into(fd: int, buf, offset: int) -> None:
    view = memoryview(buf).cast("B")
    while len(view):
        n = os.preadv(fd, [view], offset)
        if n == 0:
            raise BoundaryCorrupt("boundary file is shorter than its header says")
        view, offset = view[n:], offset + n
