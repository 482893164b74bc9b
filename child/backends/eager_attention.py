"""Eager attention with its elementwise work fused, bit for bit: AWQ's grid search on a GPU, cheaper.

llm-compressor calibrates with eager attention, and AWQ runs the attention's parent over every sample 21 times a
layer (20 grid points and the unscaled reference). transformers' eager attention (Llama's `eager_attention_forward`,
which most architectures share) materialises its rounding step by step on the [heads, tokens, tokens] scores::

    scores = bf16(q @ k^T)          cuBLAS
    x = bf16(scores * scaling)      one pass over the scores
    x = bf16(x + mask)              another
    x = fp32(x)                     another (softmax's dtype=float32 converts first, then runs the fp32 kernel)
    p = bf16(softmax(x))            PyTorch's softmax, then a cast
    out = p @ v                     cuBLAS

Everything between the two products is fused here, in one of two ways, and the products stay the same calls:

- rows of up to 2048 keys on a GPU, 1024 in fp16 (`child/backends/warp_softmax.py`): one CUDA kernel does the
  scaling, the mask, the upcast, PyTorch's fp32 warp softmax (its arithmetic in its order) and the cast: the scores
  read once, the probabilities written once;
- otherwise ("fused prefix"): the scaling, the mask and (bf16) the upcast are one Inductor kernel
  (`emulate_precision_casts` keeps each rounding: elementwise work, exact by construction), then eager's own softmax
  call on the same input, the same cast.

AWQ only: GPTQ and static scales run the attention twice a layer (forward, propagate). Against the fused prefix's
compilation (about 4 s per worker process) that was little to save; the one-kernel softmax compiles in a fraction of
a second, so it might pay there too, but that is not measured and not switched on. Installed (`installed()`) around
an AWQ layer's session where `applies(model, device)` (the Calibrator asks once), that is when all of these hold,
else nothing changes: the device is a GPU (on the CPU the fused prefix is slower than eager's chain: the products
dominate there, measured), the model's attention is eager, and every module of its layers that picks its attention
through transformers' AttentionInterface defaults to an `eager_attention_forward` whose bytecode is Llama's (Llama,
Qwen2/3, their MoE, Mistral, Mixtral, Gemma, Phi-3, DeepSeek-V3, ...; not Gemma-2/3's soft-capping nor GPT-OSS's
sinks). While installed, the AttentionInterface's "eager" entry is this module's function. Each kind of call of a
layer (shapes but the lengths, dtypes, scaling, the path and kernel variant), and for the fused prefix each of the
first lengths a process sees (until torch.compile has its kernel for any length), is also computed by the eager
function and compared bit for bit. A difference in the one-kernel softmax (a torch whose softmax computes otherwise)
turns that kernel off for the process and the fused prefix goes on; a difference in the fused prefix (an Inductor
that rounds otherwise) turns the fusion off; either way one line goes to the worker's log and the eager result is
used.
"""
from __future__ import annotations

import contextlib
import os
import sys
import threading

import torch
from torch import nn

from child.backends import rotary, warp_softmax

__all__ = ["installed", "applies", "fused_eager_attention", "DEVICES", "FORCE_ENV"]

DEVICES = ("cuda",)  # where it pays (see the module docstring)
FORCE_ENV = "SUPERVISOR_TEST_FUSED_ATTENTION"  # test-only: "1" installs it on any device (the CPU suite)
LOG_PREFIX = "fused attention:"

_lock = threading.Lock()
_state = {"users": 0, "off": False, "compiled": None, "told": False, "rotary told": False}
_checked: set = set()  # the kinds of call (shapes but the lengths, dtypes, scaling, path) compared since the last install
_lengths: set = set()  # the (query, key) lengths this process has run


def _prefix(scores: torch.Tensor, mask: torch.Tensor | None, scaling: float, upcast: bool) -> torch.Tensor:
    x = scores * scaling
    if mask is not None:
        x = x + mask
    return x.float() if upcast else x


def _compiled():
    if _state["compiled"] is None:
        # in-process compilation (one small kernel: no pool of compile workers in a forked worker)
        _state["compiled"] = torch.compile(_prefix, options={"emulate_precision_casts": True, "compile_threads": 1})
    return _state["compiled"]


def _eager():
    from transformers.models.llama.modeling_llama import eager_attention_forward

    return eager_attention_forward


