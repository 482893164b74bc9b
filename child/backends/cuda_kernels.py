"""The GPU path's own CUDA kernels (child/backends/warp_softmax.py, rotary.py): compiled at run time by NVRTC, loaded
through torch's module loader, launched with little Python per call.

torch's launcher (`torch.cuda._utils._CudaKernel.__call__`) builds a ctypes object per argument, looks up the current
stream as a `torch.cuda.Stream` and checks every tensor, at every launch. A calibrated layer launches
these kernels three times a sample and pass (the rotary embedding twice, the softmax once), 128 samples, 21 passes
of the attention a layer, and such a pass is bound by the host's Python as much as by the GPU (measured on an H100:
its kernels 0.113 s of a 0.138 s pass). `Kernel` packs all arguments into one ctypes structure whose layout is
fixed once per kernel (a pointer for "p", a C int for "i") and calls cuLaunchKernel on the raw current stream.
"""
from __future__ import annotations

import ctypes

import torch

__all__ = ["nvrtc_ptx", "Arguments", "Kernel"]


def nvrtc_ptx(source: str, name: str, arch: str) -> bytes:
    """`source` compiled to PTX by NVRTC with nvcc's defaults (torch.cuda._compile_kernel's steps, without the
    CUDA toolkit's include directory it insists on: these sources include nothing)."""
    from torch.cuda import _utils

    nvrtc = getattr(_utils, "_get_gpu_rtc_library", None) or _utils._get_nvrtc_library  # named so before torch 2.9
    nvrtc = nvrtc()
    prog = ctypes.c_void_p()
    check = _nvrtc_checker(nvrtc)
    check(nvrtc.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None))
    try:
        options = [f"--gpu-architecture=compute_{arch}".encode(), b"--std=c++17"]
        result = nvrtc.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
        if result != 0:
            size = ctypes.c_size_t()
            nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value)
            nvrtc.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC: {log.value.decode(errors='replace').strip()[:500]}")
        size = ctypes.c_size_t()
        check(nvrtc.nvrtcGetPTXSize(prog, ctypes.byref(size)))
        ptx = ctypes.create_string_buffer(size.value)
        check(nvrtc.nvrtcGetPTX(prog, ptx))
        return ptx.raw
    finally:
        nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))


def _nvrtc_checker(nvrtc):
    nvrtc.nvrtcGetErrorString.restype = ctypes.c_char_p

    def check(result: int) -> None:
        if result != 0:
            raise RuntimeError(f"NVRTC: {nvrtc.nvrtcGetErrorString(result).decode()}")
    return check


_launch_kernel = []  # cuLaunchKernel with a prototype of our own (torch's handle on libcuda is left as it is)


def _cu_launch_kernel():
    if not _launch_kernel:
        from torch.cuda._utils import _get_gpu_runtime_library

        address = ctypes.cast(_get_gpu_runtime_library().cuLaunchKernel, ctypes.c_void_p).value
        u = ctypes.c_uint
        prototype = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, u, u, u, u, u, u, u, ctypes.c_void_p,
                                     ctypes.c_void_p, ctypes.c_void_p)
        _launch_kernel.append(prototype(address))
    return _launch_kernel[0]


class Arguments:
    """A kernel's parameters laid out once: `signature` gives them in order, "p" a pointer (pass `tensor.data_ptr()`),
    "i" a C int (pass a Python int under 2^31: a C int takes its low 32 bits)."""

    def __init__(self, signature: str):
        if set(signature) - {"p", "i"}:
            raise ValueError(f"a kernel signature is made of 'p' and 'i', not {signature!r}")
        fields = [(f"a{i}", ctypes.c_void_p if kind == "p" else ctypes.c_int) for i, kind in enumerate(signature)]
        self._values = type("arguments", (ctypes.Structure,), {"_fields_": fields})
        self._offsets = [getattr(self._values, field).offset for field, _ in fields]
        self._pointers = ctypes.c_void_p * len(fields)

    def pack(self, *args: int):
        """(the arguments packed, the array of pointers to each that cuLaunchKernel takes): keep both alive until
        the launch returns."""
        values = self._values(*args)
        base = ctypes.addressof(values)
        return values, self._pointers(*[base + offset for offset in self._offsets])


class Kernel:
    """The function `name` of `source`, built for `device`, its parameters as `signature` says (`Arguments`)."""

    def __init__(self, source: str, name: str, device: torch.device, signature: str):
        from torch.cuda._utils import _cuda_load_module

        self._arguments = Arguments(signature)
        major, minor = torch.cuda.get_device_capability(device)
        with torch.cuda.device(device):
            self._loaded = _cuda_load_module(nvrtc_ptx(source, name, f"{major}{minor}"), [name])[name]  # keeps the
        self._function = self._loaded.func  # module loaded
        self._device = device.index if device.index is not None else torch.cuda.current_device()

    def __call__(self, blocks: int, threads: tuple[int, int], *args: int) -> None:
        """One launch on the device's current stream: `blocks` blocks of threads[0] x threads[1] threads."""
        if torch.cuda.current_device() != self._device:  # cuLaunchKernel launches in the current device's context
            with torch.cuda.device(self._device):
                return self(blocks, threads, *args)
        values, pointers = self._arguments.pack(*args)
        stream = torch._C._cuda_getCurrentRawStream(self._device)
        result = _cu_launch_kernel()(self._function, blocks, 1, 1, threads[0], threads[1], 1, 0, stream, pointers,
                                     None)
        if result != 0:
            raise RuntimeError(f"cuLaunchKernel failed with CUDA error {result}")
