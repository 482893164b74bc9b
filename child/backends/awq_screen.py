"""AWQ's grid search with fused attention as a screen: the library's eager losses decide, oneshot's bits are kept.

For each mapping llm-compressor's AWQ (`AWQModifier._compute_best_scale`) tries a grid of scalings (n_grid = 20) and
keeps the first whose loss is the smallest: the mean squared difference between the parent module's output with the
balance layers quantized at that scaling and its unquantized output, over every sample. Where the parent holds the
attention (q/k/v's mapping: its parent is `self_attn`), each loss is a pass of every sample through eager attention,
whose elementwise work on the [heads, tokens, tokens] scores is 64% of an 8B layer's search (bench/awq_probe.py).
The scaling kept, and so every later tensor, depends on those losses' rounding: a fused attention (SDPA) in the
search would change bits (docs/fidelity.md: `match_oneshot = false` takes that).

Here the search runs twice, and the second time is the library's own:
  screen   every grid point's loss through SDPA against the parent's SDPA output (same mask: the causal one as
           SDPA's `is_causal` where it is exactly that), in the library's `_compute_best_scale` with its passes run
           fused: the same function of the same inputs up to rounding, each loss off its eager value by `d`
  decide   the library's `_compute_best_scale`, eager as ever, on the grid points that could hold the smallest eager
           loss: first the `FIRST` smallest screened, then every point whose screened loss, less the largest `d`
           measured and a slack, is not above the smallest eager loss found, until none is left. The slack is
           `SPREAD_FACTOR` times the spread of `d` over the points decided, at least `SLACK_FLOOR` of that loss;
           where `d` is not small (`MAX_OFFSET` of the loss: an attention that SDPA does not compute alike) every
           point is decided eagerly. The scaling kept is the decided points' first smallest eager
           loss, which is the whole grid's unless a point outside moved by more than the slack beyond what the
           decided ones did (docs/calibration.md).
A parent without attention (the MLP, down_proj) is searched by the library as it is (SDPA would change nothing), and
so is one whose attention soft-caps its scores (Gemma-2: SDPA does not).
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
from compressed_tensors.utils import patch_attr
from llmcompressor.modifiers.transform.awq import AWQModifier
from torch import nn

__all__ = ["screened", "DEVICES", "FIRST", "SPREAD_FACTOR", "SLACK_FLOOR", "MAX_OFFSET", "LOG_PREFIX"]

# where the screen is used: on a GPU an SDPA pass is a fraction of an eager one (docs/calibration.md); on the CPU
# it was not (a layer of hidden 1024, 16 x 512: 30.8 s screened against 24.0, bench/calib_bench.py, docs/benchmarks.md)
DEVICES = ("cuda",)
FIRST = 3             # the screen's smallest points searched eagerly first: the offsets' spread is measured on them
SPREAD_FACTOR = 8.0   # the slack: this many times the spread of (screened - eager) over the decided points...
SLACK_FLOOR = 2e-3    # ... and at least this fraction of the smallest eager loss
MAX_OFFSET = 1e-2     # a screened loss further than this fraction from its eager one: the screen is not used

# each screened mapping's line in the worker's log (bench/calib_bench.py and the tests read it): how many of the
# grid's points the library searched eagerly
LOG_PREFIX = "awq screen:"


@contextlib.contextmanager
def screened():
    """AWQModifier's grid search screened with SDPA where its parent holds eager attention (see the module doc)."""
    library = AWQModifier._compute_best_scale

    def compute_best_scale(self, mapping, fp16_outputs, orig_layer_weights):
        configs = _eager_attention_configs(mapping.parent)
        grid = self._get_grid_search_params()
        if not configs or len(grid) <= FIRST:
            return library(self, mapping, fp16_outputs, orig_layer_weights)
        return _screened_search(self, library, mapping, fp16_outputs, orig_layer_weights, grid, configs)

    with patch_attr(AWQModifier, "_compute_best_scale", compute_best_scale):
        yield


