"""What AWQ's search takes from the layer's calibration forward, got there without extra work, bit for bit.

Two things, each what llm-compressor's AWQModifier would have, computed the same way:

- **its unscaled outputs** (below): taken from the forward instead of one more pass of each mapping's parent;
- **its activation means**: the per-sample sums of |x| its forward hook adds up stay on the device. The library's
  hook copies each sample's sum to the host (`.cpu()`, a wait for the GPU: four a sample in a Llama layer, each
  leaving the GPU idle while the next kernels are launched) and adds them there in fp32; here the same fp32 sums,
  in the same order, are added on the device (IEEE addition: the same bits), and the search reads them there
  (it moves them to the device anyway). Loss masks, where a session has them, are applied as the library does.

**Unscaled outputs.** llm-compressor's AWQModifier (run as oneshot runs it, child/backends/calibrate.py) searches
each mapping's scaling after the layer's calibration forward. Its first step is a pass of the mapping's parent over every cached sample
(`_run_samples`): the parent's unscaled outputs, which each of its 20 candidates' outputs is then compared with.
The calibration forward has already run every parent on exactly those arguments (AWQ's forward-pre hook caches them
as they go in), so its outputs are the ones that pass would compute again, where all of these hold:

- no module inside the parent was changed since: no earlier mapping of this layer searched or smoothed it (a search
  rewrites its balance layers' weights, the smoothing then its smooth and balance layers'); in Llama's order
  (`input_layernorm` -> q/k/v with the attention as parent, `v_proj` -> `o_proj`, `post_attention_layernorm` ->
  gate/up with the MLP as parent, `up_proj` -> `down_proj`) none is, so every mapping's pass is saved;
- no output was changed in place since the forward (each tensor's version counter, as kept);
- one output was kept for each set of arguments AWQ cached, in the same order (the same hooks' life: both are the
  modifier's, and disabled outside the calibration forward).

Else the library's own pass runs, as before. Each output is kept as `_run_samples` keeps it (a tuple's first
element); the parents' outputs are held from the forward until their search (the attention's and the MLP's outputs
of an 8B-shaped layer over 128 x 2048 samples: 2 GiB each; o_proj's and down_proj's are the same tensors). Outputs
are kept only where AWQ keeps its cached arguments on the device (`keep_outputs`; not where
child/backends/calibrate.py offloads them to the host, MoE models: holding outputs on the GPU there would undo
that). One pass of each mapping's 21 is saved: for an 8B-shaped layer, about 0.35 s of a 9 s search on an H100
(the three unscaled passes' times, bench/awq_probe.py --fused).
"""
from __future__ import annotations

import contextlib

import torch
from compressed_tensors.utils import patch_attr
from llmcompressor.core import active_session
from llmcompressor.modifiers.transform.awq import AWQModifier
from torch import nn

from child.backends.awq_search import COPIED_FROM

__all__ = ["AWQCapture"]


