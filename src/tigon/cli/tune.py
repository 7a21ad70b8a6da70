"""`tigon tune`: time this GPU's choices and write the winners to the per-user cache (tigon.ops.tuned_cache).

    tigon tune [--attention] [--decode-linear] [--quant-linear] [--model llama3-8b|1.5b|PATH] [--kinds K,...]
               [--dry-run] [--cache PATH]

Training attention: each backend `training_attention_forward` can run for a mask kind, through the same entry
points, fwd+bwd with triton.testing.do_bench (median), at one shape: bf16, 32 query / 8 KV heads of 128, one row of
8192 tokens (packed kinds: 4 documents of 2048, with the collator's cu_seq_lens), a 4096 window for the sliding
kinds, Gemma-2's softcap 50. A kind's cached row is the backends at least MIN_GAIN faster than Hugging Face's pick,
fastest first (empty where none is: HF's pick then runs on this card even where a shipped row or the rule says
otherwise); a kind whose HF pick could not run is not written.

decode_linear: the projections a decode step launches at the model's shapes (batch 1 with the norm fused, batch 8
without it: `decode/layer_step.py`), bf16, do_bench with a cold L2: the rule's launch (`decode_linear._rule_config`,
what an unmeasured card runs) against a staged search (block_n x split_k at 256-wide K steps; then the K step of the
best two; then warps x stages of the best two) and the shipped pick where there is one; batch 8 times batch 1's
four best. A shape's cached config is the fastest where it beats the rule by MIN_GAIN; where none does and a shipped
pick exists, the rule's launch is cached (measured here: the shipped pick is not faster on this card).

quant_linear (only with --quant-linear: for quantized models): the model's decoder projections (q/k/v stacked, o,
gate/up stacked with the SiLU GLU, down) at 1 and 8 rows, bf16 activations, in QUANT_FORMATS (int4 in groups of 128,
symmetric; fp8 in 128 x 128 blocks): the default launch (the rule in `quant_linear._plan`) against QUANT_GRID's
launches for the kernel those rows run, each call replayed from a CUDA graph over copies of the weight past the L2
(QUANT_GRAPH_BYTES; as benchmarks/generation/bench_quant_linear.py times decode rows); winners as decode_linear's.
"""

import argparse
import dataclasses
import importlib
import json
import math
import os
import sys
import time

from .. import __version__, _log
from .argtypes import name_list

SUMMARY = "Time this GPU's choices and write the winners to the per-user cache Tigon reads before its shipped tables."
MIN_GAIN = 0.02  # a winner is at least 2% faster than the default: under that, run-to-run noise
TOKENS, DOCS, HEADS, KV_HEADS, HEAD_DIM, WINDOW, SOFTCAP = 8192, 4, 32, 8, 128, 4096, 50.0
KINDS = ("causal", "packed", "sliding", "packed+sliding", "causal+softcap", "packed+softcap", "sliding+softcap",
         "packed+sliding+softcap")
