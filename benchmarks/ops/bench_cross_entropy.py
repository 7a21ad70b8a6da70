"""Cross entropy on logits [4096, 128256] bf16 and fused linear cross entropy (FLCE) on h [16384, 4096],
W [128256, 4096] bf16 (Llama-3-8B's head), plus Qwen-2.5-7B's (V 151936, H 3584) and Gemma-3's
(V 262144, H 2304) heads, and a token sweep 1k..64k. Mean reduction, targets uniform over the vocabulary,
no ignored token; the lm_head weight has std 0.02 (HF's init).

Providers: tigon (also with inplace_backward=True for CE, accum_dtype=torch.float32 and 128 MiB chunks
(LinearCrossEntropyConfig(chunk_bytes=128 << 20, min_rows=0), the chunking before 192 MiB and 768 rows) for
FLCE), eager
(HF's path: logits.float() then F.cross_entropy), torch.compile of it, Liger (LigerCrossEntropyLoss with
bf16 and with fp32-upcast logits; LigerFusedLinearCrossEntropyLoss, also with accum_dtype=fp32 where this
Liger takes it) and cut_cross_entropy.linear_cross_entropy (defaults).

Models: CE reads the logits once (fwd, n bytes) and writes dlogits in bf16 (fwd+bwd 2n). FLCE is three
GEMMs of 2 * BT * H * V FLOP each (logits, dh, dW); its floor is those three bf16 GEMMs timed in this run.
Errors: CE against fp64; FLCE (loss, dh, dW) against an fp32 reference computed chunk by chunk.
flce_completion_only: the 8B head with the first half of every 2048-token sequence labelled -100 (completion-only
SFT); tigon with and without skip_ignored=True; its floor is the three GEMMs over the labelled rows.
"""

import torch
import torch.nn.functional as F

from benchmarks.tools import harness as H
from benchmarks.tools.harness import Call

BF16 = torch.bfloat16
CE_SHAPE = (4096, 128256)
CE_QUICK = (8, 1000)
FLCE = dict(BT=16384, H=4096, V=128256)
FLCE_QUICK = dict(BT=16, H=64, V=300)
FLCE_HEADS = [dict(BT=16384, H=3584, V=151936, name="Qwen-2.5-7B head"),
              dict(BT=16384, H=2304, V=262144, name="Gemma-3 head")]
FLCE_HEADS_QUICK = [dict(BT=16, H=48, V=500, name="quick head")]
SWEEP_TOKENS = (1024, 2048, 4096, 8192, 16384, 32768, 65536)
SWEEP_QUICK = (8, 16, 32)


def _gen(ctx, seed):
    return torch.Generator(device=ctx.device).manual_seed(seed)


# ----------------------------------------------------------------------------- cross entropy


def run_cross_entropy(ctx):
    from tigon import ops
    from tigon.ops import reference as ref

    bt, v = CE_QUICK if ctx.quick else CE_SHAPE
    g = _gen(ctx, 5)
    leaf = H.randn((bt, v), ctx, requires_grad=True, gen=g)
    logits = leaf.clone()  # an lm_head's output, not a leaf: inplace_backward may write over it
    l0 = logits.detach().clone()
    tgt = torch.randint(0, v, (bt,), device=ctx.device, generator=g)
    restore = [(logits, l0)]  # Liger writes the gradient into the logits (in its forward)
    lr = l0.double().requires_grad_()
    loss_r = F.cross_entropy(lr, tgt)
    refs = [loss_r.detach(), torch.autograd.grad(loss_r, lr)[0]]
    del lr, loss_r

    def check(outs, grads):
        return H.errors(("loss", "dlogits"), [outs[0], grads[0]], refs)

    def tigon():
        return Call(lambda: ops.cross_entropy(logits, tgt), (logits,), None, restore)

    def tigon_inplace():
        f = H.with_kwargs(ops.cross_entropy, "tigon cross_entropy", inplace_backward=True)
        return Call(lambda: f(logits, tgt), (logits,), None, restore)

    def eager():
        return Call(lambda: ref.eager_cross_entropy(logits, tgt), (logits,), None, restore)

    def compiled():
        f = H.compiled(ctx, ref.eager_cross_entropy, dynamic=False)
        return Call(lambda: f(logits, tgt), (logits,), None, restore)

    def _liger(upcast):
        H.need_cuda(ctx, "liger")
        loss = H.import_first("liger_kernel.transformers:LigerCrossEntropyLoss")()
        if upcast:
            return Call(lambda: loss(logits.float(), tgt), (logits,), None, restore)
        return Call(lambda: loss(logits, tgt), (logits,), None, restore)

    n = bt * v * 2
    H.measure(ctx, "cross_entropy", f"logits [{bt}, {v}] bf16, mean",
              [("tigon", tigon), ("tigon inplace_backward", tigon_inplace), ("eager", eager),
               ("torch.compile", compiled), ("liger", lambda: _liger(False)),
               ("liger, fp32-upcast logits (HF patch path)", lambda: _liger(True))],
              bytes_fwd=n, bytes_fb=2 * n, check=check,
              extra={"model": "fwd reads the logits (n), fwd+bwd also writes dlogits (2n)"})


