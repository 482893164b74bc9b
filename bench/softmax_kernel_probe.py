"""Variants of child/backends/warp_softmax.py's kernel, the same arithmetic in the same order, timed and compared
bit for bit: which one reads and writes eager attention's scores fastest?

Each variant computes what the product's kernel computes (`softmax(float(half(half(scores * scaling) + mask)), -1)`
cast to the scores' dtype, PyTorch's warp softmax's order), and differs only in how it moves data and holds it:

    product   the product's kernel as it is (lane l loads elements l + 32 it of the row, 2 bytes at a time)
    pack      x held as packed halves (2 a register), e = expf(x - max) recomputed for the division: fewer registers
    smem      the row (and its mask row) loaded with 16-byte loads into shared memory, read back by lane in PyTorch's
              order, the probabilities written back through it with 16-byte stores
    smem+pack both

Each is run over the scores of the 8B shape's attention (32 heads, 2048 x 2048, a causal mask, bf16) `--samples`
times, the fastest of `--rounds`; its output is compared with the product kernel's and with eager's chain (scale,
mask, upcast, softmax, cast) bit for bit, for bf16 at several row lengths and for fp16 up to 1024.

    python bench/softmax_kernel_probe.py            # cuda
"""
from __future__ import annotations

import argparse
import os
import struct
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

VARIANTS = {"product": (0, 0), "pack": (1, 0), "smem": (0, 1), "smem+pack": (1, 1)}

KERNEL = r"""
typedef unsigned short u16;

__device__ __forceinline__ float to_float(u16 v) {
#if IS_BF16
    return __uint_as_float(((unsigned int)v) << 16);
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
#endif
}

__device__ __forceinline__ u16 round_to_half(float f) {
    u16 h;
#if IS_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

#define ROW (ITER * 32)

extern "C" __global__ void eager_probabilities(const u16* __restrict__ scores, const u16* __restrict__ mask,
                                               u16* __restrict__ out, int rows, int K, int Q, int H, int has_mask,
                                               int ms0, int ms1, int ms2, int ms3, int scaling_bits) {
#if SMEM
    __shared__ __align__(16) u16 srow[WARPS][ROW];
    __shared__ __align__(16) u16 mrow[WARPS][ROW];
#endif
    const int lane = threadIdx.x;
    const long long row = (long long)blockIdx.x * blockDim.y + threadIdx.y;
    if (row >= rows) return;
    const float scale = __int_as_float(scaling_bits);
    const u16* src = scores + row * (long long)K;
    u16* dst = out + row * (long long)K;
    long long moff = 0;
    if (has_mask) {
        const long long q = row % Q, bh = row / Q;
        moff = (bh / H) * (long long)ms0 + (bh % H) * (long long)ms1 + q * (long long)ms2;
    }
#if SMEM
    // the caller launches this only for K == ROW, K % 8 == 0, a contiguous mask row: 16-byte loads
    {
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4* d4 = reinterpret_cast<uint4*>(srow[threadIdx.y]);
#pragma unroll
        for (int j = 0; j < ROW / 8 / 32; ++j) d4[lane + 32 * j] = s4[lane + 32 * j];
        if (has_mask) {
            const uint4* m4 = reinterpret_cast<const uint4*>(mask + moff);
            uint4* e4 = reinterpret_cast<uint4*>(mrow[threadIdx.y]);
#pragma unroll
            for (int j = 0; j < ROW / 8 / 32; ++j) e4[lane + 32 * j] = m4[lane + 32 * j];
        }
        __syncwarp();
    }
#define LOAD_S(k) srow[threadIdx.y][k]
#define LOAD_M(k) mrow[threadIdx.y][k]
#else
#define LOAD_S(k) src[k]
#define LOAD_M(k) mask[moff + (long long)(k) * ms3]
#endif
#if PACK
    unsigned int xs[(ITER + 1) / 2];
#define GET_X(it) to_float((u16)((it) % 2 ? (xs[(it) / 2] >> 16) : (xs[(it) / 2] & 0xffffu)))
#else
    float e[ITER];
#define GET_X(it) e[it]
#endif
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int k = lane + it * 32;
        u16 h;
        if (k < K) {
            h = round_to_half(to_float(LOAD_S(k)) * scale);
            if (has_mask) h = round_to_half(to_float(h) + to_float(LOAD_M(k)));
        } else {
            h = IS_BF16 ? 0xff80 : 0xfc00;  // -inf as a half: to_float gives fp32's -inf, as PyTorch pads a row
        }
#if PACK
        if (it % 2) xs[it / 2] |= ((unsigned int)h) << 16; else xs[it / 2] = h;
#else
        e[it] = to_float(h);
#endif
    }
    float m = GET_X(0);
#pragma unroll
    for (int it = 1; it < ITER; ++it) { const float x = GET_X(it); m = m > x ? m : x; }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float b = __shfl_xor_sync(0xffffffffu, m, offset, 32);
        m = m < b ? b : m;
    }
    float sum = 0.0f;
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
#if PACK
        sum += expf(GET_X(it) - m);
#else
        e[it] = expf(e[it] - m);
        sum += e[it];
#endif
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, offset, 32);
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int k = lane + it * 32;
#if PACK
        const float ev = expf(GET_X(it) - m);
#else
        const float ev = e[it];
#endif
        const u16 p = round_to_half(sum == 0.0f ? __int_as_float(0x7fffffff) : ev / sum);
#if SMEM
        srow[threadIdx.y][k] = p;
#else
        if (k < K) dst[k] = p;
#endif
    }
#if SMEM
    __syncwarp();
    {
        const uint4* s4 = reinterpret_cast<const uint4*>(srow[threadIdx.y]);
        uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll
        for (int j = 0; j < ROW / 8 / 32; ++j) d4[lane + 32 * j] = s4[lane + 32 * j];
    }
#endif
}
"""


