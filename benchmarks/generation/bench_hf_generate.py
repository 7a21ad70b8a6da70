"""HF's own `model.generate` on Tigon's fused decode path, with and without the CUDA-graph decode step.

    PYTHONPATH=src python -m benchmarks hf-generate --out DIR [--batches 1,8] [--prompt 512] [--new 256]
        [--variants hf-rolling,hf-rolling-graph,tigon,hf-static-compile] [--quick]

One process, one model: the 1.5B Llama config of benchmarks/generation/bench_decode.py (hidden 2048, intermediate 8192,
16 layers, 32 heads / 8 KV heads, vocab 128256), random init, bf16, greedy, a random prompt, every new token
forced (min_new_tokens, no EOS). Variants, in this order per batch:
- hf-rolling: `tigon.patch(model, attention=True)`, then `model.generate(ids, past_key_values=RollingKVCache(...),
  disable_compile=True)`: HF's loop over the fused decode layers, each step eager;
- hf-rolling-graph: the same with the CUDA-graph decode step (`tigon.decode.hf_graph`, what
  `tigon.patch(model, cuda_graph=True)` installs): warm-up, capture on the second decode step, replays;
- hf-rolling-autocompile (not in the default list): the same as hf-rolling without disable_compile, i.e. HF's
  own torch.compile of the decode step (mode reduce-overhead) over the fused layers;
- tigon: `tigon.generate(model, ids, return_stats=True)` (its own loop and graph);
- hf-static-compile: the model unpatched, `cache_implementation="static"`, which generate compiles on CUDA.

Timing. A decode step of HF's loop is timed from the host: a stopping criterion synchronizes the device and
takes `time.perf_counter()` after every token (HF's loop already waits for the device every step: it reads
`unfinished_sequences.max()` on the host, so the sync adds no stall), and a step is the interval between two
stamps (the model forward, the logits processors, the token choice, the criteria). TTFT is the call's start to
the first stamp. tigon.generate's steps are its stats' CUDA-event intervals (no host sync per step; the
host clock around the call minus its TTFT, `wall_ms_per_step`, is the cross-check). Each variant runs one
warm-up call (the full length for the compiled ones: their recompiles happen there) and one timed call; p50 and
p99 are nearest-rank (`tigon.decode.percentile`) over the timed call's steps, the graph capture's step
included. `tokens_equal` compares the sequences with hf-rolling's (bf16: the unpatched static-cache rows run
cuBLAS and other kernels, so they may differ).

Writes DIR/hf_generate.json and DIR/hf_generate.md. `--quick`: a 2-layer toy in fp32 on the CPU (a smoke run:
no CUDA graph there, hf-rolling-graph runs eagerly and says why in its row).
"""

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from benchmarks.generation.bench_decode import _peak_gib, _peak_reset  # one peak-memory rule for both decode benches
from benchmarks.tools import checkout
from benchmarks.tools.checkout import DEFAULT_OUT

LLAMA_1B5 = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, max_position_embeddings=256)
VARIANTS = ("hf-rolling", "hf-rolling-graph", "hf-rolling-autocompile", "tigon", "hf-static-compile")
DEFAULT_VARIANTS = ("hf-rolling", "hf-rolling-graph", "tigon", "hf-static-compile")
WARMUP_NEW = 16  # the warm-up call's new tokens where nothing compiles per shape (Triton JIT, cuBLAS handles)


