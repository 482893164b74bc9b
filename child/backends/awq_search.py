"""AWQ's grid search with its waits for the GPU moved to the end of each mapping's grid and its passes sample by
sample, bit for bit.

llm-compressor's `AWQModifier._compute_best_scale` (0.14.0.1) tries 20 candidate scalings of a mapping one after the
other, and waits for the GPU several times per candidate: `scales[torch.isinf(scales)] = 1` and the same for NaN
(boolean indexing finds the positions on the host), `_compute_loss`'s `.item()`, which its comparison with the
best loss so far needs at once, and every `torch.tensor(number, device=cuda)` (a copy from the host, which waits
for the stream first: `_compute_loss`'s two zeros, `calculate_qparams`' eps for each balance layer). Each wait
leaves the GPU idle while Python prepares the next candidate (its scales, its weights quantized and scaled back, the
next pass's first kernels): measured on one H100 (bench/awq_probe.py, one layer of the 8B shape, 128 x 2048), 0.87 s
of a layer's search outside its passes, of which the losses' own kernels are a fraction; 0.32 s with this module
(s41a; docs/benchmarks.md, fortieth session).

`best_scale` is that method with the same operations in the same order on the device, except that:

- inf and NaN scales become 1 through `masked_fill_` (the same values, no wait);
- each candidate's loss stays a device tensor (`_compute_loss`'s arithmetic without its `.item()`, its two zeros
  made on the device rather than copied there from the host, which waits too), and all of the grid's losses come to
  the host together after the last candidate's pass has been queued, as the same fp32 values `.item()` would give;
- compressed-tensors' `calculate_qparams`, which quantizes each candidate's weights, makes its eps on the device by
  a fill instead of a copy from the host, which waits (`_NumbersFilledOnTheDevice`: the same value);
- the library's choice is then made on those values exactly as it makes it (the first candidate whose loss is below
  the best so far, the history, the initial error, the error metrics);
- each candidate's pass and its loss go sample by sample (`_candidate_loss`): a sample's output is added into the
  loss as soon as its pass is queued and then let go, and a parent's extra outputs (eager attention's probabilities)
  are let go at once. The library first runs every sample (`_run_samples`), holding each one's whole output, then adds
  them up: for the attention of an 8B-shaped layer over 128 x 2048 samples that held 128 probability matrices (32
  GiB) and the 128 outputs (2 GiB) at the layer's peak. The same operations on the same tensors in the same order
  give the same loss; only what is alive at once differs. The library's unscaled pass, where it runs (`run_samples`),
  lets go of the extra outputs the same way.

So the host prepares each candidate while the GPU still runs the one before, and the chosen scales, and every tensor
after them, are the library's. A group's ranks (torch.distributed) all-reduce each candidate's loss as the library
does, in the same order. Installed by child/backends/calibrate.py around an AWQ layer's session (`installed()`),
with the llm-compressor whose method this copies (`COPIED_FROM`); with another, the library's own search runs.
"""
from __future__ import annotations

import contextlib

import torch
from compressed_tensors.offload.dist_utils import is_distributed
from compressed_tensors.quantization import forward_quantize
from compressed_tensors.quantization.utils import helpers as qparams_helpers
from compressed_tensors.utils import get_execution_device, patch_attr, patch_attrs
from llmcompressor.core import active_session
from llmcompressor.modifiers.quantization.calibration import observe, update_qparams
from llmcompressor.modifiers.transform.awq import AWQModifier
from llmcompressor.modifiers.transform.awq import base as awq_base
from llmcompressor.observers.base import Observer
from llmcompressor.observers.helpers import fuse_weight_observers

from child.backends import graphed_pass

__all__ = ["best_scale", "run_samples", "installed", "COPIED_FROM"]

COPIED_FROM = "0.14.0.1"  # the llm-compressor whose _compute_best_scale and _compute_loss best_scale follows


