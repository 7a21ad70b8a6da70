"""Long-context LoRA training: peak memory and step time per sequence length, and the longest step that runs.

The job: Llama-3-8B shape (random init from its config), bf16 base, PEFT LoRA r=16 on all seven projections,
gradient checkpointing (non-reentrant), batch 1, labels = input_ids, AdamW on the adapters. Variants, each in its
own process (an OOM costs that variant only), every length of --seqs in ascending order inside it:
- hf: HF + PEFT, nothing else;
- liger: apply_liger_kernel_to_llama() before the model is built;
- liger-tiled: liger with each decoder MLP replaced by Liger's LigerTiledSwiGLUMLP (its default shards);
- tigon: tigon.patch(model, offload_checkpoints=False) (the fused kernels, checkpoints on the card: the default
  "auto" would move them to host memory at a length that does not fit);
- tigon-offload: tigon.patch(model, offload_checkpoints=True, tile_mlp=True): checkpoints in pinned host memory
  and the MLP over tiles of the sequence (docs/memory/offload.md, docs/memory/tiling.md);
- tigon-offload-notile: the checkpoints in host memory only (the same math as tigon, so the same bits).
Any variant with "-qlora" appended ("tigon-offload-qlora") runs QLoRA instead: every decoder projection an NF4
bitsandbytes Linear4bit (blocksize 64, double quant), quantized from the same bf16 init as bench_lora's QLoRA rows.
Each length: one warm-up step, then --steps timed steps (--steps 0: one step, timed; wall time after a
synchronize; the median); peak = max_memory_allocated over those steps. --cap-gib caps the card
(torch.cuda.set_per_process_memory_fraction), so an H200 stands in for an 80 GB card. --longest N runs one
more child, --longest-variant (tigon-offload) at N tokens, one step (peak and time). --cap-gib is set after the
model is built (and quantized), so a QLoRA model whose bf16 init would not fit the cap still runs under it.
--curve-steps N: each of --curve-variants trains N steps at --curve-seq tokens from the same init and data
(a new random batch each step), and the table gives each curve's largest difference from the first variant's:
run "tigon" twice to see the card's run-to-run noise (its attention backward is not deterministic); tigon-offload
tiles its MLP by --curve-tile there (the curve is shorter than an "auto" tile). --tile-tokens fixes the tile of
the other runs. --deterministic runs torch's deterministic algorithms (SDPA's deterministic flash backward), so
that curves whose math is the same can be compared bit for bit; the curves run the adapters with dropout
(--curve-dropout 0.05), so a recompute that drew new masks would show. --memory-profile records the allocator through
the first timed step (whose time then includes the recording) and lists the blocks live at its peak by the code
that allocated them (benchmarks/tools/memory_peak.py); --layers N builds N decoder layers instead of 32 (one
layer's working set is the same).
The slope per 1K tokens is fitted over the lengths that ran (least squares), with the longest length that fits
the cap by that slope.

    python -m benchmarks long-context --out DIR [--variants ...] [--seqs 16384,32768,65536] [--longest 262144]
    python -m benchmarks long-context --smoke      # CPU: 2 tiny layers, Tigon's kernels interpreted
"""

import argparse
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time

from benchmarks.tools import checkout, memory_peak

VARIANTS = ("hf", "liger", "liger-tiled", "tigon", "tigon-offload", "tigon-offload-notile")
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FULL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            vocab_size=128256, num_hidden_layers=32)
SMOKE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512,
             num_hidden_layers=2)


def parse_variant(variant):
    """(base variant, qlora): 'tigon-offload-qlora' -> ('tigon-offload', True)."""
    return variant.removesuffix("-qlora"), variant.endswith("-qlora")


