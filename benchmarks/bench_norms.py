"""RMSNorm, fused residual add + RMSNorm, LayerNorm: tigon vs eager (the HF formula) vs torch.compile
vs Liger-Kernel, at x [16384, 4096] bf16 (Llama-3-8B: 4 x 4096 tokens), plus a hidden-size sweep of
rms_norm at 64M elements, and rms_norm over head_dim at the QK-norm's shape (524288 rows of 64, 128, 256).

Byte models (minimal traffic, weights and per-row stats ignored: < 0.1%), n = rows * hidden * 2 bytes:
rms_norm / layer_norm fwd reads x, writes y (2n); fwd+bwd adds reading x, dy and writing dx (5n);
add_rms_norm fwd reads x, r and writes y, s (4n); fwd+bwd adds reading dy, ds, s, writing dx (8n).
"""

import _harness as H
import torch
from _harness import Call

EPS = 1e-6
LN_EPS = 1e-5
SHAPE = (16384, 4096)
QUICK_SHAPE = (32, 256)
HIDDEN_SWEEP = (1024, 2048, 4096, 8192, 16384)
# QK-norm (Qwen3, Gemma-3, OLMo-2): each head's q normalized over head_dim; 8 x 2048 tokens, 32 heads
HEAD_ROWS, HEAD_DIMS = 8 * 2048 * 32, (64, 128, 256)
SWEEP_ELEMS = 64 * 2**20
BF16 = torch.bfloat16


def _gen(ctx, seed):
    return torch.Generator(device=ctx.device).manual_seed(seed)


def _weight(ctx, h, g, base=1.0):
    return (base + 0.1 * torch.randn(h, device=ctx.device, generator=g)).to(BF16).requires_grad_()


def _liger_module(ctx, path_candidates, *args, **kwargs):
    H.need_cuda(ctx, "liger")
    cls = H.import_first(*path_candidates)
    return cls(*args, **kwargs).to(ctx.device, BF16)


def _fp64(*ts):
    return [t.detach().double().requires_grad_() for t in ts]


# ----------------------------------------------------------------------------- rms_norm


def rms_norm_providers(ctx, x, w, dy_buf, restore):
    from tigon import ops
    from tigon.ops import reference as ref

    def tigon():
        return Call(lambda: ops.rms_norm(x, w, EPS), (x, w), (dy_buf,), restore)

    def eager():
        return Call(lambda: ref.eager_rms_norm(x, w, EPS), (x, w), (dy_buf,), restore)

    def compiled():
        f = H.compiled(ctx, ref.eager_rms_norm, dynamic=False)
        return Call(lambda: f(x, w, EPS), (x, w), (dy_buf,), restore)

    def liger():
        # LigerRMSNorm's default in_place=True writes dx into dy: dy is restored before every call.
        m = _liger_module(ctx, ["liger_kernel.transformers:LigerRMSNorm"], x.shape[-1], eps=EPS)
        with torch.no_grad():
            m.weight.copy_(w)
        return Call(lambda: m(x), (x, m.weight), (dy_buf,), restore)

    return [("tigon", tigon), ("eager", eager), ("torch.compile", compiled), ("liger", liger)]


def run_rms_norm(ctx):
    from tigon.ops import reference as ref

    rows, h = QUICK_SHAPE if ctx.quick else SHAPE
    g = _gen(ctx, 0)
    x = H.randn((rows, h), ctx, requires_grad=True, gen=g)
    w = _weight(ctx, h, g)
    dy = H.randn((rows, h), ctx, gen=g)
    dy_buf = dy.clone()
    xr, wr = _fp64(x, w)
    yr = ref.rms_norm(xr, wr, EPS)
    refs = [yr.detach(), *torch.autograd.grad(yr, (xr, wr), dy.double())]
    del xr, wr, yr

    def check(outs, grads):
        return H.errors(("y", "dx", "dw"), [outs[0], grads[0], grads[1]], refs)

    n = rows * h * 2
    H.measure(ctx, "rms_norm", f"x [{rows}, {h}] bf16, weight [{h}]",
              rms_norm_providers(ctx, x, w, dy_buf, [(dy_buf, dy)]), bytes_fwd=2 * n, bytes_fb=5 * n,
              check=check, extra={"model": "fwd 2n, fwd+bwd 5n bytes (n = x bytes)"})


def _rms_norm_sweep(ctx, shapes, group, xlabel, what):
    """rms_norm fwd+bwd at each (rows, hidden) of `shapes`, one row of the `group` table each (x = hidden)."""
    for rows, h in shapes:
        if ctx.remaining() < 10:
            ctx.note(f"{group}: {what} {h} and up skipped (time budget)")
            break
        g = _gen(ctx, h)
        x = H.randn((rows, h), ctx, requires_grad=True, gen=g)
        w = _weight(ctx, h, g)
        dy = H.randn((rows, h), ctx, gen=g)
        dy_buf = dy.clone()
        n = rows * h * 2
        H.measure(ctx, "rms_norm", f"x [{rows}, {h}]", rms_norm_providers(ctx, x, w, dy_buf, [(dy_buf, dy)]),
                  bytes_fwd=2 * n, bytes_fb=5 * n, host_column=False, need_s=5.0, group=group, x=h,
                  extra={"xlabel": xlabel})
        del x, w, dy, dy_buf
        H.free(ctx)


