"""End-to-end training step on the 1.5B Llama config of the peer reference timings: HF eager vs Tigon vs Liger
(vs compile).

Variants: eager (HF), tigon (patched), liger, compile (HF under torch.compile), tigon_compile (patched, then
torch.compile: Tigon's kernels as graph nodes, inductor fusing the glue between them), tigon_compile_graphs
(the same with mode="reduce-overhead": forward and backward replayed as CUDA graphs, the optimizer eager);
`--compile` adds compile and tigon_compile to the variants. A variant ending in `_adamw` (tigon_adamw,
tigon_compile_adamw) steps with tigon.optim.AdamW instead of torch's fused AdamW; `--clip 1.0` clips the gradients'
norm every step, as the HF Trainer does (clip_grad_norm_ before torch's step; inside tigon's). A variant ending in
`_8bit` (tigon_8bit) steps with tigon.optim.AdamW's 8-bit moments in the backward; `_lean` (tigon_lean, with
--with-ckpt) adds the checkpoints offloaded to host memory (`_lean_keepN`: the last N layers' stay on the card), and
`_lean_tiled` the MLP tiled by 512 tokens.

Each variant runs in its own subprocess (clean memory stats, no cross-talk between patches): build the
model from config in bf16 with sdpa attention (eager for gemma2: its softcap), AdamW(fused=True), batch 8 x 2048
with labels=input_ids; median of 10 steps (fwd + bwd + step + zero_grad) after 3 warm-ups, GPU-synchronized per
step. On OOM a variant halves its batch and says so. `--profile` adds a kernel-time breakdown of one step of every
variant but eager.

    PYTHONPATH=src python -m benchmarks e2e --out DIR [--variants eager,tigon,liger] [--configs llama,qwen3]
        [--with-ckpt --ckpt-variants tigon,liger] [--longest eager,tigon,liger] [--profile] [--compile]
"""

import argparse
import json
import os
import statistics
import subprocess
import time

from benchmarks.tools import checkout
from benchmarks.tools.checkout import DEFAULT_OUT
from benchmarks.training.step_profile import profile_step

LLAMA_1B5 = dict(model_type="llama", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                 num_attention_heads=32, num_key_value_heads=8, vocab_size=128256)
QWEN3 = dict(LLAMA_1B5, model_type="qwen3", vocab_size=151936, head_dim=64)
# Gemma-2-style 1.5B (#14): 8 heads of 256, 4 KV heads, window 4096 on alternate layers, attention softcap 50, final
# softcap 30, vocab 256000, tied embeddings. HF's exact attention for it is eager (SDPA drops the softcap).
GEMMA2 = dict(model_type="gemma2", hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
              num_attention_heads=8, num_key_value_heads=4, head_dim=256, vocab_size=256000, sliding_window=4096,
              attn_logit_softcapping=50.0, final_logit_softcapping=30.0, query_pre_attn_scalar=256,
              hidden_activation="gelu_pytorch_tanh", tie_word_embeddings=True)
CONFIGS = {"llama": LLAMA_1B5, "qwen3": QWEN3, "gemma2": GEMMA2}
HF_ATTENTION = {"gemma2": "eager"}  # the configs' HF attention where it is not sdpa
MODEL_FLOPS_PER_TOKEN = 7.82e9  # 6 * N_non-emb (incl. lm_head) + 6 * L * s * h, for the llama config