def build(variant, smoke, dev, max_len, tile_tokens="auto", layers=0, lora_dropout=0.0):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from benchmarks.training.bench_lora import quantize_projections

    variant, qlora = parse_variant(variant)

    if variant.startswith("liger"):
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama(swiglu=variant == "liger")
    cfg = LlamaConfig(**dict(SMOKE if smoke else FULL, **({"num_hidden_layers": layers} if layers else {})),
                      rope_theta=500000.0, max_position_embeddings=max_len, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with dev:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    if qlora:
        quantize_projections(model, double_quant=True, compute_dtype=torch.bfloat16)
    if variant == "liger-tiled":
        from liger_kernel.transformers import LigerTiledSwiGLUMLP

        for layer in model.model.layers:
            tiled = LigerTiledSwiGLUMLP(cfg).to(dev, torch.bfloat16)
            tiled.load_state_dict(layer.mlp.state_dict())
            layer.mlp = tiled
    if variant.startswith("tigon"):
        import tigon

        extra = {"tigon": dict(offload_checkpoints=False),
                 "tigon-offload": dict(offload_checkpoints=True, tile_mlp=True if tile_tokens == "auto" else
                                       int(tile_tokens)),
                 "tigon-offload-notile": dict(offload_checkpoints=True)}[variant]
        tigon.patch(model, **extra)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=lora_dropout, target_modules=TARGETS))
    model.enable_input_require_grads()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4,
                            fused=dev.type == "cuda")
    return model, opt, cfg.vocab_size