MODELS = {  # Llama shapes: hidden, query heads, KV heads, head dim, MLP width
    "llama3-8b": dict(hidden=4096, heads=32, kv_heads=8, head_dim=128, inter=14336),
    "1.5b": dict(hidden=2048, heads=32, kv_heads=8, head_dim=64, inter=8192),
    "llama3-70b": dict(hidden=8192, heads=64, kv_heads=8, head_dim=128, inter=28672),
}
QUANT_FORMATS = (("int4", 128), ("fp8", 128))  # (quant_linear_picks format, group size) tuned by default
QUANT_ROWS = (1, 8, 32, 128)  # one row (the GEMV), then a row count of each rows bucket (quant_linear_picks)
QUANT_GRID = {  # QuantLinearConfig fields around the rule's launch, per kernel (a small bench_quant_linear --sweep)
    "gemv": [dict(block_n=bn, block_k=bk, prefetch=pf) for bn in (32, 64, 128) for bk in (256, 512) for pf in (0, 1)]
    + [dict(block_n=64, block_k=256, split_k=sk) for sk in (1, 2, 4, 8, 16)]
    + [dict(block_n=64, block_k=256, num_warps=w) for w in (2, 8)]
    + [dict(block_n=bn, block_k=256, split_k=sk, prefetch=1) for bn in (32, 64) for sk in (2, 4)],
    "decode": [dict(block_n=bn, block_k=bk, num_warps=w) for bn in (32, 64, 128) for bk in (64, 128) for w in (4, 8)]
    + [dict(block_n=bn, block_k=bk, prefetch=1) for bn in (64, 128) for bk in (64, 128)] + [dict(gemv_max_rows=16)],
    # 17-255 rows: the tensor-core kernel's tiles, K split (few tiles leave SMs idle), dequantize + cuBLAS
    "gemm": [dict(block_m=bm, block_n=bn, num_warps=w) for bm in (64, 128) for bn in (64, 128) for w in (4, 8)]
    + [dict(block_m=bm, split_k=sk) for bm in (64, 128) for sk in (2, 4)] + [dict(dequant_min_rows=1)],
}
# the code-MMA kernel (int4 only, both row buckets; `quant_grid`): tiles, pipeline stages, splits,
# a dot's columns (fewer registers, more programs an SM)
QUANT_MMA = [dict(code_mma=1, block_n=bn, num_stages=st) for bn in (64, 128) for st in (2, 3, 4)] + [
    dict(code_mma=1, split_k=sk) for sk in (2, 4, 8, 16)] + [dict(code_mma=1, block_k=bk) for bk in (32, 64)] + [
    dict(code_mma=1, block_n=256, block_k=64, num_warps=8)] + [
    # tiles below a warpgroup's (64 rows on 4 warps) run mma.sync on sm_90 too: no wait on each step's wgmma
    dict(code_mma=1, block_n=bn, num_warps=w) for bn, w in ((64, 2), (32, 2), (32, 1))]
# the code-MMA kernel as a GEMM (17-255 rows): tiles of x's rows x the weight's, warps, K split
QUANT_MMA_GEMM = [dict(code_mma=1, block_m=bm, block_n=bn, num_warps=w) for bm in (64, 128) for bn in (64, 128)
                  for w in (4, 8)] + [dict(code_mma=1, block_m=bm, block_n=64, split_k=sk) for bm in (64, 128)
                                      for sk in (2, 4, 8)]
QUANT_GRAPH_BYTES = 200 << 20  # weight bytes a timed graph cycles through: 4x a 50 MiB L2 (2 to 32 copies)
NEEDS_GPU = ("tigon tune needs a CUDA GPU: it times kernels on the card it tunes for, and this machine has none "
             "(torch {torch}). `tigon tune --dry-run` lists what it would measure.")


def model_shapes(text: str) -> dict:
    """--model: a name of MODELS, or a Hugging Face config.json (or the folder holding one) of a Llama-like model."""
    if text in MODELS:
        return dict(MODELS[text], name=text)
    path = os.path.join(text, "config.json") if os.path.isdir(text) else text
    try:
        with open(path) as f:
            config = json.load(f)
        config = config.get("text_config") or config
        heads = config["num_attention_heads"]
        shapes = dict(hidden=config["hidden_size"], heads=heads, kv_heads=config.get("num_key_value_heads") or heads,
                      head_dim=config.get("head_dim") or config["hidden_size"] // heads,
                      inter=config["intermediate_size"], name=text)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise argparse.ArgumentTypeError(f"expected {' or '.join(MODELS)} or a model's config.json (or its folder), "
                                         f"got {text!r} ({type(e).__name__}: {e})") from None
    if not all(type(v) is int and v > 0 for k, v in shapes.items() if k != "name"):
        raise argparse.ArgumentTypeError(f"{text!r}: the sizes must be positive ints, got {shapes}")
    return shapes


def quant_formats(text: str) -> tuple:
    """--quant-formats: comma-separated names of QUANT_FORMATS, as (format, group size) pairs in that order."""
    names = [t.strip() for t in text.split(",")]
    known = dict(QUANT_FORMATS)
    if not text.strip() or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"expected comma-separated formats of {', '.join(known)}, got {text!r}")
    return tuple((f, g) for f, g in QUANT_FORMATS if f in names)


