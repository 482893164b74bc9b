"""A parent's pass over its cached samples captured once as a CUDA graph and replayed for each sample, bit for bit:
AWQ's grid search without the host's Python in the GPU's way.

AWQ runs each mapping's parent over every cached sample for each of its 20 candidate scalings. For the attention of
an 8B-shaped layer (128 samples x 2048 tokens, one H100) a candidate's pass takes 0.138 s while its kernels take
0.113 s (bench/awq_probe.py, docs/benchmarks.md forty-second session): once the one-kernel softmax and the rotary
kernel made the GPU's part small, the pass waits on the Python that launches it (the module calls, their wrappers and
hooks, about 40 launches a sample). A graph launches the same kernels with their arguments fixed at capture: one
call a sample.

How a pass is replayed (`GraphedPass`): the parent's forward is captured once a search on a side stream, after one
eager warm-up call there, with the first sample's tensors copied into inputs of its own (the same shapes, strides and
dtypes; a tensor that is the same object in every sample is used as it is). Each sample then is: its tensors copied
into those inputs, the graph replayed, its output read (by the loss) before the next sample's copy, all on the
current stream in that order. The weights are read where they lie at capture, so the search writes each candidate's
weights into the same tensors (child/backends/awq_search.py).

Why the bits are the library's: the graph is the kernels eager launched for that call, with the same shapes and
layouts, reading each sample's values. That is checked rather than assumed: each candidate's first sample is also run
eagerly and compared with its replay bit for bit on the device (`same()`, one flag for the search, which comes to the
host with the grid's losses, no extra wait). Where they differ (a tensor the forward reads that was replaced, not
written in place; a library that picks kernels otherwise under capture), the search runs its grid again without the
graph, and graphs are off for the process (`turn_off`, one line in the worker's log).

Where it applies (`build` says why not, else None): on a CUDA device, for a parent that is more than one module with
weights (a lone Linear, `o_proj` or `down_proj`, is one product a sample: GPU-bound, where the copies would only
add), with at least two samples whose arguments have one structure (the same keys, tensors of one shape, layout,
dtype and the parent's device, every other value equal and a plain number, string, None, dtype or device), and
whose forward can be captured (no wait for the GPU inside it: an MoE block's routing cannot, nor can anything that
reads a value back; a capture that fails turns graphs off for that kind of module, for the process).
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterable, Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["GraphedPass", "applies", "build", "turn_off", "available", "LOG_PREFIX"]

LOG_PREFIX = "graphed passes:"
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)

_lock = threading.Lock()
# why graphs are off for the process; the module kinds whose capture failed; whether the first graph was told
_state: dict = {"off": None, "failed": set(), "told": False}


def available() -> str | None:
    """None while graphs may be used in this process, else why not."""
    return _state["off"]


def turn_off(why: str) -> None:
    """Graphs off for the process from here on, told once in the worker's log."""
    with _lock:
        if _state["off"] is None:
            _state["off"] = why
            print(f"{LOG_PREFIX} off: {why}; eager passes from here on", file=sys.stderr, flush=True)


def dense(t: torch.Tensor) -> bool:
    """Whether `t`'s elements fill its span once each (a permutation of a contiguous layout): a tensor of its shape
    and strides can be written with copy_."""
    step = 1
    for size, stride in sorted(((s, st) for s, st in zip(t.shape, t.stride()) if s != 1), key=lambda d: d[1]):
        if stride != step:
            return False
        step *= size
    return True


def _flat(batch: dict) -> tuple[list, object]:
    leaves, spec = tree_flatten(batch)
    return leaves, spec


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device, t.requires_grad


