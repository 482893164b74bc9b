"""GPTQ's update factor with half the arithmetic, for `[calibration] match_oneshot = false`.

GPTQ needs U, the upper Cholesky factor of the damped Hessian's inverse (H⁻¹ = UᵀU). llm-compressor 0.14.0.1's
`factorize_hessian` makes it in three steps on the whole d x d matrix: L = chol(H), H⁻¹ = cholesky_inverse(L), U =
chol(H⁻¹, upper): 4d³/3 flops, and the explicit inverse is the slowest of them (measured on an H200 for down_proj's
14336-wide Hessian: the two Cholesky factorizations 68 ms, cholesky_inverse 145 ms, of a 286 ms solve;
bench/solve_probe.py --profile, docs/benchmarks.md).

With P the reversal permutation, P H P = L' L'ᵀ (its Cholesky factor), and H⁻¹ = P L'⁻ᵀ L'⁻¹ P = (P L'⁻¹ P)ᵀ (P L'⁻¹ P),
where P L'⁻¹ P is upper triangular with a positive diagonal: it is U. So one Cholesky factorization and one triangular
inverse, 2d³/3 flops, both in place in the Hessian's own memory (the reversals a few rows at a time, the inverse by
halves whose off-diagonal blocks are triangular solves): no d x d buffer beside the Hessian, where the library's
`cholesky_inverse` needs one. The same U up to rounding; what that changes is measured in docs/fidelity.md.

Everything else is the library's, as `factorize_hessian` does it: dead columns (zero diagonal) set to 1 and their
weights zeroed, the damping (percdamp of the mean diagonal), and a Hessian that is not positive definite replaced by
the identity and flagged for RTN. Installed only around a match_oneshot = false layer's session
(child/backends/calibrate.py); the default export never runs it.
"""
from __future__ import annotations

import contextlib

import torch
from compressed_tensors.utils import patch_attr

__all__ = ["factorize_hessian", "installed"]

ROWS = 512  # rows of a reversal's step: 2 x 512 x d fp32 of scratch (58 MB at d = 14336)
LEAF = 256  # a triangle this small is inverted by one triangular solve against the identity
CHUNK = 2048  # columns (rows) of an off-diagonal block solved at a time: d/2 x 2048 fp32 of scratch


def factorize_hessian(weights: torch.Tensor, hessians: torch.Tensor, percdamp: float,
                      used_rtn_fallback: torch.Tensor) -> torch.Tensor:
    """llm-compressor's `factorize_hessian` contract (weights [B, rows, d], hessians [B, d, d], both modified in
    place; returns the factors in `hessians`' memory), computed as the module docstring says."""
    batch_size, _, num_columns = weights.shape
    diag = torch.diagonal(hessians, dim1=-2, dim2=-1)
    dead = diag == 0
    if dead.any():
        diag.masked_fill_(dead, 1.0)
        weights.masked_fill_(dead.unsqueeze(1), 0)
    info = torch.empty((), dtype=torch.int32, device=hessians.device)
    for index in range(batch_size):
        h = hessians[index]
        damp = percdamp * torch.mean(torch.diag(h))
        torch.diagonal(h).add_(damp)
        _reverse_(h)
        torch.linalg.cholesky_ex(h, check_errors=False, out=(h, info))
        if info.item() == 0:
            _invert_lower_(h)
            _reverse_(h)
        else:
            h.copy_(torch.eye(num_columns, dtype=h.dtype, device=h.device))
            used_rtn_fallback[index] = True
    return hessians


@contextlib.contextmanager
def installed():
    """GPTQ's solve (gptq_quantize.quantize_weight) factorizes with this module's function while inside."""
    from llmcompressor.modifiers.gptq import gptq_quantize

    with patch_attr(gptq_quantize, "factorize_hessian", factorize_hessian):
        yield


def _reverse_(h: torch.Tensor) -> None:
    """h[i, j] <- h[d-1-i, d-1-j] (P h P), in place, ROWS rows from each end at a time."""
    d = h.shape[-1]
    half = d // 2
    for a in range(0, half, ROWS):
        b = min(a + ROWS, half)
        top = h[a:b].flip(0, 1)  # a copy
        h[a:b] = h[d - b:d - a].flip(0, 1)
        h[d - b:d - a] = top
    if d % 2:
        h[half] = h[half].flip(0)


def _invert_lower_(h: torch.Tensor) -> None:
    """h (lower triangular, zeros above) <- h⁻¹, in place: [[A, 0], [B, C]]⁻¹ = [[A⁻¹, 0], [-C⁻¹ B A⁻¹, C⁻¹]]."""
    d = h.shape[-1]
    if d <= LEAF:
        eye = torch.eye(d, dtype=h.dtype, device=h.device)
        h.copy_(torch.linalg.solve_triangular(h, eye, upper=False))
        return
    k = d // 2
    a, b, c = h[:k, :k], h[k:, :k], h[k:, k:]
    for j in range(0, k, CHUNK):  # B <- C⁻¹ B, a block of columns at a time (each column on its own)
        b[:, j:j + CHUNK] = torch.linalg.solve_triangular(c, b[:, j:j + CHUNK], upper=False)
    for i in range(0, d - k, CHUNK):  # B <- -(C⁻¹ B) A⁻¹, a block of rows at a time
        b[i:i + CHUNK] = torch.linalg.solve_triangular(a, b[i:i + CHUNK], upper=False, left=False).neg_()
    _invert_lower_(a)
    _invert_lower_(c)