def quant_rows(text: str) -> tuple:
    """--quant-rows: comma-separated row counts of QUANT_ROWS (one a rows bucket), in that order."""
    try:
        rows = {int(t) for t in text.split(",")}
    except ValueError:
        rows = set()
    if not rows or not rows <= set(QUANT_ROWS):
        raise argparse.ArgumentTypeError(f"expected comma-separated row counts of {QUANT_ROWS}, got {text!r}")
    return tuple(r for r in QUANT_ROWS if r in rows)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--attention", action="store_true", help="tune the training-attention ranking per mask kind")
    p.add_argument("--decode-linear", action="store_true", help="tune decode_linear's launches at --model's shapes")
    p.add_argument("--quant-linear", action="store_true",
                   help="tune quant_linear's launches of 1 to 128 rows at --model's shapes (int4 g128, fp8 block 128)")
    p.add_argument("--quant-formats", type=quant_formats, default=None,
                   help=f"with --quant-linear, the formats to tune: {', '.join(f for f, _ in QUANT_FORMATS)} "
                        "(default all)")
    p.add_argument("--quant-rows", type=quant_rows, default=QUANT_ROWS,
                   help="with --quant-linear, the row counts to tune, one per rows bucket: "
                        f"{','.join(map(str, QUANT_ROWS))} (default all)")
    p.add_argument("--model", type=model_shapes, default="llama3-8b",
                   help=f"{', '.join(MODELS)} or the path of a config.json (default llama3-8b)")
    p.add_argument("--kinds", type=name_list, default=None, help=f"mask kinds to time (default all: {','.join(KINDS)})")
    p.add_argument("--dry-run", action="store_true", help="print what would be measured; time and write nothing")
    p.add_argument("--cache", default=None, help="the cache file to write (default $TIGON_CACHE_DIR/tuned.json or "
                                                 "~/.cache/tigon/tuned.json, the one Tigon reads)")
    p.add_argument("--times", default=None, metavar="PATH",
                   help="also write every launch timed (decode_linear, quant_linear), not only the winners, as JSON")


@dataclasses.dataclass(frozen=True)
class Projection:
    """One decode_linear launch of a decoder layer: `ns` the fused weights' output widths."""

    name: str
    batch: int
    K: int
    ns: tuple
    kind: str

    @property
    def n_total(self) -> int:
        return self.ns[0] if "glu" in self.kind else sum(self.ns)

    def key(self, bucket: int) -> tuple:
        return (self.K, self.n_total, bucket, self.kind)


def projections(m: dict) -> list:
    """The launches of one decoder layer's decode step: batch 1 with the norms fused, batch 8 after them."""
    q, kv, h, i = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["hidden"], m["inter"]
    out = []
    for batch, norm in ((1, "norm"), (8, "")):
        out += [Projection(f"{norm}+qkv".strip("+"), batch, h, (q, kv, kv), norm or "plain"),
                Projection("o+residual", batch, q, (h,), "residual"),
                Projection(f"{norm}+gate_up+glu".strip("+"), batch, h, (i, i), "+".join(filter(None, (norm, "glu")))),
                Projection("down+residual", batch, i, (h,), "residual")]
    return out


@dataclasses.dataclass(frozen=True)
class QuantLaunch:
    """One quant_linear launch of a decoder layer's decode step: `N` the stored rows ([gate; up] with a GLU)."""

    name: str
    rows: int
    K: int
    N: int
    glu: bool
    fmt: str
    group: int

    @property
    def n_out(self) -> int:
        return self.N // 2 if self.glu else self.N

    def key(self, bucket: int) -> tuple:
        return (self.K, self.n_out, bucket, self.fmt, self.group, self.glu)


def quant_launches(m: dict, formats=None, row_counts=QUANT_ROWS) -> list:
    """The quant_linear launches of one decoder layer at `row_counts` rows (QUANT_ROWS), per format (a 4-bit format
    only where its groups tile K: a QuantizedWeight's rule)."""
    q, kv, h, i = m["heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"], m["hidden"], m["inter"]
    shapes = (("qkv", h, q + 2 * kv, False), ("o", q, h, False), ("gate_up+glu", h, 2 * i, True), ("down", i, h, False))
    return [QuantLaunch(name, rows, K, N, glu, fmt, group) for fmt, group in formats or QUANT_FORMATS
            for rows in row_counts for name, K, N, glu in shapes if fmt == "fp8" or (K % group == 0 and K % 2 == 0)]


def quant_grid(rows: int, fmt: str) -> list:
    """The QuantLinearConfigs timed beside the rule's at `rows`: the GEMV's grid at 1 row, the decode tensor-core
    kernel's to 16, the GEMM's above, and for int4 the code-MMA kernel's (another format would run those as the
    grid's own launches)."""
    from tigon.ops import QuantLinearConfig

    kernel = "gemv" if rows == 1 else "decode" if rows <= 16 else "gemm"
    mma = (QUANT_MMA_GEMM if kernel == "gemm" else QUANT_MMA) if fmt.startswith("int4") else []
    return [QuantLinearConfig(**c) for c in QUANT_GRID[kernel] + mma]


