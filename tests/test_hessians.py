"""child/backends/hessians.py: GPTQ's Hessians computed once per distinct input equal the library's per-module ones bit for bit,
whatever the pattern of shared, diverging, repeated or missing inputs; real layers share what they feed alike."""
import types

import pytest
import torch
from torch import nn

from child.backends.hessians import SharedHessians, term


def _replay(calls, modules, hook, end_sample=lambda: None):
    """Every call in order: (name, x) a module's forward with input x; (None, fn) fn() run there (an in-place change)."""
    for sample in calls:
        for name, x in sample:
            x() if name is None else hook(modules[name], x)
        end_sample()


def _library(calls, modules):
    """llm-compressor's own hook (GPTQModifier.calibrate_module) on every call, in order: the reference."""
    from llmcompressor.modifiers.gptq import GPTQModifier

    lib = types.SimpleNamespace(_hessians={}, _num_samples={})
    _replay(calls, modules, lambda m, x: GPTQModifier.calibrate_module(lib, m, (x,), None))
    return lib


def _ours(calls, modules):
    ours = types.SimpleNamespace(_hessians={}, _num_samples={})
    sharer = SharedHessians()
    _replay(calls, modules, lambda m, x: sharer._hook(ours, m, x), sharer.end_sample)
    sharer.finish()
    return ours, sharer


def _same(lib, ours):
    assert list(lib._hessians) == list(ours._hessians)  # the library's module order (a group's bin packing uses it)
    assert list(lib._num_samples) == list(ours._num_samples)
    for m in lib._hessians:
        a, b = lib._hessians[m], ours._hessians[m]
        assert a.dtype == b.dtype and torch.equal(a.view(torch.int32), b.view(torch.int32))  # bits, -0.0 included
        assert torch.equal(lib._num_samples[m], ours._num_samples[m])


