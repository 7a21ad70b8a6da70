"""One Qwen3-30B-A3B-shaped routed-experts block, fwd+bwd: transformers' "eager" (a loop over experts),
"grouped_mm" (sort, torch grouped_mm, masked_fill / gather / multiply / sum glue) and Tigon's "tigon" (the same
grouped GEMMs; ops.moe_permute, swiglu_packed, ops.moe_combine as the glue).

    PYTHONPATH=src python -m benchmarks moe --out DIR        # H200: DIR/moe.md, DIR/moe.json
    PYTHONPATH=src python -m benchmarks moe --smoke          # tiny shapes (CPU: interpreter)

Shape: H 2048, I 768, E 128, top-k 8, 8192 tokens, bf16; the router's top-k of a softmax of random logits
(normalized, as Qwen3-MoE's norm_topk_prob). Times are the harness's medians (CUDA events, L2 flushed before each
call, run-ahead spin); peak memory is above the inputs. Errors: relative L2 of the output and every gradient
against the "eager" loop in fp32.

The glue's bytes model (bf16, S = T * K rows in expert order; one "pass" = one read or one write of [S, H] or of
[S, 2I]; [T, H] counts 1/K of an [S, H] pass):
- grouped_mm, forward: gather hidden[perm // K] 2, masked_fill_ 2, the weights' multiply 2, masked_fill 2, the
  inverse-permute gather 2, the sum 1 + 1/K  => 11 + 1/K [S, H]; masked_fill 2, silu 1, multiply 1.5 => 4.5 [S, 2I].
- tigon, forward: permute 1 + 1/K, combine 1 + 1/K => 2 + 2/K [S, H]; swiglu 1.5 [S, 2I].
- tigon, backward: the combine's (read dout, y, write dy) 2 + 1/K, the permute's (an unweighted combine) 1 + 1/K
  => 3 + 2/K [S, H]; swiglu in place (read dh, gate_up, write d gate_up) 2.5 [S, 2I]. grouped_mm's backward
  retraces its forward's glue (each masked_fill and multiply twice, the gathers as zero-fill + index_put /
  atomic index_add): more than its forward's passes; the profile of the GPU run is the measurement.
The combine kernel's own row: bytes = read [S, H] + write [T, H] (+ pos, weights), GB/s against a D2D copy of
the same [S, H] buffer timed in the same run.
"""

import argparse
import json
import os
import sys
import time

import torch

from benchmarks.tools import harness as H

FULL = dict(tokens=8192, hidden=2048, inter=768, experts=128, top_k=8)
SMOKE = dict(tokens=6, hidden=32, inter=16, experts=6, top_k=2)
PROVIDERS = ("eager", "grouped_mm", "tigon")


def glue_passes(k: int) -> dict:
    """The bytes model of the module docstring: passes over [S, H] and [S, 2I] of each forward's glue."""
    return {"grouped_mm_fwd": {"SH": 11 + 1 / k, "S2I": 4.5}, "tigon_fwd": {"SH": 2 + 2 / k, "S2I": 1.5},
            "tigon_bwd": {"SH": 3 + 2 / k, "S2I": 2.5}}


def make_block(shape, device, dtype, seed=0):
    """A Qwen3MoeExperts module with N(0, 0.02) weights, and the routed inputs: x [T, H], top-k ids [T, K],
    normalized top-k weights [T, K] (x and weights require grad)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    config = Qwen3MoeConfig(hidden_size=shape["hidden"], moe_intermediate_size=shape["inter"],
                            num_experts=shape["experts"], num_experts_per_tok=shape["top_k"], hidden_act="silu")
    g = torch.Generator(device="cpu").manual_seed(seed)
    experts = Qwen3MoeExperts(config)
    with torch.no_grad():
        for p in experts.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    experts = experts.to(device=device, dtype=dtype)
    T = shape["tokens"]
    x = torch.randn(T, shape["hidden"], generator=g).to(device=device, dtype=dtype)
    probs = torch.softmax(torch.randn(T, shape["experts"], generator=g), -1)
    w, idx = torch.topk(probs, shape["top_k"], -1)
    w = (w / w.sum(-1, keepdim=True)).to(device=device, dtype=dtype)
    return experts, x.requires_grad_(), idx.to(device), w.requires_grad_()


def forward_of(name):
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    from tigon.hf import moe

    if name == "tigon":
        moe.register()
    if name == "eager":
        return lambda m, *a: type(m).forward.__wrapped__(m, *a)  # the class's own loop (HF's "eager")
    return lambda m, *a: ALL_EXPERTS_FUNCTIONS[name](m, *a)


def _time(ctx, fn) -> dict:
    """The harness's timing; two calls in the smoke run (the interpreter takes ~0.1 s a kernel)."""
    return H.bench(ctx, fn, min_rep=1, max_rep=1, warmup=0) if ctx.quick else H.bench(ctx, fn)