def applies(module: nn.Module, device: torch.device) -> str | None:
    """None where `module`'s passes on `device` may be graphed (its samples not yet looked at), else why not."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"{device.type}: not a CUDA device"
    if _state["off"] is not None:
        return _state["off"]
    if type(module).__qualname__ in _state["failed"]:
        return f"{type(module).__qualname__}'s forward could not be captured before"
    if sum(1 for m in module.modules() if next(m.parameters(recurse=False), None) is not None) < 2:
        return "one module with weights: one product a sample"
    return None


def _why_not(module: nn.Module, batches: list[dict], device: torch.device) -> str | None:
    why = applies(module, device)
    if why is not None:
        return why
    if len(batches) < 2:
        return "fewer than two samples"
    first, spec = _flat(batches[0])
    for value in first:
        if isinstance(value, torch.Tensor):
            if value.device != device or value.requires_grad or not dense(value):
                return f"an argument on {value.device}, with grad or not dense"
        elif not isinstance(value, _PLAIN):
            return f"an argument of type {type(value).__name__}"
    layouts = [_layout(v) if isinstance(v, torch.Tensor) else None for v in first]
    for batch in batches[1:]:
        leaves, other = _flat(batch)
        if other != spec:
            return "the samples' arguments differ in structure"
        for value, ref, layout in zip(leaves, first, layouts):
            if layout is None:
                if isinstance(value, torch.Tensor) or type(value) is not type(ref) or value != ref:
                    return "the samples' other arguments differ"
            elif not isinstance(value, torch.Tensor) or _layout(value) != layout:
                return "the samples' tensors differ in shape, layout or dtype"
    return None


def _first(output) -> torch.Tensor | None:
    out = output[0] if isinstance(output, tuple) else output  # as AWQ's _run_samples keeps it
    return out if isinstance(out, torch.Tensor) else None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A device bool: `a` and `b` hold the same bits (NaNs included), without a wait for the GPU."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return torch.zeros((), dtype=torch.bool, device=b.device)
    return torch.eq(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)).all()


class GraphedPass:
    """`module` over samples with the arguments' structure of `batches`, replayed from one CUDA graph (see the
    module docstring). Made by `build`."""

    def __init__(self, module: nn.Module, batches: list[dict], device: torch.device):
        self.module = module
        self.device = device
        leaves, self._spec = _flat(batches[0])
        others = [_flat(b)[0] for b in batches[1:]]
        # an input of the graph's own for each tensor that is not the same object in every sample
        self._copied = [isinstance(v, torch.Tensor) and any(o[i] is not v for o in others)
                        for i, v in enumerate(leaves)]
        self._inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) if copied else v
                        for v, copied in zip(leaves, self._copied)]
        self._kwargs = tree_unflatten(self._inputs, self._spec)
        self._same = torch.ones((), dtype=torch.bool, device=device)
        self.replays = 0
        self.batches = batches
        current = torch.cuda.current_stream(device)
        side = torch.cuda.Stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                self._load(leaves)
                _first(module(**self._kwargs))  # warm-up: lazy set-up (a stream's cuBLAS workspace) outside the capture
                self._graph = torch.cuda.CUDAGraph()
                self._graph.capture_begin(capture_error_mode="thread_local")  # other threads' CUDA calls are theirs
                try:
                    output = module(**self._kwargs)
                except BaseException:
                    try:
                        self._graph.capture_end()
                    except Exception:  # noqa: BLE001 - the capture is invalid; the forward's error is the one told
                        pass
                    raise
                self._graph.capture_end()
        finally:
            current.wait_stream(side)  # the inputs and the warm-up's tensors are the current stream's again
        self._output = _first(output)
        del output  # the rest (eager attention's probabilities) is the graph's memory, not held here
        if self._output is None:
            raise TypeError("the parent's output is not a tensor or a tuple starting with one")

    def _load(self, leaves: list) -> None:
        for value, target, copied in zip(leaves, self._inputs, self._copied):
            if copied:
                target.copy_(value)

    def outputs(self, batches: Iterable[dict]) -> Iterator[torch.Tensor]:
        """Each sample's output, as AWQ's `_run_samples` keeps it, in order: the graph's output tensor, rewritten by
        the next sample's replay (read it before asking for the next). The first sample is also run eagerly and the
        two compared (`same()`)."""
        for index, batch in enumerate(batches):
            leaves, _ = _flat(batch)
            self._load(leaves)
            self._graph.replay()
            self.replays += 1
            if index == 0:
                reference = _first(self.module(**batch))
                self._same &= _bits_equal(reference, self._output) if reference is not None else False
                del reference
            yield self._output

    def same(self) -> torch.Tensor:
        """A device bool: every checked replay held the eager pass's bits."""
        return self._same

    def close(self) -> None:
        """The graph and its memory let go."""
        self._graph.reset()
        self._output = self._inputs = self._kwargs = None


def build(module: nn.Module, batches: list[dict], device: torch.device) -> tuple[GraphedPass | None, str | None]:
    """(the graphed pass, None), or (None, why not) where it does not apply or the capture failed (see the module
    docstring). A failed capture turns graphs off for that kind of module and is told once in the log."""
    why = _why_not(module, batches, device)
    if why is not None:
        return None, why
    try:
        graphed = GraphedPass(module, batches, device)
    except Exception as e:  # noqa: BLE001 - the forward could not be captured: its eager passes run
        kind = type(module).__qualname__
        with _lock:
            _state["failed"].add(kind)
        why = f"{kind}'s forward could not be captured ({type(e).__name__}: {str(e).splitlines()[0][:200]})"
        print(f"{LOG_PREFIX} {why}; its eager passes run", file=sys.stderr, flush=True)
        return None, why
    with _lock:
        told, _state["told"] = _state["told"], True
    if not told:
        print(f"{LOG_PREFIX} on (the first: {type(module).__qualname__}, {len(batches)} samples a pass, each replayed "
              f"from one CUDA graph)", file=sys.stderr, flush=True)
    return graphed, None
