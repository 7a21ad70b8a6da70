"""The 8B LoRA job of the peer reference timings: Llama-3-8B shape, random init, bf16, PEFT LoRA r=16 on all
seven projections (lora_dropout 0, fp32 adapters: get_peft_model's default), gradient checkpointing
(non-reentrant), AdamW(fused) on the adapters, batch 2 x 4096 with labels = input_ids.

Variants, each in its own subprocess: liger (apply_liger_kernel_to_llama before the model is built), tigon-nolora
(tigon.patch(model, lora=False): PEFT's own LoRA forward), tigon (tigon.patch(model): LoRA projections through
tigon.ops.lora_linear); tigon's patch runs before get_peft_model, as in the reference job. tigon-kept (chosen
with --variants): tigon with keep_activations (--keep-activations layers, default all): those layers run without
the recompute, the others are checkpointed (tigon.memory.install_kept_activations). Reports the median step ms,
tokens/s, peak allocated GiB and the loss of the first and last step; --profile adds one step's GPU kernel time
by bucket (gemm, attention, triton kernels, elementwise, optimizer, copy, other) and the top kernels.

QLoRA variants (chosen with --variants; the default stays the three above): liger-qlora, tigon-qlora-nolora,
tigon-qlora (and eager-qlora, plain HF). The same bf16 random-init model, then every decoder-layer projection
nn.Linear becomes a bitsandbytes Linear4bit holding that weight, NF4, blocksize 64, double quant (nested absmax,
--no-double-quant turns it off), compute dtype bf16, quantized where it lies (the model is built on the GPU), as
transformers' replace_with_bnb_linear + weight loading would do for BitsAndBytesConfig(load_in_4bit=True,
bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=bfloat16); embeddings, norms and
lm_head stay bf16 (transformers skips lm_head). transformers 5.17's from_config does not quantize (only
from_pretrained runs the quantizer), hence the swap here. prepare_model_for_kbit_training is not called: it would
cast embeddings, norms and lm_head to fp32, and the rows are meant to differ from the bf16 ones only in the 4-bit
base projections; what it does otherwise (frozen base, input grads, checkpointing) the job does anyway. With the
patch, PEFT's bnb.Linear4bit layers run bitsandbytes' base matmul, then tigon.ops.lora_add. bitsandbytes 0.50.2's
base matmul at 8192 rows on CUDA is dequantize-to-bf16 + F.linear (its fused 4-bit GEMM stops at 1536 rows), and
its backward dequantizes again: three dequantizations per projection a step under checkpointing.

    PYTHONPATH=src python -m benchmarks lora --out DIR [--variants liger,tigon-nolora,tigon] [--layers 32]
        [--bs 2 --seq 4096 --steps 6] [--profile] [--no-double-quant] [--autocast]
    PYTHONPATH=src python -m benchmarks lora --smoke [--variants ...]   # CPU, 2 tiny layers, one step each

--smoke: every chosen variant (each in its own subprocess, as on the GPU) builds a 2-layer tiny Llama on the CPU
(bf16, Tigon's kernels through Triton's interpreter: the children get TRITON_INTERPRET=1 unless it is set) and
runs one step; the liger variants build only (Liger's kernels do not run on a CPU). A check that the code paths
import and build, not a timing.
"""

import argparse
import importlib.util
import json
import os
import subprocess
import time

from benchmarks.tools import checkout
from benchmarks.training.step_profile import BUCKETS, profile_step

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("eager", "liger", "tigon-nolora", "tigon", "tigon-kept", "eager-qlora", "liger-qlora",
            "tigon-qlora-nolora", "tigon-qlora")
FULL = dict(hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
            vocab_size=128256)
# every projection's input width a multiple of 64: bitsandbytes 0.50.2's CPU NF4 dequantize reads garbage when a
# row ends mid-block (see tests/hf/test_qlora.py)
SMOKE = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, vocab_size=512)


def parse_variant(variant):
    """(base variant, qlora): 'tigon-qlora-nolora' -> ('tigon-nolora', True)."""
    return variant.replace("-qlora", ""), "-qlora" in variant


def quantize_projections(model, *, double_quant, compute_dtype):
    """Every nn.Linear inside the decoder layers -> bitsandbytes Linear4bit (NF4) holding its weight, quantized on
    the weight's device; marks the model `is_loaded_in_4bit` (what PEFT's dispatch reads). Returns the count."""
    import bitsandbytes as bnb
    import torch
    from torch import nn

    count = 0
    for layer in model.model.layers:
        for name, lin in [(n, m) for n, m in layer.named_modules() if type(m) is nn.Linear]:
            q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                  compute_dtype=compute_dtype, compress_statistics=double_quant, quant_type="nf4",
                                  device="meta")
            q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, blocksize=64,
                                         compress_statistics=double_quant, quant_type="nf4",
                                         module=q).to(lin.weight.device)  # .to() quantizes
            if lin.bias is not None:
                q.bias = nn.Parameter(lin.bias.data, requires_grad=False)
            q.requires_grad_(False)
            layer.set_submodule(name, q)
            count += 1
    model.is_loaded_in_4bit = True
    if torch.cuda.is_available():
        torch.cuda.empty_cache()  # the bf16 projections are gone
    return count


