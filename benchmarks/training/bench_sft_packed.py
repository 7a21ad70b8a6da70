"""SFT on a realistic length mix, 1.5B config: padded HF / padded Liger / padded Tigon / packed Tigon.

Examples get log-normal lengths (median 400, sigma 1, clipped to [16, 4096], numpy seed 0: bench_training_attention's
lengths_lognormal). They are grouped in order into steps of about 16k useful tokens each (whole examples; a step
closes before it would pass 16384). Every variant trains on the same steps, one optimizer step each:
  padded_hf, padded_liger, padded_tigon
                 micro-batches of --micro-batch examples in order (what a Trainer with per_device_train_batch_size
                 does), each right-padded to its longest, attention_mask and -100 labels on pads; gradients
                 accumulated over the step's micro-batches. HF's attention: sdpa (llama), eager (gemma2: its softcap)
  packed_tigon   TRL's padding_free layout: one row of the step's examples, position_ids restarting, -100 at each
                 example's start, cu_seq_lens_q/k and max_length_q/k; tigon.patch(model) with attention=True
  packed_tigon_position_ids
                 the same row with position_ids alone (DataCollatorWithFlattening's default)
Useful tokens/s counts the examples' tokens only: pads are waste ("computed / useful" says how much). Peak memory
is max_memory_allocated over the timed steps, optimizer state included. Each variant runs in its own subprocess
(a crash or OOM is that row's error); Liger-Kernel not installed skips its row with the reason. Timing: the
steps after --warmup warm-ups, each GPU-synchronized (fwd + bwd + fused AdamW + zero_grad).

Configs: llama (1.5B: hidden 2048, 16 layers, GQA 32/8, vocab 128256) and gemma2 (a Gemma-2-style 1.5B: hidden
2048, 16 layers, 8 heads of 256, 4 KV heads, window 4096 on alternate layers, softcap 50, final softcap 30,
vocab 256000, tied embeddings).

    PYTHONPATH=src python -m benchmarks sft-packed --out DIR [--config gemma2] [--steps 8] [--layers 4]
"""

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

from benchmarks.tools import checkout
from benchmarks.tools.checkout import DEFAULT_OUT
from benchmarks.training.bench_e2e import GEMMA2, HF_ATTENTION, LLAMA_1B5  # the e2e step's configs, HF's attention

VARIANTS = ("padded_hf", "padded_liger", "padded_tigon", "packed_tigon", "packed_tigon_position_ids")
CONFIGS = {"llama": dict(LLAMA_1B5, tie_word_embeddings=False), "gemma2": GEMMA2}
STEP_TOKENS = 16384
MICRO_BATCH = 8


def steps_of(n_steps, seed=0, step_tokens=STEP_TOKENS):
    """[[example length, ...] per step]: whole examples in order, each step <= step_tokens useful tokens."""
    from benchmarks.training.bench_training_attention import lengths_lognormal

    lengths = lengths_lognormal(step_tokens * (n_steps + 2), seed=seed)
    steps, cur = [], []
    for n in lengths:
        if sum(cur) + n > step_tokens and cur:
            steps.append(cur)
            cur = []
            if len(steps) == n_steps:
                break
        cur.append(n)
    return steps[:n_steps]


def micro_batches(variant, lengths, micro_batch=MICRO_BATCH):
    """The step's forward calls as lists of example lengths: one packed row, or micro-batches in order."""
    if variant.startswith("packed"):
        return [list(lengths)]
    return [list(lengths[i:i + micro_batch]) for i in range(0, len(lengths), micro_batch)]


def token_counts(variant, lengths, micro_batch=MICRO_BATCH):
    """(useful tokens, tokens computed) of one step: a padded micro-batch computes n x its longest, a packed row
    its tokens."""
    if variant.startswith("packed"):
        return sum(lengths), sum(lengths)
    return sum(lengths), sum(len(m) * max(m) for m in micro_batches(variant, lengths, micro_batch))


