"""Fused-linear preference / RL / distillation losses at model head shapes, bf16, forward + backward:

- DPO (sigmoid) on Llama-3-8B's head (H 4096, V 128256), 4 pairs x 2048 tokens, reference log-probs from a
  reference head (reference hidden states and weight, no gradient) in the same call;
- GRPO (dapo, beta 0.04, old and reference per-token log-probs given) on Qwen-2.5-7B's head (H 3584, V 151936),
  8 completions x 1024 tokens, temperature 0.9;
- JSD distillation (beta 0.5, hard/soft 0.5/0.5): student H 2048, teacher H 4096, V 128256, 8192 tokens.

Providers, side by side in one call (harness: CUDA-event medians, L2 flushed, run-ahead; peak memory above the
inputs): eager (unfused PyTorch: F.linear in bf16, fp32 log-softmax, the formula), trl (TRL 1.16's chunked
log-prob head + the formula on the [N] log-probs; not for JSD), liger (liger-kernel's chunked loss, compiled as
its default), tigon (tigon.ops). FLOP model: the policy head's 3 GEMMs of 2 N H V each (logits, dh, dW) plus the
reference or teacher head's logits GEMM; Tigon's preference/RL path runs a 4th (the recomputed logits of its grad
pass), docs/ops/losses.md.

`python -m benchmarks losses --out DIR [--smoke] [--budget S]` writes DIR/losses.md and DIR/losses.json.
"""

import argparse
import functools
import os
import sys
import time

import torch
import torch.nn.functional as F

from benchmarks.tools import harness as H
from benchmarks.tools.harness import Call

DPO = dict(P=4, T=2048, H=4096, V=128256)
GRPO = dict(B=8, T=1024, H=3584, V=151936)
JSD = dict(N=8192, HS=2048, HT=4096, V=128256)
DPO_SMOKE, GRPO_SMOKE, JSD_SMOKE = dict(P=2, T=4, H=32, V=97), dict(B=4, T=8, H=32, V=97), dict(N=16, HS=32, HT=48,
                                                                                              V=97)


def _gen(ctx, seed):
    return torch.Generator(device=ctx.device).manual_seed(seed)


def _eager_logp(h, w, t, temperature=1.0):
    logits = F.linear(h, w)
    lp = torch.log_softmax(logits.float() / temperature, -1)
    return lp.gather(-1, t.clamp(min=0).unsqueeze(-1)).squeeze(-1)


def _trl_fn():
    """TRL's chunked log-prob Function, or Skip ("not installed: ...") when it cannot run here. Its forward imports
    trl.trainer.utils at call time, which imports `datasets`; both are imported now, in the provider's factory, so
    a missing peer is a row note before any timing, not an error mid-call."""
    try:
        import trl.kernels
        import trl.trainer.utils  # noqa: F401  (the call-time import)
    except Exception as e:  # noqa: BLE001  (TRL's lazy modules raise ImportError or RuntimeError)
        raise H.Skip(f"not installed: {H.short_error(e, 120)}") from None
    return trl.kernels.ChunkedLogProbFunction


def _trl_logp(h, w, t, temperature=1.0):
    fn = _trl_fn()
    shape = t.shape
    lp = fn.apply(h.reshape(-1, h.shape[-1]), w, None, t.reshape(-1).clamp(min=0), temperature, 32768, None, 1.0,
                  ("log_probs",))[0]
    return lp.view(shape)


def _dpo_from_logps(lp, rlp, mask, P, beta=0.1):
    seq, rseq = (lp * mask).sum(-1), (rlp * mask).sum(-1)
    d = beta * ((seq[:P] - rseq[:P]) - (seq[P:] - rseq[P:]))
    return -F.logsigmoid(d).mean()


