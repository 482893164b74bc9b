"""Eager attention's probabilities in one CUDA kernel, bit for bit: scaling, mask, PyTorch's warp softmax, the cast.

Between its two products, transformers' eager attention (Llama's `eager_attention_forward`) rounds its scores step by
step, each step a pass over a [heads, tokens, tokens] tensor::

    x = half(scores * scaling)          half: the model's dtype (bf16 or fp16), products in fp32, rounded to nearest
    x = half(x + mask)
    p = softmax(float(x), dim=-1)       PyTorch's CUDA softmax in fp32 (fp16 reads its input itself: the same values)
    probs = half(p)

For rows of at most 2048 keys in bf16 (`torch.softmax`'s dispatch in torch 2.10 and later: `dim_size <= 2048 &&
dim_size * sizeof(float) <= 8192` for the upcast input) and 1024 in fp16 (whose softmax reads the half input itself,
`half_to_float`, a branch that kept the bound of 1024: rows of 1025 and over differed on an H100, the shorter ones
did not), PyTorch computes `p` with its persistent warp softmax (`softmax_warp_forward`,
aten/src/ATen/native/cuda/PersistentSoftmax.cuh): one warp a row; lane `l` holds the row's elements `l + 32 * it`
(the missing ones as -inf); the maximum, then `sum += expf(x - max)` in the lane's order, then a butterfly of
`__shfl_xor_sync` over offsets 16, 8, 4, 2, 1 (every lane ends with the same sum); each output `e / sum` (IEEE
division). `KERNEL` below is that arithmetic in that order, with the scaling, the mask and the roundings before it and
the cast after it, so one kernel reads the bf16 scores (and mask) once and writes the bf16 probabilities once, where
eager's chain writes and reads fp32 tensors four times. Compiled at run time by NVRTC (the compiler PyTorch's own
kernels come from, with nvcc's defaults: IEEE division, no flush to zero, `expf` from CUDA's math library), one
variant per dtype and row width (lanes hold `next_power_of_two(K) / 32` elements, PyTorch's WARP_ITERATIONS).
The division is IEEE's, computed with the row's reciprocal once and two fma a key where the row allows it
(`ROW_DIVISION`, checked against div.rn for every pair of significands), by `/` elsewhere: on an H100 that took the
8B layer's 128 samples from 0.053 s to 0.030 s (docs/calibration.md).

Exact by construction where the torch at hand computes as described; `child/backends/eager_attention.py` compares
its first calls with eager attention bit for bit and turns this kernel off at any difference (another torch's
dispatch or kernel). Longer rows (PyTorch's block softmax), other dtypes, and masks of another dtype than the scores'
are not handled here: `probabilities` returns None and the caller keeps eager's chain (its fused prefix).
"""
from __future__ import annotations

import struct
import threading

import torch

from child.backends.cuda_kernels import Kernel
from child.faults import switched

__all__ = ["HALVES", "probabilities", "variant", "elements_per_lane", "MAX_ROW", "available", "turn_off"]

# the longest rows PyTorch's CUDA softmax gives its warp kernel, for eager's input (torch 2.10 and later): bf16
# scores reach it upcast (`dim_size <= 2048 && dim_size * sizeof(float) <= 8192`); fp16 ones as half, read by the
# kernel itself (`half_to_float`), whose bound stayed at 1024 (measured: rows of 1025 and over differ on an H100)
MAX_ROW = {torch.bfloat16: 2048, torch.float16: 1024}
_WARPS = 4  # warps (rows) per block of 128 threads, as PyTorch launches it
# how the kernel moves and holds a row (the same arithmetic either way; bench/softmax_kernel_probe.py times them):
# rows moved through shared memory with 16-byte loads where their layout allows it (SMEM: on, 2.4x the lane-by-lane
# kernel's speed on an H100, s39c: 0.058 s against 0.140 for the 8B layer's 128 samples), x held as packed halves and
# e recomputed (PACK: off; with SMEM 0.072 s against 0.058 in s39c, 0.0293 against 0.0299 with RDIV in s43a: within
# the runs' spread). tests/gpu/test_eager_attention_gpu.py checks every combination;
# SUPERVISOR_TEST_KERNELS switches them for a test or a bench (child/faults.py)
PACK, SMEM = switched("pack", False), switched("smem", True)
# the row's division with its reciprocal once (RDIV: on, ROW_DIVISION says why it is exact; s43a on an H100: 0.0299 s
# against 0.0481 with each key divided by div.rn; off only for bench/softmax_kernel_probe.py's comparison)
RDIV = switched("rdiv", True)

