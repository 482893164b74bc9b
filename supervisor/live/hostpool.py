"""The pool of host memory a released model lives in: reusable, pinned, and shared with the child.

    PinnedPool
      chunk 0: memfd ── mmap(MAP_SHARED) ── uint8 tensor ── faulted in, cudaHostRegister (when CUDA is up)
      chunk 1: ...     (the chunks one lease adds are made ready side by side, a thread each)
                                                              ▲ release() copies device storages into views
      shared(): [(fd, size)] ──▶ the child maps the same pages (child/sources/live.py), no copy on disk

Buffers are plain host memory registered with cudaHostRegister when CUDA is available: measured on an H200,
registering existing memory costs 0.19 s per 4 GiB against 1.84 s for cudaHostAlloc, and copies into it run at
55 GB/s (pageable: 9-16 GB/s). Faulting new pages in is what costs (a 16 GiB first release: 7 s with one memfd,
1.8-2.5 s with 16 faulted side by side; see _new_chunks). Each chunk is a memfd (anonymous shared memory, not
/dev/shm: container /dev/shm is often 64 MB, and a memfd disappears with its last fd and mapping, so a crash
leaves nothing behind), so the pool the release fills anyway is also what a child reads a live model from: the
pool IS the host copy.
A pool serves one released model at a time; keep it for the next cycle and call close() to give the memory back.

Owns the memory only: it never looks at a model (supervisor/live/offload.py does) and never starts a child.
"""
from __future__ import annotations

import mmap
import os
import weakref
from concurrent.futures import ThreadPoolExecutor

import torch

from supervisor.errors import OffloadError

# Every view starts on a 256-byte boundary: divisible by every dtype's itemsize (set_ needs that).
ALIGN = 256


class PinnedPool:
    """Host byte buffers in shared memory, reused across release/restore cycles (see the module docstring)."""

    def __init__(self, *, pin: bool | None = None) -> None:
        self._pin = pin
        self._chunks: list[torch.Tensor] = []
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self._registered: list[int] = []
        self._leased = False
        self._closed = False
        self._layout: tuple[tuple[int, ...], list[tuple[int, int]]] | None = None  # see _place
        # Unregister before the memory can be freed, also when the pool is dropped without close().
        self._finalizer = weakref.finalize(self, _free, self._registered, self._chunks, self._maps, self._fds)

    @property
    def capacity(self) -> int:
        """Bytes of host memory the pool holds."""
        return sum(chunk.numel() for chunk in self._chunks)

    @property
    def pinned(self) -> bool:
        return bool(self._registered)

    @property
    def leased(self) -> bool:
        """True while a released model lives in this pool's buffers."""
        return self._leased

    def shared(self) -> list[tuple[int, int]]:
        """(fd, bytes) of every chunk: a child that inherits these fds maps the pool's memory itself."""
        return [(fd, chunk.numel()) for fd, chunk in zip(self._fds, self._chunks)]

    def locate(self, tensor: torch.Tensor) -> tuple[int, int] | None:
        """(chunk index, byte offset) of a host tensor's first element inside the pool, or None if it is elsewhere."""
        if tensor.device.type != "cpu":
            return None
        ptr = tensor.data_ptr()
        for i, chunk in enumerate(self._chunks):
            start = chunk.data_ptr()
            if start <= ptr < start + chunk.numel():
                return i, ptr - start
        return None

    def close(self) -> None:
        """Unpin and free the buffers; the pool cannot be used afterwards."""
        if self._leased:
            raise OffloadError("this PinnedPool still holds a released model: restore() it before close()")
        self._closed = True
        self._finalizer()

    def check_usable(self) -> None:
        if self._closed:
            raise OffloadError("this PinnedPool is closed: create a new one")
        if self._leased:
            raise OffloadError("this PinnedPool already holds a released model: restore that one or pass another pool")

    def lease(self, sizes: list[int]) -> list[torch.Tensor]:
        """One uint8 host view per requested size; grows the pool only by what it lacks."""
        self.check_usable()
        views = self._place(sizes)
        self._leased = True
        return views

    def end_lease(self) -> None:
        self._leased = False

    def _place(self, sizes: list[int]) -> list[torch.Tensor]:
        """A view per size. The same sizes as the last lease (the same model released again) get the same places,
        so a pool made to measure is reused whole; other sizes go first-fit into the chunks, the rest into new
        ones."""
        if self._layout is None or self._layout[0] != tuple(sizes):
            self._layout = (tuple(sizes), self._fit(sizes))
        return [self._chunks[c][offset : offset + n] for (c, offset), n in zip(self._layout[1], sizes)]

    def _fit(self, sizes: list[int]) -> list[tuple[int, int]]:
        """(chunk index, byte offset) for each size; makes the chunks the sizes that do not fit need."""
        cursors = [0] * len(self._chunks)
        spots: list[tuple[int, int] | None] = [None] * len(sizes)
        spill = []
        for i, n in enumerate(sizes):
            for c, chunk in enumerate(self._chunks):
                if cursors[c] + aligned(n) <= chunk.numel():
                    spots[i] = (c, cursors[c])
                    cursors[c] += aligned(n)
                    break
            else:
                spill.append(i)
        if spill:
            bins = _bins([(aligned(sizes[i]), i) for i in spill], _bin_count(sum(aligned(sizes[i]) for i in spill)))
            first = len(self._chunks)
            self._new_chunks([sum(n for n, _ in b) for b in bins])
            for c, members in enumerate(bins, start=first):
                offset = 0
                for n, i in members:
                    spots[i] = (c, offset)
                    offset += n
        return spots  # type: ignore[return-value]

    def _new_chunks(self, sizes: list[int]) -> None:
        """One memfd chunk per size, made ready side by side: a chunk's pages are faulted in by its own thread,
        then it is registered with CUDA. Measured for 16 GiB on an H200 host (bench/pool_fill_bench.py --pair,
        2026-11-30): 16 chunks, one thread each, 1.8 s to fault, register and copy down; one chunk faulted by
        torch's threads 4.9-5.1 s; one chunk left to cudaHostRegister to fault (one page at a time) 7.0 s. Faults
        in one memfd contend inside the kernel; in separate memfds they do not."""
        pin = torch.cuda.is_available() if self._pin is None else self._pin
        made: list[tuple[int, mmap.mmap, torch.Tensor]] = []
        registered: list[int] = []
        try:
            for nbytes in sizes:
                made.append(_memfd_chunk(max(nbytes, 1)))
            if pin:
                with ThreadPoolExecutor(max_workers=len(made), thread_name_prefix="pool-fill") as ex:
                    futures = [ex.submit(_ready, mapping, chunk) for _, mapping, chunk in made]
                registered = [f.result() for f in futures if f.exception() is None]
                for f in futures:
                    f.result()  # the first failure, after every success is known (and will be unregistered)
        except BaseException:
            _free(registered, [], [], [m[0] for m in made])
            raise
        for fd, mapping, chunk in made:
            self._fds.append(fd)
            self._maps.append(mapping)
            if pin:
                self._registered.append(chunk.data_ptr())
            self._chunks.append(chunk)