@pytest.mark.parametrize("shape", [(7, 16), (1, 7, 16), (3, 7, 16), (2, 3, 5, 16)])
def test_term_is_accumulate_hessians_addition(shape):
    """zeros + term(x) twice, added as the library adds, equals accumulate_hessian's Hessian and count bit for bit."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    lin = nn.Linear(16, 4)
    xs = [torch.randn(shape, dtype=torch.bfloat16) for _ in range(2)]
    h, n = torch.zeros(16, 16), torch.zeros(())
    for x in xs:
        h, n = accumulate_hessian(x, lin, h, n)
    ours, count = torch.zeros(16, 16), 0
    for x in xs:
        t, added = term(x, torch.device("cpu"))
        ours += t
        count += added
    assert torch.equal(h.view(torch.int32), ours.view(torch.int32)) and n.item() == count


def _script():
    """Six samples of calls on nine modules (built afresh for each run: the in-place change happens during it)."""
    g = torch.Generator().manual_seed(0)
    calls = []
    for j in range(6):
        a, b, wide = (torch.randn(1, 5, w, generator=g) for w in (16, 16, 32))
        if j == 0:  # a zero column against a negative one: products of -0.0 (a sign the Hessian must keep as the
            a[..., 0], a[..., 1] = 0.0, -a[..., 1].abs()  # library does)
        sample = [("q", a), ("k", a), ("v", a), ("g", b), ("u", b), ("d", wide)]
        if j == 2:
            sample[1] = ("k", a.clone())  # equal values, another tensor: computed on its own, still equal
        if j == 3:
            sample.append(("e", a))  # first seen late: joins no one with a history
        if j == 4:
            c = b.clone()
            sample = [("q", a), ("k", a), ("g", c), (None, lambda c=c: c.add_(1.0)), ("u", c)]  # v skipped;
            # c changed in place between g and u
        if j == 5:
            sample += [("u", b), ("l", a[..., :16].view(1, 5, 16)), ("r", a)]  # u twice; a view of a
        calls.append(sample)
    return calls


@pytest.fixture(params=["as shipped", "every width striped"])
def striped(request, monkeypatch):
    """The shipped MIN_WIDTH (the scripts' narrow terms made whole), or 0: every term a StripedTerm where this CPU's
    check allows (added into H's upper triangle, mirrored in finish(); a class that splits carries a stale H)."""
    from child.backends import hessians

    monkeypatch.setattr(hessians, "_verdicts", {})
    if request.param != "as shipped":
        monkeypatch.setattr(hessians, "MIN_WIDTH", 0)
    return hessians


def test_shared_diverging_repeated_and_missing_inputs_equal_the_library(striped):
    """Modules that share an input, then one that gets another (a copy of the same values, a view, the same tensor
    changed in place in between), one called twice in a sample, one skipped in some samples, one first seen late: every
    Hessian and count equals the library's, and only distinct inputs were computed."""
    torch.manual_seed(0)
    mods = {n: nn.Linear(16, 8, bias=False) for n in "qkvguelr"}
    mods["d"] = nn.Linear(32, 8, bias=False)  # another width
    lib = _library(_script(), mods)
    ours, sharer = _ours(_script(), mods)
    _same(lib, ours)
    calls = sum(len([c for c in s if c[0] is not None]) for s in _script())
    assert sharer.served > 0 and sharer.computed + sharer.served == calls


def _fast(calls, modules):
    ours = types.SimpleNamespace(_hessians={}, _num_samples={})
    sharer = SharedHessians(fast=True)
    _replay(calls, modules, lambda m, x: sharer._hook(ours, m, x), sharer.end_sample)
    sharer.finish()
    return ours, sharer


def test_fast_terms_follow_the_librarys_classes_and_values():
    """match_oneshot = false: the same script (shared, diverging, repeated, missing inputs; an input changed in place
    after a module took it and before its term was added) gives every module the library's Hessian up to the order
    of fp32 additions, and its count exactly; a term computed from the changed values would be off by far more."""
    torch.manual_seed(0)
    mods = {n: nn.Linear(16, 8, bias=False) for n in "qkvguelr"}
    mods["d"] = nn.Linear(32, 8, bias=False)
    lib = _library(_script(), mods)
    ours, sharer = _fast(_script(), mods)
    assert list(lib._hessians) == list(ours._hessians)
    for m in lib._hessians:
        a, b = lib._hessians[m], ours._hessians[m]
        assert b.dtype == torch.float32 and torch.allclose(a, b, rtol=1e-5, atol=1e-5), (a - b).abs().max()
        assert torch.equal(lib._num_samples[m], ours._num_samples[m])
    assert sharer.served > 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_fast_term_accumulates_2xtx_in_fp32(device):
    """FastTerm against float64 arithmetic: the first term made alone, the next accumulated into it in place (on a
    GPU: bf16 products on tensor cores, the Hessian as the GEMM's fp32 accumulator)."""
    from child.backends.hessians import fast_term

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 300, 96, generator=g).to(torch.bfloat16) for _ in range(3)]
    h = None
    for x in xs:
        t, n = fast_term(x.to(device), torch.device(device))
        assert n == 1
        if h is None:
            h = t.tensor()
        else:
            t.add_to(h)
    want = sum(2 * x[0].double().t() @ x[0].double() for x in xs)
    assert h.dtype == torch.float32 and h.device.type == device
    assert torch.allclose(h.double().cpu(), want, rtol=1e-6, atol=1e-4), (h.double().cpu() - want).abs().max()


def test_a_llama_layer_shares_qkv_and_gate_up_and_equals_the_library(striped):
    """A real decoder layer's forward: q/k/v and gate/up each computed once per sample (4 terms for 7 modules),
    every Hessian the library's bit for bit."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                      attn_implementation="eager")
    layer = LlamaDecoderLayer(cfg, 0).to(torch.bfloat16).eval()
    rope = LlamaRotaryEmbedding(cfg)
    linears = {n: m for n, m in layer.named_modules() if isinstance(m, nn.Linear)}
    calls = []
    hooks = [m.register_forward_hook(lambda m, args, out, n=n: calls[-1].append((n, args[0])))
             for n, m in linears.items()]
    with torch.no_grad():
        for length in (9, 9, 6):
            calls.append([])
            x = torch.randn(1, length, 64, dtype=torch.bfloat16)
            pos = torch.arange(length)[None]
            layer(x, position_embeddings=rope(x, pos), position_ids=pos)
    for h in hooks:
        h.remove()
    lib = _library(calls, linears)
    ours, sharer = _ours(calls, linears)
    _same(lib, ours)
    assert sharer.computed == 4 * 3 and sharer.served == 3 * 3


@pytest.fixture
def fresh_verdicts(monkeypatch):
    from child.backends import hessians

    monkeypatch.setattr(hessians, "_verdicts", {})
    return hessians


@pytest.mark.parametrize("width,tokens", [(1024, 96), (1536, 77)])
def test_wide_terms_as_verified_stripes_equal_accumulate_hessian(width, tokens, fresh_verdicts):
    """A term of width >= MIN_WIDTH is computed as upper-triangle stripes once a check on random values of its layout
    found them equal to the full matmul: made whole (term) or added into H's upper triangle and mirrored at the end
    (SharedHessians, where the check found the full matmul symmetric too), the Hessian and count still equal
    accumulate_hessian's bit for bit."""
    from llmcompressor.modifiers.gptq.helpers import accumulate_hessian

    lin = nn.Linear(width, 4)
    xs = [torch.randn(1, tokens, width, dtype=torch.bfloat16) for _ in range(3)]
    h, n = torch.zeros(width, width), torch.zeros(())
    for x in xs:
        h, n = accumulate_hessian(x, lin, h, n)
    ours = torch.zeros(width, width)
    for x in xs:
        ours += term(x, torch.device("cpu"))[0]
    assert torch.equal(h.view(torch.int32), ours.view(torch.int32))
    (layout, (count, into)), = fresh_verdicts._verdicts.items()  # checked once for the three samples of one layout
    assert layout[0] == (width, tokens) and count in fresh_verdicts.STRIPES and into  # this CPU's BLAS
    got, sharer = _ours([[("m", x)] for x in xs], {"m": lin})
    assert torch.equal(h.view(torch.int32), got._hessians[lin].view(torch.int32)) and torch.equal(n, got._num_samples[lin])
    assert sharer.computed == 3


