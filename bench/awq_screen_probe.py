"""AWQ's screened grid search (child/backends/awq_screen.py) against the library's own, mapping by mapping, on the
same inputs: llm-compressor's `oneshot` with `AWQModifier` on a random Llama of the 8B shape (one decoder layer by
default); for every mapping whose parent holds eager attention, the library's search runs as released (its losses
recorded, timed), then the screened search from the same state (timed), and the two scalings are compared bit for
bit. Printed per mapping: each grid point's eager loss over the smallest, the screen's offset from it (SDPA's loss
less eager's, in % of the smallest loss), how many points the screened search ran eagerly, both searches' seconds,
and whether the scalings are equal. oneshot goes on with the library's scaling, so its output is oneshot's.

    python bench/awq_screen_probe.py                             # 1 layer of the 8B shape, 128 x 2048, cuda
    python bench/awq_screen_probe.py --device cpu --hidden 256 --intermediate 512 --vocab 512 --samples 8 --seq-len 64
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.dirname(HERE))
from calib_bench import save_tokenizer, write_dataset  # noqa: E402
from export_bench import add_shape_args, build  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_shape_args(ap)
    ap.set_defaults(layers=1)
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--scheme", default="W4A16")
    ap.add_argument("--device", default="cuda", help="cuda (oneshot onloads each layer to the first GPU) or cpu")
    ap.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "awq-probe"))
    args = ap.parse_args()
    args.torch_device = "cpu"

    src, data = os.path.join(args.workdir, "model"), os.path.join(args.workdir, "data.jsonl")
    if not os.path.isdir(src):
        os.makedirs(args.workdir, exist_ok=True)
        t = time.perf_counter()
        build(args, src)
        save_tokenizer(src, args.vocab)
        print(f"built {args.layers} layer(s) of hidden {args.hidden} in {time.perf_counter() - t:.1f} s", flush=True)
    if not os.path.exists(data):
        write_dataset(data, args.samples, args.seq_len, args.vocab)

    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from child.backends import awq_screen
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from llmcompressor.modifiers.transform.awq import AWQModifier

    cuda = args.device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    library, compute_loss = AWQModifier._compute_best_scale, AWQModifier._compute_loss
    losses: list[float] = []
    rows_out: list[str] = []
    equal_all = []

    def recorded_loss(self, *a, **k):
        loss = compute_loss(self, *a, **k)
        losses.append(loss)
        return loss

    def compared(self, mapping, fp16_outputs, orig_layer_weights):
        configs = awq_screen._eager_attention_configs(mapping.parent)
        if not configs:
            return library(self, mapping, fp16_outputs, orig_layer_weights)
        grid = self._get_grid_search_params()
        start = awq_screen._state(mapping.balance_layers)
        losses.clear()
        sync()
        t = time.perf_counter()
        theirs = library(self, mapping, fp16_outputs, orig_layer_weights)
        sync()
        t_lib = time.perf_counter() - t
        eager = list(losses)
        awq_screen._restore(start)
        losses.clear()
        said = []
        log = awq_screen._log
        awq_screen._log = lambda m, n, points: said.append(n)
        try:
            sync()
            t = time.perf_counter()
            ours = awq_screen._screened_search(self, library, mapping, fp16_outputs, orig_layer_weights, grid,
                                               configs)
            sync()
            t_screen = time.perf_counter() - t
        finally:
            awq_screen._log = log
        screen = losses[:len(grid)]
        awq_screen._restore(start)
        equal = torch.equal(theirs, ours)
        equal_all.append(equal)
        smallest = min(eager)
        offsets = [(s - e) / smallest * 100 for s, e in zip(screen, eager)]
        order = sorted(range(len(grid)), key=lambda i: eager[i])
        rows_out.append(
            f"\n{mapping.smooth_name} -> {','.join(n.rsplit('.', 1)[-1] for n in mapping.balance_names)} "
            f"(parent {mapping.parent_name}): library {t_lib:.2f} s, screened {t_screen:.2f} s, "
            f"{said[0] if said else '?'} of {len(grid)} points eager, scalings {'EQUAL' if equal else 'DIFFER'}\n"
            f"  eager loss over the smallest, % (grid order): {' '.join(f'{(e / smallest - 1) * 100:.3f}' for e in eager)}\n"
            f"  screen's offset, % of the smallest (grid order): {' '.join(f'{d:+.4f}' for d in offsets)}\n"
            f"  offsets: mean {sum(offsets) / len(offsets):+.4f}%, spread (max - min) {max(offsets) - min(offsets):.4f}%; "
            f"the three smallest eager losses at points {order[:3]}, 2nd over 1st "
            f"{(eager[order[1]] / smallest - 1) * 100:.3f}%")
        if not all(math.isfinite(x) for x in eager):
            rows_out.append("  (non-finite eager losses)")
        return theirs

    AWQModifier._compute_loss = recorded_loss
    AWQModifier._compute_best_scale = compared
    if not cuda:  # the library pins its cached activations, which raises without an accelerator
        from llmcompressor.pipelines.cache import IntermediatesCache

        IntermediatesCache._pin_intermediate = classmethod(lambda c, value: None)

    rows = [json.loads(line)["input_ids"] for line in open(data)]
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    print(f"torch {torch.__version__}; device {torch.cuda.get_device_name() if cuda else 'cpu'}", flush=True)
    recipe = [AWQModifier(), QuantizationModifier(targets="Linear", scheme=args.scheme, ignore=["lm_head"])]
    t = time.perf_counter()
    oneshot(model=model, processor=AutoTokenizer.from_pretrained(src),
            dataset=Dataset.from_dict({"input_ids": rows, "attention_mask": [[1] * len(r) for r in rows]}),
            recipe=recipe, num_calibration_samples=len(rows), max_seq_length=args.seq_len,
            shuffle_calibration_samples=False)
    print(f"\noneshot AWQ {args.scheme}, {args.layers} layer(s), {args.samples} x {args.seq_len}: "
          f"{time.perf_counter() - t:.1f} s (both searches of each attention mapping included)")
    print("\n".join(rows_out))
    print(f"\n{sum(equal_all)} of {len(equal_all)} screened searches kept the library's scaling bit for bit")


if __name__ == "__main__":
    main()