# ----------------------------------------------------------------------------- fused linear cross entropy


def flce_eager(h, w, t):
    """HF's path (reference.eager_cross_entropy after the lm_head): the bf16 GEMM, logits.float(),
    F.cross_entropy. Written out here so torch.compile traces no import."""
    return F.cross_entropy(F.linear(h, w).float(), t, ignore_index=-100)


def flce_reference(h, w, t, chunk=2048):
    """fp32 loss, dh, dW of mean cross_entropy(h @ w.T, t), chunked over rows so the fp32 logits of a
    262k vocabulary never exist whole (same math as reference.linear_cross_entropy under autograd)."""
    hf, wf = h.detach().float(), w.detach().float()
    keep = (t != -100).float()
    n = keep.sum()
    loss = torch.zeros((), device=h.device, dtype=torch.float64)
    dh = torch.empty_like(hf)
    dw = torch.zeros_like(wf)
    for s in range(0, t.numel(), chunk):
        lg = hf[s:s + chunk] @ wf.t()
        ts, ks = t[s:s + chunk].clamp(min=0), keep[s:s + chunk]
        lse = torch.logsumexp(lg, dim=-1)
        loss += ((lse - lg.gather(1, ts[:, None]).squeeze(1)) * ks).double().sum()
        p = torch.exp_(lg.sub_(lse[:, None]))
        p[torch.arange(p.shape[0], device=p.device), ts] -= 1.0
        p *= (ks / n)[:, None]
        dh[s:s + chunk] = p @ wf
        dw.addmm_(p.t(), hf[s:s + chunk])
        del lg, p
    return (loss / n).float(), dh, dw


