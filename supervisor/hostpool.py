"""The pool of host memory a released model lives in: reusable, pinned, and shared with the child.

    PinnedPool
      chunk 0: memfd ── mmap(MAP_SHARED) ── uint8 tensor ── cudaHostRegister (when CUDA is up)
      chunk 1: ...                                            ▲ release() copies device storages into views
      shared(): [(fd, size)] ──▶ the child maps the same pages (child/pool_reader.py), no copy on disk

Buffers are plain host memory registered with cudaHostRegister when CUDA is available: measured on an H200,
registering existing memory costs 0.19 s per 4 GiB against 1.84 s for cudaHostAlloc, and copies into it run at
55 GB/s (pageable: 9-16 GB/s). Each chunk is a memfd (anonymous shared memory, not /dev/shm: container /dev/shm
is often 64 MB, and a memfd disappears with its last fd and mapping, so a crash leaves nothing behind), so the
pool the release fills anyway is also what a child reads a live model from: the pool IS the host copy.
A pool serves one released model at a time; keep it for the next cycle and call close() to give the memory back.

Owns the memory only: it never looks at a model (supervisor/offload.py does) and never starts a child.
"""
from __future__ import annotations

import mmap
import os
import weakref

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
        cursors = [0] * len(self._chunks)
        views: list[torch.Tensor | None] = [None] * len(sizes)
        spill = []
        for i, n in enumerate(sizes):
            for c, chunk in enumerate(self._chunks):
                if cursors[c] + aligned(n) <= chunk.numel():
                    views[i] = chunk[cursors[c] : cursors[c] + n]
                    cursors[c] += aligned(n)
                    break
            else:
                spill.append(i)
        if spill:
            chunk = self._new_chunk(sum(aligned(sizes[i]) for i in spill))
            offset = 0
            for i in spill:
                views[i] = chunk[offset : offset + sizes[i]]
                offset += aligned(sizes[i])
        return views  # type: ignore[return-value]

    def _new_chunk(self, nbytes: int) -> torch.Tensor:
        nbytes = max(nbytes, 1)
        fd = os.memfd_create("supervisor-pool", os.MFD_CLOEXEC)  # inherited only where a child is given it
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            raise
        chunk = torch.frombuffer(mapping, dtype=torch.uint8)
        self._fds.append(fd)
        self._maps.append(mapping)
        pin = torch.cuda.is_available() if self._pin is None else self._pin
        if pin:
            # Fault the pages in with torch's threads first: cudaHostRegister faults them one by one in a single
            # thread. Measured for 16 GiB on an H200 host (bench/pool_fill_bench.py --pair, 2026-11-30): 4.6-4.8 s
            # to fill, register and copy down, against 7.1 s.
            chunk.zero_()
            # cudaHostRegisterPortable (1): pinned for every device's context, so one pool serves a multi-GPU map.
            torch.cuda.check_error(torch.cuda.cudart().cudaHostRegister(chunk.data_ptr(), chunk.numel(), 1))
            self._registered.append(chunk.data_ptr())
        self._chunks.append(chunk)
        return chunk


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
