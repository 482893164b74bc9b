"""On a GPU: child/backends/awq_search.py's candidate steps queue their work without waiting for the GPU, where the
library's wait: the loss from device zeros (the library's `torch.tensor(0.0, device=...)` copies from the host and
waits for the stream) and compressed-tensors' `calculate_qparams` with its eps filled on the device; each gives the
library's values. (The same values on the CPU: tests/test_awq_search.py.)"""
import contextlib
from types import SimpleNamespace

import pytest
import torch
from compressed_tensors.quantization import QuantizationArgs
from compressed_tensors.quantization.utils import helpers as qparams_helpers
from compressed_tensors.utils import patch_attr

from child.backends import awq_search

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CUDA = torch.device("cuda")


@contextlib.contextmanager
def _waits_refused():
    """A synchronizing CUDA call inside raises (torch.cuda.set_sync_debug_mode("error"))."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_the_loss_queues_without_a_wait_and_is_the_librarys(monkeypatch):
    from llmcompressor.modifiers.transform.awq import AWQModifier
    from llmcompressor.modifiers.transform.awq import base as awq_base

    session = SimpleNamespace(state=SimpleNamespace(loss_masks=None))
    monkeypatch.setattr(awq_search, "active_session", lambda: session)
    monkeypatch.setattr(awq_base, "active_session", lambda: session)
    g = torch.Generator(device=CUDA).manual_seed(0)
    ref = [torch.randn(1, 64, 256, generator=g, device=CUDA).to(torch.bfloat16) for _ in range(8)]
    out = [(r.float() + 0.01 * torch.randn(r.shape, generator=g, device=CUDA)).to(torch.bfloat16) for r in ref]
    with _waits_refused():
        loss = awq_search._loss(ref, out)
    assert loss.item() == AWQModifier._compute_loss(None, ref, out)
    with pytest.raises(RuntimeError), _waits_refused():  # the library's waits (the check can fail)
        AWQModifier._compute_loss(None, ref, out)


def test_calculate_qparams_queues_without_a_wait_and_is_the_librarys():
    g = torch.Generator(device=CUDA).manual_seed(1)
    mins = -torch.rand(512, 32, generator=g, device=CUDA).to(torch.bfloat16)
    maxs = torch.rand(512, 32, generator=g, device=CUDA).to(torch.bfloat16)
    mins[::7], maxs[::7] = 0, 0
    qargs = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=128)
    expected = qparams_helpers.calculate_qparams(mins, maxs, qargs)  # its range tensors cached on the device
    with patch_attr(qparams_helpers, "torch", awq_search._NO_HOST_COPIES), _waits_refused():
        got = qparams_helpers.calculate_qparams(mins, maxs, qargs)
    for a, b in zip(got, expected):
        assert a.dtype == b.dtype and torch.equal(a, b)
    with pytest.raises(RuntimeError), _waits_refused():  # the library's own: its eps copied from the host
        qparams_helpers.calculate_qparams(mins, maxs, qargs)
