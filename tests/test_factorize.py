"""child/backends/factorize.py (match_oneshot = false): GPTQ's update factor from one Cholesky factorization of the
reversed Hessian and one triangular inverse equals llm-compressor's `factorize_hessian` (chol, cholesky_inverse, chol)
up to fp32 rounding, with the library's handling of dead columns, damping and Hessians that are not positive definite."""
import pytest
import torch
from llmcompressor.modifiers.gptq.helpers import factorize_hessian as library

from child.backends.factorize import factorize_hessian


def _hessian(d: int, g: torch.Generator, device: str, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(2 * d, d, generator=g).to(torch.bfloat16).float()
    return (x.t() @ x).div_(2 * d).mul_(scale).to(device)


def _both(weights, hessians):
    w1, w2 = weights.clone(), weights.clone()
    f1 = torch.zeros(len(weights), dtype=torch.bool, device=weights.device)
    f2 = f1.clone()
    u1 = library(w1, hessians.clone(), 0.01, f1)
    u2 = factorize_hessian(w2, hessians.clone(), 0.01, f2)
    return (w1, u1, f1), (w2, u2, f2)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("d,batch", [(7, 1), (256, 2), (601, 3), (1100, 1), (96, 16)])
def test_the_factor_is_the_librarys_up_to_rounding(d, batch, device):
    """Random Hessians as GPTQ accumulates them (X^T X of bf16 activations), odd and even widths, the leaf size and
    above it, a batch of 16 (the library's batched path), one with dead columns: the same U (upper triangular, zeros
    below), the same weights zeroed, no RTN fallback."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    g = torch.Generator().manual_seed(d)
    hessians = torch.stack([_hessian(d, g, device, scale=1 + k) for k in range(batch)])
    hessians[0, :, d // 3] = 0  # a dead column (its input always zero)
    hessians[0, d // 3, :] = 0
    weights = torch.randn(batch, 16, d, generator=g).to(device)
    (w1, u1, f1), (w2, u2, f2) = _both(weights, hessians)
    assert torch.equal(w1, w2) and (w2[0, :, d // 3] == 0).all()
    assert not f1.any() and not f2.any()
    assert torch.equal(u2, u2.triu())
    err = ((u1 - u2).abs().max() / u1.abs().max()).item()
    assert err < 1e-4, err
    # and the factor does its job: U^T U is the damped Hessian's inverse
    h = hessians.clone().double()
    diag = torch.diagonal(h, dim1=-2, dim2=-1)
    diag.masked_fill_(diag == 0, 1.0)
    diag.add_(0.01 * diag.mean(-1, keepdim=True))
    eye = torch.eye(d, dtype=torch.float64, device=device).expand(batch, d, d)
    assert torch.allclose(u2.double().transpose(-1, -2) @ u2.double() @ h, eye, atol=1e-3)


def test_a_hessian_that_is_not_positive_definite_falls_back_to_rtn_as_the_librarys_does():
    g = torch.Generator().manual_seed(3)
    good = _hessian(300, g, "cpu")
    bad = -good  # negative definite: Cholesky fails
    hessians = torch.stack([good, bad])
    weights = torch.randn(2, 8, 300, generator=g)
    (_, u1, f1), (_, u2, f2) = _both(weights, hessians)
    assert f1.tolist() == f2.tolist() == [False, True]
    assert torch.equal(u2[1], torch.eye(300)) and torch.equal(u1[1], u2[1])
    assert ((u1[0] - u2[0]).abs().max() / u1[0].abs().max()).item() < 1e-4
