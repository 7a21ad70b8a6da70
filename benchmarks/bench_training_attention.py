"""Training attention fwd+bwd (bf16, GQA 32/8): dense causal vs packed rows, sliding window, softcap, per backend.

Shapes (the anchors', shared/anchors/bench_attention_sdpa.py): head 64 at 8 x 2048 tokens, head 128 at 2 x 4096 and
1 x 8192. Each dense causal batch is compared with one packed row of the same total tokens (log-normal lengths,
median 400, sigma 1, clipped to [16, 4096], numpy seed 0; the last length fills the row), a 4096 sliding window at
8192 tokens, and Gemma-2's logit softcap 50, each with every backend that computes it exactly:
  sdpa       F.scaled_dot_product_attention as HF's sdpa path calls it (K/V repeated to 32 heads; is_causal for a
             dense batch, else HF's materialized [T, T] boolean mask: HF's pick for packed and sliding rows)
  cudnn      SDPA's cuDNN kernel with enable_gqa (dense causal only)
  flex       torch.compile(flex_attention), block mask from the document ids / window (built untimed: training builds
             it once per forward for all layers; its build time is its own row), score_mod for the softcap; dynamo
             reset before each case (extras "flex_graphs": the graphs each case compiled, 1-2 when none fell back)
  flash_attn flash_attn_func / flash_attn_varlen_func, when installed
  eager      HF's eager attention (scores [T, T] in bf16, fp32 softmax): HF's pick for softcap
FLOP count: fwd = 2 GEMMs x 2 FLOP per multiply-add x H x D x (allowed (query, key) pairs): 4 * T^2 * H * D / 2 for a
causal row, sum of 4 * L^2 * H * D / 2 over a packed row's documents, per query min(i + 1, window) keys for the
window; fwd+bwd = 3.5 x fwd (backward 2.5 x: five GEMMs against two). "% of dense" is a rate against the dense
cuDNN causal rate at the same head dim and total tokens, measured in the same run.

    PYTHONPATH=src python benchmarks/bench_training_attention.py --out DIR [--write-table]
    PYTHONPATH=src python benchmarks/bench_training_attention.py --smoke     # tiny run of the same code

--write-table rewrites hf/attention_table.py's MEASURED block with this GPU's fastest backend per mask kind (only
where it beats HF's pick by more than 3%, the run-to-run spread of these timings).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness as H  # noqa: E402

HEADS, KV_HEADS = 32, 8
SHAPES = [(8, 2048, 64), (2, 4096, 128), (1, 8192, 128)]  # batch, seq, head dim
SMOKE_SHAPES = [(1, 64, 16)]  # CPU: HF's pick only, seconds
# GPU smoke: every backend runs. Not head 16 at 64 tokens: torch 2.11's inductor finds no flex kernel config there
# (NoValidChoicesError), a shape no model trains at; 256 tokens span two 128-blocks as training rows do.
SMOKE_SHAPES_CUDA = [(1, 256, 64)]
WINDOW, SOFTCAP = 4096, 50.0
MARGIN = 1.03
TABLE = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src", "tigon", "hf",
                     "attention_table.py")


def lengths_lognormal(total: int, seed: int = 0, median: int = 400, sigma: float = 1.0, lo: int = 16,
                      hi: int = 4096) -> list[int]:
    rng = np.random.default_rng(seed)
    out = []
    while sum(out) < total:
        out.append(int(np.clip(round(float(rng.lognormal(np.log(median), sigma))), lo, hi)))
    out[-1] -= sum(out) - total
    return [n for n in out if n > 0]


def pairs(lengths, window=None) -> int:
    """(query, key) pairs attended: per query min(i + 1, window) keys, summed over the documents."""
    total = 0
    for n in lengths:
        i = np.arange(n)
        total += int(np.minimum(i + 1, window or n).sum())
    return total


def _inputs(ctx, b, t, d):
    gen = torch.Generator(device=ctx.device).manual_seed(0)
    q = H.randn((b, HEADS, t, d), ctx, requires_grad=True, gen=gen)
    k = H.randn((b, KV_HEADS, t, d), ctx, requires_grad=True, gen=gen)
    v = H.randn((b, KV_HEADS, t, d), ctx, requires_grad=True, gen=gen)
    go = H.randn((b, HEADS, t, d), ctx, gen=gen)
    return q, k, v, go


def _rep(x):
    return x.repeat_interleave(HEADS // KV_HEADS, 1)


def providers(ctx, kind, q, k, v, go, docs, window, softcap, lengths):
    """[(name, backend, factory)] for one mask kind."""
    from tigon.hf import training_attention as ta

    scale = q.shape[-1] ** -0.5
    dense = docs is None and window is None
    out = []

    def call(fn):
        return lambda: H.Call(fn, (q, k, v), (go,))

    if not softcap:
        def sdpa():
            mask = None if dense else ta.dense_mask(docs, window, q.shape[2], q.device)
            return call(lambda: F.scaled_dot_product_attention(q, _rep(k), _rep(v), attn_mask=mask,
                                                               is_causal=dense, scale=scale))()
        out.append(("sdpa", "sdpa", sdpa))
    if dense and not softcap:
        def cudnn():
            H.need_cuda(ctx, "cuDNN attention")
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def fn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return call(fn)()
        out.append(("cudnn", "sdpa", cudnn))
    if softcap:
        def eager():
            mask = ta.dense_mask(docs, window, q.shape[2], q.device)

            def fn():  # HF's eager: bf16 scores, the cap, fp32 softmax, bf16 probabilities @ V
                s = (q @ _rep(k).transpose(-1, -2)) * scale
                s = torch.tanh(s / softcap) * softcap
                s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
                return torch.softmax(s, dim=-1, dtype=torch.float32).to(q.dtype) @ _rep(v)
            return call(fn)()
        out.append(("eager", "eager", eager))

    def flex():
        H.need_cuda(ctx, "compiled FlexAttention")
        import torch._dynamo
        from torch._dynamo.utils import counters

        # Each case is another flex variant (shape, mask, score_mod, grad mode): without a reset the cases add up
        # past dynamo's recompile limit (8), where flex_attention would run eagerly ([T, T] scores, 53 GB).
        torch._dynamo.reset()
        graphs = counters["stats"]["unique_graphs"]
        mask = ta.TrainingMask(docs, window)
        t0 = time.perf_counter()
        # the inputs the timed call takes (requiring grad): the training graph, not a second no-grad variant
        ta.flex_attention_forward(q, k, v, scaling=scale, docs=docs, window=window, softcap=softcap, mask=mask)
        torch.cuda.synchronize()
        ctx.extras.setdefault("block_mask_first_call_s", {})[kind] = time.perf_counter() - t0

        def fn():
            out = ta.flex_attention_forward(q, k, v, scaling=scale, docs=docs, window=window, softcap=softcap,
                                            mask=mask).transpose(1, 2)
            ctx.extras.setdefault("flex_graphs", {})[f"{kind}, head {q.shape[-1]}, {q.shape[0]} x {q.shape[2]}"] = (
                counters["stats"]["unique_graphs"] - graphs)
            return out
        return call(fn)()
    out.append(("flex", "flex", flex))

    def flash():
        H.need_cuda(ctx, "flash_attn")
        if not ta._has_flash_attn():
            raise H.Skip("flash_attn not installed")
        cu = None
        if docs is not None:
            cu = torch.tensor([0, *np.cumsum(lengths)], device=q.device, dtype=torch.int32)
        mx = max(lengths) if lengths else None
        return call(lambda: ta._flash_attn_forward(q, k, v, scaling=scale, window=window, softcap=softcap, cu=cu,
                                                   max_length=mx).transpose(1, 2))()
    out.append(("flash_attn", "flash_attn", flash))
    return out


def run(ctx, shapes, with_extras=True):
    from tigon.hf import training_attention as ta

    for b, t, d in shapes:
        tokens = b * t
        cases = [("causal", b, t, None, None, None)]
        # the smoke run's 64 tokens get a median of 12 so that its row holds several documents too
        lengths = lengths_lognormal(tokens, median=12 if ctx.quick else 400, lo=4 if ctx.quick else 16,
                                    hi=min(4096, tokens))
        cases.append(("packed", 1, tokens, lengths, None, None))
        if with_extras and (b, t, d) == shapes[-1]:  # window and softcap at 8192 tokens, head 128
            w = WINDOW if not ctx.quick else 16
            cases += [("sliding", 1, tokens, None, w, None), ("packed+sliding", 1, tokens, lengths, w, None),
                      ("causal+softcap", b, t, None, None, SOFTCAP), ("packed+softcap", 1, tokens, lengths, None,
                                                                       SOFTCAP)]
        for kind, bb, tt, lens, window, softcap in cases:
            if ctx.remaining() < 20:
                ctx.note(f"budget: stopped before {kind} at head {d}")
                return
            q, k, v, go = _inputs(ctx, bb, tt, d)
            docs = None
            if lens:
                docs = torch.repeat_interleave(torch.arange(len(lens), device=ctx.device),
                                               torch.tensor(lens, device=ctx.device))[None]
            row_lengths = lens or [tt] * bb
            flops = 3.5 * 4 * HEADS * d * pairs(row_lengths, window)
            case = f"head {d}, {tokens} tokens" + (f", {len(lens)} docs" if lens else f" ({bb} x {tt})")
            provs = providers(ctx, kind, q, k, v, go, docs, window, softcap, lens)
            H.measure(ctx, kind, case, [(n, f) for n, _, f in provs], flops_fb=flops, do_fwd=False,
                      host_column=False, extra={"head_dim": d, "tokens": tokens, "kind": kind,
                                                "backend_of": {n: be for n, be, _ in provs}})
            del q, k, v, go
            H.free(ctx)
    del ta


def report(ctx) -> list[str]:
    dense = {}
    for r in ctx.rows:
        if r["op"] == "causal" and r["provider"] == "cudnn" and r.get("fb_TFLOPs"):
            dense[(r["head_dim"], r["tokens"])] = r["fb_TFLOPs"]
    lines = ["| mask | case | backend | fwd+bwd ms | TFLOP/s | % of dense cuDNN | peak MiB |", "|---" * 7 + "|"]
    for r in ctx.rows:
        base = dense.get((r.get("head_dim"), r.get("tokens")))
        tf = r.get("fb_TFLOPs")
        pct = f"{100 * tf / base:.0f}%" if tf and base else "-"
        ms = H.num(r["fb_us"] / 1e3) if r.get("fb_us") else (r.get("error") or r.get("note") or "-")[:70]
        lines.append(f"| {r['op']} | {r['case']} | {r['provider']} | {ms} | {H.num(tf)} | {pct} | "
                     f"{H.num(r.get('fb_peak_MiB'))} |")
    return lines


def fastest(ctx) -> dict:
    """{mask kind: backend} where the fastest exact backend beats HF's pick by more than MARGIN (largest shape)."""
    from tigon.hf.attention_table import hf_pick

    best = {}
    for kind in dict.fromkeys(r["op"] for r in ctx.rows):
        rows = [r for r in ctx.rows if r["op"] == kind and r.get("fb_us")]
        if not rows:
            continue
        top = max(r["tokens"] * r["head_dim"] for r in rows)
        rows = [r for r in rows if r["tokens"] * r["head_dim"] == top]
        hf_rows = [r for r in rows if r["backend_of"][r["provider"]] == hf_pick(kind) and r["provider"] != "cudnn"]
        win = min(rows, key=lambda r: r["fb_us"])
        backend = win["backend_of"][win["provider"]]
        if hf_rows and backend != hf_pick(kind) and win["fb_us"] * MARGIN < min(r["fb_us"] for r in hf_rows):
            best[kind] = backend
    return best