def backends_for(kind: str) -> list:
    """HF's pick first, then the backends training_attention_forward may rank for `kind`."""
    from tigon.hf.attention_table import hf_pick

    return [hf_pick(kind)] + [b for b in ("varlen", "flex", "flash_attn") if not (b == "varlen" and "softcap" in kind)]


def feasible(cfg, p: Projection, limit: int) -> bool:
    """A launch that runs as named at p's shape: whole K steps per split, a GLU unsplit, within shared memory."""
    dl = importlib.import_module("tigon.ops.decode_linear")
    glu, norm = "glu" in p.kind, "norm" in p.kind
    if (glu and cfg.split_k != 1) or p.K % cfg.block_k or cfg.block_n > dl._launch.next_power_of_2(p.n_total):
        return False
    k_split, split = dl._split_of(p.K, cfg.block_k, cfg.split_k)
    return split == cfg.split_k and k_split >= 2 * cfg.block_k and dl._smem_bytes(cfg, 2, glu, norm) <= limit


def _fitted(cfg, p: Projection, limit: int):
    """cfg with fewer stages (2 at least: a pipeline) until its shared memory fits `limit`."""
    dl = importlib.import_module("tigon.ops.decode_linear")
    while cfg.num_stages > 2 and dl._smem_bytes(cfg, 2, "glu" in p.kind, "norm" in p.kind) > limit:
        cfg = dataclasses.replace(cfg, num_stages=cfg.num_stages - 1)
    return cfg


def stage_configs(p: Projection, stage: int, ranked: list, limit: int) -> list:
    """The configs of search stage 0, 1 or 2 (`ranked`: those timed so far, fastest first)."""
    from tigon.ops.config import DecodeLinearConfig

    if stage == 1:
        return [_fitted(dataclasses.replace(c, block_k=bk), p, limit) for c in ranked[:2] for bk in (128, 256, 512)]
    if stage == 2:
        return [dataclasses.replace(c, num_warps=w, num_stages=s) for c in ranked[:2] for w in (4, 8) for s in (3, 4)]
    splits = (1,) if "glu" in p.kind else (1, 2, 4, 8)
    return [_fitted(DecodeLinearConfig(bn, 256, 4, 3 if "glu" in p.kind else 4, split), p, limit)
            for bn in (16, 32, 64, 128) for split in splits]


def search(p: Projection, time_of, must: list, limit: int, seeds=None) -> dict:
    """{config: ms} of the staged search (or of `seeds` alone), `must` (the rule, the shipped pick) always timed."""
    timed: dict = {}

    def run(configs):
        for c in configs:
            if c not in timed and (c in must or feasible(c, p, limit)):
                timed[c] = time_of(c)

    run(must)
    for stage in ((),) if seeds is not None else (0, 1, 2):
        run(seeds if seeds is not None else stage_configs(p, stage, sorted(timed, key=timed.get), limit))
    return timed


def attention_winners(kind: str, times: dict) -> tuple | None:
    """The backends >= MIN_GAIN faster than HF's pick, fastest first; None where HF's pick has no time (the
    kind keeps the shipped row or the rule). times: {backend: ms, or a str saying why it did not run}."""
    from tigon.hf.attention_table import hf_pick

    hf = times.get(hf_pick(kind))
    if not isinstance(hf, float):
        return None
    fast = {b: t for b, t in times.items() if isinstance(t, float) and b != hf_pick(kind) and t * (1 + MIN_GAIN) <= hf}
    return tuple(sorted(fast, key=fast.get))


def decode_choice(times: dict, rule, shipped):
    """The config to cache for one shape (None: nothing): the fastest where it beats the rule by MIN_GAIN, else
    the rule where a shipped pick exists (measured here: not faster on this card)."""
    best = min(times, key=times.get)
    if math.isinf(times[best]):
        return None  # nothing ran
    if best != rule and times[best] * (1 + MIN_GAIN) <= times[rule]:
        return best
    return rule if shipped is not None and math.isfinite(times[rule]) else None


