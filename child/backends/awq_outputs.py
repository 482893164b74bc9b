"""AWQ's unscaled outputs taken from the layer's calibration forward instead of one more pass, bit for bit.

llm-compressor's AWQModifier (run as oneshot runs it, child/backends/calibrate.py) searches each mapping's scaling
after the layer's calibration forward. Its first step is a pass of the mapping's parent over every cached sample
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
of an 8B-shaped layer over 128 x 2048 samples: 2 GiB each; o_proj's and down_proj's are the same tensors). Used only
where AWQ keeps its cached arguments on the device (not where child/backends/calibrate.py offloads them to the
host, MoE models: holding outputs on the GPU there would undo that). One pass of each mapping's 21 is saved: for an
8B-shaped layer, about 0.3-0.4 s of a 9 s search on an H100.
"""
from __future__ import annotations

import contextlib

import torch
from compressed_tensors.utils import patch_attr
from llmcompressor.modifiers.transform.awq import AWQModifier
from torch import nn

__all__ = ["UnscaledOutputs"]


class UnscaledOutputs:
    """For one layer's session: each AWQ parent's outputs kept from the calibration forward, handed to the
    library's unscaled pass where they are what it would compute (see the module docstring)."""

    def __init__(self) -> None:
        self._kept: dict[nn.Module, list[tuple[torch.Tensor, int]] | None] = {}  # None: not usable
        self._changed: set[nn.Module] = set()  # modules an earlier mapping of the layer searched or smoothed
        self._searching = False
        self.served = 0  # unscaled passes saved
        self.ran = 0  # unscaled passes the library ran itself

    @contextlib.contextmanager
    def installed(self):
        """AWQModifier's hook set-up, unscaled pass and search wrapped for the session's life."""
        setup, run_samples, best_scale = (AWQModifier._setup_activation_cache_hooks, AWQModifier._run_samples,
                                          AWQModifier._compute_best_scale)
        me = self

        def setup_hooks(modifier):
            setup(modifier)
            for parent in dict.fromkeys(m.parent for m in modifier._resolved_mappings):
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
            # from here this mapping's balance layers are rewritten (each candidate), then smoothed with its smooth layer
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
