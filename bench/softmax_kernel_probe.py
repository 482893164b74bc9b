"""Variants of child/backends/warp_softmax.py's kernel, the same arithmetic in the same order, timed and compared
bit for bit: which one reads and writes eager attention's scores fastest?

Each variant is the product's kernel source (`warp_softmax.KERNEL`) built with other switches: it computes
`softmax(float(half(half(scores * scaling) + mask)), -1)` cast to the scores' dtype in PyTorch's warp softmax's
order, and differs only in how it moves data and holds it:

    plain     lane l loads elements l + 32 it of the row, 2 bytes at a time, and holds them as floats (the
              thirty-seventh session's kernel)
    pack      x held as packed halves (2 a register), e = expf(x - max) computed again for the division
    smem      the row (and its mask row) loaded with 16-byte loads into shared memory, read back by lane in PyTorch's
              order, the probabilities written back through it with 16-byte stores
    smem+pack both (warp_softmax.PACK and SMEM say which the product takes)
    ...-div   each key divided with div.rn (the compiler's division, its reciprocal and range check once a key), not
              the row's reciprocal once (warp_softmax.RDIV: on in the product)
    smem-div-checked  smem-div with every key checked against the row's length even where the row fills the lanes
              (the forty-first session's kernel)
    copy      not a softmax: smem with the scores written back unchanged in place of the quotients. Since nothing
              computed from the scores is stored, the compiler leaves the arithmetic out (its SASS has no exponential
              and no shuffle): the kernel's loads and stores alone. Its "equal" column says nothing.

Each is run over the scores of the 8B shape's attention (32 heads, 2048 x 2048, a causal mask, bf16) `--samples`
times, the fastest of `--rounds`; its output is compared with eager's chain (scale,
mask, upcast, softmax, cast) bit for bit, for bf16 at several row lengths (shared memory where a row is a multiple
of 8 keys) and for fp16 up to 1024.

    python bench/softmax_kernel_probe.py            # cuda
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {  # name -> warp_softmax.source's switches
    "plain": dict(pack=False, smem=False), "pack": dict(pack=True, smem=False), "smem": dict(pack=False, smem=True),
    "smem+pack": dict(pack=True, smem=True), "plain-div": dict(pack=False, smem=False, rdiv=False),
    "smem-div": dict(pack=False, smem=True, rdiv=False),
    "smem-div-checked": dict(pack=False, smem=True, rdiv=False, full=False),
    "copy": dict(pack=False, smem=True, copy=True)}



def build(variant: str, dtype, lanes: int, warps: int, keys: int):
    import torch

    from child.backends import warp_softmax

    switches = dict(VARIANTS[variant])
    full = switches.pop("full", keys == lanes * 32)
    return warp_softmax._kernel(torch.device("cuda", torch.cuda.current_device()), dtype, lanes,
                                switches.pop("smem"), full, warps=warps, **switches)


def fits(variant: str, lanes: int, warps: int) -> bool:
    """Static shared memory (48 KiB) holds a block's rows and mask rows."""
    return not VARIANTS[variant]["smem"] or warps * lanes * 32 * 2 * 2 <= 48 * 1024


def launch(kernel, scores, mask, scaling: float, warps: int):
    import torch

    b, h, q, k = scores.shape
    strides = mask.expand(b, h, q, k).stride() if mask is not None else (0, 0, 0, 0)
    out = torch.empty_like(scores)
    rows = b * h * q
    kernel((rows + warps - 1) // warps, (32, warps), scores.data_ptr(), (scores if mask is None else mask).data_ptr(),
           out.data_ptr(), rows, k, q, h, int(mask is not None), *strides,
           struct.unpack("<i", struct.pack("<f", scaling))[0])
    return out


def eager_chain(scores, mask, scaling):
    import torch

    x = scores * scaling
    if mask is not None:
        x = x + mask
    return torch.nn.functional.softmax(x, dim=-1, dtype=torch.float32).to(scores.dtype)


def main() -> None:
    import torch

    from child.backends.warp_softmax import elements_per_lane

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--samples", type=int, default=128)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--warps", default="2,4,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    scaling = 128 ** -0.5
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    def causal(n, dtype):
        return torch.full((1, 1, n, n), torch.finfo(dtype).min, dtype=dtype, device=dev).triu(1)

    # bit-equality: each variant against eager's chain, several lengths and both dtypes, narrow scores and wide ones
    # (exponentials down to fp32's subnormals: the rows RDIV divides again key by key)
    checks = [(torch.bfloat16, n, w) for n in (8, 64, 100, 256, 1000, 1024, 1536, 2047, 2048) for w in (8, 400)] + \
        [(torch.float16, n, w) for n in (256, 1000, 1024) for w in (8, 400)]
    equal: dict[tuple, bool] = {}
    for dtype, n, spread in checks:
        scores = (torch.randn(1, 8, n, n, device=dev, generator=g) * spread).to(dtype)
        mask = causal(n, dtype)
        ref = eager_chain(scores, mask, scaling)
        lanes = elements_per_lane(n)
        for variant in VARIANTS:
            for warps in map(int, args.warps.split(",")):
                if not fits(variant, lanes, warps) or (VARIANTS[variant]["smem"] and n % 8):
                    continue
                out = launch(build(variant, dtype, lanes, warps, n), scores, mask, scaling, warps)
                equal[(variant, warps)] = equal.get((variant, warps), True) and torch.equal(out, ref)
    # timing on the benchmark's shape
    n = args.seq_len
    scores = (torch.randn(1, args.heads, n, n, device=dev, generator=g) * 8).to(torch.bfloat16)
    mask = causal(n, torch.bfloat16)
    lanes = elements_per_lane(n)
    rows = []
    for variant in VARIANTS:
        for warps in map(int, args.warps.split(",")):
            if not fits(variant, lanes, warps):
                continue
            kernel = build(variant, torch.bfloat16, lanes, warps, n)
            launch(kernel, scores, mask, scaling, warps)
            best = float("inf")
            for _ in range(args.rounds):
                torch.cuda.synchronize()
                t = time.perf_counter()
                for _ in range(args.samples):
                    launch(kernel, scores, mask, scaling, warps)
                torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t)
            gbs = args.samples * scores.numel() * 2 * 2 / best / 1e9
            rows.append((variant, warps, best, gbs, equal.get((variant, warps))))
    t = time.perf_counter()
    for _ in range(args.samples):
        eager_chain(scores, mask, scaling)
    torch.cuda.synchronize()
    chain = time.perf_counter() - t
    print(f"\n{args.samples} x [1, {args.heads}, {n}, {n}] bf16, causal mask; eager's chain {chain:.3f} s\n")
    print("| variant | warps a block | s (all samples) | GB/s (scores in, probabilities out) | equal to eager's chain everywhere |")
    print("| --- | --- | --- | --- | --- |")
    for variant, warps, best, gbs, eq in rows:
        print(f"| {variant} | {warps} | {best:.4f} | {gbs:.0f} | {eq} |")


if __name__ == "__main__":
    main()
