"""A/B of the decode step's settings on the 1.5B Llama of bench_decode (GPU): programmatic dependent launch
off, on the projections only, on the whole chain (RoPE + cache write, attention), the projections' L2 prefetch
budget (ops.decode_linear.PREFETCH_BYTES), the attention's split size and decode_qkv_rope on or off. Every
setting runs tigon.generate (CUDA graph, greedy) in the same process on the same model and prompt; the tokens
must equal the first setting's.

    PYTHONPATH=src python benchmarks/sweep_decode_pdl.py --out benchmarks/results [--batches 1,8] [--new 256]

Writes decode_pdl.md / decode_pdl.json: p50 / p99 / mean ms per step per setting and batch, and the ratio to
the first row, and the TTFT median with the library's defaults.
"""

import argparse
import importlib
import json
import os
import sys
import types

import torch

# Each setting: the library's defaults with these overrides. pdl: programmatic dependent launch on; chain: the
# RoPE / attention kernels take part too; prefetch: bytes per projection; split: min slots per attention split;
# rope: q/k/v, RoPE and the cache write in one kernel (decode_qkv_rope); rope_bn: its rotation pairs per program;
# table: the cos/sin table of tigon.hf.rotary_table instead of HF's rotary module each step.
SETTINGS = [
    ("no PDL", dict(pdl=False)),
    ("no PDL, decode_qkv_rope (q/k/v + RoPE + cache write)", dict(pdl=False, rope=True)),
    ("no PDL, HF rotary module every step", dict(pdl=False, table=False)),
    ("no PDL, attention splits >= 32 slots", dict(pdl=False, split=32)),
    ("no PDL, decode_qkv_rope, 32 pairs a program", dict(pdl=False, rope=True, rope_bn=32)),
    ("PDL projections only", dict(pdl=True, chain=False)),
    ("PDL chain", dict(pdl=True)),
    ("PDL chain, prefetch 24 MB", dict(pdl=True, prefetch=24 << 20)),
]
DEFAULT = None  # the library's settings, read before the sweep changes them


def _mods():
    """(generation, decode_layer, _pdl, decode_attention, decode_linear, kv_write) modules (tigon.ops.decode_linear
    and tigon.ops.decode_attention are the functions: importlib for the modules)."""
    return tuple(importlib.import_module(f"tigon.{m}") for m in ("generation", "hf.decode_layer", "ops._pdl",
                                                                  "ops.decode_attention", "ops.decode_linear",
                                                                  "ops.kv_write"))


def _defaults():
    generation, decode_layer, _pdl, decode_attention, decode_linear, _ = _mods()

    return dict(pdl=_pdl.ENABLED is not False, chain=True, prefetch=decode_linear.PREFETCH_BYTES,
                split=decode_attention._MIN_SPLIT_SLOTS, rope=decode_layer.ROPE_IN_QKV,
                rope_bn=decode_linear.ROPE_BLOCK_N, table=generation.ROTARY_TABLE)


def _apply(over):
    generation, decode_layer, _pdl, decode_attention, decode_linear, kv_write = _mods()
    c = dict(DEFAULT, **over)
    generation.ROTARY_TABLE = c["table"]
    _pdl.ENABLED = None if c["pdl"] else False
    decode_linear.PREFETCH_BYTES = c["prefetch"]
    decode_linear.ROPE_BLOCK_N = c["rope_bn"]
    decode_attention._MIN_SPLIT_SLOTS = c["split"]
    decode_layer.ROPE_IN_QKV = c["rope"]
    # Without the chain the RoPE and attention kernels launch plainly (their PDL constexpr off).
    plain = types.SimpleNamespace(launch=lambda kernel, grid, args, meta, device: kernel[grid](*args, **meta))
    for mod in (decode_attention, kv_write):
        mod._pdl = _pdl if c["chain"] else plain


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--batches", default="1,8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--new", type=int, default=256)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("sweep_decode_pdl: needs a CUDA GPU")
        return 1
    import tigon
    from tigon.bench_decode import _build, _percentile

    global DEFAULT
    DEFAULT = _defaults()  # the library's own settings, restored for the TTFT calls and at the end
    rows, ttfts = [], {}
    for batch in [int(b) for b in args.batches.split(",")]:
        spec = dict(quick=False, prompt=args.prompt, new=args.new, device="cuda", family="llama", batch=batch,
                    window=None)
        model, ids = _build(spec)
        tigon.patch(model)
        ref = None
        for name, over in SETTINGS:
            _apply(over)
            kw = dict(max_new_tokens=args.new, return_stats=True)
            tigon.generate(model, ids, **dict(kw, max_new_tokens=16))  # JIT for this setting
            seqs, stats = tigon.generate(model, ids, **kw)
            steps = sorted(stats["step_s"][1:])  # the first decode step includes the graph capture
            same = ref is None or torch.equal(seqs, ref)
            ref = seqs if ref is None else ref
            row = dict(batch=batch, setting=name, p50_ms=1e3 * _percentile(steps, 0.5),
                       p99_ms=1e3 * _percentile(steps, 0.99), mean_ms=1e3 * sum(steps) / len(steps),
                       tokens_equal_first=same, cuda_graph=stats["cuda_graph"])
            rows.append(row)
            print(json.dumps(row), flush=True)
        # Time to first token with the library's defaults: median of 5 prefill-only calls (host phases included).
        _apply({})
        ttft = sorted(tigon.generate(model, ids, max_new_tokens=1, return_stats=True)[1]["ttft_s"] for _ in range(5))
        ttfts[batch] = 1e3 * ttft[2]
        print(json.dumps(dict(batch=batch, ttft_ms_median=ttfts[batch], ttft_ms=[1e3 * t for t in ttft])), flush=True)
        del model
        torch.cuda.empty_cache()
    _apply({})
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "decode_pdl.json"), "w") as f:
        json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows, ttft_ms_median=ttfts),
                  f, indent=1)
    lines = [f"# Decode step: launch chaining A/B ({torch.cuda.get_device_name()}, 1.5B Llama, prompt {args.prompt}, "
             f"{args.new} new, greedy, CUDA graph)", "",
             "| batch | setting | p50 ms/step | p99 ms/step | mean ms/step | p50 vs no PDL | tokens equal |",
             "|---|---|---|---|---|---|---|"]
    base = {r["batch"]: r["p50_ms"] for r in rows if r["setting"] == SETTINGS[0][0]}
    for r in rows:
        lines.append(f"| {r['batch']} | {r['setting']} | {r['p50_ms']:.3f} | {r['p99_ms']:.3f} | {r['mean_ms']:.3f} | "
                     f"{r['p50_ms'] / base[r['batch']]:.3f} | {'yes' if r['tokens_equal_first'] else '**no**'} |")
    lines += ["", "TTFT (median of 5 prefill-only calls, the library's defaults): "
              + ", ".join(f"batch {b}: {t:.1f} ms" for b, t in ttfts.items())]
    with open(os.path.join(args.out, "decode_pdl.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(r["tokens_equal_first"] for r in rows) else 2


if __name__ == "__main__":
    sys.exit(main())