def child(variant, a):
    import torch

    cuda = not a.smoke
    dev = torch.device("cuda" if cuda else "cpu")
    if a.deterministic:  # strict: SDPA's flash backward then runs its deterministic kernel, cuDNN's is not picked
        torch.use_deterministic_algorithms(True)
    seqs = a.seqs
    model, opt, vocab = build(variant, a.smoke, dev, max(seqs), a.tile_tokens, a.layers, a.lora_dropout)
    if cuda and a.cap_gib:
        torch.cuda.empty_cache()
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, a.cap_gib * 2**30 / total))
    rows = []
    for seq in seqs:
        g = torch.Generator(device=dev).manual_seed(seq)
        ids = torch.randint(0, vocab, (1, seq), device=dev, generator=g)
        row = dict(variant=variant, seq=seq, weights_gib=round(torch.cuda.memory_allocated() / 2**30, 2)
                   if cuda else None)
        losses = []
        try:
            if cuda:
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
            times = []
            for i in range(1 + a.steps if a.steps else 1):
                if i and a.new_batches:
                    ids = torch.randint(0, vocab, (1, seq), device=dev, generator=g)
                t0 = time.perf_counter()
                profiled = cuda and a.memory_profile and i == (1 if a.steps else 0)
                with memory_peak.recording() if profiled else contextlib.nullcontext() as rec:
                    loss = model(input_ids=ids, labels=ids).loss
                    loss.backward()
                    opt.step()
                    opt.zero_grad(set_to_none=True)
                    if cuda:
                        torch.cuda.synchronize()
                if profiled:
                    row["memory_peak"] = dict(memory_peak.peak_report(rec["snapshot"]), before=rec["before"])
                    print(memory_peak.text(row["memory_peak"]), file=sys.stderr, flush=True)
                if i or not a.steps:  # --steps 0: the one step is the timed one
                    times.append((time.perf_counter() - t0) * 1e3)
                losses.append(float(loss))
            ms = sorted(times)[len(times) // 2]
            if a.new_batches:
                row["losses"] = losses
            if parse_variant(variant)[0] == "tigon-offload":  # the tile "auto" chose at the first step
                from tigon.memory import tiled_mlp_tile_tokens

                row["tile_tokens"] = tiled_mlp_tile_tokens(model)
            row.update(step_ms=round(ms, 1), tok_s=round(seq / ms * 1e3), loss=float(loss),
                       peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None)
        except torch.OutOfMemoryError:
            row["error"] = "OOM"
            rows.append(row)
            break  # longer lengths cannot fit either
        rows.append(row)
        del ids
    return rows


def slope(rows):
    """(GiB per 1K tokens, intercept GiB) of peak against length, least squares over the rows that ran."""
    pts = [(r["seq"] / 1e3, r["peak_gib"]) for r in rows if r.get("peak_gib") is not None]
    if len(pts) < 2:
        return None
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sxx
    return b, my - b * mx


def run_child(variant, seqs, a, steps=None, new_batches=False, tile_tokens=None, lora_dropout=None):
    needs = ["peft"] + (["liger_kernel"] if variant.startswith("liger") else []) + (
        ["bitsandbytes"] if parse_variant(variant)[1] else [])
    missing = next((n for n in needs if importlib.util.find_spec(n) is None), None)
    if missing:
        return [dict(variant=variant, skipped=f"{missing} not installed")]
    cmd = ["--child", variant, "--seqs", ",".join(map(str, seqs)), "--steps", str(a.steps if steps is None else steps)]
    cmd += ["--cap-gib", str(a.cap_gib), "--layers", str(a.layers),
            "--lora-dropout", str(a.lora_dropout if lora_dropout is None else lora_dropout)] + (
        ["--smoke"] if a.smoke else []) + (
        ["--memory-profile"] if a.memory_profile else []) + (
        ["--new-batches"] if new_batches else []) + ["--tile-tokens", str(tile_tokens or a.tile_tokens)]
    env = os.environ.copy()
    if a.deterministic:
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"  # what torch's deterministic mode asks of cuBLAS
        cmd.append("--deterministic")
    if a.smoke:
        env.setdefault("TRITON_INTERPRET", "1")
    try:
        proc = checkout.run_module(__file__, cmd, timeout=a.timeout, env=env)
        line = next((s for s in proc.stdout.splitlines() if s.startswith("RESULT ")), None)
        return json.loads(line[7:]) if line else [dict(variant=variant, error=(proc.stderr or "no output")[-300:])]
    except subprocess.TimeoutExpired:
        return [dict(variant=variant, error=f"timeout after {a.timeout} s")]


def markdown(rows, a):
    out = [f"Long-context LoRA (Llama-3-8B shape, r=16 on 7 projections, checkpointing, batch 1), cap {a.cap_gib} GiB",
           "", "| variant | tokens | step ms | tokens/s | peak GiB | note |", "|---|---|---|---|---|---|"]
    for r in rows:
        out.append(f"| {r['variant']} | {r.get('seq', '-')} | {r.get('step_ms', '-')} | {r.get('tok_s', '-')} | "
                   f"{r.get('peak_gib', '-')} | {r.get('error') or r.get('skipped') or ''} |")
    out += ["", "| variant | GiB per 1K tokens | longest by the slope at the cap |", "|---|---|---|"]
    for v in dict.fromkeys(r["variant"] for r in rows if not r.get("curve")):
        fit = slope([r for r in rows if r["variant"] == v and r.get("seq") in a.seqs and not r.get("curve")])
        if fit:
            longest = int((a.cap_gib - fit[1]) / fit[0] * 1e3) if fit[0] > 0 else None
            out.append(f"| {v} | {fit[0]:.3f} | {longest} |")
    for r in rows:
        if r.get("memory_peak"):
            before = r["memory_peak"]["before"] / 2**30
            out += ["", f"Memory at the peak of {r['variant']} at {r['seq']} tokens ({before:.2f} GiB allocated "
                    "before the step):", "", memory_peak.text(r["memory_peak"])]
    curves = [r for r in rows if r.get("curve")]
    if curves:
        out += ["", f"Loss curves, {a.curve_steps} steps at {a.curve_seq} tokens (tile {a.curve_tile}, LoRA dropout "
                f"{a.curve_dropout}), against the first run's",
                "", "| run | first loss | last loss | max abs difference | steps bit-equal |", "|---|---|---|---|---|"]
        ref = curves[0].get("losses")
        for i, r in enumerate(curves):
            ls = r.get("losses")
            if not ls or not ref or len(ls) != len(ref):
                out.append(f"| {i}: {r['variant']} | - | - | - | {r.get('error') or r.get('skipped') or ''} |")
                continue
            diff = max(abs(x - y) for x, y in zip(ls, ref))
            same = sum(x == y for x, y in zip(ls, ref))
            out.append(f"| {i}: {r['variant']} | {ls[0]:.6f} | {ls[-1]:.6f} | {diff:.3g} | {same}/{len(ls)} |")
    return "\n".join(out)


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seqs", default=None, help="comma-separated lengths (default 16384,32768,65536; smoke 64,96)")
    p.add_argument("--steps", type=int, default=1, help="timed steps per length, after one warm-up step")
    p.add_argument("--longest", type=int, default=0, help="also one --longest-variant step at this many tokens")
    p.add_argument("--longest-variant", default="tigon-offload")
    p.add_argument("--curve-steps", type=int, default=0, help="also a loss curve of this many steps per variant")
    p.add_argument("--curve-seq", type=int, default=4096)
    p.add_argument("--curve-variants", default="tigon,tigon,tigon-offload-notile,tigon-offload")
    p.add_argument("--curve-tile", type=int, default=1024, help="tigon-offload's MLP tile in the curves")
    p.add_argument("--tile-tokens", default="auto", help="tigon-offload's MLP tile: auto or tokens")
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the model's 32)")
    p.add_argument("--lora-dropout", type=float, default=0.0, help="the adapters' dropout in the length runs")
    p.add_argument("--curve-dropout", type=float, default=0.05,
                   help="the adapters' dropout in the curves: the recompute must replay the forward's masks")
    p.add_argument("--deterministic", action="store_true",
                   help="torch.use_deterministic_algorithms(True) in every run (for curves that can be bit-equal)")
    p.add_argument("--memory-profile", action="store_true",
                   help="record the allocator in the first timed step: the blocks live at its peak, by site")
    p.add_argument("--new-batches", action="store_true", help=argparse.SUPPRESS)  # a child's curve mode
    p.add_argument("--cap-gib", type=float, default=80.0)
    p.add_argument("--timeout", type=int, default=600, help="seconds per variant")
    p.add_argument("--smoke", action="store_true")
    p.add_argument("--out")
    p.add_argument("--child")
    a = p.parse_args(argv)
    a.seqs = [int(s) for s in (a.seqs or ("64,96" if a.smoke else "16384,32768,65536")).split(",")]
    named = [v for v in a.variants.split(",") + a.curve_variants.split(",") + [a.longest_variant] if v]
    unknown = [v for v in named if parse_variant(v)[0] not in VARIANTS]
    if unknown:
        p.error(f"unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}, each optionally + '-qlora'")
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        checkout.print_child_result(lambda: child(a.child, a), lambda msg: [dict(variant=a.child, error=msg)])
        return None
    rows = []
    for v in filter(None, a.variants.split(",")):
        rows += run_child(v, a.seqs, a)
        print(json.dumps(rows[-1]), flush=True)
    if a.longest:
        rows += run_child(a.longest_variant, [a.longest], a, steps=0)
        print(json.dumps(rows[-1]), flush=True)
    for v in a.curve_variants.split(",") if a.curve_steps else ():
        rows += [dict(r, curve=True) for r in run_child(v, [a.curve_seq], a, steps=a.curve_steps - 1,
                                                         new_batches=True, tile_tokens=a.curve_tile,
                                                         lora_dropout=a.curve_dropout)]
        print(json.dumps(rows[-1]), flush=True)
    md = markdown(rows, a)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "long_context.md"), "w") as f:
            f.write(md + "\n")
        with open(os.path.join(a.out, "long_context.json"), "w") as f:
            json.dump(dict(config={k: v for k, v in vars(a).items() if k != "child"}, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