def _fwd_bwd(fn, experts, x, idx, w, go):
    out = fn(experts, x, idx, w)
    return (out, *torch.autograd.grad(out, (x, w, experts.gate_up_proj, experts.down_proj), go))


def run_block(ctx, shape, dtype):
    experts, x, idx, w = make_block(shape, ctx.device, dtype)
    go = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(ctx.device, dtype)
    ref_m, ref_x, _, ref_w = make_block(shape, ctx.device, torch.float32)
    refs = _fwd_bwd(forward_of("eager"), ref_m, ref_x, idx, ref_w, go.float())
    del ref_m, ref_x, ref_w
    names = ("out", "dx", "dweights", "dgate_up_proj", "ddown_proj")
    for name in PROVIDERS:
        row = {"op": "experts", "provider": name, **shape, "dtype": str(dtype)}
        try:
            got = _measure_block(ctx, row, forward_of(name), experts, x, idx, w, go)
            row["err"] = {n: H.relerr(a, r) for n, a, r in zip(names, got, refs)}
        except Exception as e:  # noqa: BLE001 - one provider's failure is its cell
            row["error"] = H.short_error(e)
        ctx.add(row)
        H.free(ctx)
    _flops(ctx, shape)


def _measure_block(ctx, row, fn, experts, x, idx, w, go):
    """fwd, fwd+bwd and peak memory of one provider into row; returns one fwd+bwd's (out, grads...)."""
    got = _fwd_bwd(fn, experts, x, idx, w, go)
    with torch.no_grad():
        row["fwd_ms"] = _time(ctx, lambda: fn(experts, x, idx, w))["ms"]
    timing = _time(ctx, lambda: _fwd_bwd(fn, experts, x, idx, w, go))
    row.update(fwd_bwd_ms=timing["ms"], spread_pct=timing["spread_pct"], n=timing["n"])
    row["peak_mib"] = H.peak_mib(ctx, lambda: _fwd_bwd(fn, experts, x, idx, w, go))
    return got


