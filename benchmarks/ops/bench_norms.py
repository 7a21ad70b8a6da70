"""RMSNorm, fused residual add + RMSNorm, LayerNorm: tigon vs eager (the HF formula) vs torch.compile
vs Liger-Kernel, at x [16384, 4096] bf16 (Llama-3-8B: 4 x 4096 tokens), plus a hidden-size sweep of
rms_norm at 64M elements, rms_norm over head_dim at the QK-norm's shape (524288 rows of 64, 128, 256), and
qk_norm_rope (Qwen3's per-head q/k RMSNorm + RoPE, fused) beside the two ops run one after the other.

Byte models (minimal traffic, weights and per-row stats ignored: < 0.1%), n = rows * hidden * 2 bytes:
rms_norm / layer_norm fwd reads x, writes y (2n); fwd+bwd adds reading x, dy and writing dx (5n);
add_rms_norm fwd reads x, r and writes y, s (4n); fwd+bwd adds reading dy, ds, s, writing dx (8n).
qk_norm_rope, n = (q + k) bytes: fwd reads q, k and writes q_embed, k_embed (2n); fwd+bwd adds reading q, k,
dq_embed, dk_embed and writing dq, dk (5n). cos/sin [B, T, D] are left out (2 / (Hq + Hk) of n a pass: 5% of n
at 32 + 8 heads, so the model is ~2% under the true floor), and so are the weights. Every provider's GB/s is
against this one model: the floor of the fused computation.
"""

import torch

from benchmarks.tools import harness as H
from benchmarks.tools.harness import Call

EPS = 1e-6
LN_EPS = 1e-5
SHAPE = (16384, 4096)
QUICK_SHAPE = (32, 256)
HIDDEN_SWEEP = (1024, 2048, 4096, 8192, 16384)
# QK-norm (Qwen3, Gemma-3, OLMo-2): each head's q normalized over head_dim; 8 x 2048 tokens, 32 heads
HEAD_ROWS, HEAD_DIMS = 8 * 2048 * 32, (64, 128, 256)
SWEEP_ELEMS = 64 * 2**20
# qk_norm_rope: Qwen3's attention input, 8 x 2048 tokens, 32 q heads and 8 kv heads; head_dim 64 (the 1.5B training
# body) and 128 (Qwen3-8B's heads)
QK_CASES = (dict(B=8, T=2048, Hq=32, Hk=8, D=64, label="Qwen3 1.5B"),
            dict(B=8, T=2048, Hq=32, Hk=8, D=128, label="Qwen3-8B heads"),
            dict(B=8, T=2048, Hq=8, Hk=4, D=256, label="Gemma-3 4B heads"))
QK_QUICK_CASES = (dict(B=1, T=8, Hq=4, Hk=2, D=16, label="quick"),)
QWEN3_THETA = 1_000_000.0
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


# ----------------------------------------------------------------------------- qk_norm_rope


def _qwen3_cos_sin(ctx, B, T, D, dtype=BF16):
    """cos, sin [B, T, D] as HF's rotary embedding builds them: freqs = positions x inv_freq in fp32,
    emb = cat(freqs, freqs), cos = emb.cos() then cast to the activations' dtype."""
    inv_freq = 1.0 / (QWEN3_THETA ** (torch.arange(0, D, 2, device=ctx.device, dtype=torch.float32) / D))
    freqs = torch.outer(torch.arange(T, device=ctx.device, dtype=torch.float32), inv_freq)
    emb = torch.cat((freqs, freqs), dim=-1)[None].expand(B, T, D)
    return emb.cos().to(dtype).contiguous(), emb.sin().to(dtype).contiguous()


def hf_qk_norm_rope(qp, kp, wq, wk, cos, sin):
    """Qwen3Attention's code from the projections' outputs: q_norm(q_proj(x).view(B, T, -1, D)).transpose(1, 2)
    (Qwen3RMSNorm: fp32 variance, rsqrt, .to(input dtype), weight *), the same for k, then
    apply_rotary_pos_emb (rotate_half, unsqueeze_dim=1). Returns q_embed, k_embed [B, H, T, D]."""
    from tigon.ops import reference as ref

    B, T, D = qp.shape[0], qp.shape[1], wq.shape[0]
    q = ref.eager_rms_norm(qp.view(B, T, -1, D), wq, EPS).transpose(1, 2)
    k = ref.eager_rms_norm(kp.view(B, T, -1, D), wk, EPS).transpose(1, 2)
    return ref.eager_apply_rope(q, k, cos, sin)


def _bthd(pair):
    """[B, H, T, D] outputs seen as [B, T, H, D] (a view): every provider's outputs and grads in one layout."""
    return tuple(o.transpose(1, 2) for o in pair)


