"""Training attention fwd+bwd (bf16, GQA 32/8): every exact backend per mask, side by side in one call.

Cases, in the order they run (the budget stops the tail): head 64 at 16384 tokens (8 x 2048 dense, the 1.5B e2e
shape), head 128 at 8192 (1 x 8192) and head 256 at 8192 (Gemma-2's head dim). Per shape a dense causal batch is the
reference; a packed row of the same total tokens (log-normal lengths, median 400, sigma 1, clipped to [16, 4096],
numpy seed 0; the last length fills the row); at head 128 a 4096 sliding window, packed + window, and Gemma-2's
logit softcap 50 (dense and packed); at head 256 the softcap again. Each with every backend exact for it:
  sdpa       HF's sdpa_attention_forward (is_causal + GQA for a dense batch: cuDNN on Hopper; else HF's dense
             [T, T] boolean mask, K/V repeated): HF's pick without softcap
  cudnn      SDPA's cuDNN kernel with enable_gqa (dense causal only)
  varlen     torch.nn.attention.varlen.varlen_attn (flash kernels per sequence, no mask; cu_seq_lens and the
             longest length as the collator gives them; window_size for windows; no softcap)
  varlen_maxT  the same with max_length = the row length, the bound known without the collator's max_length:
             what an upper bound costs (not a table backend)
  flex       torch.compile(flex_attention), block mask from the document ids / window (built untimed: training builds
             it once per forward for all layers; its build time is in extras), score_mod for the softcap; dynamo
             reset before each case (extras "flex_graphs": the graphs each case compiled). Not on dense causal rows:
             cuDNN is HF's pick there and flex measured 71% of it (docs/training_attention.md)
  flash_attn flash_attn_func / flash_attn_varlen_func, when installed
  eager      Gemma-2's eager_attention_forward (scores [T, T] in bf16, fp32 softmax): HF's pick for softcap
FLOP count (useful FLOPs): fwd = 2 GEMMs x 2 FLOP per multiply-add x H x D x (allowed (query, key) pairs):
4 * T^2 * H * D / 2 for a causal row, the sum over a packed row's documents, per query min(i + 1, window) keys for
the window; fwd+bwd = 3.5 x fwd (backward 2.5 x: five GEMMs against two). "% of dense" is the rate against the
dense cuDNN causal rate at the same head dim and total tokens, measured in the same run.

    PYTHONPATH=src python -m benchmarks training-attention --out DIR [--budget S] [--write-table]
    PYTHONPATH=src python -m benchmarks training-attention --smoke     # tiny run of the same code

--write-table rewrites hf/attention_table.py's MEASURED block with this GPU's ranking per mask kind: the backends
faster than HF's pick by more than 3% (the run-to-run spread of these timings) on every shape both ran, fastest
first by the geometric mean of their speedups.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F

from benchmarks.tools import checkout
from benchmarks.tools import harness as H
from benchmarks.tools.checkout import DEFAULT_OUT

HEADS, KV_HEADS = 32, 8
WINDOW, SOFTCAP = 4096, 50.0
ALL_KINDS = ("causal", "packed", "sliding", "packed+sliding", "causal+softcap", "packed+softcap")
# (batch, seq, head dim, mask kinds), in priority order: the budget cuts the tail
PLAN = [
    ((8, 2048, 64), ("causal", "packed")),
    ((1, 8192, 128), ("causal", "packed", "sliding", "causal+softcap")),
    ((1, 8192, 256), ("causal", "causal+softcap")),
    ((1, 8192, 128), ("packed+sliding", "packed+softcap")),
]
SMOKE_PLAN = [((1, 64, 16), ALL_KINDS)]  # CPU: HF's pick only, seconds
# GPU smoke: every backend runs. Not head 16 at 64 tokens: torch 2.11's inductor finds no flex kernel config there
# (NoValidChoicesError), a shape no model trains at; 256 tokens span two 128-blocks as training rows do.
SMOKE_PLAN_CUDA = [((1, 256, 64), ALL_KINDS)]
MARGIN = 1.03
TABLE = str(checkout.SRC / "tigon" / "hf" / "attention_table.py")


def lengths_lognormal(total: int, seed: int = 0, median: int = 400, sigma: float = 1.0, lo: int = 16,
                      hi: int = 4096) -> list[int]:
    """Example lengths drawn log-normally (numpy seed `seed`), clipped to [lo, hi], the last cut to fill `total`."""
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


class _Layer(torch.nn.Module):
    """What HF's attention functions read from the attention module."""

    is_causal = True
    training = True
    num_key_value_groups = HEADS // KV_HEADS


