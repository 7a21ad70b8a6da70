"""Shared test helpers: the error bound of the op contract and the input makers.

The bound: against an fp64 reference, err(kernel) <= 2 * err(torch in dtype) + atol, where err is the
max abs error and atol = 4 * unit roundoff(dtype) * max|ref| covers the case where torch in dtype is
exact by luck (its error is then 0). Both sides see the same bf16/fp16 inputs.
"""

import torch

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float64: 2.0**-53}


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