def flce_providers(ctx, h, w, tgt, *, variants=True, compiled_fn=None, skip_ignored=False):
    from tigon import ops

    inputs = (h, w)

    def tigon():
        return Call(lambda: ops.linear_cross_entropy(h, w, tgt), inputs)

    def tigon_skip():
        return Call(lambda: ops.linear_cross_entropy(h, w, tgt, skip_ignored=True), inputs)

    def tigon_fp32():
        f = H.with_kwargs(ops.linear_cross_entropy, "tigon linear_cross_entropy", accum_dtype=torch.float32)
        return Call(lambda: f(h, w, tgt), inputs)

    def tigon_chunk(mib):
        from tigon.ops.config import LinearCrossEntropyConfig

        cfg = LinearCrossEntropyConfig(chunk_bytes=mib << 20, min_rows=0)
        return lambda: Call(lambda: ops.linear_cross_entropy(h, w, tgt, config=cfg), inputs)

    def eager():
        return Call(lambda: flce_eager(h, w, tgt), inputs)

    def compiled():
        f = compiled_fn() if compiled_fn else H.compiled(ctx, flce_eager, dynamic=False)
        return Call(lambda: f(h, w, tgt), inputs)

    def _liger(**kw):
        H.need_cuda(ctx, "liger")
        cls = H.import_first("liger_kernel.transformers:LigerFusedLinearCrossEntropyLoss")
        try:
            loss = cls(**kw)
        except TypeError as e:
            raise H.Skip(f"liger: {H.short_error(e, 120)}") from e
        return Call(lambda: loss(w, h, tgt), inputs)

    def cce():
        H.need_cuda(ctx, "cut_cross_entropy")
        fn = H.import_first("cut_cross_entropy:linear_cross_entropy")
        return Call(lambda: fn(h, w, tgt), inputs)

    provs = [("tigon", tigon)]
    if skip_ignored:
        provs.append(("tigon skip_ignored=True", tigon_skip))
    if variants:
        provs.append(("tigon accum_dtype=fp32", tigon_fp32))
        provs.append(("tigon chunk_bytes=128 MiB", tigon_chunk(128)))
    provs += [("eager", eager), ("torch.compile", compiled), ("liger", _liger)]
    if variants:
        provs.append(("liger accum_dtype=fp32", lambda: _liger(accum_dtype=torch.float32)))
    provs.append(("cut_cross_entropy", cce))
    return provs


_DYNAMIC: dict = {}


def _flce_dynamic(ctx):
    """One dynamic-shape compile of the eager FLCE, shared by the other heads and the token sweep: a
    static compile per shape would cost ~20 s each (the Llama-3-8B case keeps its static compile)."""
    if "f" not in _DYNAMIC:
        f = H.compiled(ctx, flce_eager, dynamic=True)
        import torch.fx.experimental._config as fx_config

        if hasattr(fx_config, "use_duck_shape"):  # 4096 tokens x H 4096 must not tie the two sizes together
            fx_config.use_duck_shape = False
        _DYNAMIC["f"] = f
    return _DYNAMIC["f"]


def _flce_inputs(ctx, bt, hid, v, seed):
    g = _gen(ctx, seed)
    h = H.randn((bt, hid), ctx, requires_grad=True, gen=g)
    w = H.randn((v, hid), ctx, std=0.02, requires_grad=True, gen=g)
    tgt = torch.randint(0, v, (bt,), device=ctx.device, generator=g)
    return h, w, tgt


def _floor(ctx, op, case, h, w, flops, group=None, x=None, min_rep=10):
    """The 3 GEMMs of FLCE in bf16 (logits = h W^T, dh = dlogits W, dW = dlogits^T h), timed here."""
    hd, wd = h.detach(), w.detach()
    lg = H.randn((h.shape[0], w.shape[0]), ctx)
    gemms = {"logits_gemm": lambda: hd @ wd.t(), "dh_gemm": lambda: lg @ wd, "dW_gemm": lambda: lg.t() @ hd}
    floor = H.record_floor(ctx, op, case, gemms, flops, group=group, x=x, min_rep=min_rep)
    gemms.clear()
    return floor


def _flce_case(ctx, bt, hid, v, seed, label, *, full, compiled_fn=None, prompt_share=0.0):
    """prompt_share > 0: that share of every 2048-token sequence (its start, the prompt) is labelled -100, as in
    completion-only SFT; the floor is then the three GEMMs over the labelled rows only, and tigon also runs with
    skip_ignored=True."""
    torch.backends.cuda.matmul.allow_tf32 = False  # the fp32 reference must be fp32
    h, w, tgt = _flce_inputs(ctx, bt, hid, v, seed)
    seq = min(2048, bt)
    tgt.view(-1, seq)[:, : int(seq * prompt_share)] = -100
    loss_r, dh_r, dw_r = flce_reference(h, w, tgt)
    H.free(ctx)

    def check(outs, grads):
        return H.errors(("loss", "dh", "dW"), [outs[0], grads[0], grads[1]], [loss_r, dh_r, dw_r])

    kept = int((tgt != -100).sum())
    flops = 3 * 2 * kept * hid * v
    case = f"h [{bt}, {hid}], W [{v}, {hid}] bf16, mean ({label})"
    floor = _floor(ctx, "linear_cross_entropy", case, h[:kept], w, flops) if ctx.cuda else None
    what = "the 3 bf16 GEMMs timed here" + (f" on the {kept} labelled rows" if kept < bt else "")
    H.measure(ctx, "linear_cross_entropy", case,
              flce_providers(ctx, h, w, tgt, compiled_fn=compiled_fn, variants=not prompt_share,
                             skip_ignored=bool(prompt_share)),
              flops_fb=flops, floor_us=floor,
              check=check, do_fwd=full, host_column=full, min_rep=10, host_min_rep=4,
              rep_ms=400.0, need_s=25.0,
              extra={"model": f"3 GEMMs, {flops / 1e12:.2f} TFLOP; floor = {what}"})