def fused_eager_attention(module: nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                          attention_mask: torch.Tensor | None, scaling: float, dropout: float = 0.0, **kwargs):
    """Llama's `eager_attention_forward`, its scaling + mask + fp32 upcast in one kernel (same bits)."""
    eager = _eager()
    if _state["off"] or query.dtype not in (torch.bfloat16, torch.float16):  # fp32: nothing to upcast, and a fused
        return eager(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)  # a*b+c may FMA
    from transformers.models.llama.modeling_llama import repeat_kv

    key_states = repeat_kv(key, module.num_key_value_groups)
    value_states = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, key_states.transpose(2, 3))
    kernel = warp_softmax.variant(scores, attention_mask)
    attn_weights = warp_softmax.probabilities(scores, attention_mask, scaling, kernel)  # one kernel, where it applies
    if warp_softmax.available() is not None and not _state["told"]:
        _state["told"] = True
        print(f"{LOG_PREFIX} the one-kernel softmax is off here ({warp_softmax.available()}); the fused prefix only",
              file=sys.stderr, flush=True)
    if attn_weights is not None:
        path = ("warp softmax", *(kernel or ()))  # (elements a lane holds, through shared memory)
    else:
        path = ("fused prefix",)
        # bf16: eager's softmax(dtype=float32) converts its input, then runs the fp32 kernel, so the conversion is
        # fused too; fp16 on a GPU: that softmax reads the half input itself (half_to_float, a kernel of its own for
        # rows over 1024), so it gets the half input as in eager
        x = _compiled()(scores, attention_mask, scaling, query.dtype == torch.bfloat16)
        attn_weights = nn.functional.softmax(x, dim=-1, dtype=torch.float32).to(query.dtype)  # eager's call
        del x
    del scores
    attn_weights = nn.functional.dropout(attn_weights, p=dropout, training=module.training)
    attn_output = torch.matmul(attn_weights, value_states)
    attn_output = attn_output.transpose(1, 2).contiguous()
    # compared with eager's: a layer's first call of each kind (a kind: the shapes but the lengths, the dtypes, the
    # scaling, the kernel variant), and a process's first calls of new lengths until torch.compile has made its
    # prefix kernel for any length (it does at the second length it sees); not every sample's length in every layer,
    # where a dataset's lengths vary
    length = (query.shape[-2], key.shape[-2])
    new_kernel = path == ("fused prefix",) and length not in _lengths and len(_lengths) < 3
    if path == ("fused prefix",):
        _lengths.add(length)
    call = (query.shape[:-2], query.shape[-1], key.shape[:-2], value.shape[-1], query.dtype, query.device, scaling,
            None if attention_mask is None else (attention_mask.dim(), attention_mask.dtype), dropout, module.training,
            path)
    if call not in _checked or new_kernel:
        _checked.add(call)
        ref_output, ref_weights = eager(module, query, key, value, attention_mask, scaling, dropout=dropout, **kwargs)
        if not (torch.equal(ref_output, attn_output) and torch.equal(ref_weights, attn_weights)):
            where = f"for queries {list(query.shape)} ({query.dtype}, keys {key.shape[-2]})"
            if path[0] == "warp softmax":  # the one-kernel softmax off; the fused prefix (its own check) goes on
                warp_softmax.turn_off(f"its result differed from eager attention's {where}")
                _state["told"] = True
                print(f"{LOG_PREFIX} the one-kernel softmax differs from eager attention's {where}; the fused prefix "
                      f"only from here on", file=sys.stderr, flush=True)
            else:
                _state["off"] = True
                print(f"{LOG_PREFIX} off: its result differs from eager attention's {where}; eager attention from "
                      f"here on", file=sys.stderr, flush=True)
            return ref_output, ref_weights
    return attn_output, attn_weights


def _same_code(a, b) -> bool:
    return (a.co_code, a.co_consts, a.co_names, a.co_varnames) == (b.co_code, b.co_consts, b.co_names, b.co_varnames)


def applies(model: nn.Module, device: torch.device) -> str | None:
    """None where the fused function may stand in for the model's eager attention on `device`, else why not."""
    from transformers.models.llama import modeling_llama

    if device.type not in DEVICES and os.environ.get(FORCE_ENV) != "1":
        return f"{device.type}: not where it pays"
    if getattr(model.config, "_attn_implementation", None) != "eager":
        return "the attention is not eager"
    found = False
    for sub in model.modules():
        forward = getattr(type(sub).forward, "__code__", None)
        if forward is None or "ALL_ATTENTION_FUNCTIONS" not in forward.co_names:
            continue
        names = type(sub).forward.__globals__  # where its forward finds `eager_attention_forward` (an inherited one too)
        eager = names.get("eager_attention_forward")
        repeat = getattr(eager, "__globals__", {}).get("repeat_kv")  # the one that eager function calls
        if "eager_attention_forward" not in forward.co_names or eager is None or \
                not _same_code(eager.__code__, modeling_llama.eager_attention_forward.__code__) or \
                (repeat is not None and not _same_code(repeat.__code__, modeling_llama.repeat_kv.__code__)):
            return f"{type(sub).__name__}'s eager attention is not Llama's"
        found = True
    return None if found else "no module picks its attention through transformers' AttentionInterface"


