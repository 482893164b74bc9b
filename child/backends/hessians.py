"""GPTQ's Hessians computed once per distinct input: modules fed the same tensor share one accumulation.

llm-compressor's GPTQModifier hooks every quantized module's forward (`calibrate_module`) and accumulates, per
sample, H_m += (sqrt(2) x)ᵀ(sqrt(2) x) from the module's own input x, in fp32 (`accumulate_hessian`). In a decoder
layer several modules take the very same tensor: q/k/v_proj the attention's normed input, gate/up_proj the MLP's,
MLA's q_a_proj and kv_a_proj_with_mqa theirs, a shared expert's gate/up theirs. Their Hessians are then made by the
same ops, in the same order, on the same bytes, and are equal bit for bit: one computation serves them all.

    a module's hook (x: its input)         the module's class (the modules whose Hessians are equal so far)
      x is the tensor another member got   ─▶ nothing to compute: the member's term serves it too
        in this sample (same object, not
        modified since: its version)
      else                                 ─▶ the term (sqrt 2 x)ᵀ(sqrt 2 x), as accumulate_hessian computes it
      every member has seen this sample's  ─▶ H += term (what the library does per module, once per class)
        input
      a member gets another input, twice   ─▶ it leaves the class with a copy of H as its own history says it
        in one sample, or none at all         is (the term not yet added, or added once)
    finish() before the library's solve    ─▶ _hessians[m] = its class's H (a copy each in a group, whose ranks
                                              reduce every module's Hessian in place), _num_samples[m] as the
                                              library counts them

Which modules share is found from the tensors, not from names: whatever the architecture passes to several
modules is computed once, and a module whose input differs (a routed expert, a fused projection) keeps its own.
Classes form in a module's first sample: a class with no history yet adds its term at the end of the sample, so
that the modules seen later in it can join. Only torch.nn.Linear modules are handled; any other module goes
through the library's own hook. Each default term is `inp @ inpᵀ`, computed as upper-triangle stripes where a check
in this process found them equal to the full matmul bit for bit for inp's layout (see _product); where that full
matmul is also symmetric bit for bit, the stripes are added straight into the Hessian's upper triangle and the
Hessian is mirrored once, in finish() (see StripedTerm). With `[calibration] match_oneshot = false` each term is fast_term's instead
(bf16 products on tensor cores, fp32 accumulation): rounding only, and no longer oneshot's bits. Owns nothing but these accumulations during one layer's forward stage; it never
solves, and it is used only inside child/backends/calibrate.py's session.
"""
from __future__ import annotations

import contextlib
import math
import sys

import torch
from compressed_tensors.utils import get_execution_device, patch_attr
from llmcompressor.modifiers.gptq import GPTQModifier
from llmcompressor.modifiers.gptq.helpers import GPTQ_PRECISION

__all__ = ["FastTerm", "SharedHessians", "StripedTerm", "deferred_term", "fast_term", "term"]


