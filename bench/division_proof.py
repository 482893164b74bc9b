"""The one-kernel softmax's row division (child/backends/warp_softmax.py's ROW_DIVISION) equals IEEE division, checked
on the GPU for every pair of significands.

The kernel divides each key's exponential `ev` by the row's `sum` with the reciprocal's steps done once for the row
(`rcp_row`) and two fma a key (`div_row`), where the row is in range: sum in [1, 2048], every ev 0 or in
[2^-64, 1]. Within that range every step's result is a normal float or an exact zero, so scaling ev by 2^i and sum by
2^j scales every step exactly, provided the reciprocal instruction (`rcp.approx.ftz.f32`) scales too. Two checks
then cover the whole range:

    pairs     div_row(a, b, rcp_row(b)) against `a / b` (div.rn.f32: what PyTorch's softmax divides with) for every
              a and b in [1, 2): 2^46 pairs. Any difference is counted and the first is printed.
    scaling   rcp.approx.ftz(B * 2^j) == rcp.approx.ftz(B) * 2^-j for every B in [1, 2) and j = 1..11.

    python bench/division_proof.py                 # both, on cuda (about half a minute of an H100)
    python bench/division_proof.py --sums 4096     # pairs for the first 4096 significands of b only

tests/gpu/test_eager_attention_gpu.py runs the same kernels on a sample (every ev of the range against a few sums).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

ONE = 0x3F800000  # 1.0f's bits
SIGNIFICANDS = 1 << 23

CHECKS = r"""
extern "C" __global__ void pairs(const int* bs, int nb, int a_first, int a_count, int control, unsigned int* out) {
    // every a with bits in [a_first, a_first + a_count) against every b of bs; out: mismatches, then the first's a, b;
    // control: the product a * r alone (no correction) in place of div_row, which must differ somewhere
    for (int ib = blockIdx.x; ib < nb; ib += gridDim.x) {
        const float b = __int_as_float(bs[ib]);
        const float r = rcp_row(b);
        unsigned int bad = 0;
        for (int i = threadIdx.x; i < a_count; i += blockDim.x) {
            const float a = __int_as_float(a_first + i);
            const float q = control ? __fmul_rn(a, r) : div_row(a, b, r);
            if (__float_as_uint(q) != __float_as_uint(a / b)) {
                ++bad;
                if (atomicCAS(out + 1, 0u, (unsigned int)(a_first + i)) == 0u) out[2] = (unsigned int)bs[ib];
            }
        }
        if (bad) atomicAdd(out, bad);
    }
}

extern "C" __global__ void scaling(int j_max, unsigned int* out) {
    // rcp.approx.ftz of B * 2^j is that of B times 2^-j, for the significand B of this thread and j = 1..j_max
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (1 << 23)) return;
    float r0;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r0) : "f"(__int_as_float(0x3f800000 + i)));
    for (int j = 1; j <= j_max; ++j) {
        float rj;
        asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(rj) : "f"(__int_as_float(0x3f800000 + i + (j << 23))));
        if (__float_as_uint(rj) != __float_as_uint(r0) - ((unsigned int)j << 23)) atomicAdd(out, 1u);
    }
}
"""

_loaded: dict = {}


def _kernels():
    import torch

    from child.backends import warp_softmax
    from child.backends.cuda_kernels import Kernel

    if "pairs" not in _loaded:
        device = torch.device("cuda", torch.cuda.current_device())
        _loaded["pairs"] = Kernel(warp_softmax.ROW_DIVISION + CHECKS, "pairs", device, "piiiip")
        _loaded["scaling"] = Kernel(warp_softmax.ROW_DIVISION + CHECKS, "scaling", device, "ip")
    return _loaded["pairs"], _loaded["scaling"]


def mismatches(sums, a_first: int, a_count: int, control: bool = False) -> tuple[int, int, int]:
    """(how many of the pairs differ from IEEE division, the first's a bits, its b bits): every a whose bits are in
    [a_first, a_first + a_count) against every b of `sums` (an int32 CUDA tensor of float bits); `control`: the
    uncorrected product instead of div_row (a check that can fail)."""
    import torch

    pairs, _ = _kernels()
    out = torch.zeros(3, dtype=torch.int32, device=sums.device)
    pairs(min(sums.numel(), 65535), (256, 1), sums.data_ptr(), sums.numel(), a_first, a_count, int(control), out.data_ptr())
    bad, a, b = (int(v) & 0xFFFFFFFF for v in out.tolist())
    return bad, a, b


def scaling_mismatches(j_max: int = 11) -> int:
    """How many significands B and exponents j in 1..j_max have rcp.approx.ftz(B * 2^j) != rcp.approx.ftz(B) * 2^-j."""
    import torch

    _, scaling = _kernels()
    out = torch.zeros(1, dtype=torch.int32, device="cuda")
    scaling(SIGNIFICANDS // 256, (256, 1), j_max, out.data_ptr())
    return int(out.item())


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sums", type=int, default=SIGNIFICANDS, help="how many significands of b, from 1.0 (all: 2^23)")
    ap.add_argument("--chunk", type=int, default=1 << 16, help="significands of b a launch")
    args = ap.parse_args()
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    t = time.perf_counter()
    bad_scaling = scaling_mismatches()
    print(f"scaling: rcp.approx.ftz(B * 2^j) against rcp.approx.ftz(B) * 2^-j, {SIGNIFICANDS} significands x 11 "
          f"exponents: {bad_scaling} differ ({time.perf_counter() - t:.2f} s)", flush=True)
    control = mismatches(torch.arange(ONE, ONE + 64, dtype=torch.int32, device="cuda"), ONE, SIGNIFICANDS, True)[0]
    print(f"control: the product a * r alone, uncorrected, differs on {control} of {64 * SIGNIFICANDS} pairs", flush=True)
    total, first = 0, None
    t = time.perf_counter()
    for start in range(0, args.sums, args.chunk):
        count = min(args.chunk, args.sums - start)
        sums = torch.arange(ONE + start, ONE + start + count, dtype=torch.int32, device="cuda")
        bad, a, b = mismatches(sums, ONE, SIGNIFICANDS)
        total += bad
        if bad and first is None:
            first = (a, b)
        if start // args.chunk % 16 == 15:
            print(f"  b significands {start + count} of {args.sums}: {total} differ so far "
                  f"({time.perf_counter() - t:.1f} s)", flush=True)
    pairs = args.sums * SIGNIFICANDS
    print(f"pairs: div_row against a / b (div.rn), every a in [1, 2) against {args.sums} b from 1.0: {pairs} pairs "
          f"(2^{pairs.bit_length() - 1}), {total} differ ({time.perf_counter() - t:.1f} s)", flush=True)
    if first is not None:
        import struct
        a, b = (struct.unpack("<f", struct.pack("<I", v))[0] for v in first)
        print(f"first difference: a = {a!r} (0x{first[0]:08x}), b = {b!r} (0x{first[1]:08x})")
    sys.exit(1 if total or bad_scaling or not control else 0)


if __name__ == "__main__":
    main()
