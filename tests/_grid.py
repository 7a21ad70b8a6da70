"""Shared test helpers: the error bounds of the op contract and the input makers.

bf16/fp16: against an fp64 reference, err(kernel) <= 2 * err(torch in dtype) + atol (`assert_bound`), where
err is the max abs error and atol = 4 * unit roundoff(dtype) * max|ref| covers the case where torch in dtype
is exact by luck (its error is then 0). Both sides see the same bf16/fp16 inputs. The rounding to the dtype
(2^-8, 2^-11) dwarfs any fp32 summation order, so torch's error is a fair yardstick there.

fp32 with a reduction (a GEMM, a sum over the vocabulary): torch's own error is set by how the host's BLAS
or vectorized reduction orders its sums (one CPU's M=2 GEMM over K=32000 is 87 u * sum|terms| off, its M=5 GEMM
8), so 2 * err(torch) is no bound. There the bound is an error model (`assert_tol`), per element:
a sum of k terms computed in fp32 in any order (sequential, blocked, split, pairwise, with or without FMA)
is within lambda * sqrt(k) * u * sum|terms| of the exact sum (Higham & Mary, "A new approach to probabilistic
rounding error analysis", SISC 2019: it holds with probability >= 1 - 2k exp(-lambda^2 / 2) when rounding
errors are mean independent). LAMBDA = 8 makes that k * 2.5e-14 per output: under 1e-6 for the k * outputs
<= 4e7 of these tests. Errors of the operands carry through to first order (`matmul_tol`), so a chain of
reductions (logits -> lse -> dlogits -> dW) adds its terms; `ulps` covers the few roundings outside the sums.
"""

import math

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}
LAMBDA = 8.0
U32 = UNIT_ROUNDOFF[torch.float32]


def err(a: torch.Tensor, ref: torch.Tensor) -> float:
    return (a.double() - ref.double()).abs().max().item() if ref.numel() else 0.0


def assert_bound(name: str, kernel: torch.Tensor, torch_in_dtype: torch.Tensor, ref: torch.Tensor, dtype, *,
                 ulps: float = 4, floor: float = 0.0):
    """ulps and floor widen atol where the math says so: `floor` is the magnitude the result is a difference
    of (a loss lse - x_t that cancels to 0 has the rounding of lse), `ulps` covers the GPU's approximate
    exp2/log2 (about 2 ulps each) where torch calls exact libm functions."""
    assert kernel.shape == ref.shape, f"{name}: shape {tuple(kernel.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(kernel).all() == torch.isfinite(ref).all(), f"{name}: non-finite values"
    e_k, e_t = err(kernel, ref), err(torch_in_dtype, ref)
    scale = ref.double().abs().max().item() if ref.numel() else 0.0
    atol = ulps * UNIT_ROUNDOFF[dtype] * max(scale, floor, 1e-30)
    assert e_k <= 2 * e_t + atol, f"{name}: kernel err {e_k:.3e} > 2 * torch err {e_t:.3e} + {atol:.3e}"


def sum_ulps(k: float) -> float:
    """How many u * sum|terms| an fp32 sum of k terms may be off by, in any order (the module docstring)."""
    return LAMBDA * math.sqrt(max(k, 1))


def matmul_tol(a, b, a_tol=None, b_tol=None, *, ulps: float = 4.0):
    """Per-element tolerance of a @ b computed in fp32 from operands within a_tol, b_tol of the fp64 a, b:
    a_tol @ |b| + |a| @ b_tol + u * (LAMBDA * sqrt(K) + ulps) * |a| @ |b|, K = a.shape[-1]."""
    a, b = a.detach().double(), b.detach().double()
    mag = a.abs() @ b.abs()
    tol = U32 * (sum_ulps(a.shape[-1]) + ulps) * mag
    if a_tol is not None:
        tol = tol + a_tol @ b.abs()
    if b_tol is not None:
        tol = tol + a.abs() @ b_tol
    return tol