def _winners(rows, head: str, key_of, cells_of, rule_label: str = "rule") -> dict:
    """{key: config ints} to cache from measured launches [(launch, {config: ms}, rule, shipped pick)]
    (`decode_choice`), printed as a table: `head` and `cells_of(launch, rule)` the first columns, then the rule's
    time (`rule_label`), the fastest config and its time, and what is cached."""
    print(f"\n| {head} | {rule_label} us | fastest | fastest us | cached |\n" + "|---" * (head.count("|") + 5) + "|")
    out = {}
    for p, times, rule, shipped in rows:
        best = min(times, key=times.get)
        chosen = decode_choice(times, rule, shipped)
        if chosen is not None:
            out[key_of(p)] = tuple(chosen.ints())
        print(f"| {cells_of(p, rule)} | {1e3 * times[rule]:.2f} | {_ints(best)} | {1e3 * times[best]:.2f} | "
              f"{_ints(chosen) if chosen else '-'} |")
    return out


def _attention_case(kind: str, device):
    import torch

    gen = torch.Generator(device=device).manual_seed(0)

    def randn(*shape, grad=True):
        return torch.randn(*shape, device=device, dtype=torch.bfloat16, generator=gen).requires_grad_(grad)

    q, k, v = randn(1, HEADS, TOKENS, HEAD_DIM), randn(1, KV_HEADS, TOKENS, HEAD_DIM), randn(1, KV_HEADS, TOKENS,
                                                                                                HEAD_DIM)
    go = randn(1, TOKENS, HEADS, HEAD_DIM, grad=False)
    docs = cu = max_length = None
    if "packed" in kind:
        max_length = TOKENS // DOCS
        docs = torch.arange(TOKENS, device=device)[None] // max_length
        cu = torch.arange(0, TOKENS + 1, max_length, device=device, dtype=torch.int32)
    window, softcap = WINDOW if "sliding" in kind else None, SOFTCAP if "softcap" in kind else None
    return q, k, v, go, docs, cu, max_length, window, softcap


def _layer():
    """What HF's attention functions read from the attention module. Its class sits in Gemma-2's modeling module
    (the family that caps its logits): `hf_attention` runs that module's eager attention for a softcapping layer."""
    import torch

    module = importlib.import_module("transformers.models.gemma2.modeling_gemma2")
    layer = type("Gemma2Attention", (torch.nn.Module,), {"__module__": module.__name__, "is_causal": True})()
    layer.num_key_value_groups, layer.head_dim = HEADS // KV_HEADS, HEAD_DIM
    return layer


def _attention_call(ta, backend, layer, q, k, v, docs, cu, max_length, window, softcap):
    """The forward of `backend` as training_attention_forward calls it, or a str saying why it cannot run."""
    scale = HEAD_DIM ** -0.5
    if backend == "varlen":
        plan = ta.varlen_plan(q, k, scaling=scale, docs=docs, window=window, softcap=softcap, cu=cu,
                              max_length=max_length)
        return plan if isinstance(plan, str) else (lambda: ta.varlen_attention_forward(q, k, v, plan))
    if backend in ("flex", "flash_attn") and not ta._eligible(backend, q, k, 0.0, docs, cu, max_length):
        return f"{backend} cannot take it here" + (" (not installed)" if backend == "flash_attn" else "")
    if backend == "flex":
        mask = ta.TrainingMask(docs, window)
        return lambda: ta.flex_attention_forward(q, k, v, scaling=scale, docs=docs, window=window, softcap=softcap,
                                                 mask=mask)
    if backend == "flash_attn":
        return lambda: ta._flash_attn_forward(q, k, v, scaling=scale, window=window, softcap=softcap,
                                              cu=cu if docs is not None else None, max_length=max_length)
    dense = None if docs is None and window is None else ta.dense_mask(docs, window, TOKENS, q.device)
    if backend == "eager" and dense is None:
        dense = ta.dense_mask(None, None, TOKENS, q.device)  # eager takes no is_causal
    return lambda: ta.hf_attention(layer, q, k, v, dense, dropout=0.0, scaling=scale, sliding_window=window,
                                   softcap=softcap)[0]


