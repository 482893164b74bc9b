"""One worker's host buffer for a part's output: quantized tensors come off the GPU into pinned memory it reuses.

    backend: quantized tensors on cuda ──copy (non-blocking, DMA)──▶ views of one pinned host buffer ──▶ writer
                                                                     (kept for the next part; grown when a part
                                                                      needs more; given back by release())

Why: a tensor copied to fresh pageable memory (`t.to("cpu")`) pays the page faults of its new pages and a bounce
through the driver's staging buffer. Measured on an H200 host (2026-11-30, bench/layer_profile.py): that copy was
94-99% of an 8B-shaped layer's quantize stage (FP8_DYNAMIC 0.13 of 0.16 s for 218 MB, 1.7 GB/s). Into memory that is
already mapped and registered with CUDA (cudaHostRegister) the same copy runs at the bus's speed.

The views stay valid until the next `to_host` or `release`: the worker writes a part's shard before it quantizes
the next one (one part in flight), so one buffer serves every part. Tensors that are not plain CUDA tensors
(torchao's subclasses, host tensors) are copied to the host as before. Owns this buffer only; it never decides
what is written.
"""
from __future__ import annotations

import mmap
import sys
import weakref

import torch

ALIGN = 256  # every view starts on a boundary divisible by every dtype's itemsize
HUGE = 2 << 20  # the buffer's size is rounded up to whole 2 MiB pages
_MADV_HUGEPAGE = 14  # transparent huge pages for this anonymous mapping (where the kernel allows them)


def aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


