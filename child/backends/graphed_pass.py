"""A parent's pass over its cached samples captured once as a CUDA graph and replayed for each sample, bit for bit:
AWQ's grid search without the host's Python in the GPU's way.

AWQ runs each mapping's parent over every cached sample for each of its 20 candidate scalings. For the attention of an
8B-shaped layer (128 samples x 2048 tokens, one H100) a candidate's pass takes 0.138 s while its kernels take 0.113 s
(bench/awq_probe.py, docs/benchmarks.md forty-second session): once the one-kernel softmax and the rotary kernel made
the GPU's part small, the pass waits on the Python that launches it (the module calls, their wrappers and hooks, about
40 launches a sample). A graph launches the same kernels with their arguments fixed at capture: one call a sample.
Measured on two H100s (docs/benchmarks.md, forty-third session): the attention's pass 0.119 s with graphs against
0.174 eager on a slow host, 0.120 against 0.121 on a fast one; the default AWQ at 0.478x oneshot's wall, every tensor
equal.

How a pass is replayed (`GraphedPass`): the samples are sorted into kinds (their arguments' structure, each tensor's
shape, strides and dtype, every other value), and the forward of each kind with at least two samples (at most
`MAX_GRAPHS`, the largest kinds) is captured once a search on a side stream (the process's, on that device), after one
eager warm-up call there, with its first sample's tensors copied into inputs of its own (a tensor that is the same
object in every sample of the kind is used as it is). Each sample then, in the samples' order: a graphed one's tensors
copied into its graph's inputs, the graph replayed, its output read (by the loss) before that graph's next replay, all
on the current stream; a sample of a kind of its own runs eagerly as before. The graphs share one memory pool, the
process's on that device (each graph's output stays alive while it is used; the rest is transient). The weights are
read where they lie at capture, so the search writes each candidate's weights into the same tensors
(child/backends/awq_search.py).

Why the bits are the library's: a graph is the kernels eager launched for that kind of call, with the same shapes and
layouts, reading each sample's values. That is checked rather than assumed: each graph's first sample is also run
eagerly in every candidate's pass and compared with its replay bit for bit on the device (`same()`, one flag for the
search, which comes to the host with the grid's losses, no extra wait). Where they differ (a tensor the forward reads
that was replaced, not written in place; a library that picks kernels otherwise under capture), the search runs its
grid again without the graph, and graphs are off for the process (`turn_off`, one line in the worker's log).

Where it applies (`build` says why not, else None): on a CUDA device, for a parent that is more than one module with
weights (a lone Linear, `o_proj` or `down_proj`, is one product a sample: GPU-bound, where the copies would only add),
whose samples' arguments are tensors on the parent's device (not requiring grad; one of an expanded or sliced layout
only where the samples share that very tensor) and plain values (numbers, strings, None, dtypes, devices) in dicts,
lists and tuples, with at least two samples of one kind (a dataset whose every sample has its own length runs
eagerly), and whose forward can be captured (no wait for the GPU inside it: an MoE block's routing cannot, nor can
anything that reads a value back; a capture that fails turns graphs off for that kind of module, for the process).
"""
from __future__ import annotations

import sys
import threading
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

__all__ = ["GraphedPass", "applies", "build", "turn_off", "available", "LOG_PREFIX"]

LOG_PREFIX = "graphed passes:"
MAX_GRAPHS = 8  # a search's graphs at most (the most common kinds of sample); each adds an eager check a candidate
_PLAIN = (type(None), bool, int, float, str, torch.dtype, torch.device)

_lock = threading.Lock()
# why graphs are off for the process; the module kinds whose capture failed; whether the first graph was told; the
# graphs' memory pool and the side stream on each device
_state: dict = {"off": None, "failed": set(), "told": False, "pools": {}, "streams": {}}


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


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.stride(), t.dtype, t.device


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


def _signature(leaves: list, spec, device: torch.device) -> tuple | str:
    """A sample's kind (its arguments' structure, its tensors' layouts, its other values): samples of one kind share
    a graph. Or why the sample cannot be graphed."""
    key = [repr(spec)]
    for value in leaves:
        if isinstance(value, torch.Tensor):
            if value.device != device:
                return f"an argument on {value.device}, not {device}"
            if value.requires_grad:
                return "an argument that requires grad"
            # a layout copy_ cannot fill (expanded, sliced): only samples that share that very tensor are alike
            key.append(_layout(value) if dense(value) else (_layout(value), "shared", id(value)))
        elif isinstance(value, _PLAIN):
            key.append((type(value), value))
        else:
            return f"an argument of type {type(value).__name__}"
    return tuple(key)