@contextlib.contextmanager
def installed(samplewise: bool = True, graphs: bool = False):
    """AWQModifier's `_compute_best_scale` is `best_scale`, and its `_run_samples` `run_samples`, while inside (with the
    llm-compressor they copy). `samplewise=False` (a bench's switch, child/faults.py): the passes as the library
    runs them, every sample's whole output held until the pass is over, for comparison. `graphs`: each candidate's
    pass replayed from a CUDA graph where child/backends/graphed_pass.py applies (samplewise only; the caller says
    where the cached arguments stay on the GPU)."""
    import llmcompressor

    if llmcompressor.__version__ != COPIED_FROM:
        yield
        return
    with patch_attr(AWQModifier, "_compute_best_scale", best_scale), \
            patch_attr(AWQModifier, "_run_samples", run_samples if samplewise else AWQModifier._run_samples), \
            patch_attr(_state, "samplewise", samplewise), patch_attr(_state, "graphs", graphs):
        yield


def run_samples(self, module: torch.nn.Module) -> list[torch.Tensor]:
    """llm-compressor 0.14.0.1's `AWQModifier._run_samples`: each cached sample through `module`, its output as the
    library keeps it; the rest of each output let go before the next sample's pass (`_samples`)."""
    return list(_samples(self, module))


def _samples(self, module: torch.nn.Module):
    """`_run_samples`' outputs one at a time, each sample's pass run as the next output is asked for. A tuple's first
    element is kept, as the library keeps it, and the tuple let go at once: eager attention returns its probabilities
    beside its output, 256 MiB a sample for the 8B shape at 2048 tokens, which the library's list holds for every
    sample until the pass's last sample is through."""
    cache = self._parent_args_cache[module]
    use_prefetch = active_session().state.sequential_prefetch
    for batch in cache.iter_prefetch() if use_prefetch else cache:
        output = module(**batch)
        output = output[0] if isinstance(output, tuple) else output  # the tuple let go here, not at the yield
        yield output