def _qk_norm_rope_case(ctx, B, T, Hq, Hk, D, label):
    from tigon import ops
    from tigon.ops import reference as ref

    g = _gen(ctx, 4 + D)
    # The projections' outputs [B, T, H * D]; every provider views them as [B, T, H, D], as Qwen3Attention does.
    qp = H.randn((B, T, Hq * D), ctx, requires_grad=True, gen=g)
    kp = H.randn((B, T, Hk * D), ctx, requires_grad=True, gen=g)
    wq, wk = _weight(ctx, D, g), _weight(ctx, D, g)
    cos, sin = _qwen3_cos_sin(ctx, B, T, D)
    dq, dk = H.randn((B, T, Hq, D), ctx, gen=g), H.randn((B, T, Hk, D), ctx, gen=g)
    dq_buf, dk_buf = dq.clone(), dk.clone()
    # Liger's rope backward rotates the output grads in place and its rms_norm backward (in_place=True, the
    # module's default) writes dx over them: both are restored before every call (untimed).
    restore = [(dq_buf, dq), (dk_buf, dk)]
    gos = (dq_buf, dk_buf)
    inputs = (qp, kp, wq, wk)

    def qv():
        return qp.view(B, T, Hq, D)

    def kv():
        return kp.view(B, T, Hk, D)

    qr, kr, wqr, wkr = _fp64(qp, kp, wq, wk)
    outs = ref.qk_norm_rope(qr.view(B, T, Hq, D), kr.view(B, T, Hk, D), wqr, wkr, cos.double(), sin.double(), EPS)
    refs = [o.detach() for o in outs] + list(torch.autograd.grad(outs, (qr, kr, wqr, wkr), (dq.double(), dk.double())))
    del qr, kr, wqr, wkr, outs

    def check(outs, grads):
        return H.errors(("q", "k", "dq", "dk", "dwq", "dwk"), [*outs[:2], *grads[:4]], refs)

    def tigon():
        return Call(lambda: ops.qk_norm_rope(qv(), kv(), wq, wk, cos, sin, EPS), inputs, gos, restore)

    def separate():
        def fn():
            qn, kn = ops.rms_norm(qv(), wq, EPS), ops.rms_norm(kv(), wk, EPS)
            return _bthd(ops.apply_rope(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin))

        return Call(fn, inputs, gos, restore)

    def compiled():
        f = H.compiled(ctx, hf_qk_norm_rope, dynamic=False)
        return Call(lambda: _bthd(f(qp, kp, wq, wk, cos, sin)), inputs, gos, restore)

    def liger():
        H.need_cuda(ctx, "liger")
        norm = H.import_first("liger_kernel.ops.rms_norm:LigerRMSNormFunction")
        rope = H.import_first("liger_kernel.transformers.rope:liger_rotary_pos_emb",
                              "liger_kernel.transformers:liger_rotary_pos_emb")

        def fn():  # what apply_liger_kernel_to_qwen3 runs: LigerRMSNorm's defaults, then liger_rotary_pos_emb
            qn = norm.apply(qv(), wq, EPS, 0.0, "llama", True, None)
            kn = norm.apply(kv(), wk, EPS, 0.0, "llama", True, None)
            return _bthd(rope(qn.transpose(1, 2), kn.transpose(1, 2), cos, sin))

        return Call(fn, inputs, gos, restore)

    def eager():
        return Call(lambda: _bthd(hf_qk_norm_rope(qp, kp, wq, wk, cos, sin)), inputs, gos, restore)

    n = (B * T * Hq * D + B * T * Hk * D) * 2
    H.measure(ctx, "qk_norm_rope", f"q [{B}, {T}, {Hq}, {D}], k [{B}, {T}, {Hk}, {D}] (views of q_proj / k_proj "
              f"outputs), cos/sin [{B}, {T}, {D}] bf16 ({label})",
              [("tigon", tigon), ("tigon_separate", separate), ("torch.compile", compiled), ("liger", liger),
               ("eager", eager)],
              bytes_fwd=2 * n, bytes_fb=5 * n, check=check,
              extra={"model": "fwd 2n (read q, k; write q_embed, k_embed), fwd+bwd 5n (+ read q, k, dq_embed, "
                              "dk_embed; write dq, dk); n = q + k bytes, cos/sin and weights left out; the fused "
                              "floor, for every provider"})


def run_qk_norm_rope(ctx):
    """qk_norm_rope fused vs rms_norm + apply_rope (tigon's two ops, HF eager, torch.compile, Liger) at Qwen3's
    attention-input shapes: fwd (the training forward) and fwd+bwd (grads of q, k and both weights)."""
    for case in QK_QUICK_CASES if ctx.quick else QK_CASES:
        if ctx.remaining() < 10:
            ctx.note(f"qk_norm_rope: head_dim {case['D']} and up skipped (time budget)")
            break
        _qk_norm_rope_case(ctx, **case)
        H.free(ctx)


SECTIONS = {
    "rms_norm": run_rms_norm,
    "add_rms_norm": run_add_rms_norm,
    "layer_norm": run_layer_norm,
    "rms_norm_hidden_sweep": run_rms_norm_hidden_sweep,
    "rms_norm_heads": run_rms_norm_heads,
    "qk_norm_rope": run_qk_norm_rope,
}

def main(argv=None) -> int:
    return H.standalone(SECTIONS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