def _kinds(batches: list[dict], device: torch.device) -> tuple[list[tuple[list, object]], dict, str | None]:
    """Each sample's flattened arguments, the samples of each kind (index lists), and why none can be graphed (else
    None)."""
    flat = [tree_flatten(b) for b in batches]
    kinds: dict = {}
    for index, (leaves, spec) in enumerate(flat):
        key = _signature(leaves, spec, device)
        if isinstance(key, str):
            return flat, {}, key
        kinds.setdefault(key, []).append(index)
    if all(len(samples) < 2 for samples in kinds.values()):
        return flat, kinds, "no two samples alike (their lengths, layouts or other arguments differ)"
    return flat, kinds, None


def _first(output) -> torch.Tensor | None:
    out = output[0] if isinstance(output, tuple) else output  # as AWQ's _run_samples keeps it
    return out if isinstance(out, torch.Tensor) else None


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """A device bool: `a` and `b` hold the same bits (NaNs included), without a wait for the GPU."""
    if a.shape != b.shape or a.dtype != b.dtype or a.device != b.device:
        return torch.zeros((), dtype=torch.bool, device=b.device)
    return torch.eq(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8)).all()


def _pool(device: torch.device):
    """The process's memory pool for the graphs on `device`, kept from one search to the next: what a search's graphs
    let go the next one's capture takes again, so the memory held for graphs stays that of one search's. (A pool of
    its own a search, let go with its graphs, is kept by the caching allocator until a later allocation fails or the
    cache is emptied. With a pool and a new stream a search, an 8-layer AWQ export's process tree held 31 GiB of an
    H100 against 20 without graphs; how much of that was the pools was not measured apart.)"""
    with _lock:
        pool = _state["pools"].get(device)
        if pool is None and hasattr(torch.cuda, "MemPool"):
            with torch.cuda.device(device):
                pool = _state["pools"][device] = torch.cuda.MemPool()
    return pool.id if pool is not None else torch.cuda.graph_pool_handle()  # a torch without MemPool: one a search


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """The process's stream for warm-ups and captures on `device`, kept from one search to the next. The caching
    allocator lets a freed block be taken again only on the stream it was allocated on, and `torch.cuda.Stream()` hands
    out the next of a pool of streams: a stream a search would leave each warm-up's memory cached on another one."""
    with _lock:
        stream = _state["streams"].get(device)
        if stream is None:
            stream = _state["streams"][device] = torch.cuda.Stream(device)
    return stream


def _settle_generators() -> None:
    """After a capture that failed: one empty capture, begun and ended, so that the CUDA random generators PyTorch
    registered with the failed one leave their capturing state (a failed `capture_end` skips that, and the next
    random number outside a capture then raises "Offset increment outside graph capture")."""
    graph = torch.cuda.CUDAGraph()
    graph.capture_begin(capture_error_mode="thread_local")
    torch.empty(1, device=torch.cuda.current_device()).zero_()  # not empty: PyTorch warns of an empty graph
    graph.capture_end()
    graph.reset()