def run_linear_cross_entropy(ctx):
    s = FLCE_QUICK if ctx.quick else FLCE
    _flce_case(ctx, s["BT"], s["H"], s["V"], 6, "Llama-3-8B head", full=True)


def run_flce_completion_only(ctx):
    """The Llama-3-8B head with the first half of every 2048-token sequence labelled -100."""
    s = FLCE_QUICK if ctx.quick else FLCE
    _flce_case(ctx, s["BT"], s["H"], s["V"], 6, "Llama-3-8B head, the first half of each sequence labelled -100",
               full=False, prompt_share=0.5)


def run_flce_heads(ctx):
    for i, s in enumerate(FLCE_HEADS_QUICK if ctx.quick else FLCE_HEADS):
        if ctx.remaining() < 40:
            ctx.note(f"linear_cross_entropy {s['name']}: skipped (time budget)")
            continue
        _flce_case(ctx, s["BT"], s["H"], s["V"], 7 + i, f"{s['name']}; torch.compile with dynamic shapes",
                   full=False, compiled_fn=lambda: _flce_dynamic(ctx))
        H.free(ctx)


def run_flce_token_sweep(ctx):
    """fwd+bwd time and peak memory per provider from 1k to 64k tokens (H 4096, V 128256)."""
    s = FLCE_QUICK if ctx.quick else FLCE
    hid, v = s["H"], s["V"]
    group = f"linear_cross_entropy token sweep (fwd+bwd; H {hid}, V {v}; torch.compile with dynamic shapes)"
    g = _gen(ctx, 8)
    w = H.randn((v, hid), ctx, std=0.02, requires_grad=True, gen=g)

    for bt in SWEEP_QUICK if ctx.quick else SWEEP_TOKENS:
        if ctx.remaining() < 15:
            ctx.note(f"{group}: {bt} tokens and up skipped (time budget)")
            break
        h = H.randn((bt, hid), ctx, requires_grad=True, gen=g)
        tgt = torch.randint(0, v, (bt,), device=ctx.device, generator=g)
        flops = 6 * bt * hid * v
        case = f"{bt} tokens"
        if ctx.cuda:
            _floor(ctx, "linear_cross_entropy", case, h, w, flops, group=group, x=bt, min_rep=6)
        H.measure(ctx, "linear_cross_entropy", case, flce_providers(ctx, h, w, tgt, variants=False,
                                                                    compiled_fn=lambda: _flce_dynamic(ctx)),
                  flops_fb=flops, do_fwd=False, host_column=False, min_rep=6, rep_ms=250.0, need_s=10.0,
                  group=group, x=bt, extra={"xlabel": "tokens"})
        del h, tgt
        H.free(ctx)


SECTIONS = {
    "cross_entropy": run_cross_entropy,
    "linear_cross_entropy": run_linear_cross_entropy,
    "flce_completion_only": run_flce_completion_only,
    "flce_heads": run_flce_heads,
    "flce_token_sweep": run_flce_token_sweep,
}

def main(argv=None) -> int:
    return H.standalone(SECTIONS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