@torch.no_grad()
def best_scale(self, mapping, fp16_outputs: list[torch.Tensor],
               orig_layer_weights: dict[torch.nn.Module, torch.Tensor]) -> torch.Tensor:
    """llm-compressor 0.14.0.1's `AWQModifier._compute_best_scale`, its waits moved to the grid's end (see the
    module docstring)."""
    device = get_execution_device(mapping.parent)

    x_sum, count = self._smooth_activation_stats[mapping.smooth_name]
    if is_distributed():
        x_sum, count = awq_base._allreduce_data_sum([x_sum, count])
    x_mean = x_sum.to(device) / count.to(device)

    if self.duo_scaling:
        w_mean = self._compute_layer_means(mapping.balance_layers).to(device)

    balance_layers_to_patch = [
        balance_layer
        for balance_layer in mapping.balance_layers
        if hasattr(balance_layer, "quantization_scheme") and hasattr(balance_layer.quantization_scheme, "weights")
    ]
    grid = self._get_grid_search_params()

    def run_grid(graphed):
        losses, candidates = [], []
        for ratio, use_duo_scaling in grid:
            if use_duo_scaling:
                scales = (x_mean.pow(ratio) / (w_mean.pow(1 - ratio) + 1e-4)).clamp(min=1e-4)
            else:
                scales = x_mean.pow(ratio).clamp(min=1e-4).view(-1)
            scales = scales / (scales.max() * scales.min()).sqrt()
            scales.masked_fill_(torch.isinf(scales), 1)  # the library: scales[torch.isinf(scales)] = 1
            scales.masked_fill_(torch.isnan(scales), 1)
            _scalesview = scales.view(1, -1).to(device)

            for balance_layer in balance_layers_to_patch:
                balance_layer.weight.data.copy_(orig_layer_weights[balance_layer].to(_scalesview.device)
                                                * _scalesview)
                balance_layer.weight_observer.delete_statistics(check_fused=False)

            observe(balance_layers_to_patch, "weight")
            update_qparams(balance_layers_to_patch, "weight", only_update_onload=True)

            for balance_layer in balance_layers_to_patch:
                w_qscheme = balance_layer.quantization_scheme.weights
                _set_weight(balance_layer, (
                    forward_quantize(balance_layer, balance_layer.weight, "weight", w_qscheme) / _scalesview
                ).to(balance_layer.weight.dtype))

            losses.append(_candidate_loss(self, mapping.parent, fp16_outputs, graphed))
            candidates.append(scales)  # a fresh tensor each candidate, not written after
        return losses, candidates

    with patch_attr(qparams_helpers, "torch", _NO_HOST_COPIES), patch_attrs(
        balance_layers_to_patch,
        "weight_observer",
        [
            Observer.load_from_registry("memoryless_minmax", base_name="weight",
                                        args=balance_layer.quantization_scheme.weights)
            for balance_layer in balance_layers_to_patch
        ],
    ):
        fuse_weight_observers(mapping.parent)
        graphed = None
        if _state.graphs and _state.samplewise and graphed_pass.applies(mapping.parent, device) is None:
            # each candidate's pass replayed from one CUDA graph (child/backends/graphed_pass.py)
            graphed, _ = graphed_pass.build(mapping.parent, list(self._parent_args_cache[mapping.parent]), device)
        try:
            losses, candidates = run_grid(graphed)
            values = torch.stack(losses).tolist()  # the grid's one wait for the GPU
            same = graphed is None or bool(graphed.same().item())
        finally:
            if graphed is not None:
                graphed.close()
        if not same:  # a replay differed from its eager pass: the grid again, eagerly
            graphed_pass.turn_off(f"a replay of {mapping.parent_name} differed from its eager pass")
            losses, candidates = run_grid(None)
            values = torch.stack(losses).tolist()

    history = []
    best_ratio, best_scales, best_error, initial_error = -1, None, float("inf"), None
    for (ratio, use_duo_scaling), loss, scales in zip(grid, values, candidates):
        if initial_error is None:
            initial_error = loss
        history.append({"ratio": ratio, "duo_scaling": use_duo_scaling, "error": loss})
        if loss < best_error:
            best_error, best_ratio, best_scales = loss, ratio, scales

    if best_ratio == -1:
        awq_base.logger.debug(history)
        raise Exception(
            "No finite loss was found in best scalesgrid search. This typically means NaN values are appearing in "
            "the forward pass of the parent module. If you encounter this error, raise an issue at "
            "https://github.com/vllm-project/llm-compressor/issues"
        )
    err_reduction = best_error / initial_error if initial_error > 0 else 1.0
    awq_base.logger.debug(
        f"AWQ grid search for {mapping.smooth_name}: initial error = {initial_error:.3e}, best error = "
        f"{best_error:.3e}, error reduction rate (best/initial) = {err_reduction * 100:.3f}%"
    )
    self._error_metrics.append({
        "layer_name": mapping.smooth_name,
        "parent_name": mapping.parent_name,
        "initial_error": initial_error,
        "best_error": best_error,
        "reduction": err_reduction,
    })
    assert torch.isnan(best_scales).sum() == 0, f"Nan found in scales: {best_scales}"
    return best_scales.detach().cpu()


