"""GPU facts from NVML through ctypes (as torch's own NVML-based checks read them): no torch import, no CUDA
context, so the process that asks can still fork workers that use the GPU.

    device_count()           physical GPUs, -1 without NVML
    cuda_capability(i)       (major, minor) of physical GPU i, None where NVML cannot answer

Owns the NVML calls only; which GPU a torch index names (CUDA_VISIBLE_DEVICES) is the caller's business.
"""
from __future__ import annotations

import ctypes


def _library():
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return None
    return nvml if nvml.nvmlInit_v2() == 0 else None


def device_count() -> int:
    nvml = _library()
    count = ctypes.c_int(-1)
    if nvml is None or nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != 0:
        return -1
    return count.value


def cuda_capability(physical_index: int) -> tuple[int, int] | None:
    nvml = _library()
    handle, major, minor = ctypes.c_void_p(), ctypes.c_int(), ctypes.c_int()
    if nvml is None or nvml.nvmlDeviceGetHandleByIndex_v2(physical_index, ctypes.byref(handle)) != 0 \
            or nvml.nvmlDeviceGetCudaComputeCapability(handle, ctypes.byref(major), ctypes.byref(minor)) != 0:
        return None
    return major.value, minor.value