@pytest.mark.parametrize("asymmetric", [(6,), (9,), (9, 6)], ids=["last whole", "first whole", "all whole"])
def test_a_hessian_of_terms_added_whole_and_into_its_upper_triangle_equals_the_library(asymmetric, fresh_verdicts,
                                                                                         monkeypatch):
    """Samples of other lengths are other layouts, each checked on its own: where the check finds the full matmul not
    symmetric (here: said so for the lengths in `asymmetric`), that sample's terms are added whole, after H is
    mirrored if stripes had gone into its upper triangle, and every later term whole too; the Hessians still equal the
    library's bit for bit."""
    striped = fresh_verdicts
    monkeypatch.setattr(striped, "MIN_WIDTH", 0)
    real = striped._verify

    def verify(inp):  # inp: [width, tokens]
        count, into = real(inp)
        return count, into and inp.shape[1] not in asymmetric

    monkeypatch.setattr(striped, "_verify", verify)
    g = torch.Generator().manual_seed(3)
    mods = {n: nn.Linear(48, 8, bias=False) for n in "abc"}
    calls = []
    for length in (9, 9, 6, 9):
        x, y = torch.randn(1, length, 48, generator=g), torch.randn(1, length, 48, generator=g)
        calls.append([("a", x), ("b", x), ("c", y)])
    lib = _library(calls, mods)
    ours, _ = _ours(calls, mods)
    _same(lib, ours)
    intos = {layout[0][1]: into for layout, (count, into) in striped._verdicts.items()}
    assert intos == {t: t not in asymmetric for t in (9, 6)}, intos


def test_the_symmetry_check_sees_one_bit():
    from child.backends import hessians

    x = torch.randn(1100, 40)
    full = x.matmul(x.t())
    assert hessians._symmetric(full.view(torch.int32))  # this CPU's BLAS: the product is symmetric bit for bit
    full[1050, 3] = torch.nextafter(full[1050, 3], torch.tensor(float("inf")))  # below the diagonal, past a chunk
    assert not hessians._symmetric(full.view(torch.int32))


def test_stripes_that_differ_by_one_bit_are_never_used(fresh_verdicts, monkeypatch):
    """A stripe count whose result differs from the full matmul in one element's last bit fails the check: the next
    count is tried, and with none equal every term is the full matmul, bit for bit."""
    import math

    real, flawed = fresh_verdicts._stripes, set()

    def stripes(inp, count):
        out = real(inp, count)
        if count in flawed:
            out[0, -1] = torch.nextafter(out[0, -1], torch.tensor(float("inf")))
        return out

    monkeypatch.setattr(fresh_verdicts, "_stripes", stripes)
    x = torch.randn(1, 64, 1024, dtype=torch.bfloat16)
    inp = math.sqrt(2) * x[0].t().to(torch.float32)
    flawed.add(fresh_verdicts.STRIPES[0])
    assert fresh_verdicts.stripe_count(inp) == fresh_verdicts.STRIPES[1]
    fresh_verdicts._verdicts.clear()
    flawed.update(fresh_verdicts.STRIPES)
    got, _ = term(x, torch.device("cpu"))
    assert fresh_verdicts.stripe_count(inp) == 0
    assert torch.equal(got.view(torch.int32), inp.matmul(inp.t()).view(torch.int32))