def run_rms_norm_hidden_sweep(ctx):
    total = 8192 if ctx.quick else SWEEP_ELEMS
    _rms_norm_sweep(ctx, [(total // h, h) for h in ((256, 512) if ctx.quick else HIDDEN_SWEEP)],
                    "rms_norm hidden-size sweep (fwd+bwd, 64M elements bf16)", "hidden", "H")


def run_rms_norm_heads(ctx):
    """rms_norm over head_dim, the QK-norm's shape: 524288 rows of 64, 128 or 256."""
    shapes = [(64, h) for h in (16, 64)] if ctx.quick else [(HEAD_ROWS, h) for h in HEAD_DIMS]
    _rms_norm_sweep(ctx, shapes, "rms_norm over head_dim (QK-norm: 8 x 2048 tokens x 32 heads, bf16)", "head_dim",
                    "head_dim")


# ----------------------------------------------------------------------------- add_rms_norm


def run_add_rms_norm(ctx):
    from tigon import ops
    from tigon.ops import reference as ref

    rows, h = QUICK_SHAPE if ctx.quick else SHAPE
    g = _gen(ctx, 1)
    x = H.randn((rows, h), ctx, requires_grad=True, gen=g)
    r = H.randn((rows, h), ctx, requires_grad=True, gen=g)
    w = _weight(ctx, h, g)
    dy, ds = H.randn((rows, h), ctx, gen=g), H.randn((rows, h), ctx, gen=g)
    dy_buf, ds_buf = dy.clone(), ds.clone()
    restore = [(dy_buf, dy), (ds_buf, ds)]
    gos = (dy_buf, ds_buf)
    xr, rr, wr = _fp64(x, r, w)
    yr, sr = ref.add_rms_norm(xr, rr, wr, EPS)
    refs = [yr.detach(), sr.detach(), *torch.autograd.grad((yr, sr), (xr, rr, wr), (dy.double(), ds.double()))]
    del xr, rr, wr, yr, sr

    def check(outs, grads):
        return H.errors(("y", "s", "dx", "dr", "dw"), [*outs[:2], *grads[:3]], refs)

    def tigon():
        return Call(lambda: ops.add_rms_norm(x, r, w, EPS), (x, r, w), gos, restore)

    def eager():
        return Call(lambda: ref.eager_add_rms_norm(x, r, w, EPS), (x, r, w), gos, restore)

    def compiled():
        f = H.compiled(ctx, ref.eager_add_rms_norm, dynamic=False)
        return Call(lambda: f(x, r, w, EPS), (x, r, w), gos, restore)

    def liger():
        m = _liger_module(ctx, ["liger_kernel.transformers:LigerFusedAddRMSNorm",
                                "liger_kernel.transformers.fused_add_rms_norm:LigerFusedAddRMSNorm"], h, eps=EPS)
        with torch.no_grad():
            m.weight.copy_(w)
        return Call(lambda: m(x, r), (x, r, m.weight), gos, restore)

    n = rows * h * 2
    H.measure(ctx, "add_rms_norm", f"x, residual [{rows}, {h}] bf16, weight [{h}]",
              [("tigon", tigon), ("eager", eager), ("torch.compile", compiled), ("liger", liger)],
              bytes_fwd=4 * n, bytes_fb=8 * n, check=check,
              extra={"model": "fwd 4n (read x, r; write y, s), fwd+bwd 8n bytes"})


# ----------------------------------------------------------------------------- layer_norm


def run_layer_norm(ctx):
    from tigon import ops
    from tigon.ops import reference as ref

    rows, h = QUICK_SHAPE if ctx.quick else SHAPE
    g = _gen(ctx, 2)
    x = H.randn((rows, h), ctx, requires_grad=True, gen=g)
    w = _weight(ctx, h, g)
    b = _weight(ctx, h, g, base=0.0)
    dy = H.randn((rows, h), ctx, gen=g)
    dy_buf = dy.clone()
    restore = [(dy_buf, dy)]
    xr, wr, br = _fp64(x, w, b)
    yr = torch.nn.functional.layer_norm(xr, (h,), wr, br, LN_EPS)
    refs = [yr.detach(), *torch.autograd.grad(yr, (xr, wr, br), dy.double())]
    del xr, wr, br, yr

    def check(outs, grads):
        return H.errors(("y", "dx", "dw", "db"), [outs[0], *grads[:3]], refs)

    def tigon():
        return Call(lambda: ops.layer_norm(x, w, b, LN_EPS), (x, w, b), (dy_buf,), restore)

    def eager():
        return Call(lambda: ref.eager_layer_norm(x, w, b, LN_EPS), (x, w, b), (dy_buf,), restore)

    def compiled():
        f = H.compiled(ctx, ref.eager_layer_norm, dynamic=False)
        return Call(lambda: f(x, w, b, LN_EPS), (x, w, b), (dy_buf,), restore)

    def liger():
        m = _liger_module(ctx, ["liger_kernel.transformers:LigerLayerNorm"], h, eps=LN_EPS)
        with torch.no_grad():
            m.weight.copy_(w)
            m.bias.copy_(b)
        return Call(lambda: m(x), (x, m.weight, m.bias), (dy_buf,), restore)

    n = rows * h * 2
    H.measure(ctx, "layer_norm", f"x [{rows}, {h}] bf16, weight and bias [{h}]",
              [("tigon", tigon), ("eager", eager), ("torch.compile", compiled), ("liger", liger)],
              bytes_fwd=2 * n, bytes_fb=5 * n, check=check,
              extra={"model": "fwd 2n, fwd+bwd 5n bytes (n = x bytes)"})


SECTIONS = {
    "rms_norm": run_rms_norm,
    "add_rms_norm": run_add_rms_norm,
    "layer_norm": run_layer_norm,
    "rms_norm_hidden_sweep": run_rms_norm_hidden_sweep,
    "rms_norm_heads": run_rms_norm_heads,
}

if __name__ == "__main__":
    raise SystemExit(H.standalone(SECTIONS))
