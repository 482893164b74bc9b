"""Which accelerator each worker sees, and whether it has room.

This module owns GPU visibility: parsing CUDA_VISIBLE_DEVICES the way the CUDA runtime does, giving each child
an environment in which its one device is the only one visible (so it is `cuda:0` inside the child), resolving
`--device` specs, and the free-memory check before a worker is started. It must never change `os.environ`
(children get a copy), never import torch for a "cpu" spec or at import time (the CLI starts fast), and never
initialise CUDA just to count devices (torch's NVML-based count keeps the parent fork-safe).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping

from shared.nvml import device_count as _nvml_count  # physical GPUs, -1 without NVML
from supervisor.errors import DeviceError  # noqa: F401 - re-exported; the hierarchy lives in errors.py

_CUDA_SPEC = re.compile(r"cuda(?::(\d+))?")


def parse_visible_devices(value: str | None) -> list[str] | None:
    """The entries of a CUDA_VISIBLE_DEVICES value, in order; None when unset (every device is visible).

    Like the CUDA runtime, parsing stops at the first invalid entry: "0,2,-1,3" shows devices 0 and 2, and
    "" or "-1" show none. Valid entries are ordinals, `GPU-<uuid>` and `MIG-<...>` identifiers.
    """
    if value is None:
        return None
    visible = []
    for raw in value.split(","):
        entry = raw.strip()
        if entry.isdigit():
            visible.append(str(int(entry)))
        elif entry.startswith(("GPU-", "MIG-")) and len(entry) > 4:
            visible.append(entry)
        else:
            break
    return visible


def child_env(device: str, base_env: Mapping[str, str] | None = None) -> dict[str, str]:
    """A copy of `base_env` (default os.environ) in which only `device` (parent numbering) is visible."""
    env = dict(os.environ if base_env is None else base_env)
    if device == "cpu":
        env["CUDA_VISIBLE_DEVICES"] = ""  # a CPU worker must not create a CUDA context on anyone's GPU
        return env
    index = _cuda_index(device)
    visible = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if visible is None:
        # Unset: the parent's cuda:N is ordinal N; the child inherits CUDA_DEVICE_ORDER, so "N" names the same GPU.
        env["CUDA_VISIBLE_DEVICES"] = str(index)
    elif index < len(visible):
        env["CUDA_VISIBLE_DEVICES"] = visible[index]
    else:
        raise DeviceError(
            f"{device} is not visible: CUDA_VISIBLE_DEVICES={env['CUDA_VISIBLE_DEVICES']!r} shows "
            f"{len(visible)} device(s); pick one of cuda:0..cuda:{len(visible) - 1} or widen CUDA_VISIBLE_DEVICES"
        )
    return env


def resolve_device(spec: str) -> str:
    """"auto" | "cpu" | "cuda" | "cuda:N" -> "cpu" or "cuda:N" that exists here."""
    spec = spec.strip().lower()
    if spec == "cpu":
        return "cpu"
    if spec == "auto":
        if parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES")) == []:
            return "cpu"  # GPUs hidden on purpose: no need to import torch to know it
        return "cuda:0" if _cuda_count() > 0 else "cpu"
    index = _cuda_index(spec)
    count = _cuda_count()
    if count == 0:
        raise DeviceError(f"--device {spec}: no CUDA device is visible here; use --device cpu (or auto)")
    if index >= count:
        raise DeviceError(f"--device {spec}: only {count} CUDA device(s) visible; use cuda:0..cuda:{count - 1}")
    return f"cuda:{index}"


def resolve_devices(spec: str) -> list[str]:
    """Every device a job's workers use: "cuda" and "auto" (with a GPU) mean every visible GPU, one worker slot
    each at least; "cuda:N" and "cpu" mean that one."""
    spec = spec.strip().lower()
    first = resolve_device(spec)
    if first == "cpu" or spec not in ("auto", "cuda"):
        return [first]
    return [f"cuda:{i}" for i in range(_cuda_count())]


# GPU exports get at least three workers in all when a layer is at most OVERLAP_MAX_LAYER_BYTES, two when bigger:
# one worker's write and fsync then overlap the others' read and quantization, and the disk has more than one shard
# in flight. Layers up to that size are on the GPU in every worker at once (each holds ~3 layers and a CUDA context:
# under 8 GiB); bigger ones (a large MoE's, GBs of experts) take turns on the device (device_stage_shared), where a
# third worker would add host memory (its layers read ahead) but no turn on the GPU.
OVERLAP_MAX_LAYER_BYTES = 1 << 30
GPU_WORKERS = 3  # measured on one H200, 8B-shaped (docs/benchmarks.md, eighth session): the work after start-up
# against the disk's write floor, FP8_DYNAMIC 1.26x with two workers and 1.06x with three, W4A16 1.50x and 1.29x
GPU_WORKERS_BIG_LAYERS = 2
# CPU exports: one worker per CPU_CORES_PER_WORKER cores and at least CPU_WORKERS: one worker's save, hash and fsync,
# and its Python between torch's calls, then overlap another's quantization. Measured on the 2-core VM, 8 layers of
# 125 MB (docs/benchmarks.md, ninth session): first part to last part 3.75-4.0 s with one worker of two threads,
# 2.83-3.07 s with two of one thread each.
CPU_WORKERS = 2
CPU_CORES_PER_WORKER = 4


def worker_slots(devices: list[str], workers: int, layer_bytes: int) -> list[str]:
    """The device of each worker slot. `workers` > 0 is taken as asked (spread round-robin over `devices`);
    0 means on GPUs one per GPU and at least GPU_WORKERS in all (GPU_WORKERS_BIG_LAYERS for layers over
    OVERLAP_MAX_LAYER_BYTES), those beyond one per GPU only as the host's free memory allows; on CPU one per
    CPU_CORES_PER_WORKER cores and at least CPU_WORKERS, as the free memory allows (they split the cores: torch's
    threads do the rest), each wanting worker_bytes."""
    import psutil

    by_memory = psutil.virtual_memory().available // worker_bytes(layer_bytes)
    if workers <= 0 and devices != ["cpu"]:
        want = GPU_WORKERS if layer_bytes <= OVERLAP_MAX_LAYER_BYTES else GPU_WORKERS_BIG_LAYERS
        workers = max(len(devices), min(want, by_memory))
    if workers > 0:
        return [devices[i % len(devices)] for i in range(workers)]
    by_cores = max(CPU_WORKERS, (os.cpu_count() or 1) // CPU_CORES_PER_WORKER)
    return ["cpu"] * max(1, min(by_cores, by_memory))


def worker_threads(torch_threads: int, device: str, sharing: int, cores: int) -> int:
    """The torch thread count a worker is started with (0: torch's default): [resources] torch_threads when set;
    else, for one of `sharing` > 1 CPU workers on `cores` cores, its share (several workers each starting one thread
    per core would contend for them)."""
    if torch_threads or device != "cpu" or sharing <= 1:
        return torch_threads
    return max(1, cores // sharing)


def room_for_planner(slots: list[str], layer_bytes: int) -> bool:
    """Whether the export plan's worker may run beside the parts' workers (Scheduler.judge_beside): always on GPUs (it
    holds a CUDA context and one module's probe there); on a CPU when the host's free memory holds one worker more
    than `slots` has, each wanting worker_bytes."""
    if any(d != "cpu" for d in slots):
        return True
    import psutil

    return psutil.virtual_memory().available // worker_bytes(layer_bytes) > len(slots)


def worker_bytes(layer_bytes: int) -> int:
    """What one worker wants: ~1 GiB of private memory plus three layers (the one being quantized, its output, the
    next one read ahead)."""
    return (1 << 30) + 3 * max(layer_bytes, 1)


def device_stage_shared(device: str, slots_on_device: int, layer_bytes: int) -> bool:
    """Whether the workers on `device` take turns for their device stage (Hello.device_lock): on a GPU shared by
    several workers when a layer is over OVERLAP_MAX_LAYER_BYTES, so the GPU holds about one layer at a time
    (peak ~1x a layer, as with one worker) while the other worker's read and write overlap it."""
    return device != "cpu" and slots_on_device > 1 and layer_bytes > OVERLAP_MAX_LAYER_BYTES


def check_free_memory(device: str, need_bytes: int) -> None:
    """Raise DeviceError when `device` has less free memory than `need_bytes`; no-op for "cpu".

    torch.cuda.mem_get_info creates a CUDA context on that device in the calling process: call this where the
    device will be used (a worker), or accept the context in a parent that already holds one (a studio).
    """
    if device == "cpu":
        return
    index = _cuda_index(device)
    import torch

    free, total = torch.cuda.mem_get_info(index)
    if free < need_bytes:
        raise DeviceError(
            f"cuda:{index} has {_gib(free)} free of {_gib(total)}, this step needs {_gib(need_bytes)}: release the "
            "live model, stop other GPU processes, or pick another --device"
        )


def _cuda_index(spec: str) -> int:
    match = _CUDA_SPEC.fullmatch(spec.strip().lower())
    if match is None:
        raise DeviceError(f"unknown device {spec!r}: use auto, cpu, cuda or cuda:N")
    return int(match.group(1) or 0)


def _cuda_count() -> int:
    """GPUs visible to this process. NVML answers in milliseconds without torch (importing torch costs seconds
    on some machines, and a re-run of a finished export should not pay it); without NVML, torch's own count,
    which asks NVML first too and never initialises CUDA, so workers can still be forked after it."""
    physical = _nvml_count()
    if physical < 0:
        import torch

        return torch.cuda.device_count()
    visible = parse_visible_devices(os.environ.get("CUDA_VISIBLE_DEVICES"))
    return physical if visible is None else min(len(visible), physical)


def _gib(n: int) -> str:
    return f"{n / 2**30:.1f} GiB"
