"""How GPTQ's per-sample Hessian terms are added (issue 34: the default path may change no bit): is accumulating the
upper-triangle stripes straight into H, and mirroring once after the last sample, bit-identical to the library's
`H += inp.matmul(inp.t())` per sample? How much faster than today's stripes (a full mirrored d x d term per sample,
then `H += term`)? And what the first use of each costs in a fresh process (the worker's layer 0).

    python bench/accumulate_probe.py --device cuda --tokens 2048 --widths 4096:2,14336:4 --samples 16

Variants, per sample (inp: sqrt(2) x^T in fp32, [d, tokens]); today's and into_h are child/backends/hessians.py's own:
- library: term = inp @ inp^T; H += term (the first: H = term + 0.0)
- today: term = stripes (each stripe's matmul into a d x d buffer, the block left of it mirrored); H += term
- into_h: per stripe, H[a:b, a:] += inp[a:b] @ inp[a:]^T (StripedTerm.add_upper); mirrored once (mirror_upper)
- addmm: per stripe, addmm(H[a:b, a:], inp[a:b], inp[a:]^T, out=H[a:b, a:]) (the add in the GEMM's epilogue: another
  kernel may be chosen, so its bits must be checked); mirrored once
"""
from __future__ import annotations

import argparse
import math
import time

import torch

t_process = time.perf_counter()


def scaled(x: torch.Tensor) -> torch.Tensor:
    return math.sqrt(2) * x.t().to(torch.float32)


def library(xs):
    """The reference: llm-compressor's accumulate_hessian, the first term added to zeros as `t + 0.0`."""
    h = None
    for x in xs:
        inp = scaled(x)
        t = inp.matmul(inp.t())
        h = t.add_(0.0) if h is None else h.add_(t)
    return h


def today(xs, count):
    """The twenty-seventh session's product: each term whole (child/backends/hessians.py's mirrored stripes), added."""
    from child.backends import hessians

    h = None
    for x in xs:
        t = hessians._stripes(scaled(x), count)
        h = t.add_(0.0) if h is None else h.add_(t)
    return h


def upper(xs, add_stripe):
    """Stripes added into H's upper triangle from zeros by add_stripe(h, inp, a, b), mirrored once at the end."""
    from child.backends import hessians

    h = None
    for x in xs:
        inp = scaled(x)
        d = inp.shape[0]
        h = torch.zeros((d, d), dtype=inp.dtype, device=inp.device) if h is None else h
        add_stripe(h, inp)
    hessians.mirror_upper(h)
    return h


def into_h(xs, count):
    """This change's product: hessians.StripedTerm.add_upper (each stripe's matmul, then an add into H)."""
    from child.backends import hessians

    return upper(xs, lambda h, inp: hessians.StripedTerm(inp, count).add_upper(h))


def addmm(xs, count):
    """The add in the GEMM's epilogue (not in the product: its bits with a nonzero C are not checked there)."""
    from child.backends import hessians

    def add(h, inp):
        e = hessians._edges(inp.shape[0], count)
        for a, b in zip(e[:-1], e[1:]):
            torch.addmm(h[a:b, a:], inp[a:b], inp[a:].t(), out=h[a:b, a:])

    return upper(xs, add)


def timed(fn, sync):
    sync()
    t = time.perf_counter()
    out = fn()
    sync()
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--widths", default="4096:2,14336:4", help="width:stripe count, comma-separated")
    ap.add_argument("--samples", type=int, default=16)
    a = ap.parse_args()
    dev = torch.device(a.device)
    cuda = dev.type == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t = time.perf_counter()
    torch.empty(1, device=dev)
    sync()
    print(f"process start to torch imported {t - t_process:.3f} s; first tensor on {dev} (context) "
          f"{time.perf_counter() - t:.3f} s")
    print(f"device {torch.cuda.get_device_name() if cuda else 'cpu'}, torch {torch.__version__}")
    # first uses, in this fresh process: what a worker's layer 0 pays once
    for w in (4096, 14336):
        x = torch.randn(a.tokens, w, device=dev, dtype=torch.bfloat16)
        inp = scaled(x)
        for k in range(2):
            _, s = timed(lambda: inp.matmul(inp.t()), sync)
            print(f"fp32 matmul {w} x {a.tokens}: call {k + 1} {s:.4f} s")
        wt = torch.randn(w, w, device=dev, dtype=torch.bfloat16)
        for k in range(2):
            _, s = timed(lambda: torch.nn.functional.linear(x, wt), sync)
            print(f"bf16 linear {a.tokens} x {w} -> {w}: call {k + 1} {s:.4f} s")
    from child.backends import hessians

    for w in (4096, 14336):
        inp = scaled(torch.randn(a.tokens, w, device=dev, dtype=torch.bfloat16))
        _, s = timed(lambda: hessians.stripe_count(inp), sync)
        print(f"stripe verdict (child.backends.hessians._verify) width {w}: {s:.3f} s -> {hessians.stripe_count(inp)}")
    print("| width | stripes | samples | variant | equal library | s per sample | / library | / today |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for spec in a.widths.split(","):
        w, count = map(int, spec.split(":"))
        g = torch.Generator().manual_seed(w)
        xs = [torch.randn(a.tokens, w, generator=g).to(torch.bfloat16).to(dev) for _ in range(a.samples)]
        library(xs[:2]), today(xs[:2], count), into_h(xs[:2], count), addmm(xs[:2], count)  # warm
        ref, t_lib = timed(lambda: library(xs), sync)
        _, t_today = timed(lambda: today(xs, count), sync)
        for name, fn in (("library", lambda: library(xs)), ("today", lambda: today(xs, count)),
                         ("into_h", lambda: into_h(xs, count)), ("addmm", lambda: addmm(xs, count))):
            h, s = timed(fn, sync)
            eq = torch.equal(h.view(torch.int32), ref.view(torch.int32))
            print(f"| {w} | {count} | {a.samples} | {name} | {eq} | {s / a.samples:.5f} | {s / t_lib:.3f} | "
                  f"{s / t_today:.3f} |", flush=True)
            del h
        del ref, xs
        if cuda:
            torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
