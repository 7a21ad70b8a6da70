"""Shared by tests/ops/test_{preference,rl,distill}_losses.py: inputs, the fp64 run, the bound.

Bound (tests/_grid.py's error model, first order): the kernel path rounds the logits once per term of the H-long
dot products (matmul_tol: lambda sqrt(H) u |h| |w|), the lse sums V terms (lambda sqrt(V) u), the per-sequence sums
T terms and the gradient GEMMs sum over N rows (dW) or V columns (dh). Each output's tolerance is u times those
sqrt factors times the magnitude it is made of (the max of |ref| and its inputs' scale), plus for bf16/fp16
u is the dtype's unit roundoff for bf16/fp16 (the chunk logits and the stored gradients round to it).
"""

import torch

from tests._grid import UNIT_ROUNDOFF, assert_tol, sum_ulps


def head(B, T, H, V, dtype, bias=True, seed=0, n_ignored=3):
    g = torch.Generator().manual_seed(seed)
    h = (torch.randn(B, T, H, generator=g)).to(dtype).requires_grad_()
    w = (torch.randn(V, H, generator=g) * (2.0 / H**0.5)).to(dtype).requires_grad_()
    b = (torch.randn(V, generator=g) * 0.5).to(dtype).requires_grad_() if bias else None
    t = torch.randint(0, V, (B, T), generator=g)
    flat = t.view(-1)
    flat[torch.randperm(B * T, generator=g)[:n_ignored]] = -100
    t[:, 0] = -100  # a prompt token in every sequence
    return h, w, b, t


def grads_of(loss, ins):
    want = [i for i in ins if i is not None and i.requires_grad]
    got = iter(torch.autograd.grad(loss, want))
    return [next(got) if (i is not None and i.requires_grad) else None for i in ins]


def as64(ins):
    return [None if i is None else i.detach().double().requires_grad_(i.requires_grad) for i in ins]


def check(name, got, ref, dtype, *, k=1.0, mag=None):
    """|got - ref| <= 8 u(dtype) k max(|ref|, mag): k the product of the sqrt(length) factors (module docstring)."""
    ref = ref.detach().double()
    scale = max(ref.abs().max().item() if ref.numel() else 0.0, mag or 0.0, 1e-30)
    assert_tol(name, got.detach().double(), ref, UNIT_ROUNDOFF[dtype] * 8 * k * scale)


def lengths(H, V, N):
    return sum_ulps(H) + sum_ulps(V) + sum_ulps(N)