def providers(ctx, kind, q, k, v, go, docs, window, softcap, lengths):
    """[(name, backend, factory)] of the backends exact for one mask kind."""
    from tigon.hf import training_attention as ta

    scale = q.shape[-1] ** -0.5
    dense = docs is None and window is None
    layer = _Layer()
    out = []

    def call(fn):
        return H.Call(fn, (q, k, v), (go,))

    if not softcap:
        def sdpa():
            mask = None if dense else ta.dense_mask(docs, window, q.shape[2], q.device)
            return call(lambda: ta._sdpa(layer, q, k, v, mask, scaling=scale, dropout=0.0)[0].transpose(1, 2))
        out.append(("sdpa", "sdpa", sdpa))
    if dense and not softcap:
        def cudnn():
            H.need_cuda(ctx, "cuDNN attention")
            from torch.nn.attention import SDPBackend, sdpa_kernel

            def fn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return call(fn)
        out.append(("cudnn", "sdpa", cudnn))
    if softcap:
        def eager():
            from transformers.models.gemma2.modeling_gemma2 import eager_attention_forward

            allowed = ta.dense_mask(docs, window, q.shape[2], q.device)
            mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed,
                                                                                           torch.finfo(q.dtype).min)
            return call(lambda: eager_attention_forward(layer, q, k, v, mask, scaling=scale,
                                                        softcap=softcap)[0].transpose(1, 2))
        out.append(("eager", "eager", eager))

    def varlen(max_is_row_length=False):
        def factory():
            H.need_cuda(ctx, "varlen_attn")
            cu = mx = None
            if docs is not None:
                cu = torch.tensor([0, *np.cumsum(lengths)], device=q.device, dtype=torch.int32)
                mx = q.shape[2] if max_is_row_length else max(lengths)
            plan = ta.varlen_plan(q, k, scaling=scale, docs=docs, window=window, softcap=softcap, cu=cu,
                                  max_length=mx)
            if isinstance(plan, str):
                raise H.Skip(plan)
            return call(lambda: ta.varlen_attention_forward(q, k, v, plan).transpose(1, 2))
        return factory
    if not softcap:
        out.append(("varlen", "varlen", varlen()))
        if docs is not None:
            out.append(("varlen_maxT", "varlen (max_length = T)", varlen(True)))

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
        ctx.extras.setdefault("block_mask_first_call_s", {})[f"{kind}, head {q.shape[-1]}"] = time.perf_counter() - t0

        def fn():
            out = ta.flex_attention_forward(q, k, v, scaling=scale, docs=docs, window=window, softcap=softcap,
                                            mask=mask).transpose(1, 2)
            ctx.extras.setdefault("flex_graphs", {})[f"{kind}, head {q.shape[-1]}, {q.shape[0]} x {q.shape[2]}"] = (
                counters["stats"]["unique_graphs"] - graphs)
            return out
        return call(fn)
    if not dense or softcap:
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
                                                   max_length=mx).transpose(1, 2))
    out.append(("flash_attn", "flash_attn", flash))
    return out


def _case(ctx, kind, b, t, d):
    """(batch, seq, lengths or None, window, softcap) of one mask kind at a dense shape of b x t tokens."""
    tokens = b * t
    packed = kind.startswith("packed")
    # the smoke run's 64 tokens get a median of 12 so that its row holds several documents too
    lengths = lengths_lognormal(tokens, median=12 if ctx.quick else 400, lo=4 if ctx.quick else 16,
                                hi=min(4096, tokens)) if packed else None
    window = (16 if ctx.quick else WINDOW) if "sliding" in kind else None
    softcap = SOFTCAP if kind.endswith("softcap") else None
    if packed or window:
        b, t = 1, tokens
    return b, t, lengths, window, softcap