# CUDA helpers for a half dtype (IS_BF16: bf16, else fp16) as c10 converts it on the device; rotary.py's kernel too
HALVES = r"""
typedef unsigned short u16;

__device__ __forceinline__ float to_float(u16 v) {
#if IS_BF16
    return __uint_as_float(((unsigned int)v) << 16);
#else
    float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v)); return f;
#endif
}

__device__ __forceinline__ u16 round_to_half(float f) {  // c10's conversion on the device: round to nearest even
    u16 h;
#if IS_BF16
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
#else
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
#endif
    return h;
}

"""

# the division by the row's sum (RDIV), apart so that bench/division_proof.py checks these very lines
ROW_DIVISION = r"""
// ev / sum as div.rn.f32's fast path computes it (ptxas's lowering of `/`: MUFU.RCP, one Newton step, the product,
// one fma correction), the reciprocal's steps done once for the row rather than once a key, and without div.rn's
// per-key range check (FCHK, which sends the hard cases to a slow path). The kernel checks the range once a row
// instead: the sum in [1, 2048] (a finite sum is at least the maximum's own exponential, 1, and at most K ones) and no
// lane's ev in (0, 2^-64); any other row is divided again key by key with `/`. In that range every step's result is a
// normal float or an exact zero, so each scales exactly with the operands' exponents (rcp.approx too: checked for
// every significand and exponent 0-11), and the quotient equals IEEE division's for every pair of significands: all
// 2^46 pairs, checked on the GPU (bench/division_proof.py; tests/gpu/test_eager_attention_gpu.py checks every ev of
// the range against a few sums). ev == 0 gives +0 as 0 / sum does.
__device__ __forceinline__ float rcp_row(float sum) {
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(sum));
    return __fmaf_rn(r0, __fmaf_rn(-sum, r0, 1.0f), r0);
}

__device__ __forceinline__ float div_row(float ev, float sum, float r) {
    const float q = __fmaf_rn(ev, r, 0.0f);
    return __fmaf_rn(r, __fmaf_rn(-sum, q, ev), q);
}
"""

