"""Could a fused attention screen AWQ's grid search and keep oneshot's bits? Measured on the library's own search:
llm-compressor's `oneshot` with `AWQModifier` on a random Llama of the 8B shape (one decoder layer by default); for
every mapping whose parent holds eager attention (q/k/v's), the library's search runs as released (each grid point's
eager loss recorded, timed), then again from the same state with its passes through SDPA (the parent's unscaled SDPA
output as the reference; a causal mask handed to SDPA as `is_causal`), timed. Printed per mapping: each grid point's
eager loss over the smallest (the landscape the search decides on), SDPA's offset from it (SDPA's loss less eager's,
in % of the smallest loss), and how many points lie within the offsets' spread of the smallest eager loss: those a
screen through SDPA cannot tell apart, each of which a search that keeps oneshot's bits must still run eagerly.
oneshot goes on with the library's (eager) scaling, so its output is oneshot's.

    python bench/awq_screen_probe.py                             # 1 layer of the 8B shape, 128 x 2048, cuda
    python bench/awq_screen_probe.py --device cpu --hidden 256 --intermediate 512 --vocab 512 --samples 8 --seq-len 64
"""
from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from awq_probe import add_probe_args, prepare, run_oneshot  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_probe_args(ap)
    args = ap.parse_args()
    args.torch_device = "cpu"

    src, data = prepare(args)

    import contextlib

    import torch
    from compressed_tensors.utils import patch_attr

    from llmcompressor.modifiers.transform.awq import AWQModifier

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    library, compute_loss = AWQModifier._compute_best_scale, AWQModifier._compute_loss
    losses: list[float] = []
    rows_out: list[str] = []

    def recorded_loss(self, *a, **k):
        loss = compute_loss(self, *a, **k)
        losses.append(loss)
        return loss

    def attention_configs(parent):  # transformers' attention modules read config._attn_implementation at each call
        return list({id(m.config): m.config for m in parent.modules()
                     if "Attention" in type(m).__name__ and getattr(getattr(m, "config", None),
                                                                     "_attn_implementation", None) == "eager"}.values())

    def causal_as_none(kwargs):
        mask = kwargs.get("attention_mask")
        if isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[-1] == mask.shape[-2]:
            allowed = mask if mask.dtype == torch.bool else mask == 0
            if bool((allowed == torch.ones(mask.shape[-2:], dtype=torch.bool, device=mask.device).tril()).all()):
                return {**kwargs, "attention_mask": None}
        return kwargs

    def fused_run_samples(self, module):
        outputs = [module(**causal_as_none(batch)) for batch in self._parent_args_cache[module]]
        return [out[0] if isinstance(out, tuple) else out for out in outputs]

    def state(modules):  # the search leaves the balance layers quantized and reads their means at its start
        return [(m, n, t.detach().clone()) for m in modules
                for n, t in [*m.named_parameters(recurse=False), *m.named_buffers(recurse=False)]]

    def restore(saved):
        for module, name, value in saved:
            getattr(module, name).data.copy_(value)

    def compared(self, mapping, fp16_outputs, orig_layer_weights):
        configs = attention_configs(mapping.parent)
        if not configs:
            return library(self, mapping, fp16_outputs, orig_layer_weights)
        start = state(mapping.balance_layers)
        losses.clear()
        sync()
        t = time.perf_counter()
        theirs = library(self, mapping, fp16_outputs, orig_layer_weights)
        sync()
        t_lib = time.perf_counter() - t
        eager = list(losses)
        end = state(mapping.balance_layers)
        restore(start)
        losses.clear()
        with contextlib.ExitStack() as stack:
            for config in configs:
                stack.enter_context(patch_attr(config, "_attn_implementation", "sdpa"))
            stack.enter_context(patch_attr(AWQModifier, "_run_samples", fused_run_samples))
            sync()
            t = time.perf_counter()
            reference = self._run_samples(mapping.parent)
            library(self, mapping, reference, orig_layer_weights)
            sync()
            t_sdpa = time.perf_counter() - t
            del reference
        self._error_metrics.pop()  # the SDPA search's entry: the library's own stays
        screen = list(losses)
        restore(end)  # as the library's search left them
        smallest = min(eager)
        offsets = [(s - e) / smallest * 100 for s, e in zip(screen, eager)]
        spread = max(offsets) - min(offsets)
        order = sorted(range(len(eager)), key=lambda i: eager[i])
        within = sum((e / smallest - 1) * 100 <= spread for e in eager)
        rows_out.append(
            f"\n{mapping.smooth_name} -> {','.join(n.rsplit('.', 1)[-1] for n in mapping.balance_names)} "
            f"(parent {mapping.parent_name}): the library's search {t_lib:.2f} s; through SDPA (its reference "
            f"pass included) {t_sdpa:.2f} s\n"
            f"  eager loss over the smallest, % (grid order): {' '.join(f'{(e / smallest - 1) * 100:.3f}' for e in eager)}\n"
            f"  SDPA's offset, % of the smallest (grid order): {' '.join(f'{d:+.4f}' for d in offsets)}\n"
            f"  offsets: mean {sum(offsets) / len(offsets):+.4f}%, spread (max - min) {spread:.4f}%; the grid's "
            f"eager losses span {(max(eager) / smallest - 1) * 100:.3f}%, the 2nd smallest over the smallest "
            f"{(eager[order[1]] / smallest - 1) * 100:.3f}%; {within} of {len(eager)} points within the offsets' "
            f"spread of the smallest")
        return theirs

    AWQModifier._compute_loss = recorded_loss
    AWQModifier._compute_best_scale = compared
    print(f"torch {torch.__version__}; device {torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)
    seconds = run_oneshot(args, src, data)
    print(f"\noneshot AWQ {args.scheme}, {args.layers} layer(s), {args.samples} x {args.seq_len}: {seconds:.1f} s "
          "(both searches of each attention mapping included)")
    print("\n".join(rows_out))


if __name__ == "__main__":
    main()
