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

import concurrent.futures
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
spent = 0.0  # seconds measuring on the caller's thread since the last take(), reported as their own stage
_later: concurrent.futures.Future | None = None  # measure_later's, until take() or discard() waits for it


def measure(modules: Iterable[tuple[str, nn.Module]], source: Mapping[str, torch.Tensor]) -> None:
    """Record rel_error for each compressed (name, module) whose source weight is `source[name + ".weight"]`."""
    for name, module in modules:
        weight = source.get(f"{name}.weight")
        if weight is not None:
            record(name, module, weight)


def measure_later(modules: Iterable[tuple[str, nn.Module]], source: Mapping[str, torch.Tensor]) -> None:
    """measure() on a thread of its own while the caller goes on (a calibrated layer's shard is serialized, written
    and fsynced on the host while its device decompresses and compares: on an H100 the measure took 0.07-0.11 s of an
    8B-shaped layer and the write 0.12, one after the other); the next take() waits for it and raises what it
    raised. Holds the modules and the source tensors until it is done, never longer."""
    global _later
    if not enabled:
        return
    discard()  # one at a time
    pairs = [(name, module, source[f"{name}.weight"]) for name, module in modules if f"{name}.weight" in source]
    pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="quant-error")

    def run() -> None:
        for name, module, weight in pairs:
            _measure_one(name, module, weight)
        pairs.clear()  # the modules and tensors are the caller's again

    _later = pool.submit(run)
    pool.shutdown(wait=False)  # the thread ends with its one task


def record(label: str, module: nn.Module, weight: torch.Tensor) -> None:
    """Record rel_error for one module just compressed, against `weight`, its weight before compression."""
    global spent
    if not enabled:
        return
    t = time.perf_counter()
    _measure_one(label, module, weight)
    spent += time.perf_counter() - t


def _measure_one(label: str, module: nn.Module, weight: torch.Tensor) -> None:
    scheme = getattr(module, "quantization_scheme", None)
    if scheme is not None and scheme.format is not None:
        compressor = BaseCompressor.get_value_from_registry(scheme.format.value)
        dequantized = compressor.decompress(get_direct_state_dict(module), scheme)["weight"]
        error = relative_error(dequantized, weight)
        del dequantized
        if error is not None:
            _tally[label] = error


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
    """The figures recorded since the last take() (a measure_later's once it is done, raising what it raised),
    and an empty tally (and time spent)."""
    global spent, _later
    later, _later = _later, None
    try:
        if later is not None:
            later.result()  # bounded: one layer's modules decompressed and compared
        return dict(_tally)
    finally:
        _tally.clear()
        spent = 0.0


def wait() -> None:
    """Until a measure_later is done (what it raised, the next take() raises)."""
    later = _later
    if later is not None:
        concurrent.futures.wait([later])  # bounded: one layer's modules decompressed and compared


def discard() -> None:
    """Drop whatever an earlier part left (a failed part's figures, its measure_later once done, failed or not)."""
    try:
        take()
    except Exception:  # noqa: BLE001 - the part it belonged to has failed already
        pass


def record_loss(name: str, loss: float) -> None:
    """The calibration method's own loss for module `name` (GPTQ: the loss its solver returns)."""
    _losses[name] = float(loss)


def take_losses() -> dict[str, float]:
    out = dict(_losses)
    _losses.clear()
    return out
