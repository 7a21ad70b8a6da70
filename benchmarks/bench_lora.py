"""The anchors' 8B LoRA job (anchors/bench_lora8b.py): Llama-3-8B shape, random init, bf16, PEFT LoRA r=16 on all
seven projections (lora_dropout 0, fp32 adapters: get_peft_model's default), gradient checkpointing
(non-reentrant), AdamW(fused) on the adapters, batch 2 x 4096 with labels = input_ids.

Variants, each in its own subprocess: liger (apply_liger_kernel_to_llama before the model is built), tigon-nolora
(tigon.patch(model, lora=False): PEFT's own LoRA forward), tigon (tigon.patch(model): LoRA projections through
tigon.ops.lora_linear); tigon's patch runs before get_peft_model, as in the anchor. Reports the median step ms,
tokens/s, peak allocated GiB and the loss of the first and last step; --profile adds one step's GPU kernel time
by bucket (gemm, attention, triton kernels, elementwise, optimizer, copy, other) and the top kernels.

    PYTHONPATH=src python benchmarks/bench_lora.py --out DIR [--variants liger,tigon-nolora,tigon] [--layers 32]
        [--bs 2 --seq 4096 --steps 6] [--profile]
"""

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _profile import BUCKETS, profile_step  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
VARIANTS = ("eager", "liger", "tigon-nolora", "tigon")


def child(variant, a):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    if variant == "liger":
        from liger_kernel.transformers import apply_liger_kernel_to_llama

        apply_liger_kernel_to_llama()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=a.layers, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192,
                      tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)
    report = None
    if variant.startswith("tigon"):
        import tigon

        report = str(tigon.patch(model, lora=variant == "tigon"))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=TARGETS))
    model.enable_input_require_grads()
    opt = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-4, fused=True)
    g = torch.Generator(device="cuda").manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (a.bs, a.seq), device="cuda", generator=g)
    torch.cuda.synchronize()
    weights = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(a.steps + 2):
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        t1.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(t0.elapsed_time(t1))
        losses.append(float(loss))
    times.sort()
    ms = times[len(times) // 2]
    out = dict(variant=variant, layers=a.layers, step_ms=round(ms, 1), tok_s=round(a.bs * a.seq / ms * 1e3),
               peak_gib=round(torch.cuda.max_memory_allocated() / 2**30, 2), weights_gib=round(weights / 2**30, 2),
               loss_first=losses[0], loss_last=losses[-1], times_ms=[round(t, 1) for t in times])
    if variant == "tigon":
        from tigon.ops import dispatch_counts

        out["lora_linear_calls"] = sum(n for (op, _), n in dispatch_counts.items() if op == "lora_linear")
    if report is not None:
        out["patch_report"] = report
    if a.profile:
        out["profile"] = profile_step(model, opt, ids)
    return out


def _versions():
    import importlib.metadata as md

    got = {}
    for name in ("torch", "transformers", "peft", "liger-kernel", "triton"):
        try:
            got[name] = md.version(name)
        except md.PackageNotFoundError:
            got[name] = None
    return got


def _markdown(rows, a, versions):
    lines = [f"# LoRA r=16, Llama-3-8B shape ({a.layers} layers), bf16, gradient checkpointing, {a.bs} x {a.seq}",
             "", "versions: " + ", ".join(f"{k} {v}" for k, v in versions.items() if v), "",
             "| variant | step ms | tokens/s | peak GiB | weights GiB | loss first -> last |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['variant']} | failed: {r['error'][:160]} | | | | |")
        else:
            lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {r['tok_s']} | {r['peak_gib']:.2f} | "
                         f"{r['weights_gib']:.2f} | {r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
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


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default="liger,tigon-nolora,tigon")
    p.add_argument("--bs", type=int, default=2)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--timeout", type=int, default=400, help="seconds per variant")
    p.add_argument("--out", help="directory for lora.md and lora.json")
    p.add_argument("--child")
    a = p.parse_args()
    if a.child:
        try:
            print("RESULT " + json.dumps(child(a.child, a)), flush=True)
        except Exception as e:  # noqa: BLE001 - the parent reports the failure in the table
            print("RESULT " + json.dumps(dict(variant=a.child, error=f"{type(e).__name__}: {str(e)[:300]}")))
        return
    rows = []
    for v in a.variants.split(","):
        if v not in VARIANTS:
            raise SystemExit(f"bench_lora: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        cmd = [sys.executable, __file__, "--child", v, "--bs", str(a.bs), "--seq", str(a.seq), "--steps",
               str(a.steps), "--layers", str(a.layers)] + (["--profile"] if a.profile else [])
        t = time.time()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout, env=os.environ.copy())
            r = next((json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")),
                     dict(variant=v, error=(proc.stderr or "no output")[-300:]))
        except subprocess.TimeoutExpired:
            r = dict(variant=v, error=f"timeout after {a.timeout} s")
        r["wall_s"] = round(time.time() - t, 1)
        rows.append(r)
        print(json.dumps({k: x for k, x in r.items() if k != "patch_report"}), flush=True)
    versions = _versions()
    md = _markdown(rows, a, versions)
    print(md)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "lora.md"), "w") as f:
            f.write(md)
        with open(os.path.join(a.out, "lora.json"), "w") as f:
            json.dump(dict(config=vars(a), versions=versions, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
