"""Llama's rotary position embedding in one CUDA kernel, bit for bit.

transformers' `apply_rotary_pos_emb` (Llama's, which most architectures copy) rotates the queries and keys with one
eager operation after another, each a pass over a [batch, heads, tokens, head_dim] tensor rounded to its dtype::

    t1 = half(x * cos)                        cos, sin: [batch, tokens, head_dim], unsqueezed over the heads
    r  = cat(-x[..., D/2:], x[..., :D/2])     negation and a copy: exact
    t2 = half(r * sin)
    out = half(t1 + t2)

(half: the model's dtype, bf16 or fp16; each product and the sum computed in fp32 and rounded to nearest, as
PyTorch's elementwise kernels compute them). `rotated` computes every element of `out` that way in one kernel (the
products and the sum with `__fmul_rn` / `__fadd_rn`, which the compiler never contracts into a fused multiply-add),
reading x, cos and sin once and writing `out` once, where eager's chain makes four intermediate tensors. Its output
has the strides eager's would have (found by running the library's function on meta tensors of the same layout), so
everything after it (the attention's products) sees the same tensor. Compiled at run time by NVRTC like
child/backends/warp_softmax.py's kernel. Where it does not apply (not a GPU, another dtype, an odd head dimension,
shapes that do not broadcast as Llama's do), `rotated` returns None and the caller runs the library's function;
child/backends/eager_attention.py, which installs it, compares its first calls with that function bit for bit.
"""
from __future__ import annotations

import threading

import torch

from child.backends.cuda_kernels import Kernel
from child.backends.warp_softmax import HALVES
from child.faults import switched

__all__ = ["rotated", "available", "turn_off", "ENABLED"]

# whether child/backends/eager_attention.py installs it (on: run on an H100 in s39f, equal to the library's in
# tests/gpu/test_eager_attention_gpu.py; "norotary" in SUPERVISOR_TEST_KERNELS turns it off for a test or a bench)
ENABLED = switched("rotary", True)

KERNEL = HALVES + r"""
#define AT(t, b, h, s, d) ((long long)(b) * t##0 + (long long)(h) * t##1 + (long long)(s) * t##2 + (long long)(d) * t##3)

// one thread an element of `out` [B, H, S, D] (logical order); x, cos, sin and out each with their own strides
// (cos and sin expanded to [B, H, S, D]: zeros where broadcast); every number a C int (the host checks < 2^31)
extern "C" __global__ void rotary(const u16* __restrict__ x, const u16* __restrict__ cos, const u16* __restrict__ sin,
                                  u16* __restrict__ out, int n, int H, int S, int D,
                                  int xs0, int xs1, int xs2, int xs3, int cs0, int cs1, int cs2, int cs3,
                                  int ss0, int ss1, int ss2, int ss3, int os0, int os1, int os2, int os3) {
    const int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const int d = i % D;
    int rest = i / D;
    const int s = rest % S;
    rest /= S;
    const int h = rest % H;
    const int b = rest / H;
    const int half = D / 2;
    const float xv = to_float(x[AT(xs, b, h, s, d)]);
    const float r = d < half ? -to_float(x[AT(xs, b, h, s, d + half)]) : to_float(x[AT(xs, b, h, s, d - half)]);
    const u16 t1 = round_to_half(__fmul_rn(xv, to_float(cos[AT(cs, b, h, s, d)])));
    const u16 t2 = round_to_half(__fmul_rn(r, to_float(sin[AT(ss, b, h, s, d)])));
    out[AT(os, b, h, s, d)] = round_to_half(__fadd_rn(to_float(t1), to_float(t2)));
}
"""

_THREADS = 256
_lock = threading.Lock()
_kernels: dict = {}  # (device index, dtype) -> the loaded kernel
_layouts: dict = {}  # the arguments' layout -> the strides of eager's outputs
_state = {"error": None}  # why the kernel is off for the process, once known


def available() -> str | None:
    """None while the kernel is used, else why not (the first failure, kept for the process)."""
    return _state["error"]


def turn_off(why: str) -> None:
    _state["error"] = why


def _kernel(device: torch.device, dtype: torch.dtype):
    key = (device.index, dtype)
    with _lock:
        if key not in _kernels:
            source = f"#define IS_BF16 {int(dtype == torch.bfloat16)}\n" + KERNEL
            _kernels[key] = Kernel(source, "rotary", device, "pppp" + "i" * 20)
        return _kernels[key]


def _eager_strides(library, q, k, cos, sin) -> tuple:
    """The strides of the library function's outputs for arguments of this layout (its ops on meta tensors)."""
    key = tuple((t.shape, t.stride()) for t in (q, k, cos, sin))
    if key not in _layouts:
        meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in (q, k, cos, sin)]
        outs = library(*meta)
        _layouts[key] = tuple(o.stride() for o in outs)
    return _layouts[key]


def rotated(library, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
            unsqueeze_dim: int = 1) -> tuple[torch.Tensor, torch.Tensor] | None:
    """`library(q, k, cos, sin)` (Llama's apply_rotary_pos_emb) computed by the kernel, or None where it does not
    apply (see the module docstring)."""
    if _state["error"] is not None or unsqueeze_dim != 1 or not q.is_cuda:
        return None
    tensors = (q, k, cos, sin)
    if any(t.dtype != q.dtype or t.device != q.device for t in tensors) or q.dtype not in (torch.bfloat16,
                                                                                         torch.float16):
        return None
    if q.dim() != 4 or k.dim() != 4 or cos.dim() != 3 or sin.dim() != 3 or q.shape[-1] % 2 \
            or k.shape[-1] != q.shape[-1] or max(q.numel(), k.numel()) >= 2 ** 31:
        return None
    try:
        strides = _eager_strides(library, q, k, cos, sin)
        outs = []
        for x, out_strides in zip((q, k), strides):
            c4, s4 = cos.unsqueeze(1).expand(x.shape), sin.unsqueeze(1).expand(x.shape)
            out = torch.empty_strided(x.shape, out_strides, dtype=x.dtype, device=x.device)
            b, h, s, d = x.shape
            n = x.numel()
            if max(max(t.stride()) for t in (x, c4, s4, out)) >= 2 ** 31 or min(
                    min(t.stride()) for t in (x, c4, s4, out)) < 0:
                return None
            if n:
                _kernel(x.device, x.dtype)((n + _THREADS - 1) // _THREADS, (_THREADS, 1), x.data_ptr(), c4.data_ptr(),
                                           s4.data_ptr(), out.data_ptr(), n, h, s, d, *x.stride(), *c4.stride(),
                                           *s4.stride(), *out.stride())
            outs.append(out)
    except Exception as exc:  # no NVRTC here, an architecture it does not know, shapes that do not broadcast, ...
        _state["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return None
    return outs[0], outs[1]