def cross_entropy_tol(x, target, *, x_tol=None, scale=None, ignore_index=-100, label_smoothing=0.0,
                      z_loss_scale=0.0, softcap=None, ulps: float = 4.0):
    """(per-row loss tolerance [N], dlogits tolerance [N, V]) of an fp32 cross-entropy of the logits x [N, V]
    (fp64, exact), computed from logits within x_tol of x, the gradient scaled by `scale` [N] (grad_output /
    denominator); exp, log and sigmoid `ulps` u off (2 ulps each on a GPU). First-order terms, u = 2^-24:
      softcap  xc = cap tanh(x / cap), d = 1 - tanh^2, tanh = 2 sigmoid(2x / cap) - 1: (2 ulps + 1) u absolute;
      lse      logsumexp(xc): the sum of V positive terms, two roundings per term where an online max rescales
               the running sum (sqrt(2V)), each exp's argument xc_j - max (2 max|xc| u), the log, the add;
      dlogits  scale * (p (1 + 2 z lse) - y) * d, p = exp(xc - lse): p's relative error is xc's + lse's +
               |xc - lse| u + the exp's; 6 roundings on terms of size p and y = (1 - ls) onehot + ls / V
               (scale ls, / V, the product, the difference, * d, * grad_output);
      loss     (1 - ls)(lse - xc_t) + ls (lse - mean xc) + z lse^2: the sum over V for the mean, 6 roundings."""
    x = x.detach().double()
    N, V = x.shape
    x_tol = torch.zeros_like(x) if x_tol is None else x_tol
    t = target.reshape(-1)
    valid = t != ignore_index
    t_safe = torch.where(valid, t, torch.zeros_like(t))
    if softcap:
        th = torch.tanh(x / softcap)
        xc, d = softcap * th, 1 - th * th
        th_tol = d / softcap * (x_tol + 2 * U32 * x.abs()) + (2 * ulps + 1) * U32
        xc_tol = softcap * th_tol + U32 * xc.abs()
        d_tol = 2 * th.abs() * th_tol + U32
    else:
        xc, d, xc_tol, d_tol = x, torch.ones_like(x), x_tol, torch.zeros_like(x)
    lse = torch.logsumexp(xc, -1, keepdim=True)
    p = torch.softmax(xc, -1)
    m = xc.abs().amax(-1, keepdim=True)
    lse_tol = (p * xc_tol).sum(-1, keepdim=True) + U32 * (
        sum_ulps(2 * V) + ulps + 2 * m + ulps * (lse.abs() + m) + lse.abs())
    a = 1 + 2 * z_loss_scale * lse
    y = torch.full_like(x, label_smoothing / V).scatter_add_(
        1, t_safe[:, None], torch.full_like(x[:, :1], 1 - label_smoothing))
    p_rel = xc_tol + lse_tol + U32 * ((xc - lse).abs() + ulps)
    pa_tol = p * a.abs() * (p_rel + 3 * U32) + p * 2 * z_loss_scale * lse_tol  # a: 3 roundings
    s = torch.as_tensor(1.0 if scale is None else scale).detach().to(x).reshape(-1, 1).expand(N, 1)
    g_tol = s.abs() * ((pa_tol + 6 * U32 * (p * a.abs() + y)) * d + (p * a - y).abs() * d_tol)
    xt, xt_tol = xc.gather(1, t_safe[:, None]), xc_tol.gather(1, t_safe[:, None])
    mean_abs = xc.abs().mean(-1, keepdim=True)
    row_tol = (a.abs() * lse_tol + (1 - label_smoothing) * xt_tol
               + label_smoothing * (xc_tol.mean(-1, keepdim=True) + U32 * sum_ulps(V) * mean_abs)
               + 6 * U32 * (lse.abs() * a.abs() + xt.abs() + mean_abs))
    keep = valid.to(x.device)[:, None]
    return torch.where(keep, row_tol, 0.0).squeeze(1), torch.where(keep, g_tol, 0.0)


def reduce_tol(rows, row_tol, denom=None, *, ulps: float = 4.0):
    """Tolerance of sum(rows) / denom in fp32 from rows within row_tol of the fp64 rows."""
    rows = rows.detach().double()
    tol = row_tol.sum() + U32 * (sum_ulps(rows.numel()) + ulps) * rows.abs().sum()
    return tol if denom is None else tol / denom