class _Clock:
    """Step time: CUDA events on the GPU, perf_counter on the CPU (smoke)."""

    def __init__(self, cuda):
        import torch

        self.cuda, self.torch = cuda, torch

    def start(self):
        if self.cuda:
            self.t0, self.t1 = self.torch.cuda.Event(enable_timing=True), self.torch.cuda.Event(enable_timing=True)
            self.t0.record()
        else:
            self.t = time.perf_counter()

    def stop_ms(self):
        if self.cuda:
            self.t1.record()
            self.torch.cuda.synchronize()
            return self.t0.elapsed_time(self.t1)
        return (time.perf_counter() - self.t) * 1e3


def build(variant, a, dev):
    """The job's model for `variant` on `dev`: (PEFT model, optimizer, input ids, patch report or None, number of
    4-bit layers)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    base, qlora = parse_variant(variant)
    if base == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    cfg = LlamaConfig(**(SMOKE if a.smoke else FULL), num_hidden_layers=a.layers, rope_theta=500000.0,
                      max_position_embeddings=8192, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with dev:
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    four_bit = quantize_projections(model, double_quant=a.double_quant, compute_dtype=torch.bfloat16) if qlora else 0
    report = None
    if base.startswith("tigon"):
        import tigon

        kept = (a.keep_activations if a.keep_activations >= 0 else a.layers) if base == "tigon-kept" else 0
        report = str(tigon.patch(model, lora=base != "tigon-nolora", keep_activations=kept))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    model.enable_input_require_grads()
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4, fused=True)
    g = torch.Generator(device=dev).manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.bs, a.seq), device=dev, generator=g)
    return model, opt, ids, report, four_bit


def step(model, opt, ids, autocast=False):
    """One training step: forward with labels = ids, backward, optimizer step. Returns the loss tensor. autocast:
    the forward under bf16 autocast, as the HF Trainer with bf16=True runs it (PEFT's fp32 adapters then multiply
    in bf16)."""
    import torch

    with torch.autocast(ids.device.type, dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss


def child(variant, a):
    import torch

    base, qlora = parse_variant(variant)
    cuda = not a.smoke
    model, opt, ids, report, four_bit = build(variant, a, torch.device("cuda" if cuda else "cpu"))
    out = dict(variant=variant, layers=a.layers, autocast=a.autocast,
               keep_activations=(a.keep_activations if a.keep_activations >= 0 else a.layers)
               if base == "tigon-kept" else 0,
               base="nf4" + (" dq" if a.double_quant else "") if qlora else "bf16")
    if qlora:
        out["four_bit_layers"] = four_bit
    if report is not None:
        out["patch_report"] = report
    if a.smoke and base == "liger":
        return dict(out, skipped="built; no step: Liger's Triton kernels do not run on the CPU (nor in Triton's "
                                 "interpreter)")
    if cuda:
        torch.cuda.synchronize()
        weights = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    if base in ("tigon", "tigon-kept"):
        from tigon.ops import dispatch_counts

        calls_before = dict(dispatch_counts)
    clock, warmup = _Clock(cuda), 0 if a.smoke else 2
    times, losses = [], []
    for i in range(a.steps + warmup):
        clock.start()
        loss = step(model, opt, ids, a.autocast)
        ms = clock.stop_ms()
        if i >= warmup:
            times.append(ms)
        losses.append(float(loss))
    ms = sorted(times)[len(times) // 2]
    out.update(step_ms=round(ms, 1), tok_s=round(a.bs * a.seq / ms * 1e3),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None,
               weights_gib=round(weights / 2**30, 2) if cuda else None,
               loss_first=losses[0], loss_last=losses[-1], times_ms=[round(t, 1) for t in times])
    if base in ("tigon", "tigon-kept"):
        for op in ("lora_linear", "lora_add"):  # calls in the step loop, warmup included (lora_add: 4-bit)
            out[f"{op}_calls"] = sum(n - calls_before.get(k, 0) for k, n in dispatch_counts.items() if k[0] == op)
    if a.profile and cuda:
        out["profile"] = profile_step(model, opt, ids)
    return out


def _versions():
    import importlib.metadata as md

    got = {}
    for name in ("torch", "transformers", "peft", "liger-kernel", "bitsandbytes", "triton"):
        try:
            got[name] = md.version(name)
        except md.PackageNotFoundError:
            got[name] = None
    return got


def _gib(x):
    return "" if x is None else f"{x:.2f}"


def _markdown(rows, a, versions):
    lines = [f"# LoRA r=16, Llama-3-8B shape ({a.layers} layers), bf16, gradient checkpointing, {a.bs} x {a.seq}"
             + (", forward under bf16 autocast (the Trainer's bf16=True)" if a.autocast
                else ", no autocast (fp32 adapter GEMMs)")
             + (" (smoke: tiny config on the CPU)" if a.smoke else ""),
             "", "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), "",
             "| variant | base projections | step ms | tokens/s | peak GiB | weights GiB | loss first -> last |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        if "skipped" in r:
            lines.append(f"| {r['variant']} | skipped: {r['skipped']} | | | | | |")
        elif "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:160]} | | | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['base']} | {r['step_ms']:.1f} | {r['tok_s']} | {_gib(r['peak_gib'])} "
                         f"| {_gib(r['weights_gib'])} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    profiled = [r for r in rows if "profile" in r]
    if profiled:
        lines += ["", "## GPU kernel time of one step (ms)", "",
                  "| bucket | " + " | ".join(r["variant"] for r in profiled) + " |",
                  "|---|" + "---|" * len(profiled)]
        for b in BUCKETS:
            lines.append(f"| {b} | " + " | ".join(f"{r['profile']['buckets_ms'][b]:.1f}" for r in profiled) + " |")
        lines.append("| total | " + " | ".join(f"{sum(r['profile']['buckets_ms'].values()):.1f}" for r in profiled)
                     + " |")
        for r in profiled:
            lines += ["", f"top kernels, {r['variant']}:", ""]
            lines += [f"- {ms:.2f} ms  `{name}`" for name, ms in r["profile"]["top"]]
    return "\n".join(lines) + "\n"


def _missing(variant):
    """The package a variant needs and this environment lacks, else None."""
    base, qlora = parse_variant(variant)
    needs = ["peft"] + (["liger_kernel"] if base == "liger" else []) + (["bitsandbytes"] if qlora else [])
    return next((n for n in needs if importlib.util.find_spec(n) is None), None)


def run_variant(v, a):
    """One variant in its own subprocess: its result row (or a skipped / error row)."""
    missing = _missing(v)
    if missing:
        return dict(variant=v, skipped=f"{missing} not installed")
    cmd = ["--child", v, "--bs", str(a.bs), "--seq", str(a.seq), "--steps", str(a.steps), "--layers", str(a.layers)]
    cmd += (["--profile"] if a.profile else []) + ([] if a.double_quant else ["--no-double-quant"])
    cmd += (["--smoke"] if a.smoke else []) + (["--autocast"] if a.autocast else [])
    cmd += ["--keep-activations", str(a.keep_activations)]
    env = os.environ.copy()
    if a.smoke:
        env.setdefault("TRITON_INTERPRET", "1")  # the child's CPU tensors run Tigon's kernels, interpreted
    t = time.time()
    try:
        proc = checkout.run_module(__file__, cmd, timeout=a.timeout, env=env)
        r = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
                 dict(variant=v, error=(proc.stderr or "no output")[-300:]))
    except subprocess.TimeoutExpired:
        r = dict(variant=v, error=f"timeout after {a.timeout} s")
    r["wall_s"] = round(time.time() - t, 1)
    return r


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="liger,tigon-nolora,tigon", help=f"from {', '.join(VARIANTS)}")
    p.add_argument("--bs", type=int)
    p.add_argument("--seq", type=int)
    p.add_argument("--steps", type=int)
    p.add_argument("--layers", type=int)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--no-double-quant", dest="double_quant", action="store_false",
                   help="QLoRA variants: plain fp32 absmax per block instead of NF4's nested (double) quant")
    p.add_argument("--smoke", action="store_true", help="2 tiny layers on the CPU, one step per variant")
    p.add_argument("--autocast", action="store_true",
                   help="the forward under bf16 autocast, as the HF Trainer with bf16=True (adapters in bf16)")
    p.add_argument("--keep-activations", type=int, default=-1,
                   help="tigon-kept: layers that run without the recompute (default -1: all of them)")
    p.add_argument("--timeout", type=int, default=400, help="seconds per variant")
    p.add_argument("--out", help="directory for lora.md and lora.json")
    p.add_argument("--child")
    a = p.parse_args(argv)
    for name, full, smoke in (("bs", 2, 1), ("seq", 4096, 64), ("steps", 6, 1), ("layers", 32, 2)):
        if getattr(a, name) is None:
            setattr(a, name, smoke if a.smoke else full)
    return a


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        checkout.print_child_result(lambda: child(a.child, a), lambda msg: dict(variant=a.child, error=msg))
        return None
    variants = a.variants.split(",")
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        raise SystemExit(f"bench_lora: unknown variant {unknown[0]!r}; choose from {', '.join(VARIANTS)}")
    rows = []
    for v in variants:
        rows.append(run_variant(v, a))
        print(json.dumps({k: x for k, x in rows[-1].items() if k != "patch_report"}), flush=True)
    versions = _versions()
    md = _markdown(rows, a, versions)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "lora.md"), "w") as f:
            f.write(md)
        with open(os.path.join(a.out, "lora.json"), "w") as f:
            json.dump(dict(config=vars(a), versions=versions, rows=rows), f, indent=1)
    return rows


if __name__ == "__main__":
    main()