def run_dpo(ctx):
    from tigon import ops

    s = DPO_SMOKE if ctx.quick else DPO
    P, T, Hd, V = s["P"], s["T"], s["H"], s["V"]
    g = _gen(ctx, 1)
    h = H.randn((2 * P, T, Hd), ctx, requires_grad=True, gen=g)
    w = H.randn((V, Hd), ctx, std=0.02, requires_grad=True, gen=g)
    rh = H.randn((2 * P, T, Hd), ctx, gen=g)
    rw = H.randn((V, Hd), ctx, std=0.02, gen=g)
    t = torch.randint(0, V, (2 * P, T), device=ctx.device, generator=g)
    t[:, : T // 4] = -100  # the prompt
    mask = (t != -100).float()

    def eager():
        def f():
            with torch.no_grad():
                rlp = _eager_logp(rh, rw, t)
            return _dpo_from_logps(_eager_logp(h, w, t), rlp, mask, P)
        return Call(f, (h, w))

    def trl():
        _trl_fn()

        def f():
            with torch.no_grad():
                rlp = _trl_logp(rh, rw, t)
            return _dpo_from_logps(_trl_logp(h, w, t), rlp, mask, P)
        return Call(f, (h, w))

    def liger():
        cls = H.import_first("liger_kernel.chunked_loss:LigerFusedLinearDPOLoss")
        loss = cls(use_ref_model=True, compiled=ctx.cuda)
        return Call(lambda: loss(w, h, t, ref_input=rh, ref_weight=rw)[0], (h, w))

    def tigon(cfg=None):
        return Call(lambda: ops.fused_linear_dpo(h, w, t, ref_hidden=rh, ref_weight=rw, config=cfg)[0], (h, w))

    N = 2 * P * T
    case = f"{P} pairs x {T}, H {Hd}, V {V}, ref head"
    floor = _floor(ctx, "dpo", case, [(h, w), (rh, rw)], 4 * 2 * N * Hd * V)
    H.measure(ctx, "dpo", case, _peers(eager, trl, liger) + [("tigon", tigon)] + _variants(ctx, tigon),
              flops_fb=4 * 2 * N * Hd * V, floor_us=floor, do_fwd=False)


def run_grpo(ctx):
    from tigon import ops

    s = GRPO_SMOKE if ctx.quick else GRPO
    B, T, Hd, V = s["B"], s["T"], s["H"], s["V"]
    g = _gen(ctx, 2)
    h = H.randn((B, T, Hd), ctx, requires_grad=True, gen=g)
    w = H.randn((V, Hd), ctx, std=0.02, requires_grad=True, gen=g)
    ids = torch.randint(0, V, (B, T), device=ctx.device, generator=g)
    mask = (torch.rand(B, T, device=ctx.device, generator=g) > 0.1).float()
    adv = torch.randn(B, device=ctx.device, generator=g)
    old = -torch.rand(B, T, device=ctx.device, generator=g) * 2 - 10
    ref = old + 0.01
    kw = dict(beta=0.04, loss_type="dapo", temperature=0.9)

    def formula(lp):
        w_ = torch.exp(lp - old)
        a = adv.unsqueeze(1)
        per = -torch.min(w_ * a, torch.clamp(w_, 0.8, 1.2) * a) + 0.04 * (torch.exp(ref - lp) - (ref - lp) - 1)
        return (per * mask).sum() / mask.sum().clamp(min=1)

    def eager():
        return Call(lambda: formula(_eager_logp(h, w, ids, 0.9)), (h, w))

    def trl():
        _trl_fn()
        return Call(lambda: formula(_trl_logp(h, w, ids, 0.9)), (h, w))

    def liger():
        cls = H.import_first("liger_kernel.chunked_loss:LigerFusedLinearGRPOLoss")
        loss = cls(compiled=ctx.cuda, **kw)
        return Call(lambda: loss(h, w, ids, mask, adv, ref_per_token_logps=ref, old_per_token_logps=old)[0], (h, w))

    def tigon(cfg=None):
        return Call(lambda: ops.fused_linear_grpo(h, w, ids, mask, adv, ref_per_token_logps=ref,
                                                  old_per_token_logps=old, config=cfg, **kw)[0], (h, w))

    N = B * T
    case = f"{B} x {T}, H {Hd}, V {V}"
    floor = _floor(ctx, "grpo", case, [(h, w)], 3 * 2 * N * Hd * V)
    H.measure(ctx, "grpo", case, _peers(eager, trl, liger) + [("tigon", tigon)] + _variants(ctx, tigon),
              flops_fb=3 * 2 * N * Hd * V, floor_us=floor, do_fwd=False)


def run_jsd(ctx):
    from tigon import ops

    s = JSD_SMOKE if ctx.quick else JSD
    N, HS, HT, V = s["N"], s["HS"], s["HT"], s["V"]
    g = _gen(ctx, 3)
    hs = H.randn((N, HS), ctx, requires_grad=True, gen=g)
    ws = H.randn((V, HS), ctx, std=0.02, requires_grad=True, gen=g)
    ht = H.randn((N, HT), ctx, gen=g)
    wt = H.randn((V, HT), ctx, std=0.02, gen=g)
    lab = torch.randint(0, V, (N,), device=ctx.device, generator=g)

    def eager():
        def f():
            zs = F.linear(hs, ws).float()
            with torch.no_grad():
                zt = F.linear(ht, wt).float()
            ls, lt = torch.log_softmax(zs, -1), torch.log_softmax(zt, -1)
            lm = torch.logsumexp(torch.stack([ls + torch.log(torch.tensor(0.5)), lt + torch.log(torch.tensor(0.5))]),
                                 0)
            soft = (0.5 * (lt.exp() * (lt - lm)).sum(-1) + 0.5 * (ls.exp() * (ls - lm)).sum(-1)).mean()
            return 0.5 * F.cross_entropy(zs, lab) + 0.5 * soft
        return Call(f, (hs, ws))

    def trl():
        raise H.Skip("TRL has no fused-head JSD")

    def liger():
        cls = H.import_first("liger_kernel.chunked_loss:LigerFusedLinearJSDLoss")
        loss = cls(compiled=ctx.cuda)
        return Call(lambda: loss(hs, ws, ht, wt, lab), (hs, ws))

    def tigon(cfg=None):
        return Call(lambda: ops.fused_linear_jsd(hs, ws, ht, wt, lab, config=cfg)[0], (hs, ws))

    case = f"{N} tokens, student H {HS}, teacher H {HT}, V {V}"
    floor = _floor(ctx, "jsd", case, [(hs, ws), (ht, wt)], 2 * N * V * (3 * HS + HT))
    H.measure(ctx, "jsd", case, _peers(eager, trl, liger) + [("tigon", tigon)] + _variants(ctx, tigon),
              flops_fb=2 * N * V * (3 * HS + HT), floor_us=floor, do_fwd=False)


def _peers(eager, trl, liger):
    return [("eager", eager), ("trl", trl), ("liger", liger)]


def _variants(ctx, tigon):
    """Extra tigon providers, one per FusedLinearLossConfig of --chunk-mib (ctx.tigon_configs)."""
    return [(label, functools.partial(tigon, cfg)) for label, cfg in getattr(ctx, "tigon_configs", ())]


def _floor(ctx, op, case, heads, flops):
    """The GEMMs any fused head must run, timed alone at full size (cuBLAS, bf16): the trained head's logits,
    dh and dW GEMMs, plus the logits GEMM of each frozen head after it (reference model, teacher). CUDA only."""
    if not ctx.cuda:
        return None
    (h, w), frozen = heads[0], heads[1:]
    hd, wd = h.detach().reshape(-1, h.shape[-1]), w.detach()
    lg = H.randn((hd.shape[0], wd.shape[0]), ctx)
    gemms = {"logits_gemm": lambda: hd @ wd.t(), "dh_gemm": lambda: lg @ wd, "dW_gemm": lambda: lg.t() @ hd}
    for i, (fh, fw) in enumerate(frozen):
        fhd, fwd = fh.detach().reshape(-1, fh.shape[-1]), fw.detach()
        gemms[f"frozen{i}_logits_gemm"] = lambda a=fhd, b=fwd: a @ b.t()
    floor = H.record_floor(ctx, op, case, gemms, flops, label=f"{len(gemms)}-GEMM floor")
    gemms.clear()
    H.free(ctx)
    return floor


SECTIONS = {"dpo": run_dpo, "grpo": run_grpo, "jsd": run_jsd}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for losses.md and losses.json")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, runs on a CPU")
    p.add_argument("--budget", type=float, default=540.0, help="seconds")
    p.add_argument("--only", default=None, help="comma-separated: dpo,grpo,jsd")
    p.add_argument("--chunk-mib", default="", help="comma-separated chunk sizes: one more tigon row each")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    ctx = H.Context(quick=a.smoke, deadline=time.time() + a.budget)
    from tigon.ops import FusedLinearLossConfig

    ctx.tigon_configs = [(f"tigon {m} MiB", FusedLinearLossConfig(chunk_bytes=int(m) << 20))
                         for m in a.chunk_mib.split(",") if m.strip()]
    if ctx.cuda:
        H.run_ceilings(ctx)
    for name, fn in SECTIONS.items():
        if a.only and name not in a.only.split(","):
            continue
        fn(ctx)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name() if ctx.cuda else "cpu",
            "smoke": a.smoke}
    H.write_json(os.path.join(a.out, "losses.json"), {"meta": meta, **ctx.state()})
    lines = [f"# Fused-linear losses ({meta['device']}, torch {meta['torch']})", ""]
    lines += H.markdown_tables(ctx.rows, ctx.ceilings)
    with open(os.path.join(a.out, "losses.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