@contextlib.contextmanager
def installed(model: nn.Module | None = None):
    """While inside, transformers' eager attention is `fused_eager_attention` (for a model `applies` said yes to),
    and, given the model (and `rotary.ENABLED`), its attention's `apply_rotary_pos_emb` is `child/backends/rotary.py`'s
    kernel wherever that function (and the rotate_half it calls) is Llama's (compared by bytecode), each kind of call
    compared with the library's once a layer."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    with _lock:
        _checked.clear()  # each layer's calls are compared once
        _state["users"] += 1
        ALL_ATTENTION_FUNCTIONS["eager"] = fused_eager_attention  # the global instance's own (local) mapping
    patched = []
    try:
        for names in _rotary_globals(model) if model is not None and rotary.ENABLED else ():
            library = names["apply_rotary_pos_emb"]
            names["apply_rotary_pos_emb"] = _fused_rotary(library)
            patched.append((names, library))
        yield
    finally:
        for names, library in patched:
            names["apply_rotary_pos_emb"] = library
        with _lock:
            _state["users"] -= 1
            if _state["users"] == 0:
                del ALL_ATTENTION_FUNCTIONS["eager"]


def _rotary_globals(model: nn.Module) -> list[dict]:
    """The module globals of each attention class whose forward calls an `apply_rotary_pos_emb` with Llama's
    bytecode (and a rotate_half with Llama's): where the fused rotary stands in for it."""
    from transformers.models.llama import modeling_llama

    found: dict[int, dict] = {}
    for sub in model.modules():
        forward = getattr(type(sub).forward, "__code__", None)
        if forward is None or "apply_rotary_pos_emb" not in forward.co_names:
            continue
        names = type(sub).forward.__globals__
        fn = names.get("apply_rotary_pos_emb")
        rotate = getattr(fn, "__globals__", {}).get("rotate_half")
        if getattr(fn, "__code__", None) is not None and getattr(rotate, "__code__", None) is not None and \
                _same_code(fn.__code__, modeling_llama.apply_rotary_pos_emb.__code__) and \
                _same_code(rotate.__code__, modeling_llama.rotate_half.__code__):
            found[id(names)] = names
    return list(found.values())


def _fused_rotary(library):
    """`library` (a module's Llama apply_rotary_pos_emb) through child/backends/rotary.py's kernel where it applies,
    each kind of call (shapes but the tokens, strides' order, dtype, device) compared with the library's once a
    layer: a difference turns the kernel off for the process (one line in the log) and that call gets the library's
    result."""

    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        out = rotary.rotated(library, q, k, cos, sin, unsqueeze_dim)
        if rotary.available() is not None and not _state["rotary told"]:
            _state["rotary told"] = True
            print(f"{LOG_PREFIX} the rotary kernel is off here ({rotary.available()})", file=sys.stderr, flush=True)
        if out is None:
            return library(q, k, cos, sin, unsqueeze_dim)
        call = ("rotary",) + tuple((t.shape[:-2], t.shape[-1], _order(t)) for t in (q, k, cos, sin)) + \
            (q.dtype, q.device)
        if call not in _checked:
            _checked.add(call)
            ref = library(q, k, cos, sin, unsqueeze_dim)
            if not all(torch.equal(a, b) and a.stride() == b.stride() for a, b in zip(out, ref)):
                rotary.turn_off(f"its result differed from the library's for queries {list(q.shape)} ({q.dtype})")
                _state["rotary told"] = True
                print(f"{LOG_PREFIX} the rotary kernel differs from apply_rotary_pos_emb for queries {list(q.shape)} "
                      f"({q.dtype}); the library's from here on", file=sys.stderr, flush=True)
                return ref
        return out

    return apply_rotary_pos_emb


def _order(t: torch.Tensor) -> tuple:
    """The order of a tensor's dimensions by stride: its layout, whatever the lengths."""
    return tuple(sorted(range(t.dim()), key=lambda i: -t.stride(i)))