def _build(variant, config_name, max_positions, ckpt=False):
    """The variant's model in bf16 on the GPU, in training mode: (model, config, tigon's patch report or None)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(CONFIGS[config_name])
    model_type = cfg.pop("model_type")
    if variant == "liger":
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{model_type}")()
    cfg.setdefault("tie_word_embeddings", False)
    config = AutoConfig.for_model(model_type, **cfg, max_position_embeddings=max_positions)
    config._attn_implementation = HF_ATTENTION.get(config_name, "sdpa")
    torch.manual_seed(0)
    with torch.device("cuda"):  # random init on the GPU: seconds, where 1.5B parameters on the CPU take ~30 s
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    if ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = None
    if variant.startswith("tigon"):
        import tigon

        lean = dict(offload_checkpoints=True) if "_lean" in variant and ckpt else {}
        if lean and "_keep" in variant:
            lean["offload_checkpoints"] = int(variant.rsplit("_keep", 1)[1])
        if variant.endswith("_lean_tiled"):
            lean["tile_mlp"] = 512
        report = str(tigon.patch(model, **lean))
    return model, config, report


class _ClipThenStep:
    """torch's optimizer behind clip_grad_norm_ (what the HF Trainer runs with max_grad_norm > 0)."""

    def __init__(self, opt, params, max_norm):
        self.opt, self.params, self.max_norm = opt, list(params), max_norm

    def step(self):
        import torch

        torch.nn.utils.clip_grad_norm_(self.params, self.max_norm, foreach=True)
        self.opt.step()

    def zero_grad(self, set_to_none=True):
        self.opt.zero_grad(set_to_none=set_to_none)