def _flops(ctx, shape):
    S, Hd, I2 = shape["tokens"] * shape["top_k"], shape["hidden"], 2 * shape["inter"]
    fwd = 2 * S * Hd * I2 + 2 * S * (I2 // 2) * Hd
    ctx.extras["gemm_flops"] = {"fwd": fwd, "fwd_bwd": 3 * fwd}


def run_combine(ctx, shape, dtype):
    """The combine kernel alone (forward, and its backward with dweights) against a D2D copy of [S, H]."""
    from tigon import ops
    from tigon.hf.moe import _routing

    T, K, Hd = shape["tokens"], shape["top_k"], shape["hidden"]
    S = T * K
    _, _, idx, w = make_block(shape, ctx.device, dtype)
    pos, _, n_rows, _ = _routing(idx, shape["experts"])
    y = torch.randn(S, Hd, device=ctx.device).to(dtype)
    dout = torch.randn(T, Hd, device=ctx.device).to(dtype)
    w = w.detach()
    e = y.element_size()
    flat = pos.reshape(-1)
    w_g = w.reshape(-1)[torch.argsort(flat)]  # the weights in expert order, as HF's sample_weights_g
    sentinel = torch.zeros(S, 1, dtype=torch.bool, device=ctx.device)
    dst = torch.empty_like(y)
    copy_ms = _time(ctx, lambda: dst.copy_(y))["ms"]
    copy_gbps = 2 * S * Hd * e / (copy_ms * 1e-3) / 1e9
    rows = [
        ("moe_combine fwd", lambda: ops.moe_combine(y, w, pos, n_rows), (S + T) * Hd * e),
        ("moe_combine bwd (dy, dweights)", lambda: torch.ops.tigon.moe_combine_bwd(dout, y, w, pos, n_rows),
         (T + 2 * S) * Hd * e),
        ("moe_permute fwd", lambda: ops.moe_permute(dout, pos, n_rows), (T + S) * Hd * e),
        ("grouped_mm's glue: masked_fill, * w, gather, sum",
         lambda: (y.masked_fill(sentinel, 0.0) * w_g[:, None])[flat].view(T, K, Hd).sum(1), (S + T) * Hd * e),
    ]
    for name, fn, nbytes in rows:
        row = {"op": "glue", "kernel": name, "copy_ms": copy_ms, "copy_GBps": copy_gbps}
        try:
            ms = _time(ctx, fn)["ms"]
            gbps = nbytes / (ms * 1e-3) / 1e9
            row.update(ms=ms, bytes=nbytes, GBps=gbps, pct_of_copy=100 * gbps / copy_gbps)
        except Exception as ex:  # noqa: BLE001
            row["error"] = H.short_error(ex)
        ctx.add(row)


def _fmt(v, nd=3):
    return "" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def markdown(ctx, shape, versions) -> str:
    k = shape["top_k"]
    lines = [f"# Routed experts fwd+bwd: T {shape['tokens']}, H {shape['hidden']}, I {shape['inter']}, "
             f"E {shape['experts']}, top-k {k}, bf16 ({ctx.device.type})", "",
             "versions: " + ", ".join(f"{a} {b}" for a, b in versions.items()), "",
             "| provider | fwd ms | fwd+bwd ms | vs grouped_mm | peak MiB | max rel err |", "|---|---|---|---|---|---|"]
    blocks = [r for r in ctx.rows if r["op"] == "experts"]
    base = next((r.get("fwd_bwd_ms") for r in blocks if r["provider"] == "grouped_mm"), None)
    for r in blocks:
        if "error" in r:
            lines.append(f"| {r['provider']} | failed: {r['error']} | | | | |")
            continue
        ratio = f"{base / r['fwd_bwd_ms']:.2f}x" if base and isinstance(r.get("fwd_bwd_ms"), float) else ""
        lines.append(f"| {r['provider']} | {_fmt(r['fwd_ms'])} | {_fmt(r['fwd_bwd_ms'])} | {ratio} | "
                     f"{_fmt(r.get('peak_mib'), 0)} | {max(r['err'].values()):.2e} |")
    lines += ["", "| glue kernel | ms | GB/s | % of D2D copy |", "|---|---|---|---|"]
    for r in (r for r in ctx.rows if r["op"] == "glue"):
        if "error" in r:
            lines.append(f"| {r['kernel']} | failed: {r['error']} | | |")
        else:
            lines.append(f"| {r['kernel']} | {_fmt(r['ms'])} | {_fmt(r['GBps'], 0)} | {_fmt(r['pct_of_copy'], 1)} |")
    copy = next((r for r in ctx.rows if r["op"] == "glue"), {})
    lines += ["", f"D2D copy of [S, H]: {_fmt(copy.get('copy_ms'))} ms, {_fmt(copy.get('copy_GBps'), 0)} GB/s "
              "(read + write)", "", "bytes model of the glue (passes over [S, H] / [S, 2I]): " +
              "; ".join(f"{n} {p['SH']:.2f} / {p['S2I']:.1f}" for n, p in glue_passes(k).items())]
    return "\n".join(lines) + "\n"


def _versions():
    import transformers
    import triton

    v = {"torch": torch.__version__, "triton": triton.__version__, "transformers": transformers.__version__}
    if torch.cuda.is_available():
        v["gpu"] = torch.cuda.get_device_name()
    return v


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (without a GPU: Triton's interpreter)")
    p.add_argument("--tokens", type=int, default=None)
    p.add_argument("--out", default=None, help="directory for moe.md and moe.json")
    a = p.parse_args(argv)
    if a.smoke and not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    shape = dict(SMOKE if a.smoke else FULL)
    if a.tokens:
        shape["tokens"] = a.tokens
    device = "cuda" if torch.cuda.is_available() else "cpu"  # a smoke run on a GPU runs the tiny shapes there
    ctx = H.Context(device=device, quick=a.smoke, deadline=time.time() + 1e9)
    ctx.extras["glue_passes"] = glue_passes(shape["top_k"])
    run_block(ctx, shape, torch.bfloat16)
    run_combine(ctx, shape, torch.bfloat16)
    versions = _versions()
    md = markdown(ctx, shape, versions)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "moe.md"), "w") as f:
            f.write(md)
        with open(os.path.join(a.out, "moe.json"), "w") as f:
            json.dump(dict(shape=shape, versions=versions, **ctx.state()), f, indent=1, default=str)
    return 0


if __name__ == "__main__":
    sys.exit(main())