def batch_for(variant, lengths, vocab, gen):
    """The model inputs of one forward call over examples of these lengths (random token ids from `gen`)."""
    import torch

    ids = [torch.randint(0, vocab, (n,), generator=gen) for n in lengths]
    if variant.startswith("packed"):
        flat = torch.cat(ids)[None]
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        labels = flat.clone()
        labels[pos == 0] = -100
        batch = dict(input_ids=flat, position_ids=pos, labels=labels)
        if not variant.endswith("position_ids"):  # TRL's padding_free collator adds these
            cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
            batch.update(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
        return batch
    t = max(lengths)
    out = torch.zeros(len(ids), t, dtype=torch.long)
    mask, labels = torch.zeros_like(out), torch.full_like(out, -100)
    for i, x in enumerate(ids):
        out[i, :len(x)], mask[i, :len(x)], labels[i, :len(x)] = x, 1, x
    return dict(input_ids=out, attention_mask=mask, labels=labels)


def _targets(batch) -> int:
    """Tokens the loss averages over (HF shifts the labels by one)."""
    return int((batch["labels"][:, 1:] != -100).sum())


def _child(variant, config_name, n_steps, warmup, layers, micro_batch):
    import faulthandler

    import torch

    faulthandler.dump_traceback_later(45, repeat=True)  # a stuck or slow step leaves its stack in the row's log
    from transformers import AutoConfig, AutoModelForCausalLM

    if not torch.cuda.is_available():
        raise SystemExit("needs CUDA")
    fields = dict(CONFIGS[config_name])
    model_type = fields.pop("model_type")
    if layers:
        fields["num_hidden_layers"] = layers
    if variant == "padded_liger":
        import liger_kernel.transformers as lk

        getattr(lk, f"apply_liger_kernel_to_{model_type}")()
    config = AutoConfig.for_model(model_type, **fields, max_position_embeddings=8192)
    config._attn_implementation = HF_ATTENTION.get(config_name, "sdpa")  # eager for gemma2: SDPA drops its softcap
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).train()
    report = None
    if "tigon" in variant:
        import tigon

        report = str(tigon.patch(model, attention=variant.startswith("packed")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=True)
    steps = steps_of(warmup + n_steps)
    gen = torch.Generator().manual_seed(0)
    batches = [[{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in
                 batch_for(variant, m, config.vocab_size, gen).items()} for m in micro_batches(variant, s, micro_batch)]
               for s in steps]
    times, losses = [], []
    for i, step in enumerate(batches):
        targets = [_targets(b) for b in step]  # host ints, read before the clock starts
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step_loss = 0.0
        for batch, n in zip(step, targets):
            loss = model(**batch).loss * (n / sum(targets))
            loss.backward()
            step_loss = step_loss + loss.detach()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        losses.append(float(step_loss))
        print(f"step {i}: {1e3 * times[-1]:.1f} ms, {sum(steps[i])} tokens", file=sys.stderr, flush=True)
        if i == warmup - 1:
            torch.cuda.reset_peak_memory_stats()
    counts = [token_counts(variant, s, micro_batch) for s in steps[warmup:]]
    t = times[warmup:]
    out = dict(variant=variant, config=config_name, layers=config.num_hidden_layers, steps=n_steps,
               step_ms=1e3 * statistics.median(t), useful_tokens_per_s=sum(u for u, _ in counts) / sum(t),
               computed_tokens_per_step=statistics.mean(c for _, c in counts),
               useful_tokens_per_step=statistics.mean(u for u, _ in counts),
               step_times_ms=[round(1e3 * x, 2) for x in times],  # warm-up steps first
               peak_gib=torch.cuda.max_memory_allocated() / 2**30, losses=losses, report=report)
    print("RESULT " + json.dumps(out))


def last_stack(stderr: str, lines: int = 60) -> list:
    """The child's last faulthandler dump (innermost frame first) with the progress lines before it, or the last
    `lines` lines of stderr when it dumped none."""
    text = stderr.strip().splitlines()
    starts = [i for i, line in enumerate(text) if line.startswith(("Thread 0x", "Current thread 0x"))]
    if not starts:
        return text[-lines:]
    progress = [line for line in text[:starts[-1]] if line.startswith("step ")]
    return progress[-5:] + text[starts[-1]:starts[-1] + lines]


def run_variant(variant, args, timeout):
    """One variant in its own process: its RESULT row, or the reason it did not run."""
    if variant == "padded_liger" and importlib.util.find_spec("liger_kernel") is None:
        return dict(variant=variant, skipped="liger_kernel not installed")
    if timeout < 30:
        return dict(variant=variant, skipped="time budget")
    cmd = ["--child", variant, "--config", args.config, "--steps", str(args.steps), "--warmup", str(args.warmup),
           "--layers", str(args.layers or 0), "--micro-batch", str(args.micro_batch)]
    try:
        p = checkout.run_module(__file__, cmd, timeout=timeout)
    except subprocess.TimeoutExpired as e:  # the child's last progress lines say where the time went
        err = e.stderr.decode() if isinstance(e.stderr, bytes) else (e.stderr or "")
        return dict(variant=variant, error=f"timeout after {timeout:.0f}s", log=last_stack(err))
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    return dict(variant=variant, error=" / ".join(p.stderr.strip().splitlines()[-3:]) or f"exit {p.returncode}")


def table(results):
    base = next((r for r in results if r["variant"] == "padded_liger" and "step_ms" in r), None)
    lines = ["| variant | median step ms | slowest timed step ms | useful tokens/s (all timed steps) | vs padded Liger "
             "| tokens computed / useful | peak GiB |", "|---|---|---|---|---|---|---|"]
    for r in results:
        if "step_ms" not in r:
            lines.append(f"| {r['variant']} | {(r.get('error') or r.get('skipped'))[:100]} | | | | | |")
            continue
        vs = f"{r['useful_tokens_per_s'] / base['useful_tokens_per_s']:.2f}x" if base else "-"
        timed = r.get("step_times_ms", [])[-r["steps"]:]
        slowest = f"{max(timed):.1f}" if timed else "-"
        lines.append(f"| {r['variant']} | {r['step_ms']:.1f} | {slowest} | {r['useful_tokens_per_s']:,.0f} | {vs} | "
                     f"{r['computed_tokens_per_step'] / r['useful_tokens_per_step']:.2f} | {r['peak_gib']:.1f} |")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--config", choices=sorted(CONFIGS), default="llama")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--steps", type=int, default=8, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--layers", type=int, default=0, help="decoder layers (0: the config's 16)")
    p.add_argument("--micro-batch", type=int, default=MICRO_BATCH, help="examples per padded forward")
    p.add_argument("--budget", type=float, default=290.0, help="seconds for all variants")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 1 or a.micro_batch < 1 or a.layers < 0:
        p.error("--steps, --warmup and --micro-batch must be >= 1, --layers >= 0")
    if a.child:
        _child(a.child, a.config, a.steps, a.warmup, a.layers, a.micro_batch)
        return 0
    unknown = set(a.variants.split(",")) - set(VARIANTS)
    if unknown:
        p.error(f"unknown variants {sorted(unknown)}; known: {', '.join(VARIANTS)}")
    deadline = time.time() + a.budget
    results = [run_variant(v, a, deadline - time.time()) for v in a.variants.split(",")]
    layers = a.layers or CONFIGS[a.config]["num_hidden_layers"]
    md = [f"SFT, 1.5B {a.config} ({layers} layers), ~{STEP_TOKENS} useful tokens a step (log-normal lengths, median "
          f"400), padded micro-batches of {a.micro_batch}", ""] + table(results)
    print("\n".join(md))
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, f"sft_packed_{a.config}.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    with open(os.path.join(a.out, f"sft_packed_{a.config}.json"), "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