def run(ctx, plan):
    for (b0, t0, d), kinds in plan:
        for kind in kinds:
            if ctx.remaining() < 20:
                ctx.note(f"budget: stopped before {kind} at head {d}")
                return
            b, t, lens, window, softcap = _case(ctx, kind, b0, t0, d)
            q, k, v, go = _inputs(ctx, b, t, d)
            docs = None
            if lens:
                docs = torch.repeat_interleave(torch.arange(len(lens), device=ctx.device),
                                               torch.tensor(lens, device=ctx.device))[None]
            flops = 3.5 * 4 * HEADS * d * pairs(lens or [t] * b, window)
            tokens = b * t
            case = f"head {d}, {tokens} tokens" + (f", {len(lens)} docs" if lens else f" ({b} x {t})")
            provs = providers(ctx, kind, q, k, v, go, docs, window, softcap, lens)
            H.measure(ctx, kind, case, [(n, f) for n, _, f in provs], flops_fb=flops, do_fwd=False,
                      host_column=False, extra={"head_dim": d, "tokens": tokens, "kind": kind,
                                                "backend_of": {n: be for n, be, _ in provs}})
            del q, k, v, go
            H.free(ctx)


def _dense_rates(rows) -> dict:
    """{(head dim, tokens): dense cuDNN causal TFLOP/s}: the first such row of each."""
    dense = {}
    for r in rows:
        if r["op"] == "causal" and r["provider"] == "cudnn" and r.get("fb_TFLOPs"):
            dense.setdefault((r["head_dim"], r["tokens"]), r["fb_TFLOPs"])
    return dense


def report(ctx) -> list[str]:
    dense = _dense_rates(ctx.rows)
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
    """{mask kind: backend or (backends, fastest first)}: the table backends faster than HF's pick by more than
    MARGIN on every shape where both ran, ordered by the geometric mean of the speedups."""
    from tigon.hf.attention_table import BACKENDS, hf_pick

    best = {}
    for kind in dict.fromkeys(r["op"] for r in ctx.rows):
        rows = [r for r in ctx.rows if r["op"] == kind and r.get("fb_us")]
        by_case: dict = {}
        for r in rows:
            backend = r["backend_of"][r["provider"]]
            if backend in BACKENDS and r["provider"] != "cudnn":  # cuDNN alone is not what HF's sdpa runs
                by_case.setdefault(r["case"], {})[backend] = min(r["fb_us"], by_case.get(r["case"], {}).get(
                    backend, math.inf))
        speedups: dict = {}
        for times in by_case.values():
            hf = times.get(hf_pick(kind))
            if hf is None:
                continue
            for backend, us in times.items():
                if backend != hf_pick(kind):
                    speedups.setdefault(backend, []).append(hf / us)
        winners = {b: math.exp(sum(map(math.log, s)) / len(s)) for b, s in speedups.items() if min(s) > MARGIN}
        ranked = tuple(sorted(winners, key=winners.get, reverse=True))
        if ranked:
            best[kind] = ranked[0] if len(ranked) == 1 else ranked
    return best


def write_table(gpu: str, best: dict, path: str = TABLE) -> None:
    """Rewrite the MEASURED block of `path`: this GPU's rows from `best`, the other GPUs' rows kept."""
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
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on this machine's device")
    p.add_argument("--budget", type=float, default=560.0, help="seconds (flex compiles ~7 variants)")
    p.add_argument("--write-table", action="store_true", help="rewrite hf/attention_table.py's MEASURED block")
    a = p.parse_args(argv)
    os.makedirs(a.out, exist_ok=True)
    # every row is printed and kept in a part file as it lands: a run cut off by a timeout keeps what it measured
    ctx = H.Context(quick=a.smoke, deadline=time.time() + a.budget, verbose=True,
                    part_path=os.path.join(a.out, "training_attention.part.json"))
    run(ctx, (SMOKE_PLAN_CUDA if ctx.cuda else SMOKE_PLAN) if a.smoke else PLAN)
    gpu = torch.cuda.get_device_name() if ctx.cuda else "cpu"
    best = fastest(ctx)
    from tigon.hf.training_attention import varlen_parameters

    md = [f"Training attention fwd+bwd, bf16, GQA {HEADS}/{KV_HEADS} ({gpu}, torch {torch.__version__}; "
          f"varlen_attn takes {sorted(varlen_parameters() - {'query', 'key', 'value'}) or 'nothing: absent'})", ""]
    md += report(ctx) + ["", f"table ranking (backends beating HF's pick by > {MARGIN - 1:.0%}): {best}"]
    md += [f"note: {n}" for n in ctx.notes]
    print("\n".join(md))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "training_attention.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "training_attention.json"), "w") as f:
        json.dump({"gpu": gpu, "torch": torch.__version__, "rows": ctx.rows, "extras": ctx.extras,
                   "notes": ctx.notes, "fastest": best}, f, indent=1, default=str)
    if a.write_table and ctx.cuda:
        write_table(gpu, best)
    return 0


if __name__ == "__main__":
    sys.exit(main())