def _sync(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()


def build(cfg, device):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(LlamaConfig(**cfg))
    finally:
        torch.set_default_dtype(prev)
    model = model.eval()
    model.config._attn_implementation = "sdpa"
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def prompt_ids(cfg, batch, prompt, device):
    import torch

    g = torch.Generator(device="cpu").manual_seed(1)
    return torch.randint(10, cfg["vocab_size"] - 10, (batch, prompt), generator=g).to(device)


def _hf_call(model, ids, new, variant):
    """One HF generate call of `variant`: (sequences, [stamp after each token], start time)."""
    import torch
    from transformers import StoppingCriteria

    from tigon.memory import RollingKVCache

    device = ids.device
    stamps = []

    class Clock(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            _sync(device)
            stamps.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None,
              stopping_criteria=[Clock()])
    if variant == "hf-static-compile":
        kw["cache_implementation"] = "static"
    else:
        b, p = ids.shape
        kw["past_key_values"] = RollingKVCache(model.config, batch_size=b, capacity=p + new)
        if variant != "hf-rolling-autocompile":
            kw["disable_compile"] = True
    _sync(device)
    t0 = time.perf_counter()
    seqs = model.generate(ids, **kw)
    return seqs, stamps, t0


def _switch(model, variant, patched):
    """Put the model in the state `variant` runs in (patched, graphed or plain); `patched` is a one-item list
    recording whether tigon.patch holds."""
    import tigon
    from tigon.decode import hf_graph

    if variant == "hf-static-compile":
        if patched[0]:
            tigon.unpatch(model)
            patched[0] = False
        return
    if not patched[0]:
        tigon.patch(model, attention=True)
        patched[0] = True
    if variant == "hf-rolling-graph":
        hf_graph.install(model)
    else:
        hf_graph.uninstall(model)


def run_variant(model, ids, new, variant, patched):
    """Warm-up, then the timed call: the row's timings (seconds) and its sequences."""
    import tigon
    from tigon.decode import hf_graph

    device = ids.device
    _switch(model, variant, patched)
    t = time.perf_counter()
    if variant == "tigon":
        tigon.generate(model, ids, max_new_tokens=WARMUP_NEW)
        _sync(device)
        warmup_s = time.perf_counter() - t
        _peak_reset(device)
        t0 = time.perf_counter()
        seqs, stats = tigon.generate(model, ids, max_new_tokens=new, return_stats=True)
        _sync(device)
        total = time.perf_counter() - t0
        steps, ttft = list(stats["step_s"]), stats["ttft_s"]
        extra = dict(cuda_graph=stats["cuda_graph"], wall_ms_per_step=1e3 * (total - ttft) / max(len(steps), 1))
    else:
        compiles = variant in ("hf-static-compile", "hf-rolling-autocompile")
        _hf_call(model, ids, new if compiles else WARMUP_NEW, variant)
        _sync(device)
        warmup_s = time.perf_counter() - t
        before = dict(hf_graph.graph_stats(model) or {})
        _peak_reset(device)
        seqs, stamps, t0 = _hf_call(model, ids, new, variant)
        _sync(device)
        total = time.perf_counter() - t0
        steps, ttft = [b - a for a, b in zip(stamps, stamps[1:])], stamps[0] - t0
        after = hf_graph.graph_stats(model)
        extra = {}
        if after is not None:
            extra = dict(captures=after["captures"] - before.get("captures", 0),
                         replays=after["replays"] - before.get("replays", 0),
                         eager_steps=after["eager_steps"] - before.get("eager_steps", 0),
                         fallback=after["last_fallback"] or None)
    return dict(steps=steps, ttft_s=ttft, total_s=total, warmup_s=warmup_s, peak_gib=_peak_gib(device), **extra), seqs


def row_of(variant, batch, timed, seqs, ref):
    from tigon.decode import percentile

    steps = sorted(timed.pop("steps"))
    mean = sum(steps) / len(steps)
    row = dict(variant=variant, batch=batch, p50_ms=1e3 * percentile(steps, 0.5),
               p99_ms=1e3 * percentile(steps, 0.99), mean_ms=1e3 * mean, tokens_per_s=batch / mean,
               ttft_ms=1e3 * timed.pop("ttft_s"), steps=len(steps), **timed)
    if ref is not None:
        row["tokens_equal"] = bool(seqs.shape == ref.shape and bool((seqs == ref).all()))
    return row


def _versions():
    import torch
    import transformers

    commit = checkout.git_commit()
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return dict(torch=torch.__version__, transformers=transformers.__version__, python=platform.python_version(),
                gpu=gpu, commit=commit)


def _cell(v, fmt="{:.3f}"):
    return "" if v is None else (fmt.format(v) if isinstance(v, float) else str(v))


def markdown(result) -> str:
    s = result["setup"]
    lines = [f"# HF generate with Tigon's CUDA-graph decode step ({s['model']}, prompt {s['prompt']}, "
             f"{s['new']} new tokens, {s['dtype']})", "",
             f"{result['versions']['gpu'] or 'CPU'}, torch {result['versions']['torch']}, transformers "
             f"{result['versions']['transformers']}, commit {result['versions']['commit']}.", "",
             "| batch | variant | p50 ms/step | p99 ms/step | TTFT ms | tokens/s | peak GiB | captures | "
             "tokens = hf-rolling | note |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['batch']} | {r['variant']} | | | | | | | | {r['error'][:160]} |")
            continue
        note = r.get("fallback") or ""
        lines.append(f"| {r['batch']} | {r['variant']} | {_cell(r['p50_ms'])} | {_cell(r['p99_ms'])} | "
                     f"{_cell(r['ttft_ms'], '{:.1f}')} | {_cell(r['tokens_per_s'], '{:.0f}')} | "
                     f"{_cell(r.get('peak_gib'), '{:.2f}')} | {_cell(r.get('captures'))} | "
                     f"{_cell(r.get('tokens_equal'))} | {note} |")
    lines += ["", "A step: HF's rows from host stamps after a sync per token (a stopping criterion), tigon's from its "
              "CUDA events; p50/p99 nearest-rank over the timed call's steps (the capture step included). "
              "Method: benchmarks/generation/bench_hf_generate.py."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="bench_hf_generate", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS), help=f"comma-separated of {', '.join(VARIANTS)}")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8; --quick 1,2)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens (default 512; --quick 16)")
    p.add_argument("--new", type=int, default=None, help="new tokens, all forced (default 256; --quick 8)")
    p.add_argument("--quick", action="store_true", help="a 2-layer toy on the CPU (smoke run)")
    a = p.parse_args(argv)
    variants = [v for v in a.variants.split(",") if v]
    bad = [v for v in variants if v not in VARIANTS]
    if bad:
        p.error(f"unknown variant {bad[0]!r}; choose from {', '.join(VARIANTS)}")
    if "hf-static-compile" in variants:  # it unpatches the model: last
        variants = [v for v in variants if v != "hf-static-compile"] + ["hf-static-compile"]
    try:
        batches = [int(b) for b in (a.batches or ("1,2" if a.quick else "1,8")).split(",")]
    except ValueError:
        p.error("--batches takes integers joined by commas")
    prompt = a.prompt or (16 if a.quick else 512)
    new = a.new or (8 if a.quick else 256)
    if min(batches) < 1 or prompt < 1 or new < 3:
        p.error("batches and --prompt must be >= 1 and --new >= 3 (a capture needs two decode steps)")

    import torch

    device = torch.device("cpu" if a.quick or not torch.cuda.is_available() else "cuda")
    cfg = dict(TOY if a.quick else LLAMA_1B5)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], prompt + new)
    rows = []
    with torch.no_grad():
        for batch in batches:
            model, patched = build(cfg, device), [False]
            ids = prompt_ids(cfg, batch, prompt, device)
            ref = None
            for variant in variants:
                t = time.time()
                try:
                    timed, seqs = run_variant(model, ids, new, variant, patched)
                    row = row_of(variant, batch, timed, seqs, ref)
                    if variant == "hf-rolling":
                        ref = seqs
                except Exception as e:  # noqa: BLE001 - a failing variant is a row with its error
                    row = dict(variant=variant, batch=batch, error=f"{type(e).__name__}: {e}"[:600])
                row["process_s"] = time.time() - t
                rows.append(row)
                said = row["error"] if "error" in row else "p50 {:.3f} ms/step".format(row["p50_ms"])
                print(f"{'FAILED' if 'error' in row else 'DONE'} {variant} batch {batch}: {said}", file=sys.stderr,
                      flush=True)
            del model
            if device.type == "cuda":
                torch.cuda.empty_cache()
    result = dict(setup=dict(model="toy" if a.quick else "llama-1.5B", config=cfg, prompt=prompt, new=new,
                             batches=batches, dtype="fp32" if device.type == "cpu" else "bf16", device=device.type),
                  versions=_versions(), rows=rows)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "hf_generate.json").write_text(json.dumps(result, indent=1, default=str) + "\n")
    (out / "hf_generate.md").write_text(markdown(result))
    print(markdown(result))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
