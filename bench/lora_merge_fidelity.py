"""Is PEFT's LoRA merge on a GPU bit-equal to the same merge on the CPU (the reference of the studio path)?

    python bench/lora_merge_fidelity.py [--device cuda:0]

For Llama-8B-shaped projections (q/k/v/o, gate/up/down) and ranks 8..64, with and without rsLoRA, it merges the
same bf16 weight and fp32 adapter pair with PEFT's own lora.Linear.merge (child/sources/adapter.py: merge_pair) on the CPU
and on the device, and prints how many merged elements differ. The exporter merges on the CPU in the child
whatever the export device, so its output is bit-equal to the CPU reference either way; this script answers
whether a studio's own merge_and_unload() on the GPU would be (docs/fidelity.md records the answer).
"""
from __future__ import annotations

import argparse
import time

import torch

from child.sources.adapter import LoraPair, merge_pair

SHAPES = {"q_proj": (4096, 4096), "k_proj": (1024, 4096), "o_proj": (4096, 4096), "gate_proj": (14336, 4096),
          "down_proj": (4096, 14336)}


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cuda:0")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    merge_pair(torch.zeros(4, 4, dtype=torch.bfloat16), LoraPair(torch.zeros(1, 4), torch.zeros(4, 1), r=1,
                                                                 lora_alpha=1))  # imports PEFT outside the timing
    rows = []
    for name, (out_f, in_f) in SHAPES.items():
        for r in (8, 16, 64):
            for rslora in (False, True):
                w = (torch.randn(out_f, in_f, generator=gen) * 0.02).to(torch.bfloat16)
                a = torch.randn(r, in_f, generator=gen) * 0.01
                b = torch.randn(out_f, r, generator=gen) * 0.01
                t = time.perf_counter()
                cpu = merge_pair(w, LoraPair(a, b, r=r, lora_alpha=2 * r, use_rslora=rslora))
                seconds = time.perf_counter() - t
                dev = merge_pair(w.to(args.device), LoraPair(a.to(args.device), b.to(args.device), r=r,
                                                             lora_alpha=2 * r, use_rslora=rslora)).cpu()
                differ = int((cpu.view(torch.int16) != dev.view(torch.int16)).sum())
                rows.append((name, r, rslora, differ, cpu.numel(), seconds))
                print(f"{name:10s} r={r:<3d} rslora={rslora!s:5s} differing elements: {differ} of {cpu.numel()}; "
                      f"CPU merge {seconds:.3f} s")
    total = sum(row[3] for row in rows)
    layer = sum(row[5] for row in rows if row[1] == 16 and not row[2]) + sum(  # q,k,v,o,gate,up,down at r=16
        row[5] for row in rows if row[1] == 16 and not row[2] and row[0] in ("k_proj", "gate_proj"))
    print(f"CPU merge of one 8B-shaped layer (7 Linears, r=16, {torch.get_num_threads()} threads): {layer:.2f} s")
    state = "bit-equal in all" if total == 0 else f"NOT bit-equal: {total} differing elements over"
    print(f"{state} {len(rows)} cases (torch.backends.cuda.matmul.allow_tf32={torch.backends.cuda.matmul.allow_tf32})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