KERNEL = HALVES + ROW_DIVISION + r"""
#define ROW (ITER * 32)
#define VECS ((ROW / 8 + 31) / 32)  // 16-byte vectors a lane moves per row (SMEM)
#if FULL
#define IN_ROW(k) true  // K == ROW: every lane's every element is a key of the row
#else
#define IN_ROW(k) ((k) < K)
#endif

// ITER: elements a lane holds (PyTorch's WARP_ITERATIONS). PACK: x held as packed halves, e = expf(x - max)
// computed again for the division (the same function of the same value: the same bits), half the registers.
// SMEM: the row and its mask row moved with 16-byte loads through shared memory, read there in PyTorch's order, the
// probabilities written back the same way (the host launches it only for K % 8 == 0, 16-byte aligned rows, a mask
// whose last dimension is contiguous and whose other strides are multiples of 8).
extern "C" __global__ void eager_probabilities(const u16* __restrict__ scores, const u16* __restrict__ mask,
                                               u16* __restrict__ out, int rows, int K, int Q, int H, int has_mask,
                                               int ms0, int ms1, int ms2, int ms3, int scaling_bits) {
#if SMEM
    __shared__ __align__(16) u16 srow[WARPS][ROW];
    __shared__ __align__(16) u16 mrow[WARPS][ROW];
#endif
    const int lane = threadIdx.x;
    const int row = blockIdx.x * blockDim.y + threadIdx.y;  // rows < 2^31 (the host's check)
    if (row >= rows) return;  // a whole warp: its shuffles stay among live lanes
    const float scale = __int_as_float(scaling_bits);  // the mul kernel's scalar as its opmath type, float(scaling)
    const u16* src = scores + row * (long long)K;
    u16* dst = out + row * (long long)K;
    long long moff = 0;
    if (has_mask) {
        const unsigned int q = (unsigned int)row % Q, bh = (unsigned int)row / Q;
        moff = (long long)(bh / H) * ms0 + (long long)(bh % H) * ms1 + (long long)q * ms2;
    }
#if SMEM
    const int nv = K / 8;
    {
        const uint4* s4 = reinterpret_cast<const uint4*>(src);
        uint4* d4 = reinterpret_cast<uint4*>(srow[threadIdx.y]);
#pragma unroll
        for (int j = 0; j < VECS; ++j) if (lane + 32 * j < nv) d4[lane + 32 * j] = s4[lane + 32 * j];
        if (has_mask) {
            const uint4* m4 = reinterpret_cast<const uint4*>(mask + moff);
            uint4* e4 = reinterpret_cast<uint4*>(mrow[threadIdx.y]);
#pragma unroll
            for (int j = 0; j < VECS; ++j) if (lane + 32 * j < nv) e4[lane + 32 * j] = m4[lane + 32 * j];
        }
        __syncwarp();
    }
#define SCORE(k) srow[threadIdx.y][k]
#define MASK(k) mrow[threadIdx.y][k]
#else
#define SCORE(k) src[k]
#define MASK(k) mask[moff + (long long)(k) * ms3]
#endif
#if PACK
    unsigned int xs[(ITER + 1) / 2];
#define X(it) to_float((u16)((it) % 2 ? (xs[(it) / 2] >> 16) : (xs[(it) / 2] & 0xffffu)))
#else
    float e[ITER];
#define X(it) e[it]
#endif
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
        const int k = lane + it * 32;
        u16 h = IS_BF16 ? 0xff80 : 0xfc00;  // -inf, as PyTorch pads a row
        if (IN_ROW(k)) {
            h = round_to_half(to_float(SCORE(k)) * scale);
            if (has_mask) h = round_to_half(to_float(h) + to_float(MASK(k)));
        }
#if PACK
        if (it % 2) xs[it / 2] |= ((unsigned int)h) << 16; else xs[it / 2] = h;
#else
        e[it] = to_float(h);
#endif
    }
    float m = X(0);
#pragma unroll
    for (int it = 1; it < ITER; ++it) { const float x = X(it); m = m > x ? m : x; }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) {
        const float b = __shfl_xor_sync(0xffffffffu, m, offset, 32);
        m = m < b ? b : m;
    }
    float sum = 0.0f;
#pragma unroll
    for (int it = 0; it < ITER; ++it) {
#if PACK
        sum += expf(X(it) - m);
#else
        e[it] = expf(e[it] - m);
        sum += e[it];
#endif
    }
#pragma unroll
    for (int offset = 16; offset > 0; offset /= 2) sum = sum + __shfl_xor_sync(0xffffffffu, sum, offset, 32);
#if PACK
#define EV(it) expf(X(it) - m)
#else
#define EV(it) e[it]
#endif
#if SMEM
#define PUT(k, p) srow[threadIdx.y][k] = (p)  // the row's slots past K are never written out: no check
#else
#define PUT(k, p) if (IN_ROW(k)) dst[k] = (p)
#endif
    // the sum is the same in every lane (a butterfly of commutative additions): each branch below is the warp's
#if COPY
#pragma unroll
    for (int it = 0; it < ITER; ++it) {  // bench/softmax_kernel_probe.py only: the scores back, no division
        const int k = lane + it * 32;
        PUT(k, SCORE(k));
    }
#else
    bool divided = false;
#if RDIV
    if (sum >= 1.0f && sum <= 2048.0f) {
        const float r = rcp_row(sum);
        bool tiny = false;
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            const int k = lane + it * 32;
            const float ev = EV(it);
            tiny |= __float_as_uint(ev) - 1u < 0x1f800000u - 1u;  // 0 < ev < 2^-64 (ev is +0, positive or NaN)
            PUT(k, round_to_half(div_row(ev, sum, r)));
        }
        divided = !__any_sync(0xffffffffu, tiny);
    }
#endif
    if (!divided) {
#pragma unroll
        for (int it = 0; it < ITER; ++it) {
            const int k = lane + it * 32;
            const float ev = EV(it);
            PUT(k, round_to_half(sum == 0.0f ? __int_as_float(0x7fffffff) : ev / sum));
        }
    }
#endif
#if SMEM
    __syncwarp();
    {
        const uint4* s4 = reinterpret_cast<const uint4*>(srow[threadIdx.y]);
        uint4* d4 = reinterpret_cast<uint4*>(dst);
#pragma unroll
        for (int j = 0; j < VECS; ++j) if (lane + 32 * j < nv) d4[lane + 32 * j] = s4[lane + 32 * j];
    }
#endif
}
"""

_lock = threading.Lock()
_kernels: dict = {}  # (device index, switches) -> the loaded kernel
_state = {"error": None}  # why the kernel is off for the process (NVRTC missing, a build or launch that failed, a
# difference from eager's result), once known