def cross_entropy_model(x, target, grad_output, *, x_tol=None, reduction="mean", num_items_in_batch=None,
                        ulps: float = 4.0, **kw):
    """((loss, its tolerance), (dlogits, its tolerance)): reference.cross_entropy of the logits x [N, V] in
    fp64 and its gradient for `grad_output`, with the fp32 model's tolerances (`cross_entropy_tol`; the sum
    over the rows has K = N)."""
    from tigon.ops import reference

    x = x.detach().double().requires_grad_()
    t = target.reshape(-1)
    rows = reference.cross_entropy(x, t, reduction="none", **kw)
    if num_items_in_batch is not None:
        denom = float(num_items_in_batch)
    else:
        denom = (t != kw.get("ignore_index", -100)).sum().double() if reduction == "mean" else None
    if reduction == "none" and num_items_in_batch is None:
        loss = rows.reshape(target.shape)
    else:
        loss = rows.sum() / (1 if denom is None else denom)
    go = grad_output.detach().double()
    (g,) = torch.autograd.grad(loss, x, go)
    row_tol, g_tol = cross_entropy_tol(x, t, x_tol=x_tol, scale=go / (1 if denom is None else denom), ulps=ulps,
                                       **kw)
    loss_tol = row_tol.reshape(target.shape) if loss.dim() else reduce_tol(rows, row_tol, denom, ulps=ulps)
    return (loss.detach(), loss_tol), (g, g_tol)


def assert_tol(name: str, got: torch.Tensor, ref: torch.Tensor, tol):
    """|got - ref| <= tol per element (tol a tensor broadcastable to ref, or a float)."""
    assert got.shape == ref.shape, f"{name}: shape {tuple(got.shape)} != {tuple(ref.shape)}"
    assert torch.isfinite(got).all() == torch.isfinite(ref).all(), f"{name}: non-finite values"
    if not ref.numel():
        return
    e = (got.double() - ref.double()).abs()
    tol = torch.as_tensor(tol, dtype=torch.float64, device=e.device).expand_as(e)
    ratio = e / tol.clamp_min(1e-300)
    i = int(ratio.argmax())
    assert bool((e <= tol).all()), (f"{name}: err {e.flatten()[i].item():.3e} > tol {tol.flatten()[i].item():.3e} at "
                                    f"flat index {i} (ref {ref.flatten()[i].item():.3e}); max err {e.max().item():.3e}")


def randn(*shape, dtype=torch.float32, device="cpu", requires_grad=False, scale=1.0, transposed=False):
    """Random normal input; transposed=True returns a non-contiguous view with the same shape."""
    if transposed and len(shape) >= 2:
        base = torch.randn(*shape[:-2], shape[-1], shape[-2], device=device) * scale
        t = base.to(dtype).transpose(-1, -2)
    else:
        t = (torch.randn(*shape, device=device) * scale).to(dtype)
    return t.requires_grad_(requires_grad)


def grads(outputs, inputs, grad_outputs):
    """autograd.grad with None for inputs that do not require grad."""
    outputs = outputs if isinstance(outputs, (tuple, list)) else (outputs,)
    grad_outputs = grad_outputs if isinstance(grad_outputs, (tuple, list)) else (grad_outputs,)
    want = [i for i in inputs if i is not None and i.requires_grad]
    got = iter(torch.autograd.grad(outputs, want, grad_outputs, allow_unused=True))
    return [next(got) if (i is not None and i.requires_grad) else None for i in inputs]


def fp64_copy(*ts):
    return [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in ts]


def run_without_host_sync_twice(run):
    """GPU: run() once to compile, then under sync-debug "error" (any host sync raises), then again; returns
    both results so the caller can check they are bitwise equal (determinism)."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        first = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    return first, run()


def assert_no_sync_and_deterministic(run):
    first, second = run_without_host_sync_twice(run)
    for a, c in zip(first, second, strict=True):
        assert torch.equal(a, c)


class KernelSpy:
    """Stands in for a Triton kernel (monkeypatched over the module's name): records each launch's keyword
    arguments in `calls`, then launches the real one."""

    def __init__(self, kernel):
        self.kernel, self.calls = kernel, []

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.calls.append(kwargs)
            return self.kernel[grid](*args, **kwargs)
        return launch
