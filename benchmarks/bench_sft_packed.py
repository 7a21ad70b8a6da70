"""SFT on a realistic length mix, 1.5B Llama config: padded HF / padded Liger / padded Tigon / packed Tigon.

Examples get log-normal lengths (median 400, sigma 1, clipped to [16, 4096], numpy seed 0, the lengths of
bench_training_attention). They are grouped in order into steps of about 16k useful tokens each (whole
examples, a step closes before it would pass 16384). Each variant trains on the same steps:
  padded_*       one [n, longest] batch with right padding, attention_mask and -100 labels on pads (HF sdpa)
  packed_tigon   DataCollatorWithFlattening's layout (one row, position_ids restarting, -100 at each start)
                 on tigon.patch(model, attention=True)
Useful tokens/s counts the examples' tokens only: pads are waste. Peak memory is max_memory_allocated over the
timed steps, with the optimizer state included. Each variant runs in its own subprocess. Timing: median of the
steps after 3 warm-ups, each step GPU-synchronized (fwd + bwd + AdamW fused + zero_grad).

    PYTHONPATH=src python benchmarks/bench_sft_packed.py --out DIR [--variants padded_hf,padded_liger,...]
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

VARIANTS = ("padded_hf", "padded_liger", "padded_tigon", "packed_tigon")
LLAMA_1B5 = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
STEP_TOKENS = 16384


def steps_of(n_steps, seed=0):
    """[[example length, ...] per step]: whole examples in order, each step <= STEP_TOKENS useful tokens."""
    from bench_training_attention import lengths_lognormal

    lengths = lengths_lognormal(STEP_TOKENS * (n_steps + 2), seed=seed)
    steps, cur = [], []
    for n in lengths:
        if sum(cur) + n > STEP_TOKENS and cur:
            steps.append(cur)
            cur = []
        cur.append(n)
        if len(steps) == n_steps:
            break
    return steps[:n_steps]


def batch_for(variant, lengths, vocab, gen):
    import torch

    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    if variant.startswith("packed"):
        flat = torch.cat(ids)[None]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = flat.clone()
        labels[pos == 0] = -100
        return dict(input_ids=flat, position_ids=pos, labels=labels)
    t = max(lengths)
    out = torch.zeros(len(ids), t, dtype=torch.long)
    mask, labels = torch.zeros_like(out), torch.full_like(out, -100)
    for i, x in enumerate(ids):
        out[i, :len(x)], mask[i, :len(x)], labels[i, :len(x)] = x, 1, x
    return dict(input_ids=out, attention_mask=mask, labels=labels)


def _child(variant, n_steps, warmup):
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if variant == "padded_liger":
        import liger_kernel.transformers as lk

        lk.apply_liger_kernel_to_llama()
    config = AutoConfig.for_model("llama", **LLAMA_1B5, max_position_embeddings=8192, tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    report = None
    if variant.endswith("tigon"):
        import tigon

        report = str(tigon.patch(model, attention=variant.startswith("packed")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    steps = steps_of(warmup + n_steps)
    gen = torch.Generator().manual_seed(0)
    batches = [{k: v.cuda() for k, v in batch_for(variant, s, config.vocab_size, gen).items()} for s in steps]
    times, losses = [], []
    for i, batch in enumerate(batches):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
        if i == warmup - 1:
            torch.cuda.reset_peak_memory_stats()
    useful = [sum(s) for s in steps[warmup:]]
    padded = [len(s) * max(s) for s in steps[warmup:]]
    t = times[warmup:]
    out = dict(variant=variant, steps=n_steps, step_ms=1e3 * statistics.median(t),
               useful_tokens_per_s=sum(useful) / sum(t), computed_tokens_per_step=statistics.mean(
                   useful if variant.startswith("packed") else padded),
               useful_tokens_per_step=statistics.mean(useful), peak_gib=torch.cuda.max_memory_allocated() / 2**30,
               losses=losses, report=report)
    print("RESULT " + json.dumps(out))


def run_variant(variant, n_steps, warmup, timeout=400):
    cmd = [sys.executable, __file__, "--child", variant, "--steps", str(n_steps), "--warmup", str(warmup)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=os.environ.copy())
    except subprocess.TimeoutExpired:
        return dict(variant=variant, error=f"timeout after {timeout}s")
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(variant=variant, error=" / ".join(p.stderr.strip().splitlines()[-3:]))


def table(results):
    base = next((r for r in results if r["variant"] == "padded_liger" and "error" not in r), None)
    lines = ["| variant | step ms | useful tokens/s | vs padded Liger | tokens computed / useful | peak GiB |",
             "|---|---|---|---|---|---|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | {r['error'][:100]} | | | | |")
            continue
        vs = f"{r['useful_tokens_per_s'] / base['useful_tokens_per_s']:.2f}x" if base else "-"
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {r['useful_tokens_per_s']:,.0f} | {vs} | "
                     f"{r['computed_tokens_per_step'] / r['useful_tokens_per_step']:.2f} | {r['peak_gib']:.1f} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _child(a.child, a.steps, a.warmup)
        return 0
    results = [run_variant(v, a.steps, a.warmup) for v in a.variants.split(",")]
    md = ["SFT, 1.5B Llama, ~16k useful tokens a step (log-normal lengths, median 400)", ""] + table(results)
    print("\n".join(md))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "sft_packed.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, "sft_packed.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