def measure_attention(kinds, device) -> dict:
    """{kind: {backend: fwd+bwd ms, or why it did not run}}."""
    import torch
    from triton.testing import do_bench

    from tigon.hf import training_attention as ta

    layer, results = _layer(), {}
    for kind in kinds:
        q, k, v, go, *case = _attention_case(kind, device)
        results[kind] = {}
        for backend in backends_for(kind):
            try:
                fn = _attention_call(ta, backend, layer, q, k, v, *case)
                if not isinstance(fn, str):
                    fn = do_bench(lambda fn=fn, go=go: fn().backward(go), grad_to_none=[q, k, v],
                                  return_mode="median")
            except Exception as e:  # noqa: BLE001  (out of memory, no kernel for this card: not a winner)
                fn = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:80] if str(e).strip() else ''}"
            results[kind][backend] = float(fn) if not isinstance(fn, str) else fn
            print(f"  attention {kind:<24} {backend:<10} {_ms(results[kind][backend])}", flush=True)
        del q, k, v, go, case
        torch.cuda.empty_cache()
    return results


def measure_decode(model: dict, device, gpu: str) -> list:
    """[(Projection, {config: ms}, rule, shipped pick or None)] at the model's shapes."""
    import torch
    from triton.testing import do_bench

    from tigon import ops
    from tigon.ops import decode_linear_picks
    from tigon.ops.config import DecodeLinearConfig

    dl = importlib.import_module("tigon.ops.decode_linear")
    index, rows, best_of = device.index or 0, [], {}
    limit, sms = dl._smem_limit(device), dl._launch.sm_count(index)
    for p in projections(model):
        glu, norm = "glu" in p.kind, "norm" in p.kind
        rule = dl._fit_smem(dl._rule_config(p.K, p.n_total, glu, norm, sms), 2, glu, norm, limit)
        shipped = decode_linear_picks.lookup(gpu, p.K, p.n_total, p.batch, p.kind, decode_linear_picks.MEASURED_PICKS)
        must = [rule] + ([DecodeLinearConfig(*shipped)] if shipped else [])
        x = torch.randn(p.batch, p.K, device=device, dtype=torch.bfloat16)
        ws = [torch.randn(n, p.K, device=device, dtype=torch.bfloat16) * p.K ** -0.5 for n in p.ns]
        extra = dict(norm_weight=torch.ones(p.K, device=device, dtype=torch.bfloat16) if norm else None,
                     residual=torch.randn(p.batch, p.n_total, device=device, dtype=torch.bfloat16)
                     if "residual" in p.kind else None, activation="silu" if glu else None)

        def time_of(cfg, x=x, ws=ws, extra=extra):
            try:
                with torch.inference_mode():
                    return float(do_bench(lambda: ops.decode_linear(x, ws, config=cfg, **extra), warmup=5, rep=25,
                                          return_mode="median"))
            except Exception:  # noqa: BLE001  (a launch this card cannot compile: never the winner)
                return math.inf

        seeds = best_of.get((p.K, p.ns)) if p.batch > 1 else None
        times = search(p, time_of, must, limit, seeds)
        best_of[(p.K, p.ns)] = sorted(times, key=times.get)[:4]
        rows.append((p, times, rule, shipped))
        print(f"  decode_linear {p.name:<16} batch {p.batch}: {len(times)} launches timed", flush=True)
        del x, ws, extra
    return rows


