"""Is GPTQ's Hessian term, computed as upper-triangle stripes and mirrored, bit-identical to the library's full
`inp.matmul(inp.t())`? And how much faster? (issue 34: the default path may change no bit.)

    python bench/symmetric_probe.py --device cuda --tokens 2048 --widths 4096,14336 --blocks 2,4,8
"""
from __future__ import annotations

import argparse
import math
import time

import torch


def library(x: torch.Tensor) -> torch.Tensor:
    inp = math.sqrt(2) * x.t().to(torch.float32)  # accumulate_hessian: inp.t(), upcast, scale
    return inp.matmul(inp.t())


def stripes(x: torch.Tensor, blocks: int) -> torch.Tensor:
    inp = math.sqrt(2) * x.t().to(torch.float32)
    d = inp.shape[0]
    out = torch.empty((d, d), dtype=torch.float32, device=inp.device)
    edges = [round(d * k / blocks) // 8 * 8 for k in range(blocks)] + [d]
    for a, b in zip(edges[:-1], edges[1:]):
        torch.matmul(inp[a:b], inp[a:].t(), out=out[a:b, a:])
        if b < d:
            out[b:, a:b].copy_(out[a:b, b:].t())
    return out


def timed(fn, sync, reps=3):
    fn(); sync()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    sync()
    return (time.perf_counter() - t) / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--widths", default="4096,14336")
    ap.add_argument("--blocks", default="2,4,8")
    ap.add_argument("--seeds", type=int, default=3)
    a = ap.parse_args()
    dev = torch.device(a.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    print(f"device {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"tf32 {torch.backends.cuda.matmul.allow_tf32}")
    print("| width | tokens | blocks | equal (seeds) | full symmetric | full s | stripes s | ratio |")
    for w in map(int, a.widths.split(",")):
        xs = [torch.randn(1, a.tokens, w, generator=torch.Generator().manual_seed(s)).to(torch.bfloat16).to(dev)[0]
              for s in range(a.seeds)]
        fulls = [library(x) for x in xs]
        sym = all(torch.equal(f, f.t()) for f in fulls)
        tf = timed(lambda: library(xs[0]), sync)
        for b in map(int, a.blocks.split(",")):
            eq = sum(torch.equal(f, stripes(x, b)) for f, x in zip(fulls, xs))
            ts = timed(lambda: stripes(xs[0], b), sync)
            print(f"| {w} | {a.tokens} | {b} | {eq}/{len(xs)} | {sym} | {tf:.4f} | {ts:.4f} | {ts / tf:.3f} |", flush=True)
        del fulls, xs


if __name__ == "__main__":
    main()