class _Graph:
    """One kind of sample's forward captured: inputs of its own for each tensor that is not the same object in every
    sample of the kind, the graph, and its output."""

    def __init__(self, module: nn.Module, samples: list[list], spec, device: torch.device, pool):
        leaves = samples[0]
        self._copied = [isinstance(v, torch.Tensor) and any(o[i] is not v for o in samples[1:])
                        for i, v in enumerate(leaves)]
        self._inputs = [torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=v.device) if copied else v
                        for v, copied in zip(leaves, self._copied)]
        kwargs = tree_unflatten(self._inputs, spec)
        current = torch.cuda.current_stream(device)
        side = _side_stream(device)
        side.wait_stream(current)
        try:
            with torch.cuda.stream(side):
                self._load(leaves)
                _first(module(**kwargs))  # warm-up: lazy set-up (a stream's cuBLAS workspace) outside the capture
                self.graph = torch.cuda.CUDAGraph()
                # other threads' CUDA calls are theirs (capture_error_mode)
                self.graph.capture_begin(pool=pool, capture_error_mode="thread_local")
                try:
                    output = module(**kwargs)
                except BaseException:
                    try:
                        self.graph.capture_end()
                    except Exception:  # noqa: BLE001 - the capture is invalid; the forward's error is the one told
                        _settle_generators()
                    raise
                try:
                    self.graph.capture_end()
                except BaseException:
                    _settle_generators()
                    raise
        finally:
            current.wait_stream(side)  # the inputs and the warm-up's tensors are the current stream's again
        self.output = _first(output)
        del output  # the rest (eager attention's probabilities) is the graph's memory, not held here
        if self.output is None:
            raise TypeError("the parent's output is not a tensor or a tuple starting with one")

    def _load(self, leaves: list) -> None:
        for value, target, copied in zip(leaves, self._inputs, self._copied):
            if copied:
                target.copy_(value)

    def run(self, leaves: list) -> torch.Tensor:
        self._load(leaves)
        self.graph.replay()
        return self.output


class GraphedPass:
    """`module` over `batches`, each sample of a kind that has a graph replayed from it, the rest run eagerly, in the
    samples' order (see the module docstring). Made by `build`."""

    def __init__(self, module: nn.Module, batches: list[dict], device: torch.device, flat: list, kinds: dict):
        self.module = module
        self.batches = batches
        self._leaves = [leaves for leaves, _ in flat]
        self._graph_of: list[_Graph | None] = [None] * len(batches)
        self._firsts: set[int] = set()  # each graph's first sample: also run eagerly, and compared, each pass
        self._same = torch.ones((), dtype=torch.bool, device=device)
        self.replays = 0
        self.graphs: list[_Graph] = []
        pool = _pool(device)  # each graph's output stays alive while it is used, the rest is transient
        alike = sorted((samples for samples in kinds.values() if len(samples) >= 2), key=len, reverse=True)
        for samples in alike[:MAX_GRAPHS]:
            graph = _Graph(module, [self._leaves[i] for i in samples], flat[samples[0]][1], device, pool)
            self.graphs.append(graph)
            self._firsts.add(samples[0])
            for i in samples:
                self._graph_of[i] = graph
        self.graphed = sum(g is not None for g in self._graph_of)

    def outputs(self) -> Iterator[torch.Tensor]:
        """Each sample's output, as AWQ's `_run_samples` keeps it, in order; a graphed sample's is its graph's output
        tensor, rewritten by that graph's next replay (read it before asking for the next). Each graph's first sample
        is also run eagerly and the two compared (`same()`)."""
        for index, batch in enumerate(self.batches):
            graph = self._graph_of[index]
            if graph is None:
                output = _first(self.module(**batch))  # the tuple let go at once, as awq_search's passes do
                yield output
                del output
                continue
            out = graph.run(self._leaves[index])
            self.replays += 1
            if index in self._firsts:
                reference = _first(self.module(**batch))
                self._same &= _bits_equal(reference, out) if reference is not None else False
                del reference
            yield out

    def same(self) -> torch.Tensor:
        """A device bool: every checked replay held the eager pass's bits."""
        return self._same

    def close(self) -> None:
        """The graphs and their memory let go."""
        for graph in self.graphs:
            graph.graph.reset()
        self.graphs, self._graph_of = [], []


def build(module: nn.Module, batches: list[dict], device: torch.device) -> tuple[GraphedPass | None, str | None]:
    """(the graphed pass, None), or (None, why not) where it does not apply or the capture failed (see the module
    docstring). A failed capture turns graphs off for that kind of module and is told once in the log."""
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    why = applies(module, device)
    if why is not None:
        return None, why
    flat, kinds, why = _kinds(batches, device)
    if why is not None:
        return None, why
    try:
        graphed = GraphedPass(module, batches, device, flat, kinds)
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
        print(f"{LOG_PREFIX} on (the first: {type(module).__qualname__}, {graphed.graphed} of {len(batches)} samples a "
              f"pass replayed from {len(graphed.graphs)} CUDA graph(s))", file=sys.stderr, flush=True)
    return graphed, None
