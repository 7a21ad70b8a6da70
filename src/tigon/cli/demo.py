"""`tigon demo`: fine-tune a small Llama-style model with Tigon off, then on, and print a report.

Both runs start from the same weights and see the same batches, so their losses must match (bit for bit
in fp32 up to kernel rounding; within bf16 noise on a GPU). On a CPU the model is tiny and the timings only
show that it runs; on a GPU it is the 1.5B Llama config of the end-to-end benchmark. Data: a random order-1
Markov chain over the vocabulary with peaked transitions, generated here, so the loss has something to learn.
Needs transformers (pip install "tigon[hf]").
"""

import argparse
import gc
import json
import os
import time

import torch

from .. import _log
from .argtypes import indexed_device, positive_float, positive_int

CPU_CONFIG = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=512)
GPU_CONFIG = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                  num_key_value_heads=8, vocab_size=128256)


def _checkpoint_folder(text: str) -> str:
    if not os.path.isfile(os.path.join(text, "config.json")):
        raise argparse.ArgumentTypeError(f"{text!r} is not a checkpoint folder (no config.json in it)")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", type=_checkpoint_folder,
                   help="a local checkpoint folder (default: a Llama built from a config)")
    p.add_argument("--steps", type=positive_int, default=None, help="training steps per run (CPU 20, GPU 30)")
    p.add_argument("--seq-len", type=positive_int, default=None, help="tokens per sequence (CPU 64, GPU 2048)")
    p.add_argument("--batch-size", type=positive_int, default=None, help="sequences per step (CPU 4, GPU 8)")
    p.add_argument("--lr", type=positive_float, default=None,
                   help="AdamW learning rate (CPU 1e-3; GPU 1e-4: at 1e-3 the 1.5B model's loss climbs, and a run that "
                        "diverges amplifies bf16 rounding until the two runs part)")
    p.add_argument("--device", type=indexed_device, default=None,
                   help="cuda, cuda:N or cpu (default: cuda when available)")
    p.add_argument("--out", default="demo_out", help="folder for the PNG plot and the JSON report")


def markov_batches(vocab, steps, batch, seq, seed=0):
    g = torch.Generator().manual_seed(seed)
    nxt = torch.randint(0, vocab, (vocab, 4), generator=g)  # each token has 4 likely successors
    data = torch.empty(steps, batch, seq, dtype=torch.long)
    tok = torch.randint(0, vocab, (steps, batch), generator=g)
    for t in range(seq):
        data[:, :, t] = tok
        pick = torch.randint(0, 4, tok.shape, generator=g)
        noise = torch.rand(tok.shape, generator=g) < 0.1
        tok = torch.where(noise, torch.randint(0, vocab, tok.shape, generator=g), nxt[tok, pick])
    return data


def _build(args, device, dtype):
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    if args.model:
        return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype).to(device)
    cfg = GPU_CONFIG if device.type == "cuda" else CPU_CONFIG
    config = LlamaConfig(**cfg, max_position_embeddings=max(4096, args.seq_len), tie_word_embeddings=False,
                         attn_implementation="sdpa")
    with torch.device(device):  # random init where the model will live (a 1.5B init on a CPU takes ~30 s)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _progress(iterable, desc):
    try:
        from tqdm.auto import tqdm

        return tqdm(iterable, desc=desc, leave=False)
    except ImportError:
        return iterable


def run_variant(args, use_tigon, data, device, dtype):
    import tigon

    model = _build(args, device, dtype)
    model.train()
    report = tigon.patch(model) if use_tigon else None
    lr = args.lr if args.lr is not None else (1e-4 if device.type == "cuda" else 1e-3)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device.type == "cuda")
    losses, warmup = [], min(2, args.steps - 1)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    for step in _progress(range(args.steps), "tigon on " if use_tigon else "tigon off"):
        if step == warmup:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
        ids = data[step].to(device, non_blocking=True)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    tokens = (args.steps - warmup) * data.shape[1] * data.shape[2]
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    result = dict(losses=[x.item() for x in losses], tokens_per_s=tokens / seconds, peak_gib=peak,
                  step_ms=1e3 * seconds / (args.steps - warmup), report=str(report) if report else None)
    del model, opt
    gc.collect()
    return result


