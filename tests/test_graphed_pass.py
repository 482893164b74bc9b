"""child/backends/graphed_pass.py's decisions, on the CPU: where a parent's passes may be replayed from a CUDA graph
(its module, its samples' arguments), the layouts its inputs can take, the bit comparison, and awq_search's weights
written in place where the library replaces them. (Replays against eager passes: tests/gpu/test_graphed_pass_gpu.py.)"""
import pytest
import torch
from torch import nn

from child.backends import awq_search, graphed_pass

CUDA = torch.device("cuda")


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)


def test_on_the_cpu_no_pass_is_graphed():
    batches = [{"x": torch.ones(2, 8)} for _ in range(3)]
    assert graphed_pass.build(_Block(), batches, torch.device("cpu")) == (None, "cpu: not a CUDA device")


@pytest.mark.parametrize("shape,stride,expected", [
    ((3, 4), (4, 1), True),
    ((3, 4), (1, 3), True),  # a transposed contiguous tensor
    ((1, 1, 5, 5), (25, 25, 5, 1), True),
    ((1, 1, 5, 5), (0, 0, 5, 1), True),  # size-1 dimensions: any stride
    ((3, 4), (0, 1), False),  # expanded: one element read for many
    ((3, 2), (0, 5), False),
    ((3, 4), (8, 1), False),  # a slice: gaps
    ((2, 2), (1, 1), False),
])
def test_dense_is_a_permutation_of_a_contiguous_layout(shape, stride, expected):
    t = torch.empty(64).as_strided(shape, stride)
    assert graphed_pass.dense(t) is expected


def _why(batches):
    """Why `batches` cannot be graphed (None where they can), past the device and module checks (`applies`): the
    samples' tensors on the CPU stand for the GPU's."""
    return graphed_pass._kinds(batches, torch.device("cpu"))[2]


def test_samples_of_one_structure_are_graphed():
    shared = torch.zeros(1, 1, 4, 4)
    batches = [{"hidden_states": torch.randn(1, 4, 8), "position_embeddings": (torch.randn(1, 4, 2), torch.randn(1, 4, 2)),
                "attention_mask": shared, "past_key_values": None, "use_cache": False, "dtype": torch.bfloat16}
               for _ in range(3)]
    assert _why(batches) is None


@pytest.mark.parametrize("change", [
    lambda b: b.pop("use_cache"),  # another structure
    lambda b: b.update(use_cache=True),  # another value
    lambda b: b.update(x=torch.randn(1, 5, 8)),  # another length
    lambda b: b.update(x=torch.randn(1, 4, 8).to(torch.bfloat16)),  # another dtype
    lambda b: b.update(x=torch.randn(1, 8, 4).transpose(1, 2)),  # another layout
    lambda b: b.update(x=None),
], ids=["structure", "value", "length", "dtype", "layout", "none"])
def test_samples_of_each_kind_share_a_graph_and_a_kind_of_one_is_left_eager(change):
    batches = [{"x": torch.randn(1, 4, 8), "use_cache": False} for _ in range(4)]
    change(batches[2])
    _, kinds, _ = graphed_pass._kinds(batches, torch.device("cpu"))
    assert sorted(kinds.values()) == [[0, 1, 3], [2]]
    assert _why(batches) is None
    alone = [batches[0], batches[2]]  # no two alike: nothing to graph
    assert _why(alone) == "no two samples alike (their lengths, layouts or other arguments differ)"


def test_a_tensor_copy_cannot_fill_is_graphed_only_where_the_samples_share_it():
    mask = torch.ones(1, 4).expand(3, 4)  # expanded: a graph's input of this layout cannot be written
    shared = [{"x": torch.randn(2, 4), "mask": mask} for _ in range(3)]
    assert _why(shared) is None
    own = [{"x": torch.randn(2, 4), "mask": torch.ones(1, 4).expand(3, 4)} for _ in range(3)]
    assert _why(own).startswith("no two samples alike")


@pytest.mark.parametrize("value,why", [
    (torch.ones(3, 4, requires_grad=True), "requires grad"),
    (object(), "of type object"),
])
def test_arguments_a_graph_cannot_take_are_left_eager(value, why):
    batches = [{"x": value} for _ in range(2)]
    assert why in _why(batches)


def test_one_sample_is_left_eager():
    assert _why([{"x": torch.ones(2)}]).startswith("no two samples alike")


def test_a_lone_linear_is_left_eager(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # past the device check
    assert graphed_pass.applies(nn.Linear(8, 8), CUDA) == "one module with weights: one product a sample"
    assert graphed_pass.applies(_Block(), CUDA) is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16])
def test_bits_equal_compares_bits(dtype):
    a = torch.randn(3, 5).to(dtype)
    b = a.clone()
    assert graphed_pass._bits_equal(a, b).item()
    b[1, 2] = torch.nextafter(b[1, 2].float(), torch.tensor(9.0)).to(dtype) if dtype == torch.float32 else b[1, 2] * 2
    assert not graphed_pass._bits_equal(a, b).item()
    nan = torch.full((4,), float("nan"), dtype=dtype)
    assert graphed_pass._bits_equal(nan, nan.clone()).item()  # the same bits, though NaN != NaN
    zero = torch.zeros(4, dtype=dtype)
    assert not graphed_pass._bits_equal(zero, -zero).item()  # equal values, other bits
    assert not graphed_pass._bits_equal(a, a.float() if dtype != torch.float32 else a.double()).item()
    assert not graphed_pass._bits_equal(a, a[:2]).item()


def test_the_searchs_weights_are_written_in_place_where_the_library_replaces_them():
    layer = nn.Linear(8, 4)
    storage = layer.weight.data_ptr()
    value = torch.randn(4, 8)
    awq_search._set_weight(layer, value)
    assert layer.weight.data_ptr() == storage and torch.equal(layer.weight.data, value)
    awq_search._set_weight(layer, torch.randn(8, 4).t())  # not contiguous: replaced, as the library does
    assert layer.weight.data_ptr() != storage and not layer.weight.is_contiguous()