class _NumbersFilledOnTheDevice:
    """What compressed-tensors' qparams helpers see as `torch` during the grid: torch itself, except that
    `torch.tensor(number, dtype=..., device=...)` is `torch.full((), number, ...)`: the same value of the same dtype
    (both convert the Python number on the host; where full refuses one out of the dtype's range, torch.tensor
    makes it), filled on the device. `calculate_qparams` makes its eps that way
    for each balance layer of each candidate (`torch.tensor(eps, dtype=scales.dtype, device=device)`), and a
    host-to-device copy waits for the stream (pytorch/pytorch#120996): for the candidate's weights, the previous
    candidate's whole pass. Anything else goes to torch.tensor as written."""

    def __getattr__(self, name: str):
        return getattr(torch, name)

    @staticmethod
    def tensor(data, *args, dtype=None, device=None, **kwargs):
        if args or kwargs or device is None or isinstance(data, bool) or not isinstance(data, (int, float)) or \
                dtype not in _FILLED:
            return torch.tensor(data, *args, dtype=dtype, device=device, **kwargs)
        if dtype is None:  # as torch.tensor infers it from a Python number
            dtype = torch.int64 if isinstance(data, int) else torch.get_default_dtype()
        try:
            return torch.full((), data, dtype=dtype, device=device)
        except RuntimeError:  # out of the dtype's range: full refuses, torch.tensor gives inf
            return torch.tensor(data, dtype=dtype, device=device)


_FILLED = (None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
_NO_HOST_COPIES = _NumbersFilledOnTheDevice()


def _candidate_loss(self, parent: torch.nn.Module, fp16_outputs: list[torch.Tensor],
                    graphed: graphed_pass.GraphedPass | None = None) -> torch.Tensor:
    """A candidate's pass of `parent` over the cached samples and its loss against `fp16_outputs`, sample by sample:
    each sample's output added into the loss right after its pass, then let go (see the module docstring); with
    `graphed`, each sample's pass is a replay of its graph."""
    if graphed is not None:
        return _loss(fp16_outputs, graphed.outputs())
    return _loss(fp16_outputs, _samples(self, parent) if _state.samplewise else self._run_samples(parent))


def _set_weight(layer: torch.nn.Module, value: torch.Tensor) -> None:
    """The library's `layer.weight.data = value`, written into the weight's own tensor where both are contiguous and
    alike (the same values in the same layout; a graphed pass reads the weight where it lay at capture), else as the
    library does it."""
    weight = layer.weight.data
    if weight.is_contiguous() and value.is_contiguous() and value.shape == weight.shape and \
            value.dtype == weight.dtype and value.device == weight.device:
        weight.copy_(value)
    else:
        layer.weight.data = value


class _state:
    samplewise = True  # installed()'s
    graphs = False


def _loss(fp16_outputs: list[torch.Tensor], int_w_outputs) -> torch.Tensor:
    """llm-compressor 0.14.0.1's `AWQModifier._compute_loss`, its result left on the device (no `.item()`).
    `int_w_outputs`: a list, or `_samples`, which runs each sample's pass as its turn comes."""
    session = active_session()
    loss_masks = session.state.loss_masks if session.state else None

    device = fp16_outputs[0].device
    # the library's torch.tensor(0.0, device=device) and torch.tensor(0, device=device): the same zeros (the default
    # dtype, int64), but made on the device by a fill; torch.tensor copies its value from the host and waits for the
    # stream to finish first (pytorch/pytorch#120996), a wait for the candidate's whole pass
    loss = torch.zeros((), device=device)
    num_elements = torch.zeros((), dtype=torch.int64, device=device)
    for batch_idx, (fp16_batch, int_w_batch) in enumerate(zip(fp16_outputs, int_w_outputs)):
        loss_mask = loss_masks[batch_idx] if loss_masks else None
        if loss_mask is not None:
            token_mask = loss_mask.to(fp16_batch.device) == 1
            fp16_masked = fp16_batch[token_mask]
            int_w_masked = int_w_batch.to(fp16_batch.device)[token_mask]
            loss += torch.nn.functional.mse_loss(fp16_masked, int_w_masked, reduction="sum")
            num_elements += fp16_masked.numel()
        else:
            loss += torch.nn.functional.mse_loss(fp16_batch, int_w_batch.to(fp16_batch.device), reduction="sum")
            num_elements += fp16_batch.numel()
    if is_distributed():
        loss, num_elements = awq_base._allreduce_data_sum([loss, num_elements])
    return loss / num_elements
