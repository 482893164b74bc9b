"""The quantization error of each module, measured while its layer is in memory (so it costs no second read).

    rel_error(module) = ||decompress(compressed module) - W_source||_F / ||W_source||_F

The dequantized weight comes from compressed-tensors' own decompressor for the module's format (the one a loader
runs), applied to exactly the tensors that go into the shard, so the figure describes the written checkpoint.
The data-free compressed-tensors backend calls `record` for each module right after compressing it, against its
weight as it was just before (already on the export's device: nothing is read or copied twice, and only one
module's source weight outlives its compression); the calibrated backend calls `measure` after a part's modules
are compressed, with the part's source tensors. The figures collect in this process's tally, which the worker
loop empties with `take()` around each part and sends in LayerWritten.

Owns that arithmetic and the tally. It never changes a module or a tensor it is given, and keeps no reference
to either after returning.
"""
from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

import torch
from compressed_tensors.compressors import BaseCompressor
from compressed_tensors.utils import get_direct_state_dict
from torch import nn

ROWS = 1024  # rows per float32 block: 16 MiB per temporary for a 4096-wide weight (an 8B MLP: 14336 x 4096)

_tally: dict[str, float] = {}
_losses: dict[str, float] = {}  # module -> the calibration's own loss for it (GPTQ's), where the method has one
enabled = True  # the job's [export] measure_error; the worker sets it once
spent = 0.0  # seconds measuring since the last take(), so the worker can report them as their own stage


def measure(modules: Iterable[tuple[str, nn.Module]], source: Mapping[str, torch.Tensor]) -> None:
    """Record rel_error for each compressed (name, module) whose source weight is `source[name + ".weight"]`."""
    for name, module in modules:
        weight = source.get(f"{name}.weight")
        if weight is not None:
            record(name, module, weight)


def record(label: str, module: nn.Module, weight: torch.Tensor) -> None:
    """Record rel_error for one module just compressed, against `weight`, its weight before compression."""
    global spent
    if not enabled:
        return
    t = time.perf_counter()
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is not None and scheme.format is not None:
        compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
        dequantized = compressor.decompress(get_direct_state_dict(module), scheme)["weight"]
        error = relative_error(dequantized, weight)
        del dequantized
        if error is not None:
            _tally[label] = error
    spent += time.perf_counter() - t


def relative_error(got: torch.Tensor, ref: torch.Tensor) -> float | None:
    """||got - ref|| / ||ref|| (Frobenius) in float32, block by block; None when ref is all zeros."""
    if got.shape != ref.shape:
        raise ValueError(f"dequantized weight has shape {tuple(got.shape)}, the source {tuple(ref.shape)}")
    # float32 blocks, not one float32 copy of the whole weight: that would add twice the weight to the peak
    diff_sq = ref_sq = None
    for g, r in zip(got.split(ROWS), ref.split(ROWS)):
        # copy in the source's own dtype, then widen where the block now is: a blocking host-to-GPU copy that also
        # changes dtype converts on the CPU and sends float32, twice the bytes (torch's copy_kernel_cuda); MoE
        # layers above the worker's read-ahead limit keep their sources on the host. The values are the same.
        # Not blocking: the source stays alive (the caller's), so the next block's copy is queued while this one's
        # norms compute.
        r = r.to(g.device, non_blocking=True).float()
        # each block's float32 norm squared and summed in float64 where the block is: the sums a Python float
        # would make of `.item() ** 2`, without a wait for the device per block (two per 1024 rows)
        d = torch.linalg.vector_norm(g.float() - r).double()
        n = torch.linalg.vector_norm(r).double()
        diff_sq = d * d if diff_sq is None else diff_sq + d * d
        ref_sq = n * n if ref_sq is None else ref_sq + n * n
    if diff_sq is None:
        return None
    diff, total = torch.stack([diff_sq, ref_sq]).tolist()  # the one wait for the device
    return (diff / total) ** 0.5 if total else None


def take() -> dict[str, float]:
    """The figures recorded since the last take(), and an empty tally (and time spent)."""
    global spent
    out = dict(_tally)
    _tally.clear()
    spent = 0.0
    return out


def record_loss(name: str, loss: float) -> None:
    """The calibration method's own loss for module `name` (GPTQ: the loss its solver returns)."""
    _losses[name] = float(loss)


def take_losses() -> dict[str, float]:
    out = dict(_losses)
    _losses.clear()
    return out