def _optimizer(variant, model, clip):
    """AdamW(fused=True), or tigon.optim.AdamW for the *_adamw variants; with clip, clipping to that norm first
    (tigon's inside its step)."""
    import torch

    if variant.endswith("_adamw"):
        import tigon

        return tigon.optim.AdamW(model.parameters(), lr=1e-5, max_grad_norm=clip)
    if "_8bit" in variant or "_lean" in variant:  # no clipping: it needs every gradient first
        import tigon

        return tigon.optim.AdamW(model.parameters(), lr=1e-5, state_bits=8, step_in_backward=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    return _ClipThenStep(opt, model.parameters(), clip) if clip else opt


def _child(variant, config_name, batch, seq, ckpt, steps, warmup, profile, clip=None):
    import torch

    model, config, report = _build(variant, config_name, max(4096, seq), ckpt)
    graphs = "_graphs" in variant
    if "compile" in variant:  # the first step pays the compile
        model = torch.compile(model, mode="reduce-overhead" if graphs else None)
    opt = _optimizer(variant, model, clip)
    ids = torch.randint(0, config.vocab_size, (batch, seq), device="cuda")
    times, losses = [], []
    t_first = time.perf_counter()
    for i in range(warmup + steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        if graphs:
            torch.compiler.cudagraph_mark_step_begin()  # a new training step: earlier replays' outputs are done
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if i == 0:
            torch.cuda.reset_peak_memory_stats()  # step 1 allocates the optimizer state: include it below
            first_step_s = time.perf_counter() - t_first
    peak = torch.cuda.max_memory_allocated() / 2**30
    reserved = torch.cuda.max_memory_reserved() / 2**30
    med = statistics.median(times[warmup:])
    out = dict(variant=variant, config=config_name, batch=batch, seq=seq, ckpt=ckpt, clip=clip, step_ms=1e3 * med,
               tokens_per_s=batch * seq / med, peak_gib=peak, reserved_gib=reserved, first_step_s=first_step_s,
               losses=losses, report=report,
               mfu_tflops=MODEL_FLOPS_PER_TOKEN * batch * seq / med / 1e12 if config_name == "llama" else None)
    if profile:
        out["profile"] = profile_step(model, opt, ids,
                                      torch.compiler.cudagraph_mark_step_begin if graphs else None)
    print("RESULT " + json.dumps(out))


def _longest(variant, config_name, start, cap, grain):
    """The longest sequence one training step (fwd + bwd + AdamW step) fits at batch 1, in this process: the
    model is built once, lengths double from `start` until a step runs out of memory, then bisect to `grain`."""
    import torch

    model, config, _ = _build(variant, config_name, cap)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)

    def fits(seq):
        ids = torch.randint(0, config.vocab_size, (1, seq), device="cuda")
        try:
            model(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            opt.zero_grad(set_to_none=True)
            del ids
            torch.cuda.synchronize()
            torch.cuda.empty_cache()

    tried, ok, bad, seq = [], 0, None, start
    while seq <= cap:
        t0 = time.perf_counter()
        good = fits(seq)
        tried.append((seq, good, round(time.perf_counter() - t0, 2)))
        if not good:
            bad = seq
            break
        ok, seq = seq, seq * 2
    while bad is not None and bad - ok > grain:
        mid = (ok + bad) // 2 // grain * grain
        good = fits(mid)
        tried.append((mid, good, None))
        ok, bad = (mid, bad) if good else (ok, mid)
    return dict(variant=variant, config=config_name, longest_seq=ok, first_oom=bad, cap=cap, tried=tried)


def run_variant(variant, config_name="llama", batch=8, seq=2048, ckpt=False, steps=10, warmup=3, profile=False,
                timeout=300, clip=None):
    while batch >= 1:
        cmd = ["--child", variant, "--config", config_name, "--batch", str(batch), "--seq", str(seq), "--steps",
               str(steps), "--warmup", str(warmup)]
        cmd += ["--ckpt"] if ckpt else []
        cmd += ["--profile"] if profile else []
        cmd += ["--clip", str(clip)] if clip else []
        limit = 2 * timeout if "compile" in variant else timeout  # inductor's first compile: ~1-2 min
        try:
            p = checkout.run_module(__file__, cmd, timeout=limit)
        except subprocess.TimeoutExpired:
            return dict(variant=variant, config=config_name, ckpt=ckpt, error=f"timeout after {limit}s")
        for line in p.stdout.splitlines():
            if line.startswith("RESULT "):
                return json.loads(line[7:])
        if "OutOfMemoryError" in p.stderr or "out of memory" in p.stderr:
            batch //= 2
            continue
        return dict(variant=variant, config=config_name, ckpt=ckpt, error=_error_lines(p.stderr))
    return dict(variant=variant, config=config_name, ckpt=ckpt, error="OOM at batch 1")


def _error_lines(stderr):
    """The exception's own line (the last one naming an Error) and the last three lines of a child's stderr."""
    lines = stderr.strip().splitlines()
    named = [ln for ln in lines if "Error" in ln][-1:]
    return named + [ln for ln in lines[-3:] if ln not in named]


def _run_longest(variant, cap, timeout=400):
    cmd = ["--child", variant, "--longest-child", "--longest-cap", str(cap)]
    try:
        p = checkout.run_module(__file__, cmd, timeout=timeout)
    except subprocess.TimeoutExpired:
        return dict(variant=variant, error=f"timeout after {timeout}s")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            print(f"longest {variant}: {r['longest_seq']} (first OOM {r['first_oom']})", flush=True)
            return r
    return dict(variant=variant, error=_error_lines(p.stderr))


def table(results):
    rows = ["| config | variant | ckpt | batch x seq | step ms | tokens/s | model TFLOP/s | peak GiB | "
            "reserved GiB | first step s | vs eager |", "|" + "---|" * 11]
    base = {(r["config"], r.get("ckpt")): r for r in results if r.get("variant") == "eager" and "step_ms" in r}
    for r in results:
        if "error" in r:
            rows.append(f"| {r['config']} | {r['variant']} | {r.get('ckpt')} | | error: {r['error']} | | | | | | |")
            continue
        b = base.get((r["config"], r["ckpt"]))
        ratio = f"x{b['step_ms'] / r['step_ms']:.2f}" if b and b["batch"] == r["batch"] else ""
        mfu = f"{r['mfu_tflops']:.0f}" if r.get("mfu_tflops") else ""
        rows.append(f"| {r['config']} | {r['variant']} | {r['ckpt']} | {r['batch']}x{r['seq']} | {r['step_ms']:.1f} | "
                    f"{r['tokens_per_s'] / 1e3:.1f}k | {mfu} | {r['peak_gib']:.2f} | {r['reserved_gib']:.2f} | "
                    f"{r['first_step_s']:.1f} | {ratio} |")
    return "\n".join(rows)


def main(argv=None):
    p = argparse.ArgumentParser()
    p.add_argument("--child")
    p.add_argument("--config", default="llama")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--ckpt", action="store_true")
    p.add_argument("--profile", action="store_true")
    p.add_argument("--variants", default="eager,tigon,liger")
    p.add_argument("--clip", type=float, default=None, help="clip the gradients' norm to this in every step")
    p.add_argument("--compile", action="store_true", help="also run compile and tigon_compile")
    p.add_argument("--configs", default="llama")
    p.add_argument("--with-ckpt", action="store_true", help="also run --ckpt-variants with checkpointing")
    p.add_argument("--ckpt-variants", default="eager,tigon,liger")
    p.add_argument("--longest", default="", help="variants whose longest batch-1 sequence to find (llama config)")
    p.add_argument("--longest-cap", type=int, default=262144)
    p.add_argument("--longest-child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    a = p.parse_args(argv)
    if a.child and a.longest_child:
        print("RESULT " + json.dumps(_longest(a.child, a.config, 16384, a.longest_cap, 4096)), flush=True)
        return None
    if a.child:
        return _child(a.child, a.config, a.batch, a.seq, a.ckpt, a.steps, a.warmup, a.profile, a.clip)
    variants = [v for v in a.variants.split(",") if v]
    variants += [v for v in ("compile", "tigon_compile") if a.compile and v not in variants]
    results = []
    for config_name in a.configs.split(","):
        for v in variants:
            results.append(run_variant(v, config_name, a.batch, a.seq, profile=a.profile and v != "eager",
                                       clip=a.clip))
            print(table(results[-1:]), flush=True)
    if a.with_ckpt:
        for v in a.ckpt_variants.split(","):
            results.append(run_variant(v, "llama", a.batch, a.seq, ckpt=True, profile=a.profile and v != "eager",
                                       clip=a.clip))
            print(table(results[-1:]), flush=True)
    longest = [_run_longest(v, a.longest_cap) for v in a.longest.split(",") if v]
    md = table(results)
    if longest:
        md += "\n\nLongest sequence one training step fits at batch 1 (llama config, bf16, AdamW fused):\n\n"
        md += "| variant | longest seq | first OOM | tried (seq, fits, s) |\n|---|---|---|---|\n"
        md += "\n".join(f"| {r['variant']} | {r.get('longest_seq', r.get('error'))} | {r.get('first_oom')} | "
                         f"{r.get('tried')} |" for r in longest)
        results += longest
    for r in results:
        prof = r.get("profile")
        if not prof:
            continue
        total = sum(prof["buckets_ms"].values())
        md += (f"\n\nOne {r['variant']} step ({r.get('config')}), GPU kernel time by bucket (sum {total:.1f} ms; "
               f"the step's median {r.get('step_ms')} ms):\n\n| bucket | ms | share |\n|---|---|---|\n")
        md += "\n".join(f"| {k} | {v:.1f} | {100 * v / total:.0f}% |" for k, v in prof["buckets_ms"].items())
        md += "\n\nTop kernels:\n\n" + "\n".join(f"- {ms:.1f} ms {name}" for name, ms in prof["top"])
        rest = [k for k in prof.get("kernels", ()) if k[0] not in ("gemm", "attention")]
        if rest:
            md += ("\n\nEvery other kernel of 0.05 ms or more (bucket, launches, ms):\n\n"
                   + "\n".join(f"- {b}, {n}x, {ms:.2f} ms: {name}" for b, name, n, ms in rest))
        tl = prof.get("timeline")
        if tl:
            md += (f"\n\nTimeline of the profiled step: span {tl['span_ms']} ms, a kernel running {tl['busy_ms']} ms, "
                   f"idle {tl['idle_ms']} ms; longest gaps (ms, kernel before -> after):\n\n")
            md += "\n".join(f"- {g} {a} -> {b}" for g, a, b in tl["gaps"])
    print(md)
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "e2e.md"), "w") as f:
        f.write(md + "\n")
    with open(os.path.join(a.out, "e2e.json"), "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
