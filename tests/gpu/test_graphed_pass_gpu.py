"""On a GPU: child/backends/graphed_pass.py replays a decoder layer's attention and MLP over samples cached as AWQ
caches them, bit for bit with the eager passes (with the fused attention and without, Llama and Qwen3, weights
rewritten in place between passes as the search writes them; samples of several lengths, one graph a length and a
lone length eager); the check finds a weight replaced after the capture;
a forward that waits for the GPU is not captured and the GPU works on. (AWQ exports on cuda against oneshot, the
graphs in use: tests/gpu/test_calibrated_gpu.py.)"""
import inspect

import pytest
import torch
from torch import nn

from child.backends import eager_attention, graphed_pass
from tests.test_eager_attention import fresh_state  # noqa: F401 - autouse: the fusion on, nothing compared yet

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def graphs_on(monkeypatch):
    monkeypatch.setitem(graphed_pass._state, "off", None)
    monkeypatch.setitem(graphed_pass._state, "failed", set())


def _model(kind: str):
    from transformers import AutoConfig, AutoModelForCausalLM

    shape = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=8,
                 num_key_value_heads=2, vocab_size=512, head_dim=32)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **shape), attn_implementation="eager")
    return model.to(CUDA, torch.bfloat16).eval()


def _cached(model, parents, lengths: list[int]) -> dict:
    """Each parent's arguments for each sample's forward, by name, as AWQ's pre-forward hook caches them."""
    cached = {p: [] for p in parents}

    def hook(module, args, kwargs):
        names = list(inspect.signature(module.forward).parameters)
        cached[module].append({**dict(zip(names, args)), **kwargs})

    handles = [p.register_forward_pre_hook(hook, with_kwargs=True) for p in parents]
    g = torch.Generator().manual_seed(len(lengths))
    with torch.no_grad():
        for length in lengths:
            model(torch.randint(3, 512, (1, length), generator=g).to(CUDA), use_cache=False)
    for h in handles:
        h.remove()
    return cached


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _same_bits(a, b) -> bool:
    return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("kind", ["llama", "qwen3"])
@pytest.mark.parametrize("fused", [True, False], ids=["fused-attention", "eager-attention"])
def test_replays_give_the_eager_passes_bits_as_the_weights_change_in_place(kind, fused):
    model = _model(kind)
    layer = model.model.layers[0]
    parents = [layer.self_attn, layer.mlp]
    # three kinds of sample (by length): two graphs, the lone one eager, in the samples' order
    cached = _cached(model, parents, [300, 200, 300, 300, 100, 200])
    with torch.no_grad(), (eager_attention.installed(layer) if fused else _nothing()):
        for parent in parents:
            graphed, why = graphed_pass.build(parent, cached[parent], CUDA)
            assert why is None and graphed is not None, why
            assert len(graphed.graphs) == 2 and graphed.graphed == 5
            for step in range(3):  # as each candidate rewrites its balance layers' weights (in place)
                for linear in [m for m in parent.modules() if isinstance(m, nn.Linear)][:3]:
                    linear.weight.mul_(1 + 0.01 * (step + 1))
                ours = [o.clone() for o in graphed.outputs()]
                ref = [_first(parent(**b)) for b in cached[parent]]
                assert all(_same_bits(a, b) for a, b in zip(ours, ref)), (type(parent).__name__, step)
            assert graphed.same().item() and graphed.replays == 3 * 5
            graphed.close()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def test_a_weight_replaced_after_the_capture_is_found_by_the_check():
    """A replay reads the weights where they lay at capture: a weight replaced (not written in place) leaves the
    replay on the old values, and the check (each pass's first sample run eagerly too) says so."""
    model = _model("llama")
    mlp = model.model.layers[0].mlp
    cached = _cached(model, [mlp], [64] * 4)[mlp]
    with torch.no_grad():
        graphed, why = graphed_pass.build(mlp, cached, CUDA)
        assert why is None
        first = [o.clone() for o in graphed.outputs()]
        assert graphed.same().item()
        old = mlp.up_proj.weight.data  # kept alive: the graph reads it still
        mlp.up_proj.weight.data = old * 1.5  # a new tensor, not written in place
        stale = [o.clone() for o in graphed.outputs()]
        assert all(_same_bits(a, b) for a, b in zip(first, stale))  # the old weights' outputs
        assert not graphed.same().item()
        graphed.close()


class _Waits(nn.Module):
    """A parent whose forward reads a value back from the GPU (as an MoE block's routing does)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(64, 64), nn.Linear(64, 64)

    def forward(self, hidden_states):
        x = self.a(hidden_states)
        return self.b(x) if x.sum().item() > -1e9 else x


def test_a_forward_that_waits_is_not_captured_and_the_gpu_works_on():
    module = _Waits().to(CUDA)
    batches = [{"hidden_states": torch.randn(1, 8, 64, device=CUDA)} for _ in range(3)]
    graphed, why = graphed_pass.build(module, batches, CUDA)
    assert graphed is None and "could not be captured" in why
    assert "could not be captured before" in graphed_pass.applies(module, CUDA)  # not tried again in the process
    with torch.no_grad():
        out = module(**batches[0])
    assert torch.isfinite(out).all() and (torch.ones(4, device=CUDA) @ torch.ones(4, device=CUDA)).item() == 4
    assert torch.randn(4, device=CUDA).isfinite().all()  # the random generators left their capturing state
    good = _model("llama").model.layers[0].mlp  # and the next capture works
    cached = [{"x": torch.randn(1, 8, 256, device=CUDA, dtype=torch.bfloat16)} for _ in range(3)]
    graphed, why = graphed_pass.build(good, cached, CUDA)
    assert why is None
    with torch.no_grad():
        assert all(_same_bits(o.clone(), good(**b)) for o, b in zip(graphed.outputs(), cached))
    graphed.close()


def test_a_lone_linear_and_unlike_samples_are_left_eager():
    linear = nn.Linear(64, 64).to(CUDA)
    batches = [{"input": torch.randn(1, 8, 64, device=CUDA)} for _ in range(3)]
    assert graphed_pass.build(linear, batches, CUDA)[1] == "one module with weights: one product a sample"
    mlp = _model("llama").model.layers[0].mlp
    ragged = [{"x": torch.randn(1, n, 256, device=CUDA, dtype=torch.bfloat16)} for n in (8, 9)]
    assert graphed_pass.build(mlp, ragged, CUDA)[1].startswith("no two samples alike")


def test_the_graphs_memory_is_taken_again_by_the_next_search():
    """Each search's graphs are let go at its end; the next search's capture takes their memory again (one pool a
    process and device), so what the caching allocator holds does not grow from search to search."""
    model = _model("llama")
    attn = model.model.layers[0].self_attn
    cached = _cached(model, [attn], [256] * 4)[attn]
    reserved = []
    with torch.no_grad():
        for _ in range(4):
            graphed, why = graphed_pass.build(attn, cached, CUDA)
            assert why is None
            for _ in graphed.outputs():
                pass
            assert graphed.same().item()
            graphed.close()
            del graphed
            reserved.append(torch.cuda.memory_reserved())
    assert reserved[-1] == reserved[1], reserved