def build(variant: str, dtype, lanes: int, warps: int):
    import torch
    from torch.cuda._utils import _cuda_load_module

    from child.backends.warp_softmax import _nvrtc_ptx

    pack, smem = VARIANTS[variant]
    major, minor = torch.cuda.get_device_capability()
    src = (f"#define IS_BF16 {int(dtype == torch.bfloat16)}\n#define ITER {lanes}\n#define PACK {pack}\n"
           f"#define SMEM {smem}\n#define WARPS {warps}\n" + KERNEL)
    ptx = _nvrtc_ptx(src, "eager_probabilities", f"{major}{minor}")
    return _cuda_load_module(ptx, ["eager_probabilities"])["eager_probabilities"]


def launch(kernel, scores, mask, scaling: float, warps: int):
    import torch

    b, h, q, k = scores.shape
    strides = mask.expand(b, h, q, k).stride() if mask is not None else (0, 0, 0, 0)
    out = torch.empty_like(scores)
    rows = b * h * q
    kernel(grid=((rows + warps - 1) // warps, 1, 1), block=(32, warps, 1),
           args=[scores, scores if mask is None else mask, out, rows, k, q, h, int(mask is not None), *strides,
                 struct.unpack("<i", struct.pack("<f", scaling))[0]])
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
    ap.add_argument("--warps", default="4,8")
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    scaling = 128 ** -0.5
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)

    def causal(n, dtype):
        return torch.full((1, 1, n, n), torch.finfo(dtype).min, dtype=dtype, device=dev).triu(1)

    # bit-equality: each variant against the product kernel and eager's chain, several lengths and both dtypes
    checks = [(torch.bfloat16, n) for n in (64, 256, 1024, 2048)] + [(torch.float16, n) for n in (256, 1024)]
    equal: dict[tuple, bool] = {}
    for dtype, n in checks:
        scores = (torch.randn(1, 8, n, n, device=dev, generator=g) * 8).to(dtype)
        mask = causal(n, dtype)
        ref = eager_chain(scores, mask, scaling)
        lanes = elements_per_lane(n)
        for variant in VARIANTS:
            for warps in map(int, args.warps.split(",")):
                if VARIANTS[variant][1] and (n != lanes * 32 or n % 8 or lanes < 8):
                    continue
                out = launch(build(variant, dtype, lanes, warps), scores, mask, scaling, warps)
                equal[(variant, warps)] = equal.get((variant, warps), True) and torch.equal(out, ref)
    # timing on the benchmark's shape
    n = args.seq_len
    scores = (torch.randn(1, args.heads, n, n, device=dev, generator=g) * 8).to(torch.bfloat16)
    mask = causal(n, torch.bfloat16)
    lanes = elements_per_lane(n)
    rows = []
    for variant in VARIANTS:
        for warps in map(int, args.warps.split(",")):
            kernel = build(variant, torch.bfloat16, lanes, warps)
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
    print("| variant | warps a block | s (all samples) | GB/s (scores in, probabilities out) | equal to eager's and the product's everywhere |")
    print("| --- | --- | --- | --- | --- |")
    for variant, warps, best, gbs, eq in rows:
        print(f"| {variant} | {warps} | {best:.4f} | {gbs:.0f} | {eq} |")


if __name__ == "__main__":
    main()