def write_table(gpu: str, best: dict, path: str = TABLE) -> None:
    text = open(path).read()
    from tigon.hf.attention_table import MEASURED

    rows = {k: v for k, v in MEASURED.items() if k[0] != gpu}
    rows.update({(gpu, kind): b for kind, b in best.items()})
    body = "MEASURED: dict = {\n" + "".join(f"    {k!r}: {v!r},\n" for k, v in sorted(rows.items())) + "}\n"
    if not rows:
        body = "MEASURED: dict = {}\n"
    new = re.sub(r"(# BEGIN MEASURED[^\n]*\n).*?(# END MEASURED)", lambda m: m.group(1) + body + m.group(2), text,
                 flags=re.S)
    with open(path, "w") as f:
        f.write(new)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device")
    p.add_argument("--budget", type=float, default=560.0, help="seconds (flex compiles ~10 variants)")
    p.add_argument("--write-table", action="store_true", help="rewrite hf/attention_table.py's MEASURED block")
    a = p.parse_args(argv)
    ctx = H.Context(quick=a.smoke, deadline=time.time() + a.budget)
    run(ctx, (SMOKE_SHAPES_CUDA if ctx.cuda else SMOKE_SHAPES) if a.smoke else SHAPES)
    gpu = torch.cuda.get_device_name() if ctx.cuda else "cpu"
    best = fastest(ctx)
    md = [f"Training attention fwd+bwd, bf16, GQA {HEADS}/{KV_HEADS} ({gpu}, torch {torch.__version__})", ""]
    md += report(ctx) + ["", f"fastest exact backend beating HF's pick by > {MARGIN - 1:.0%}: {best}"]
    print("\n".join(md))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "training_attention.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "training_attention.json"), "w") as f:
        json.dump({"gpu": gpu, "rows": ctx.rows, "extras": ctx.extras, "notes": ctx.notes, "fastest": best}, f,
                  indent=1, default=str)
    if a.write_table and ctx.cuda:
        write_table(gpu, best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