def _plot(off, on, path):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.plot(off["losses"], label="Tigon off")
    a.plot(on["losses"], "--", label="Tigon on")
    a.set(xlabel="step", ylabel="loss", title="training loss")
    a.legend()
    if off["peak_gib"] is not None:
        b.bar(["Tigon off", "Tigon on"], [off["peak_gib"], on["peak_gib"]], color=["tab:gray", "tab:orange"])
        b.set(ylabel="GiB", title="peak GPU memory")
    else:  # no GPU: no memory statistics; show the step time instead
        b.bar(["Tigon off", "Tigon on"], [off["step_ms"], on["step_ms"]], color=["tab:gray", "tab:orange"])
        b.set(ylabel="ms", title="step time (CPU: not representative)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def run(args) -> dict:
    from tigon.ops import backend_for

    _log.import_optional("transformers", "tigon demo")
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    gpu = device.type == "cuda"
    # None is "not given": an explicit value is never replaced by the default (the parser refuses 0)
    if args.steps is None:
        args.steps = 30 if gpu else 20
    if args.seq_len is None:
        args.seq_len = 2048 if gpu else 64
    if args.batch_size is None:
        args.batch_size = 8 if gpu else 4
    for name in ("steps", "seq_len", "batch_size"):  # run() is also called with a Namespace built in code
        value = getattr(args, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"tigon.demo.run: {name} must be an int >= 1, got {value!r}")
    dtype = torch.bfloat16 if gpu else torch.float32
    vocab = (GPU_CONFIG if gpu else CPU_CONFIG)["vocab_size"]
    if args.model:
        from transformers import AutoConfig

        vocab = AutoConfig.from_pretrained(args.model).vocab_size
    data = markov_batches(vocab, args.steps, args.batch_size, args.seq_len)
    kernels = {"reference": "the PyTorch reference ops", "triton": "Triton kernels"}[backend_for(device)]
    if not gpu and kernels == "Triton kernels":
        kernels += " through Triton's interpreter"
    print(f"tigon demo: {'checkpoint ' + args.model if args.model else 'Llama from config'} on {device} "
          f"({dtype}), {args.steps} steps of {args.batch_size}x{args.seq_len} tokens; "
          f"kernels: {kernels}")
    off = run_variant(args, False, data, device, dtype)
    on = run_variant(args, True, data, device, dtype)
    print(on["report"])
    print(f"\n{'step':>5} {'loss off':>10} {'loss on':>10} {'|diff|':>9}")
    for i, (a, b) in enumerate(zip(off["losses"], on["losses"])):
        if i < 5 or i % max(1, args.steps // 10) == 0 or i == args.steps - 1:
            print(f"{i:>5} {a:>10.4f} {b:>10.4f} {abs(a - b):>9.2e}")
    max_diff = max(abs(a - b) for a, b in zip(off["losses"], on["losses"]))
    tol = 5e-2 if dtype == torch.bfloat16 else 1e-3
    print(f"\n{'':<14}{'Tigon off':>12}{'Tigon on':>12}")
    print(f"{'tokens/s':<14}{off['tokens_per_s']:>12.0f}{on['tokens_per_s']:>12.0f}"
          f"   x{on['tokens_per_s'] / off['tokens_per_s']:.2f}")
    print(f"{'step ms':<14}{off['step_ms']:>12.1f}{on['step_ms']:>12.1f}")
    if not gpu:
        print(f"(CPU timings, {kernels}: they show the demo runs, not how fast Tigon is; run it on a GPU)")
    if gpu:
        print(f"{'peak GiB':<14}{off['peak_gib']:>12.2f}{on['peak_gib']:>12.2f}"
              f"   {off['peak_gib'] / on['peak_gib']:.2f}x less")
    verdict = "match" if max_diff <= tol else "DIFFER"
    print(f"losses {verdict}: max |diff| {max_diff:.2e} (tolerance {tol:g} for {dtype})")
    os.makedirs(args.out, exist_ok=True)
    png = _plot(off, on, os.path.join(args.out, "demo.png"))
    with open(os.path.join(args.out, "demo.json"), "w") as f:
        json.dump(dict(device=str(device), dtype=str(dtype), timings_representative=gpu, off=off, on=on,
                       max_loss_diff=max_diff), f, indent=1)
    print(f"wrote {png or '(no matplotlib: no plot)'} and {os.path.join(args.out, 'demo.json')}")
    return dict(off=off, on=on, max_loss_diff=max_diff, ok=max_diff <= tol)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="tigon demo", description=__doc__.splitlines()[0])
    add_arguments(p)
    return 0 if run(p.parse_args(argv))["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