def _screened_search(modifier, library, mapping, fp16_outputs, orig_layer_weights, grid, configs) -> torch.Tensor:
    metrics = len(modifier._error_metrics)
    # the library's search leaves the balance layers quantized at its last point (and their qparams), and reads them
    # at its start (duo scaling's weight means): each search here starts from the state the one search of oneshot did
    start = _state(mapping.balance_layers)
    try:
        with _fused_attention(configs):
            reference = modifier._run_samples(mapping.parent)
            screen, _ = _search(modifier, library, mapping, reference, orig_layer_weights, grid, range(len(grid)),
                                start)
        del reference
    except Exception:  # the library's "No finite loss was found" through SDPA: the whole grid decides, as ever
        screen = []
    del modifier._error_metrics[metrics:]
    if len(screen) != len(grid) or not all(math.isfinite(x) for x in screen):
        return _whole(modifier, library, mapping, fp16_outputs, orig_layer_weights, grid, start)

    eager: dict[int, float] = {}
    best: tuple[float, int, torch.Tensor] | None = None  # (loss, grid index, scales): the library's first smallest
    todo = sorted(range(len(grid)), key=lambda i: screen[i])[:FIRST]
    while todo:
        todo = sorted(todo)  # the library searches them in the grid's order
        try:
            losses, scales = _search(modifier, library, mapping, fp16_outputs, orig_layer_weights, grid, todo, start)
        except Exception:  # the library's "No finite loss was found" for these points: the whole grid decides
            del modifier._error_metrics[metrics:]
            return _whole(modifier, library, mapping, fp16_outputs, orig_layer_weights, grid, start)
        del modifier._error_metrics[metrics:]
        eager.update(zip(todo, losses))
        finite = [(loss, i) for i, loss in zip(todo, losses) if math.isfinite(loss)]
        if finite:
            loss, i = min(finite)
            if best is None or (loss, i) < best[:2]:
                best = (loss, i, scales)
        smallest = best[0] if best is not None else math.inf
        offsets = [screen[i] - eager[i] for i in eager]
        if not all(math.isfinite(d) for d in offsets) or max(abs(d) for d in offsets) > MAX_OFFSET * smallest:
            todo = [i for i in range(len(grid)) if i not in eager]  # not a rounding's difference: decide them all
            continue
        slack = max(SPREAD_FACTOR * (max(offsets) - min(offsets)), SLACK_FLOOR * smallest)
        todo = [i for i in range(len(grid)) if i not in eager and screen[i] - max(offsets) - slack <= smallest]
    _log(mapping, len(eager), len(grid))
    loss, i, scales = best
    initial = eager.get(0, screen[0])  # logged only (the library's "error reduction"): the eager loss where decided
    modifier._error_metrics.append({"layer_name": mapping.smooth_name, "parent_name": mapping.parent_name,
                                    "initial_error": initial, "best_error": loss,
                                    "reduction": loss / initial if initial > 0 else 1.0})
    return scales


def _search(modifier, library, mapping, outputs, weights, grid, points, start) -> tuple[list[float], torch.Tensor]:
    """The library's grid search over `points` (indices into the grid, ascending): each point's loss, and the scales
    of the first smallest among them."""
    _restore(start)
    losses: list[float] = []
    # each call of the library's search all-reduces the mapping's activation statistics in place in a group (its
    # _allreduce_data_sum): every call starts from the statistics as the one call of oneshot would
    stats = modifier._smooth_activation_stats[mapping.smooth_name]
    modifier._smooth_activation_stats[mapping.smooth_name] = [t.clone() for t in stats]
    compute_loss = AWQModifier._compute_loss

    def recorded(self, *args, **kwargs):
        loss = compute_loss(self, *args, **kwargs)
        losses.append(loss)
        return loss

    with patch_attr(AWQModifier, "_get_grid_search_params", lambda self: [grid[i] for i in points]), \
            patch_attr(AWQModifier, "_compute_loss", recorded):
        try:
            scales = library(modifier, mapping, outputs, weights)
        finally:
            modifier._smooth_activation_stats[mapping.smooth_name] = stats
    return losses, scales


def _whole(modifier, library, mapping, fp16_outputs, orig_layer_weights, grid, start) -> torch.Tensor:
    _log(mapping, len(grid), len(grid))
    _restore(start)
    return library(modifier, mapping, fp16_outputs, orig_layer_weights)


def _state(modules) -> list[tuple[nn.Module, str, torch.Tensor]]:
    return [(m, name, t.detach().clone()) for m in modules
            for name, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]


def _restore(state) -> None:
    for module, name, value in state:
        getattr(module, name).data.copy_(value)


def _log(mapping, eager: int, points: int) -> None:
    print(f"{LOG_PREFIX} {mapping.smooth_name}: {eager} of {points} grid points searched eagerly", file=sys.stderr,
          flush=True)


def _eager_attention_configs(parent: nn.Module) -> list:
    """The configs through which the attention modules under `parent` pick eager attention (transformers' attention
    modules read `config._attn_implementation` at each call); none where one soft-caps its scores (Gemma-2), which
    SDPA does not do: its losses would not be eager's up to rounding."""
    configs = {}
    for module in parent.modules():
        config = getattr(module, "config", None)
        if "Attention" in type(module).__name__ and getattr(config, "_attn_implementation", None) == "eager":
            if getattr(config, "attn_logit_softcapping", None) is not None:
                return []
            configs[id(config)] = config
    return list(configs.values())


@contextlib.contextmanager
def _fused_attention(configs: list):
    """The parent's passes through SDPA: its attention modules switched, and a causal mask handed to SDPA as its
    `is_causal` (transformers' sdpa_attention_forward does that where the mask is None)."""
    def fused(self, module):
        cache = self._parent_args_cache[module]
        outputs = [module(**_causal_as_none(batch)) for batch in cache]
        return [out[0] if isinstance(out, tuple) else out for out in outputs]

    with contextlib.ExitStack() as stack:
        for config in configs:
            stack.enter_context(patch_attr(config, "_attn_implementation", "sdpa"))
        stack.enter_context(patch_attr(AWQModifier, "_run_samples", fused))
        yield


def _causal_as_none(kwargs: dict) -> dict:
    mask = kwargs.get("attention_mask")
    if not isinstance(mask, torch.Tensor) or mask.dim() != 4 or mask.shape[-1] != mask.shape[-2]:
        return kwargs
    allowed = mask if mask.dtype == torch.bool else mask == 0
    causal = torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()
    if bool((allowed == causal).all()):
        return {**kwargs, "attention_mask": None}
    return kwargs