def _quant_weight(p: QuantLaunch, device, gen):
    """A random QuantizedWeight of p's format and shape (the values do not change a launch's time)."""
    import torch

    from tigon.ops import QuantizedWeight
    from tigon.ops.quantized_weight import pack_int4

    N, K, G = p.N, p.K, p.group
    if p.fmt == "fp8":
        data = torch.randn(N, K, generator=gen, device=device).to(torch.float8_e4m3fn)
        scales = torch.rand((-(-N // G), -(-K // G)) if G else (N,), generator=gen, device=device) * 0.01
        return QuantizedWeight("fp8", data, scales.to(torch.bfloat16), None, G, (N, K), torch.bfloat16)
    codes = torch.randint(0, 16, (N, K), generator=gen, device=device, dtype=torch.uint8)
    scales = (torch.rand(N, K // G, generator=gen, device=device) * 0.01).to(torch.bfloat16)
    zeros = torch.full_like(scales, 8.0) if p.fmt == "int4_zeros" else None
    return QuantizedWeight("nf4" if p.fmt == "nf4" else "int4", pack_int4(codes), scales, zeros, G, (N, K),
                           torch.bfloat16)


def same_product(got, expected) -> bool:
    """Whether two launches of one product agree to rounding: each sums its fp32 products in its own order (split-K,
    tile shapes), the tensor-core kernel rounds each weight to bf16 first, and each output is rounded to bf16 once
    (2^-9 relative apiece), so their norm-relative difference stays near 2^-8; a launch that reads the wrong layout
    or scales is off by O(1). The bound, 2^-5, sits between the two."""
    import torch

    got = got.float()
    return bool(torch.isfinite(got).all()) and float((got - expected).norm()) <= 2.0**-5 * float(expected.norm())


def measure_quant(model: dict, device, gpu: str, formats=None, row_counts=QUANT_ROWS) -> list:
    """[(QuantLaunch, {config: ms}, rule, shipped pick or None)] at the model's shapes: ms per call replayed from a
    CUDA graph that calls it once on each of enough weight copies to pass QUANT_GRAPH_BYTES."""
    import torch
    from triton.testing import do_bench_cudagraph

    from tigon import ops
    from tigon.ops import QuantLinearConfig, quant_linear_picks

    rows, gen = [], torch.Generator(device=device).manual_seed(0)
    for p in quant_launches(model, formats, row_counts):
        rule = QuantLinearConfig()  # passed as a config: the rule's launch, never a pick
        shipped = quant_linear_picks.lookup(gpu, p.K, p.n_out, p.rows, p.fmt, p.group, p.glu,
                                            quant_linear_picks.MEASURED_PICKS)
        first = _quant_weight(p, device, gen)
        copies = max(2, min(32, -(-QUANT_GRAPH_BYTES // first.nbytes)))
        ws = [first] + [_quant_weight(p, device, gen) for _ in range(copies - 1)]
        x = torch.randn(p.rows, p.K, device=device, dtype=torch.bfloat16)
        act = "silu" if p.glu else None

        with torch.inference_mode():
            expected = ops.quant_linear(x, first, activation=act, config=rule).float()

        def time_of(cfg, x=x, ws=ws, act=act, expected=expected):
            def step():
                for w in ws:
                    ops.quant_linear(x, w, activation=act, config=cfg)
            try:
                with torch.inference_mode():
                    got = ops.quant_linear(x, ws[0], activation=act, config=cfg)  # compiles outside the capture
                    if not same_product(got, expected):
                        print(f"  quant_linear {tuple(cfg.ints())}: a different product from the rule's launch; "
                              "not timed", flush=True)
                        return math.inf
                    step()  # allocates outside the capture
                    return float(do_bench_cudagraph(step, rep=20, return_mode="median")) / len(ws)
            except Exception:  # noqa: BLE001  (a launch this card cannot compile: never the winner)
                return math.inf

        configs = [rule] + ([QuantLinearConfig(*shipped)] if shipped else []) + quant_grid(p.rows, p.fmt)
        times = {c: time_of(c) for c in dict.fromkeys(configs)}
        rows.append((p, times, rule, shipped))
        print(f"  quant_linear {p.fmt}-g{p.group} {p.name:<12} rows {p.rows}: {len(times)} launches timed", flush=True)
        del ws, first, x
        torch.cuda.empty_cache()
    return rows


def _ms(t) -> str:
    return f"{t:.3f} ms" if isinstance(t, float) else t


def _ints(cfg) -> str:
    return str(tuple(cfg.ints()))


def dry_run(args, kinds, gpu) -> int:
    from tigon.ops import tuned_cache

    print(f"tigon tune --dry-run: nothing is timed or written. GPU: {gpu or 'none here'}; cache: "
          f"{args.cache or tuned_cache.cache_path()}")
    if args.attention:
        print(f"attention, fwd+bwd, bf16, 1 x {TOKENS} tokens (packed: {DOCS} documents of {TOKENS // DOCS}), "
              f"{HEADS} / {KV_HEADS} heads of {HEAD_DIM}, window {WINDOW}, softcap {SOFTCAP:g}; per mask kind:")
        for kind in kinds:
            first, *rest = backends_for(kind)
            print(f"  {kind:<24} {first} (HF's pick) against {', '.join(rest)}")
    if args.decode_linear:
        print(f"decode_linear at {args.model['name']}'s shapes, bf16: the rule's launch against a staged search "
              "(batch 8: batch 1's four best); per launch:")
        for p in projections(args.model):
            print(f"  {p.name:<18} batch {p.batch}  K {p.K:<6} N {p.n_total:<6} kind {p.kind}")
    if args.quant_linear:
        print(f"quant_linear at {args.model['name']}'s shapes, bf16 x, CUDA-graph timing over weight copies: the "
              "default launch (the rule) against a grid (1 row: the GEMV's; 8 rows: the decode tensor-core kernel's; "
              "32 and 128 rows: the GEMM's); per launch:")
        for p in quant_launches(args.model, args.quant_formats, args.quant_rows):
            print(f"  {p.fmt + '-g' + str(p.group):<10} {p.name:<12} rows {p.rows}  K {p.K:<6} N {p.n_out:<6} "
                  f"{len(quant_grid(p.rows, p.fmt)) + 1} launches")
    return 0


def write_times(path: str, gpu: str, timed: dict) -> None:
    """Every launch timed, per op: the launch's fields, the rule's config and {config ints: ms} (inf: did not run
    or computed another product), as JSON at `path`."""
    out = {op: [dict(launch=dataclasses.asdict(p), rule=list(rule.ints()),
                     times={_ints(c): (ms if math.isfinite(ms) else None) for c, ms in times.items()})
                for p, times, rule, _ in rows] for op, rows in timed.items()}
    with open(path, "w") as f:
        json.dump(dict(gpu=gpu, **out), f, indent=1)


def cmd_tune(args) -> int:
    if not (args.attention or args.decode_linear or args.quant_linear):
        args.attention = args.decode_linear = True
    kinds = KINDS if args.kinds is None else tuple(k.strip() for k in args.kinds.split(","))
    unknown = [k for k in kinds if k not in KINDS]
    if unknown:
        print(f"tigon tune: unknown mask kind(s) {unknown}; known: {', '.join(KINDS)}", file=sys.stderr)
        return 2
    try:
        with _log.requires_extra("tigon tune"):
            import torch

            from tigon.ops import tuned_cache
            from tigon.ops.decode_linear_picks import batch_bucket
            if args.attention:
                importlib.import_module("transformers")
    except ModuleNotFoundError as e:
        print(f"tigon: {e}", file=sys.stderr)
        return 2
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    if args.dry_run:
        return dry_run(args, kinds, gpu)
    if gpu is None:
        print(NEEDS_GPU.format(torch=torch.__version__), file=sys.stderr)
        return 2
    device, t0 = torch.device("cuda", 0), time.time()
    print(f"tigon tune on {gpu} (torch {torch.__version__}); winners need {MIN_GAIN:.0%} over the default", flush=True)
    attention, decode, quant = {}, {}, {}
    if args.attention:
        times = measure_attention(kinds, device)
        print("\n| mask kind | " + " | ".join(f"{b} fwd+bwd" for b in ("sdpa / eager", "varlen", "flex", "flash_attn"))
              + " | cached ranking |\n|---|---|---|---|---|---|")
        for kind, row in times.items():
            won = attention_winners(kind, row)
            if won is not None:
                attention[kind] = won
            cells = [_ms(row.get(b, "-")) for b in (backends_for(kind)[0], "varlen", "flex", "flash_attn")]
            shown = "not written: HF's pick did not run" if won is None else " > ".join(won) or "HF's pick"
            print(f"| {kind} | " + " | ".join(cells) + f" | {shown} |")
    timed = {}
    if args.decode_linear:
        timed["decode_linear"] = measure_decode(args.model, device, gpu)
        decode = _winners(timed["decode_linear"], "launch | batch | K | N | kind | rule",
                          lambda p: p.key(batch_bucket(p.batch)),
                          lambda p, rule: f"{p.name} | {p.batch} | {p.K} | {p.n_total} | {p.kind} | {_ints(rule)}")
    if args.quant_linear:
        from tigon.ops.quant_linear_picks import rows_bucket

        timed["quant_linear"] = measure_quant(args.model, device, gpu, args.quant_formats, args.quant_rows)
        quant = _winners(timed["quant_linear"], "launch | format | rows | K | N",
                         lambda p: p.key(rows_bucket(p.rows)),
                         lambda p, rule: f"{p.name} | {p.fmt}-g{p.group} | {p.rows} | {p.K} | {p.n_out}", "default")
    if args.times:
        write_times(args.times, gpu, timed)
    path = tuned_cache.write(gpu, attention=attention, decode_linear=decode, quant_linear=quant, path=args.cache,
                             info=dict(tigon=__version__, updated=time.strftime("%Y-%m-%dT%H:%M:%S%z")))
    print(f"\nwrote {len(attention)} attention rows, {len(decode)} decode_linear picks and {len(quant)} quant_linear "
          f"picks for {gpu} to {path} ({time.time() - t0:.0f} s); `tigon env` shows where each choice comes from")
    return 0