# A new chunk's bytes are split over about this many memfds (each made ready by its own thread), at least this big.
FILL_THREADS = min(16, os.cpu_count() or 1)
MIN_BIN = 256 << 20


def _bin_count(total: int) -> int:
    return max(1, min(FILL_THREADS, total // MIN_BIN))


def _bins(items: list[tuple[int, int]], count: int) -> list[list[tuple[int, int]]]:
    """(size, key) items in `count` bins of about equal total size, biggest first (each item whole: a storage
    lives in one chunk); empty bins dropped."""
    bins: list[list[tuple[int, int]]] = [[] for _ in range(count)]
    totals = [0] * count
    for item in sorted(items, key=lambda it: -it[0]):
        b = totals.index(min(totals))
        bins[b].append(item)
        totals[b] += item[0]
    return [b for b in bins if b]


def _memfd_chunk(nbytes: int) -> tuple[int, mmap.mmap, torch.Tensor]:
    fd = os.memfd_create("supervisor-pool", os.MFD_CLOEXEC)  # inherited only where a child is given it
    try:
        os.ftruncate(fd, nbytes)
        mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return fd, mapping, torch.frombuffer(mapping, dtype=torch.uint8)


def _ready(mapping: mmap.mmap, chunk: torch.Tensor) -> int:
    """Fault the chunk's pages in (reading /dev/zero into it: the GIL is released for the read, so the threads
    fault side by side, and torch's own thread count is left alone), then pin it; the pinned pointer.
    cudaHostRegisterPortable (1): pinned for every device's context, so one pool serves a multi-GPU map."""
    view = memoryview(mapping)
    try:
        with open("/dev/zero", "rb", buffering=0) as zero:
            for start in range(0, len(view), 1 << 30):
                zero.readinto(view[start : start + (1 << 30)])
    except OSError:
        chunk.zero_()  # no /dev/zero to read: fault them with torch's threads
    finally:
        view.release()
    torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), chunk.numel(), 1))
    return chunk.data_ptr()


def _free(registered: list[int], chunks: list[torch.Tensor], maps: list[mmap.mmap], fds: list[int]) -> None:
    for ptr in registered:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    registered.clear()
    chunks.clear()
    # Not mapping.close(): torch.frombuffer keeps a reference to the mmap but no buffer export, so close() would
    # unmap memory that a tensor a caller kept still points at (no BufferError is raised). The mapping goes with
    # its last reference.
    maps.clear()
    for fd in fds:
        os.close(fd)
    fds.clear()


def aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN
