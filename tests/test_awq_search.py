"""child/backends/awq_search.py's pieces that keep the library's values while leaving out its waits for the GPU:
the numbers compressed-tensors' qparams helpers make on the device (filled there, not copied from the host) equal
torch.tensor's, value and dtype; `calculate_qparams` through them gives the library's scales and zero points; the
loss made from device zeros equals the library's `_compute_loss`; and none of them calls torch.tensor with a device
(a copy from the host, which on a GPU waits for the stream). (Whole AWQ exports through them against oneshot:
tests/test_calibrate.py; the waits themselves, on a GPU: tests/gpu/test_awq_search_gpu.py.)"""
import random

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import helpers as qparams_helpers
from compressed_tensors.utils import patch_attr

from child.backends import awq_search

DTYPES = [None, torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32]


def _numbers() -> list:
    rng = random.Random(0)
    edges = [0, 7, -8, 2**31 - 1, 2**40, 0.0, -2.5, 1 / 3, 1e-4, 2**-126, 2**-149, 1e-45, 5.96e-8, 65504.0, 65520.0,
             3.4e38, 3.5e38, 1e300, *(torch.finfo(d).eps for d in (torch.float32, torch.float16, torch.bfloat16)),
             *(torch.finfo(d).tiny for d in (torch.float32, torch.float16, torch.bfloat16))]
    return edges + [rng.uniform(-1, 1) * 10 ** rng.randint(-50, 40) for _ in range(500)] + \
        [rng.randint(-2**40, 2**40) for _ in range(50)] + [rng.randint(-1000, 1000) for _ in range(50)]


def _host_copies(fn) -> list:
    """The calls of torch.tensor with a device that `fn()` made (each a copy from the host, which on a GPU waits for
    the stream)."""
    made, tensor = [], torch.tensor

    def spy(*args, **kwargs):
        if kwargs.get("device") is not None:
            made.append((args, kwargs))
        return tensor(*args, **kwargs)

    with patch_attr(torch, "tensor", spy):
        fn()
    return made


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_numbers_filled_on_the_device_are_torch_tensors_values(dtype):
    """Every Python number torch.tensor takes gives the same value and dtype through the stand-in (a fill where the
    dtype's range holds it, torch.tensor itself where not), and a non-number goes to torch.tensor."""
    compared = 0
    for number in _numbers():
        if dtype in (torch.int64, torch.int32) and isinstance(number, float):
            continue
        try:
            expected = torch.tensor(number, dtype=dtype, device="cpu")
        except RuntimeError:  # out of an integer dtype's range: torch.tensor refuses it too
            continue
        got = awq_search._NO_HOST_COPIES.tensor(number, dtype=dtype, device="cpu")
        assert got.dtype == expected.dtype and got.shape == expected.shape, (number, dtype)
        assert torch.equal(got, expected) or bool(got.isnan() & expected.isnan()), (number, dtype, got, expected)
        compared += 1
    assert compared > 20
    copied = _host_copies(lambda: awq_search._NO_HOST_COPIES.tensor(0.5, dtype=dtype if dtype not in (
        torch.int64, torch.int32) else None, device="cpu"))
    assert not copied, copied  # a number with a device is filled there, never made by torch.tensor
    listed = awq_search._NO_HOST_COPIES.tensor([1.5, 2.5], dtype=dtype if dtype not in (torch.int64, torch.int32)
                                                else None, device="cpu")
    assert listed.shape == (2,) and listed.tolist() == [1.5, 2.5]
    assert awq_search._NO_HOST_COPIES.float32 is torch.float32 and awq_search._NO_HOST_COPIES.where is torch.where


@pytest.mark.parametrize("args", [dict(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32),
                                  dict(num_bits=4, type="int", symmetric=False, strategy="group", group_size=32),
                                  dict(num_bits=8, type="int", symmetric=True, strategy="channel"),
                                  dict(num_bits=8, type="float", symmetric=True, strategy="tensor")],
                         ids=["w4-sym", "w4-asym", "w8-channel", "fp8-tensor"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_calculate_qparams_through_the_stand_in_gives_the_librarys(args, dtype):
    """compressed-tensors' calculate_qparams (which makes its eps with torch.tensor) gives the same scales and zero
    points, zeros among the ranges included (where the eps is used), with the stand-in as its `torch`."""
    g = torch.Generator().manual_seed(1)
    mins = -torch.rand(64, 4, generator=g).to(dtype)
    maxs = torch.rand(64, 4, generator=g).to(dtype)
    mins[::7], maxs[::7] = 0, 0  # all-zero ranges: scale 0, replaced by the eps
    qargs = QuantizationArgs(**args)
    expected = qparams_helpers.calculate_qparams(mins, maxs, qargs)
    qparams_helpers._calculate_range.cache_clear()
    got = []
    with patch_attr(qparams_helpers, "torch", awq_search._NO_HOST_COPIES):
        copied = _host_copies(lambda: got.extend(qparams_helpers.calculate_qparams(mins, maxs, qargs)))
    qparams_helpers._calculate_range.cache_clear()
    assert not copied, copied
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)


@pytest.mark.parametrize("masked", [False, True])
def test_the_loss_from_device_zeros_is_the_librarys(masked, monkeypatch):
    """`_loss` (its zeros filled, no .item()) equals llm-compressor's `_compute_loss`, loss masks included."""
    from types import SimpleNamespace

    from llmcompressor.modifiers.transform.awq import AWQModifier

    g = torch.Generator().manual_seed(2)
    ref = [torch.randn(1, 9, 16, generator=g).to(torch.bfloat16) for _ in range(5)]
    out = [(r.float() + 0.01 * torch.randn(r.shape, generator=g)).to(torch.bfloat16) for r in ref]
    masks = [torch.randint(0, 2, (1, 9), generator=g) for _ in ref] if masked else None
    session = SimpleNamespace(state=SimpleNamespace(loss_masks=masks))
    monkeypatch.setattr(awq_search, "active_session", lambda: session)
    from llmcompressor.modifiers.transform.awq import base as awq_base

    monkeypatch.setattr(awq_base, "active_session", lambda: session)
    made = []
    assert not _host_copies(lambda: made.append(awq_search._loss(ref, out)))  # its zeros filled, not copied
    got = made[0]
    assert got.dtype == torch.float32 and got.dim() == 0
    assert got.item() == AWQModifier._compute_loss(None, ref, out)


@pytest.mark.parametrize("masked", [False, True])
def test_a_candidates_loss_sample_by_sample_is_the_librarys(masked, monkeypatch):
    """`_candidate_loss` runs the parent over AWQ's cached samples one at a time, each output added into the loss as
    it comes (eager attention's tuple: its first element), and gives the loss of the library's `_run_samples` and
    `_compute_loss`, loss masks included; `run_samples` gives `_run_samples`' outputs."""
    from types import SimpleNamespace

    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.awq import base as awq_base

    g = torch.Generator().manual_seed(3)
    weight = torch.randn(16, 16, generator=g).to(torch.bfloat16)

    class Parent(torch.nn.Module):  # returns a tuple, as an attention does: (output, probabilities)
        def forward(self, hidden_states):
            return hidden_states @ weight, torch.softmax(hidden_states.float(), -1)

    parent = Parent()
    cache = [{"hidden_states": torch.randn(1, 9, 16, generator=g).to(torch.bfloat16)} for _ in range(5)]
    modifier = SimpleNamespace(_parent_args_cache={parent: cache})
    modifier._run_samples = lambda module: AWQModifier._run_samples(modifier, module)
    reference = [(b["hidden_states"].float() + 0.01).to(torch.bfloat16) @ weight for b in cache]
    masks = [torch.randint(0, 2, (1, 9), generator=g) for _ in cache] if masked else None
    session = SimpleNamespace(state=SimpleNamespace(loss_masks=masks, sequential_prefetch=False))
    for module in (awq_search, awq_base):
        monkeypatch.setattr(module, "active_session", lambda: session)
    expected = AWQModifier._compute_loss(None, reference, modifier._run_samples(parent))
    assert awq_search._candidate_loss(modifier, parent, reference).item() == expected
    ours, library = awq_search.run_samples(modifier, parent), modifier._run_samples(parent)
    assert len(ours) == len(library) == 5 and all(torch.equal(a, b) for a, b in zip(ours, library))