def term(inp: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """One sample's addition to a Linear module's Hessian and the samples it counts: llm-compressor 0.14.0.1's
    `accumulate_hessian` for torch.nn.Linear, line for line, up to (not including) `hessian += ...`."""
    inp, num_added = _scaled(inp, device)
    return _product(inp), num_added


def deferred_term(inp: torch.Tensor, device: torch.device) -> tuple["StripedTerm | torch.Tensor", int]:
    """`term`, but a StripedTerm where inp's layout allows one (its stripes added into the Hessian's upper triangle,
    see StripedTerm): the d x d term is then never made."""
    inp, num_added = _scaled(inp, device)
    count, into = verdict(inp)
    return (StripedTerm(inp, count) if into else _product(inp)), num_added


def _scaled(inp: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """accumulate_hessian's lines before its product: sqrt(2) xᵀ in fp32 ([width, tokens]), and the samples it counts."""
    inp = inp.to(device=device)
    if len(inp.shape) == 2:
        inp = inp.unsqueeze(0)
    elif len(inp.shape) > 3:
        inp = inp.reshape(inp.shape[0], -1, inp.shape[-1])
    num_added = inp.shape[0]
    if len(inp.shape) == 3:
        inp = inp.reshape((-1, inp.shape[-1]))
    inp = inp.t()
    inp = math.sqrt(2) * inp.to(dtype=GPTQ_PRECISION)
    return inp, num_added


# ---- inp @ inpᵀ as upper-triangle stripes, where they are the full matmul's bits ------------------------------
# inp @ inpᵀ is symmetric, so its upper triangle carries it all: s row stripes, each against the columns from its own
# first row on, compute (s + 1) / 2s of the products (0.75 for 2 stripes, 0.625 for 4). Each element is a dot product
# over the tokens; its bits depend on the order the kernel adds the products in, and that depends on the kernel the
# BLAS library picks for the GEMM's shape, never on the values. Measured on an H200 (torch 2.11,
# bench/symmetric_probe.py, docs/benchmarks.md): width 4096 x 2048 tokens equal the full matmul bit for bit with 2
# stripes (0.79x its time), not with 4 or 8; width 14336 with 2 and 4 (0.66x), not with 8. So the stripes are used
# only where a check made in this process found them equal: per layout of inp (shape, strides, dtype, device), the
# first time it is seen, the full matmul and each stripe count in STRIPES (most first) on random values of that
# very layout; the first count equal bit for bit is kept for that layout, none if none is (the full matmul then).
# The same check asks whether the full matmul is symmetric bit for bit (element (j, i) the bits of (i, j)). Where it
# is, the stripes go straight into the Hessian: H's upper triangle gets, element for element, the very additions the
# library makes there (H + the full matmul's element, which the stripe's equals), and once every sample is in, each
# element below the diagonal is set to its mirror above, which holds the same additions of the same bits in the same
# order. No d x d term is made per sample, nor mirrored, nor added whole (bench/accumulate_probe.py measures it).
STRIPES = (8, 6, 5, 4, 3, 2)
MIN_WIDTH = 1024  # narrower products are a few milliseconds: the extra launches cost more than they save
_verdicts: dict[tuple, tuple[int, bool]] = {}  # layout -> (stripe count found equal (0: none), into H), this process's
_CHUNK = 1024  # rows compared or mirrored at a time: a d x d comparison's bool tensor is 205 MB at width 14336


def _product(inp: torch.Tensor) -> torch.Tensor:
    """inp @ inpᵀ (inp: [width, tokens]) with the bits of `inp.matmul(inp.t())`, as stripes where verified."""
    count = stripe_count(inp)
    return _stripes(inp, count) if count else inp.matmul(inp.t())


def stripe_count(inp: torch.Tensor) -> int:
    """The stripe count verified equal to the full matmul for inp's layout (0: use the full matmul)."""
    return verdict(inp)[0]


def verdict(inp: torch.Tensor) -> tuple[int, bool]:
    """For inp's layout: the stripe count verified equal to the full matmul (0: use the full matmul), and whether the
    stripes may go straight into the Hessian's upper triangle (the full matmul verified symmetric too)."""
    if inp.shape[0] < MIN_WIDTH:
        return 0, False
    key = (tuple(inp.shape), inp.stride(), inp.dtype, str(inp.device))
    found = _verdicts.get(key)
    if found is None:
        found = _verdicts[key] = _verify(inp)
        count, into = found
        how = f"{count} stripes (equal to the full matmul bit for bit)" if count else "the full matmul (no stripe count equal)"
        if into:
            how += ", added into the Hessian's upper triangle (the full matmul symmetric bit for bit)"
        print(f"hessians: width {inp.shape[0]} x {inp.shape[1]} tokens on {inp.device}: {how}", file=sys.stderr,
              flush=True)  # the worker's log
    return found


def _verify(inp: torch.Tensor) -> tuple[int, bool]:
    # random values in inp's own layout: every element a true sum of `tokens` rounded products, so a kernel that adds
    # them in another order shows (-0.0 and NaN compared as bits)
    g = torch.Generator(device=inp.device).manual_seed(0)
    probe = torch.empty_strided(inp.shape, inp.stride(), dtype=inp.dtype, device=inp.device)
    probe.normal_(generator=g)
    full = probe.matmul(probe.t())
    bits = full.view(torch.int32)
    for count in STRIPES:
        if _bits_equal(_stripes(probe, count).view(torch.int32), bits):
            return count, _symmetric(bits)
    return 0, False


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    # a row chunk at a time: a d x d comparison's bool tensor is 205 MB at width 14336
    return all(torch.equal(x, y) for x, y in zip(a.split(_CHUNK), b.split(_CHUNK)))


def _symmetric(bits: torch.Tensor) -> bool:
    d = bits.shape[0]
    return all(torch.equal(bits[a:a + _CHUNK], bits[:, a:a + _CHUNK].t()) for a in range(0, d, _CHUNK))


def _edges(d: int, count: int) -> list[int]:
    return [d * k // count // 8 * 8 for k in range(count)] + [d]


def _stripes(inp: torch.Tensor, count: int) -> torch.Tensor:
    # inp: [d, t] -> [d, d]; stripe [a, b) computes rows a..b against columns a..d, the block left of it is mirrored
    d = inp.shape[0]
    out = torch.empty((d, d), dtype=inp.dtype, device=inp.device)
    edges = _edges(d, count)
    for a, b in zip(edges[:-1], edges[1:]):
        torch.matmul(inp[a:b], inp[a:].t(), out=out[a:b, a:])
        if b < d:
            out[b:, a:b].copy_(out[a:b, b:].t())
    return out


def mirror_upper(h: torch.Tensor) -> None:
    """Every element below h's diagonal set to its mirror above it, in place: a copy, no arithmetic (bits kept)."""
    d = h.shape[0]
    for a in range(0, d, _CHUNK):
        b = min(a + _CHUNK, d)
        block = h[a:b, a:b]
        upper = torch.ones((b - a, b - a), dtype=torch.bool, device=h.device).triu_()
        block.copy_(torch.where(upper, block, block.t()))
        if b < d:
            h[b:, a:b].copy_(h[a:b, b:].t())


class StripedTerm:
    """One sample's term (sqrt 2 x)ᵀ(sqrt 2 x) for a layout whose stripes equal the full matmul and whose full matmul
    is symmetric (see `verdict`), not computed until it is added: each stripe's product is added into the Hessian's
    block right of the diagonal, which then holds in its upper triangle exactly what the library's `H += term` would;
    the elements below the diagonal are stale until `mirror_upper` (the session's finish())."""

    __slots__ = ("inp", "count")

    def __init__(self, inp: torch.Tensor, count: int):
        self.inp, self.count = inp, count  # inp: sqrt(2) xᵀ in fp32, [d, tokens], a tensor of its own

    def add_upper(self, hessian: torch.Tensor) -> None:
        inp, d = self.inp, self.inp.shape[0]
        edges = _edges(d, self.count)
        for a, b in zip(edges[:-1], edges[1:]):
            hessian[a:b, a:] += torch.matmul(inp[a:b], inp[a:].t())  # the stripe's bits, added as the library adds

    def tensor(self) -> torch.Tensor:
        """The whole term, mirrored per sample (the full matmul's bits): for a Hessian that is kept whole."""
        return _stripes(self.inp, self.count)


def fast_term(inp: torch.Tensor, device: torch.device) -> tuple["FastTerm", int]:
    """`[calibration] match_oneshot = false`: the same sum, 2 xᵀx, from the inputs' own dtype with fp32 accumulation,
    as a FastTerm: computed when it is added, by one GEMM that accumulates into the Hessian (see FastTerm)."""
    inp = inp.to(device=device)
    if len(inp.shape) == 2:
        inp = inp.unsqueeze(0)
    elif len(inp.shape) > 3:
        inp = inp.reshape(inp.shape[0], -1, inp.shape[-1])
    # a copy of x (tens of MB; the d x d term it replaces is hundreds): the term is added once the class's members
    # have seen it, and the forward may change x in place before then
    return FastTerm(inp.reshape((-1, inp.shape[-1])).clone()), inp.shape[0]


class FastTerm:
    """One sample's 2 xᵀx (x: [tokens, width]) for `match_oneshot = false`, not computed until it is added.

    On a GPU, bf16/fp16 products on the tensor cores with fp32 accumulation, and the Hessian as the GEMM's
    accumulator: `addmm(H, xᵀ, x, alpha=2, out_dtype=float32, out=H)`, with no d x d term in memory and no passes
    over one (measured on an H200, a layer's seven Hessians took 0.35 s this way against 3.10 s for the default's
    fp32 products, shared/reference/floor). Elsewhere (the CPU has no mixed-precision GEMM) the inputs upcast to fp32,
    the same addmm. Products of bf16 values are exact in fp32, and the factor 2 is exact: only the order of the
    additions and the rounding of the default's sqrt(2) scaling differ from `term` (docs/fidelity.md measures what
    that changes). A class that splits adds the same term to each part: each computes it from x."""

    __slots__ = ("x",)

    def __init__(self, x: torch.Tensor):
        self.x = x

    def add_to(self, hessian: torch.Tensor) -> None:
        self._gemm(hessian, beta=1.0)

    def tensor(self) -> torch.Tensor:
        """The term on its own (a class's first): the same GEMM into fresh memory (beta 0: its contents unread)."""
        out = torch.empty((self.x.shape[1], self.x.shape[1]), dtype=GPTQ_PRECISION, device=self.x.device)
        self._gemm(out, beta=0.0)
        return out

    def _gemm(self, out: torch.Tensor, beta: float) -> None:
        x = self.x
        if x.is_cuda and x.dtype in (torch.bfloat16, torch.float16):  # aten::addmm.dtype: CUDA only
            torch.addmm(out, x.t(), x, beta=beta, alpha=2.0, out_dtype=GPTQ_PRECISION, out=out)
        else:
            x = x.to(GPTQ_PRECISION)
            torch.addmm(out, x.t(), x, beta=beta, alpha=2.0, out=out)


class _Input:
    """A module's input, as identity: the same tensor object, unmodified since (its version counter). Holding the
    tensor keeps its memory from being reused by another tensor that would look the same."""

    __slots__ = ("tensor", "version")

    def __init__(self, x: torch.Tensor):
        self.tensor, self.version = x, _version(x)

    def same(self, x: torch.Tensor) -> bool:
        return self.version is not None and x is self.tensor and _version(x) == self.version


def _version(x: torch.Tensor) -> int | None:
    try:
        return x._version
    except RuntimeError:  # an inference tensor has no version counter: never taken as shared
        return None


class _Class:
    """Modules whose Hessians are equal so far: one accumulation (None: no sample added yet, zeros)."""

    __slots__ = ("members", "hessian", "width", "device", "input", "pending", "shared", "seen", "stale", "whole")

    def __init__(self, members: list, hessian: torch.Tensor | None, width: int, device: torch.device,
                 stale: bool = False, whole: bool = False):
        self.members, self.hessian, self.width, self.device = members, hessian, width, device
        # StripedTerms went into H's upper triangle: below the diagonal is stale until mirrored (finish)
        self.stale = stale
        # a whole term (not known symmetric) is in H: every later term is added whole too, so H is never mirrored
        self.whole = whole
        self.input: _Input | None = None  # this sample's input, once a member got it
        self.pending: torch.Tensor | None = None  # its term, not yet added
        self.shared = False  # the pending term is another class's too (split)
        self.seen: list = []  # the members that got it

    def add_pending(self) -> None:
        if self.pending is None:
            return
        if isinstance(self.pending, FastTerm):  # match_oneshot = false: the GEMM accumulates into H
            if self.hessian is None:
                self.hessian = self.pending.tensor()
            else:
                self.pending.add_to(self.hessian)
        elif isinstance(self.pending, StripedTerm) and not self.whole:
            if self.hessian is None:  # make_empty_hessian's zeros, then the library's `+=` (its upper triangle)
                self.hessian = torch.zeros((self.width, self.width), device=self.device, dtype=GPTQ_PRECISION)
            self.pending.add_upper(self.hessian)
            self.stale = True
        else:
            self._add_whole()
        self.input, self.pending, self.shared, self.seen = None, None, False, []

    def _add_whole(self) -> None:
        """The pending term made whole and added as the library adds it; H mirrored first if it was stale."""
        if isinstance(self.pending, StripedTerm):
            self.pending = self.pending.tensor()
        self.whole = True
        self.settle()
        if self.hessian is None and not self.shared:
            # the library adds the first term to make_empty_hessian's zeros: 0 + t is t + 0.0 for every float
            # (-0.0 becomes +0.0 either way), so the term itself becomes the Hessian, without a second d x d tensor
            self.hessian = self.pending.add_(0.0)
        else:
            if self.hessian is None:
                self.hessian = torch.zeros((self.width, self.width), device=self.device, dtype=GPTQ_PRECISION)
            self.hessian += self.pending  # accumulate_hessian's `hessian += inp.matmul(inp.t())`

    def settle(self) -> None:
        """H whole: the elements below its diagonal mirrored from above, if StripedTerms left them stale."""
        if self.stale:
            mirror_upper(self.hessian)
            self.stale = False

    def split(self, members: list, with_pending: bool) -> "_Class":
        """`members` leave with a copy of the history they have: H, plus the pending term if they got it."""
        for m in members:
            self.members.remove(m)
            if m in self.seen:
                self.seen.remove(m)
        other = _Class(members, None if self.hessian is None else self.hessian.clone(), self.width, self.device,
                       self.stale, self.whole)
        if with_pending:
            other.input, other.pending, other.seen = self.input, self.pending, list(members)
            other.shared = self.shared = True
        return other


class SharedHessians:
    """Stands in for GPTQModifier.calibrate_module during one layer's forward stage (see the module docstring)."""

    def __init__(self, copies: bool = False, fast: bool = False):
        """`copies`: finish() gives every module a Hessian of its own (a group's ranks reduce them in place);
        `fast`: each term from fast_term (`[calibration] match_oneshot = false`), else the library's own."""
        self._copies = copies
        self._term = fast_term if fast else deferred_term
        self._of: dict = {}  # module -> its _Class
        self._classes: list[_Class] = []
        self._modifiers: dict = {}  # module -> the GPTQModifier whose hook it is
        self.computed = 0  # terms computed, for the stage clock's curious (tests read it)
        self.served = 0  # module samples served by a term computed for another module

    @contextlib.contextmanager
    def installed(self):
        """GPTQModifier's hook replaced by this object's for the session's life (hooks bind it at registration)."""
        original = GPTQModifier.calibrate_module
        sharer = self

        def calibrate_module(modifier, module, args, _output):
            if type(module) is not torch.nn.Linear:
                return original(modifier, module, args, _output)
            sharer._hook(modifier, module, args[0])

        with patch_attr(GPTQModifier, "calibrate_module", calibrate_module):
            yield self

    # ---- per sample ----------------------------------------------------------------------------------------
    def _hook(self, modifier, module, x: torch.Tensor) -> None:
        device = get_execution_device(module)
        if module not in modifier._num_samples:  # calibrate_module's own bookkeeping, in its order
            modifier._hessians[module] = None  # placeholder until finish(): keeps the library's module order
            modifier._num_samples[module] = torch.zeros(tuple(), device=device)
            self._modifiers[module] = modifier
            c = self._join(module, x, module.weight.shape[1], torch.device(device))
        else:
            c = self._of[module]
            if c.input is None:
                self._compute(c, x)
                c.seen = [module]
            elif c.input.same(x) and module not in c.seen:
                c.seen.append(module)
                self.served += 1
            else:
                # another input than the others got, or a second call in this sample (its history then holds the
                # pending term as well): it goes on alone, from the history it has
                old, again = c, module in c.seen
                c = self._leave(c, module, with_pending=again)
                c.add_pending()  # a class of one with a history: added at once (no-op when the term is not its own)
                self._compute(c, x)
                c.seen = [module]
                if old.members:
                    self._settle(old)
        modifier._num_samples[module] += self._count(x)
        self._settle(c)

    def _join(self, module, x: torch.Tensor, width: int, device: torch.device) -> _Class:
        """A module's first call: into a class with no history yet whose input this sample is this same tensor,
        else a class of its own."""
        for c in self._classes:
            if c.hessian is None and c.input is not None and c.input.same(x) and c.width == width \
                    and c.device == device:
                c.members.append(module)
                c.seen.append(module)
                self._of[module] = c
                self.served += 1
                return c
        c = _Class([module], None, width, device)
        self._classes.append(c)
        self._of[module] = c
        self._compute(c, x)
        c.seen = [module]
        return c

    def _leave(self, c: _Class, module, with_pending: bool) -> _Class:
        other = c.split([module], with_pending)
        self._classes.append(other)
        self._of[module] = other
        if not c.members:
            self._classes.remove(c)
        return other

    def _compute(self, c: _Class, x: torch.Tensor) -> None:
        c.pending, _ = self._term(x, c.device)
        c.input = _Input(x)
        self.computed += 1

    @staticmethod
    def _count(x: torch.Tensor) -> int:
        return x.shape[0] if x.dim() >= 3 else 1  # accumulate_hessian's num_added

    @staticmethod
    def _settle(c: _Class) -> None:
        """Add the pending term once every member has it; a class with no history waits for the sample's end."""
        if c.pending is not None and c.hessian is not None and len(c.seen) == len(c.members):
            c.add_pending()

    def end_sample(self) -> None:
        """After each sample's forward: members that did not get the class's input keep the history without it."""
        for c in list(self._classes):
            if c.pending is None:
                continue
            missed = [m for m in c.members if m not in c.seen]
            if missed:
                self._classes.append(c.split(missed, with_pending=False))
                for m in missed:
                    self._of[m] = self._classes[-1]
            c.add_pending()

    def finish(self) -> None:
        """Hand each module its Hessian, where the library's hook would have left it, before its solve."""
        self.end_sample()
        for c in self._classes:
            c.settle()
            for k, m in enumerate(c.members):
                hessian = c.hessian.clone() if self._copies and k > 0 else c.hessian
                self._modifiers[m]._hessians[m] = hessian
        self._of, self._classes, self._modifiers = {}, [], {}