class AWQCapture:
    """For one layer's session: each AWQ parent's outputs kept from the calibration forward, handed to the
    library's unscaled pass where they are what it would compute, and the activation sums kept on the device (see
    the module docstring)."""

    def __init__(self, keep_outputs: bool = True) -> None:
        self._keep_outputs = keep_outputs
        self._kept: dict[nn.Module, list[tuple[torch.Tensor, int]] | None] = {}  # None: not usable
        self._changed: set[nn.Module] = set()  # modules an earlier mapping of the layer searched or smoothed
        self._searching = False
        self.served = 0  # unscaled passes saved
        self.ran = 0  # unscaled passes the library ran itself
        self.hooks_replaced = 0  # the library's activation hooks replaced by ours (one per mapping)

    @contextlib.contextmanager
    def installed(self):
        """AWQModifier's hook set-up, unscaled pass and search wrapped for the session's life."""
        setup, run_samples, best_scale = (AWQModifier._setup_activation_cache_hooks, AWQModifier._run_samples,
                                          AWQModifier._compute_best_scale)
        me = self

        def setup_hooks(modifier):
            setup(modifier)
            me.hooks_replaced += _sums_on_the_device(modifier)
            for parent in dict.fromkeys(m.parent for m in modifier._resolved_mappings) if me._keep_outputs else ():
                me._kept[parent] = []
                modifier.register_hook(parent, me._keep, "forward")  # disabled with the library's own hooks

        def run(modifier, module):
            kept = None if me._searching else me._take(modifier, module)
            if kept is not None:
                return kept
            if not me._searching:
                me.ran += 1
            return run_samples(modifier, module)

        def search(modifier, mapping, *args, **kwargs):
            # from here this mapping's balance layers are rewritten (each candidate), then smoothed with its smooth
            # layer
            me._changed.update([mapping.smooth_layer, *mapping.balance_layers])
            me._searching = True
            try:
                return best_scale(modifier, mapping, *args, **kwargs)
            finally:
                me._searching = False

        with contextlib.ExitStack() as stack:
            stack.enter_context(patch_attr(AWQModifier, "_setup_activation_cache_hooks", setup_hooks))
            stack.enter_context(patch_attr(AWQModifier, "_run_samples", run))
            stack.enter_context(patch_attr(AWQModifier, "_compute_best_scale", search))
            try:
                yield self
            finally:
                self._kept.clear()

    def _keep(self, module: nn.Module, _args, output) -> None:
        kept = self._kept.get(module)
        if kept is None:
            return
        out = output[0] if isinstance(output, tuple) else output  # as _run_samples keeps it
        if isinstance(out, torch.Tensor):
            kept.append((out, out._version))
        else:
            self._kept[module] = None  # not a tensor: its pass runs

    def _take(self, modifier, module: nn.Module) -> list[torch.Tensor] | None:
        kept = self._kept.pop(module, None)
        if not kept or len(kept) != len(modifier._parent_args_cache[module]):
            return None
        if any(m in self._changed for m in module.modules()):
            return None
        if any(t._version != version for t, version in kept):
            return None
        self.served += 1
        return [t for t, _ in kept]


def _sums_on_the_device(modifier) -> int:
    """The library's activation hooks (`cache_smooth_activations_hook`, one per mapping) replaced by the same
    computation whose sums stay on the device (see the module docstring): registered on the same modules, in the
    same order, for the same mappings. How many were replaced (none, and nothing changed, with another
    llm-compressor than the one copied, or where the library registered another number of them than it has
    mappings)."""
    import llmcompressor

    if llmcompressor.__version__ != COPIED_FROM:  # _activation_sums copies that version's hook
        return 0
    handles = []
    for handle in modifier._hooks:
        hooks = handle.hooks_dict_ref()
        fn = hooks.get(handle.id) if hooks is not None else None
        if getattr(fn, "__name__", "") == "cache_smooth_activations_hook":  # functools.wraps keeps the name
            handles.append(handle)
    if len(handles) != len(modifier._resolved_mappings):
        return 0
    for handle in handles:
        handle.remove()
        modifier._hooks.discard(handle)
    for mapping in modifier._resolved_mappings:
        target = mapping.activation_hook_target or mapping.balance_layers[0]  # as the library picks it
        modifier.register_hook(target, _activation_sums(modifier, mapping.smooth_name), "forward")
    return len(handles)


def _activation_sums(modifier, smooth_name: str):
    """llm-compressor 0.14.0.1's `cache_smooth_activations_hook` for `smooth_name`, but the sum of |x| over the
    sample's tokens is added to the running fp32 sum on the device, not copied to the host first (the count, a
    Python int, is a host tensor as before)."""

    def cache_smooth_activations_on_device(_module, args, _output):
        activations = args[0].abs().detach()
        state = active_session().state
        loss_masks = state.loss_masks if state else None
        batch_idx = state.current_batch_idx if state else -1
        loss_mask = loss_masks[batch_idx] if loss_masks and batch_idx >= 0 else None
        if loss_mask is not None:
            mask = loss_mask.to(activations.device).unsqueeze(-1)
            masked = activations.flatten(0, -2)[mask.flatten(0, -2).squeeze(-1).bool()]
        else:
            masked = activations.flatten(0, -2)
        new_sum = masked.float().sum(dim=0)
        new_count = torch.tensor(masked.size(0))
        stats = modifier._smooth_activation_stats
        if smooth_name not in stats:
            stats[smooth_name] = [torch.zeros_like(new_sum), torch.zeros_like(new_count)]
        stats[smooth_name][0] += new_sum
        stats[smooth_name][1] += new_count

    return cache_smooth_activations_on_device