def elements_per_lane(k: int) -> int:
    """PyTorch's WARP_ITERATIONS for a row of `k`: its next power of two over 32 lanes (one kernel variant each)."""
    return max(1, (1 << (k - 1).bit_length()) // 32)


def source(dtype: torch.dtype, lanes: int, smem: bool, full: bool, pack: bool | None = None, rdiv: bool | None = None,
           warps: int = _WARPS, copy: bool = False) -> str:
    """KERNEL for these switches (the module's by default); `full`: every row has exactly `lanes * 32` keys; `copy`
    only for bench/softmax_kernel_probe.py: the scores written back unchanged in place of the quotients (nothing
    computed from them is stored, so the compiler leaves the arithmetic out: its loads and stores alone)."""
    pack = PACK if pack is None else pack
    rdiv = RDIV if rdiv is None else rdiv
    return (f"#define IS_BF16 {int(dtype == torch.bfloat16)}\n#define ITER {lanes}\n#define PACK {int(pack)}\n"
            f"#define SMEM {int(smem)}\n#define FULL {int(full)}\n#define RDIV {int(rdiv)}\n#define WARPS {warps}\n"
            f"#define COPY {int(copy)}\n" + KERNEL)


def _kernel(device: torch.device, dtype: torch.dtype, lanes: int, smem: bool, full: bool, pack: bool | None = None,
            rdiv: bool | None = None, warps: int = _WARPS, copy: bool = False):
    """The loaded kernel for `source` of these switches, built once a device."""
    key = (device.index, dtype, lanes, smem, full, PACK if pack is None else pack, RDIV if rdiv is None else rdiv,
           warps, copy)
    with _lock:
        if key not in _kernels:
            _kernels[key] = Kernel(source(*key[1:]), "eager_probabilities", device, "ppp" + "i" * 10)
        return _kernels[key]


def available() -> str | None:
    """None while the kernel is used, else why not (the first failure, kept for the process)."""
    return _state["error"]


def turn_off(why: str) -> None:
    """No more kernel in this process (`probabilities` returns None from here on)."""
    _state["error"] = why


def variant(scores: torch.Tensor, mask: torch.Tensor | None) -> tuple | None:
    """Which kernel `probabilities` runs for these arguments: (elements a lane holds, through shared memory), or
    None where it runs none (see the module docstring)."""
    if _state["error"] is not None or not scores.is_cuda or scores.dtype not in (torch.bfloat16, torch.float16) \
            or scores.dim() != 4 or not scores.is_contiguous():
        return None
    b, h, q, k = scores.shape
    if not 0 < k <= MAX_ROW[scores.dtype] or scores.numel() // k >= 2 ** 31:
        return None
    aligned = SMEM and k % 8 == 0 and scores.data_ptr() % 16 == 0
    if mask is not None:
        if mask.dtype != scores.dtype or mask.dim() != 4 or mask.device != scores.device:
            return None
        try:
            strides = mask.expand(b, h, q, k).stride()
        except RuntimeError:
            return None
        if max(strides) >= 2 ** 31:
            return None
        aligned = aligned and strides[3] == 1 and all(st % 8 == 0 for st in strides[:3]) and mask.data_ptr() % 16 == 0
    return elements_per_lane(k), aligned


def probabilities(scores: torch.Tensor, mask: torch.Tensor | None, scaling, which: tuple | None = ()) \
        -> torch.Tensor | None:
    """`softmax(float(half(half(scores * scaling) + mask)), -1)` rounded to `scores.dtype`, computed as PyTorch's
    CUDA kernels compute it, in one pass; None where this kernel does not apply (see the module docstring). `which`:
    `variant(scores, mask)` where the caller has it already."""
    which = variant(scores, mask) if which == () else which
    if which is None or not isinstance(scaling, float) or not abs(scaling) < 3e38:
        return None
    lanes, smem = which
    b, h, q, k = scores.shape
    strides = mask.expand(b, h, q, k).stride() if mask is not None else (0, 0, 0, 0)
    out = torch.empty_like(scores)
    rows = b * h * q
    try:
        kernel = _kernel(scores.device, scores.dtype, lanes, smem, k == lanes * 32)
        kernel((rows + _WARPS - 1) // _WARPS, (32, _WARPS), scores.data_ptr(),
               (scores if mask is None else mask).data_ptr(), out.data_ptr(), rows, k, q, h, int(mask is not None),
               *strides, struct.unpack("<i", struct.pack("<f", scaling))[0])  # float(scaling)'s bits
    except Exception as exc:  # no NVRTC in this torch's environment, an architecture it does not know, a launcher
        _state["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]  # that
        return None  # refuses the arguments, ...
    return out