class HostStaging:
    """A reusable host buffer for one worker's outputs, pinned when the worker's device is a GPU."""

    def __init__(self, device: str, *, pin: bool | None = None, stage_host: bool = False) -> None:
        """`pin`: register the buffer with CUDA (default: when `device` is a CUDA device). `stage_host`: also copy
        host tensors into the buffer (tests use it to exercise the buffer on a machine without a GPU)."""
        self.device = torch.device(device)
        self._pin = self.device.type == "cuda" if pin is None else pin
        self._stage_host = stage_host
        self._held: list = []  # [mmap, uint8 tensor over it, registered pointer or 0]
        self._finalizer = weakref.finalize(self, _free, self._held)

    @property
    def capacity(self) -> int:
        return self._held[1].numel() if self._held else 0

    def to_host(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor on the host, contiguous, same names, dtypes, shapes and values. Plain tensors on a GPU
        (and host tensors, with stage_host) become views of the buffer: the previous call's views are overwritten."""
        staged = {k: v for k, v in tensors.items() if self._stages(v)}
        if not staged:
            return plain_to_host(tensors)
        self._reserve(sum(aligned(_nbytes(v)) for v in staged.values()))
        buf, offset, out = self._held[1], 0, {}
        for k, v in tensors.items():
            if k not in staged:
                out[k] = v.to("cpu").contiguous()
                continue
            n = _nbytes(v)
            view = buf[offset:offset + n].view(v.dtype).view(v.shape)
            view.copy_(v, non_blocking=bool(self._held[2]))  # asynchronous only into registered memory
            offset += aligned(n)
            out[k] = view
        for device in {v.device for v in staged.values() if v.device.type == "cuda"}:
            # the copies were asynchronous: done before anyone reads the views (the stream they were queued on,
            # not every stream of the device)
            torch.cuda.current_stream(device).synchronize()
        return out

    def release(self) -> None:
        """Give the buffer back (unregister and unmap); the next to_host allocates a new one."""
        _free(self._held)

    def _stages(self, t: torch.Tensor) -> bool:
        if type(t) is not torch.Tensor:  # a tensor subclass (torchao) knows its own way to the host
            return False
        if t.device.type == "cpu":
            return self._stage_host
        return t.device.type == "cuda" and self._pin

    def _reserve(self, nbytes: int) -> None:
        if nbytes <= self.capacity:
            return
        _free(self._held)
        size = aligned(max(nbytes, 1), HUGE)
        mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            mapping.madvise(_MADV_HUGEPAGE)
        except (OSError, AttributeError, ValueError):
            pass  # no transparent huge pages here: 4 KiB pages, only slower to fault in
        buf = torch.frombuffer(mapping, dtype=torch.uint8)
        ptr = 0
        if self._pin:
            cudart = torch.cuda.cudart()
            err = cudart.cudaHostRegister(buf.data_ptr(), buf.numel(), 0)
            if err == cudart.cudaError.success:
                ptr = buf.data_ptr()
            else:  # still a working host buffer, copied into synchronously: slower, never wrong
                print(f"staging: cudaHostRegister of {size} bytes failed ({err}); copying into unpinned memory",
                      file=sys.stderr, flush=True)
        self._held[:] = [mapping, buf, ptr]


class DeviceStaging:
    """A calibrated worker's way onto the GPU for the layers it reads ahead: host tensors (pageable: a checkpoint's
    mapped file) copied in CHUNK-sized pieces through two small pinned buffers in turn, on a stream of its own. A
    pageable tensor's `.to("cuda")` goes through the driver's own staging on the default stream, so the kernels queued
    after it wait for it (an 8B layer's 0.41 GB: 0.07-0.13 s, measured); through pinned memory on a side stream the
    copy runs beside them. Costs 2 x CHUNK of pinned host memory, made on first use. A data-free worker, whose copy
    has no kernels of its own to run beside, keeps the driver's copy (child/exporter.py, _onto_device)."""

    CHUNK = 8 << 20

    def __init__(self, device: str) -> None:
        self.device = torch.device(device)
        self._chunks: list[torch.Tensor] = []
        self._landed: list = [None, None]  # each chunk's last copy out of it (a CUDA event)
        self._stream = None

    def to_device(self, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Every tensor on the device (same names, dtypes, shapes, values), complete when this returns (for any
        stream): allocated from the calling thread's current stream, whose queued work the copies wait for (memory
        it freed may still be in use there)."""
        if not self._chunks:
            self._chunks = [pinned_host_buffer(self.CHUNK) for _ in range(2)]
            self._stream = torch.cuda.Stream(self.device)
        out = {k: torch.empty(v.shape, dtype=v.dtype, device=self.device) for k, v in tensors.items()}
        self._stream.wait_stream(torch.cuda.current_stream(self.device))
        turn = 0
        for k, v in tensors.items():
            src, dst = _bytes_of(v.contiguous()), _bytes_of(out[k])
            for a in range(0, src.numel(), self.CHUNK):
                n = min(self.CHUNK, src.numel() - a)
                if self._landed[turn] is not None:
                    self._landed[turn].synchronize()  # bounded: one chunk's copy
                chunk = self._chunks[turn][:n]
                chunk.copy_(src[a:a + n])
                with torch.cuda.stream(self._stream):
                    dst[a:a + n].copy_(chunk, non_blocking=True)
                self._landed[turn] = self._stream.record_event()
                turn ^= 1
        self._stream.synchronize()  # bounded: the last chunks' copies
        return out


def _bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def pinned_host_buffer(nbytes: int) -> torch.Tensor:
    """`nbytes` of page-locked host memory (a uint8 tensor) for asynchronous copies to and from the current GPU:
    mapped, its pages faulted in by torch's threads, then registered (cudaHostRegister), instead of cudaHostAlloc,
    which maps and locks every page on one thread (measured on an H200 host, DESIGN: 4 GiB cudaHostAlloc'd in 1.84 s,
    allocated + touched in 0.21 s and registered in 0.19 s). Unregistered once its last view is gone, after the device
    has finished every copy queued until then. Where registering fails, plain host memory: slower, never wrong."""
    size = aligned(max(nbytes, 1), HUGE)
    mapping = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        mapping.madvise(_MADV_HUGEPAGE)
    except (OSError, AttributeError, ValueError):
        pass
    buf = torch.frombuffer(mapping, dtype=torch.uint8)
    buf.zero_()  # the page faults on torch's intra-op threads, not one by one inside cudaHostRegister
    cudart = torch.cuda.cudart()
    err = cudart.cudaHostRegister(buf.data_ptr(), size, 0)
    if err != cudart.cudaError.success:
        print(f"staging: cudaHostRegister of {size} bytes failed ({err}); copying through unpinned memory",
              file=sys.stderr, flush=True)
        return buf[:nbytes]
    # the mapping lives as long as any tensor over it (torch.frombuffer holds it); its finalizer runs before munmap
    weakref.finalize(mapping, _unregister, buf.data_ptr(), torch.cuda.current_device()).atexit = False
    return buf[:nbytes]


def _unregister(ptr: int, device: int) -> None:
    torch.cuda.synchronize(device)  # no asynchronous copy from or into it is still in flight
    torch.cuda.cudart().cudaHostUnregister(ptr)


def plain_to_host(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Every tensor copied to fresh host memory, contiguous: a backend's default way off the device."""
    return {k: v.to("cpu").contiguous() for k, v in tensors.items()}


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _free(held: list) -> None:
    if not held:
        return
    ptr = held[2]
    held.clear()
    if ptr:
        torch.cuda.cudart().cudaHostUnregister(ptr)
    # Not mapping.close(): torch.frombuffer keeps a reference to the mmap but no buffer export, so close() would
    # unmap memory that a caller's view still points at. The mapping goes with its last reference.
