"""Decode benchmark: Hugging Face `generate` against `tigon.generate` on a 1.5B Llama config, or the Llama-3-8B
shape (`--model llama3-8b`), in bf16 or quantized weights (`--weights`; the 70B shape `--model llama3-70b`).

    PYTHONPATH=src python -m benchmarks decode --out DIR [--model llama-1.5b|llama3-8b|llama3-70b]
        [--weights bf16|int4|nf4|fp8] [--variants ...]
        [--batches 1,8] [--swa-batches 1] [--prompts 512,8192 | --prompt 512] [--new 256] [--budget S]
        [--prometheus FILE] [--profile] [--quick]
    tigon bench decode ...      (the same from a source checkout, then prints the table)

A benchmark of the checkout, not part of the package: it uses tigon's public API (tigon.patch, tigon.generate,
tigon.decode's stats helpers TTFT_PHASES and percentile, tigon.decode.metrics.prometheus_text) and its
siblings benchmarks.generation.decode_profile (the --profile traces) and benchmarks.generation.decode_report (the
byte model and read bound, the targets, decode.md's tables, the plot). This module builds and runs the models:
the plan of variants, one process each, the timed calls. The HF and Tigon rows' p50/p99 use the stats' nearest-rank
rule (tigon.decode.percentile).

The method of the peer reference timings (REFERENCE_TIMINGS), so the numbers compare: each variant in its own
process, model from config (hidden 2048, intermediate 8192, 16 layers, 32 heads / 8 KV heads, vocab 128256),
bf16, random init, sdpa; greedy, a random prompt, every new token forced (no EOS). One warm-up call, then
one timed call with the peak-memory counter reset just before it (weights included).

- HF variants: per-step timestamps from a stopping criterion that synchronizes (the reference method's timer).
  `hf-static-compile` is `cache_implementation="static"`, which `generate` compiles itself on CUDA (the
  2.70 ms row of REFERENCE_TIMINGS; the explicit reduce-overhead compile fails in transformers 5.17).
- Tigon variants: `tigon.patch(model)` then `tigon.generate(..., return_stats=True)` with its default
  attention ("auto": the "tigon" attention implementation for the call); its steps are CUDA events recorded
  after each step, read once at the end (no sync in the loop). The first decode step of the graph path
  includes the capture. `wall_ms_per_step` (host clock around the whole call, minus TTFT) is a cross-check of
  the events. `*-hf-attn` is the same with `attention="hf"` (HF's sdpa in the loop), for comparison.
- `swa-*`: Mistral with sliding_window 1024 and a 4096-token prompt (every layer's ring wraps): swa-tigon
  replays a CUDA graph (the tigon attention), swa-tigon-hf-attn cannot (HF's mask past the ring) and runs
  eagerly; `swa-tigon-full` is the same model with the window off, so every layer holds all 4352 tokens (no
  wrap): the "ring past capacity within 5% of full-cache step time" target compares swa-tigon with it.

- `--profile`: after its timed call each tigon variant runs torch.profiler (CUDA activity) over three more
  calls with the timed call's ring size: `max_new_tokens=1` (the TTFT: prefill and first token), 3 and
  3 + PROFILE_STEPS. The 3-token call has one replayed step, the longer one PROFILE_STEPS more; their kernel
  counts differ by PROFILE_STEPS x (kernels per step), so the longer call's last kernels are exactly its last
  PROFILE_STEPS decode steps (replay + token choice), whatever the profiler sees outside them. Kernel time (the
  time some kernel ran: under programmatic dependent launch a kernel's traced interval starts while its
  predecessor runs, and the overlap is given to the predecessor) is bucketed by name (BUCKETS) and set against
  the measured p50 step: the difference is launch gaps and idle.
  GEMM bandwidth = bytes of the weights GEMMs read per step (every parameter once, the input embedding
  left out unless tied to the lm_head: a lookup reads B rows of it) / GEMM time. On a CPU (--quick) the
  profiler sees CPU ops only: the same tables over aten ops by self CPU time (interpreted Triton kernels
  are not ops and do not show).
- Variants take `@B[+B...]` to run at those batches only: `--variants tigon,hf-static-compile@1`.
- `--model llama3-8b`: the Llama-3-8B shape (hidden 4096, intermediate 14336, 32 layers, 32 / 8 heads of 128,
  vocab 128256, rope_theta 500000; bf16, random init on the GPU), default variants tigon,hf-static-compile and
  prompts 512,8192. `--prompts` runs every Llama variant at each prompt length (TTFT and decode steps per row;
  32768 works too, at the cost of time).
- The read bound: after the variants the parent process times a device-to-device copy of 2 GiB
  (triton.testing.do_bench, median; (read + write) bytes / time: the copy ceiling, in the same run). Each row's
  bound is the bytes one decode step must read, the weights (every parameter once, the untied input embedding
  left out: a lookup reads B rows of it) plus the keys and values its attention reads (the mean context of the
  decode steps: prompt + new / 2 tokens, the window's at most), over that ceiling; `% of bound` = bound / p50.

- `--weights int4|nf4|fp8` (default bf16): the random-init model is quantized round-to-nearest
  (`tigon.quantize(model, fmt, group_size=128)`, nf4 64; --quick 32 for the toy's 64 features) in each
  variant's process before the variant runs, so tigon and HF's own `generate` run the same quantized model (HF
  through QuantLinear's module forward: static cache + compile where it works, else the dynamic cache eagerly;
  the row's `hf_path` says which). With int4, `torchao-static-compile` is the peer outside Tigon: the bf16
  model's decoder projections quantized by torchao (int4 weight-only, the tinygemm layout gpt-fast runs, group
  128), then HF's generate with the static cache, compiled. `tigon-bf16` runs the same random-init model left in
  bf16 through tigon in the same call: the quantized rows' TTFT is checked against its (issue 42: within 1.3x).
  The read bound then counts the packed projections
  (QuantizedWeight.nbytes: codes, scales) measured on the model, plus the bf16 norms and lm_head and the KV; the
  bf16 model's bound is reported beside it. Except at the 70B shape a separate process reports fidelity once: KL(bf16 ||
  quantized) and top-1 agreement of the next-token distributions over one FIDELITY_PROMPT-token prompt (the bf16
  logits are taken, then the same model is quantized in place: one copy of the weights at a time).
- `--model llama3-70b` (80 layers, hidden 8192, intermediate 28672, 64 / 8 heads; quantized only: its bf16
  weights are ~140 GB): built on the meta device, then layer by layer materialized on the GPU, initialized as
  HF initializes it and quantized at once, so no more than one bf16 layer exists; tigon rows decode into a
  RING_70B-token ring (`capacity`), batch 1 by default.

Writes DIR/decode.json, DIR/decode.md and DIR/decode_latency.png (without matplotlib: no PNG). `--budget`
skips the variants that no longer fit, with a note in the table. `--quick`: a 2-layer toy on the CPU.
"""

import argparse
import json
import os
import subprocess
import sys
import time

from benchmarks.generation.decode_profile import PROFILE_STEPS, profile_tigon, sync
from benchmarks.generation.decode_report import (
    DEFAULT_MODEL,
    QUICK_TTFT_REPEATS,
    REFERENCE_TIMINGS,
    TARGETS_BY_MODEL,
    TARGETS_QUANT,
    TORCHAO_VARIANT,
    TTFT_REPEATS,
    copy_ceiling,
    markdown,
    plot,
    prometheus_rows,
    read_bound,
)
from benchmarks.tools import checkout
from benchmarks.tools.checkout import DEFAULT_OUT

LLAMA_1B5 = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192)
LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA3_70B = dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
MODELS = {"llama-1.5b": LLAMA_1B5, "llama3-8b": LLAMA3_8B, "llama3-70b": LLAMA3_70B}
WEIGHTS = ("bf16", "int4", "nf4", "fp8")
GROUP_SIZE = {"int4": 128, "nf4": 64, "fp8": 128}  # tigon.quantize's group_size (fp8: square blocks of this side)
QUICK_GROUP_SIZE = 32  # divides the toy's 64 and 128 features
QUANTIZED_ONLY = ("llama3-70b",)  # built layer by layer, each quantized at once (build_layerwise)
RING_70B = 32768  # the tigon rows' ring (KV capacity) at the 70B shape
FIDELITY_PROMPT = 512  # tokens of the fidelity prompt (--quick: QUICK["prompt"])
FIDELITY_NEED_S = 60  # seconds of the fidelity process (a guess: build, quantize, 2 forwards), NEED_SCALE'd
TOY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
           vocab_size=512, max_position_embeddings=256)
VARIANTS = ("hf-eager", "hf-static-compile", "tigon", "tigon-nograph", "tigon-hf-attn", "swa-hf-static-compile",
            "swa-tigon", "swa-tigon-full", "swa-tigon-hf-attn", "torchao-static-compile", "tigon-bf16")
# tigon-bf16 (with --weights int4|nf4|fp8): the same model left in bf16, run by tigon in the same call, the
# reference of the quantized rows' TTFT (TARGETS_QUANT["ttft_over_bf16"]) and step
# torchao-static-compile (TORCHAO_VARIANT; --weights int4 only): the bf16 model quantized by torchao's int4
# weight-only config in the tinygemm layout
# (`Int4WeightOnlyConfig(group_size, int4_packing_format="tile_packed_to_4d")`, torch's own `_weight_int4pack_mm`
# kernel, as gpt-fast runs it), then HF's generate with the static cache, which compiles itself
DEFAULT_VARIANTS = ("tigon,hf-static-compile,tigon-nograph,hf-eager,swa-tigon,swa-tigon-full,swa-hf-static-compile,"
                    "tigon-hf-attn,swa-tigon-hf-attn")
DEFAULT_VARIANTS_BY_MODEL = {"llama3-8b": "tigon,hf-static-compile", "llama3-70b": "tigon"}
DEFAULT_PROMPTS = {"llama-1.5b": "512", "llama3-8b": "512,8192", "llama3-70b": "512"}
DEFAULT_BATCHES = {"llama3-70b": "1"}
WINDOW, SWA_PROMPT = 1024, 4096
# --quick (a smoke run under Triton's interpreter): one prefill-only repeat and a 2-token warm-up, which runs every
# kernel once (there is no CUDA graph to capture on a CPU).
QUICK = dict(prompt=16, new=8, window=8, swa_prompt=24, batches="1,2", profile_steps=2,
             ttft_repeats=QUICK_TTFT_REPEATS, warmup_new=2)
PROFILE_NEED_S = 15  # the three profiled calls and the trace parsing of a 1.5B tigon row on an H200
# Seconds a variant needs on an H200 (process start, model build, warm-up, timed call); the budget check
# skips a variant with less than this left. Measured compile of the static decode step: ~40-60 s.
# swa-tigon-hf-attn: two eager 256-step calls (warm-up and timed) at an estimated 20-60 ms per step.
NEED_S = {"hf-static-compile": 110, "swa-hf-static-compile": 120, "hf-eager": 60, "swa-tigon-hf-attn": 70,
          "fidelity": FIDELITY_NEED_S, TORCHAO_VARIANT: 130}
NEED_DEFAULT_S = 50
# The 8B rows: a guess, unmeasured until a run times them (6x the weights to build, 2x the layers to compile).
NEED_SCALE = {"llama3-8b": 1.5, "llama3-70b": 3.0}


def model_config(spec):
    """The config dict of a spec's model: the toy with --quick, else MODELS[spec["model"]]."""
    return dict(TOY if spec["quick"] else MODELS[spec.get("model", DEFAULT_MODEL)])


def build(spec, quantized=True):
    """The spec's model (random init, eval, sdpa) on its device and a random prompt of [batch, prompt] ids. With
    spec["weights"] (int4, nf4, fp8) and `quantized` the model's projections are quantized (`quantize_model`;
    a QUANTIZED_ONLY model is built layer by layer, `build_layerwise`)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    cfg = model_config(spec)
    cfg["max_position_embeddings"] = max(cfg["max_position_embeddings"], spec["prompt"] + spec["new"])
    device = torch.device(spec["device"])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        if spec["family"] == "mistral":
            make = lambda: MistralForCausalLM(MistralConfig(**cfg, sliding_window=spec["window"]))  # noqa: E731
        else:
            make = lambda: LlamaForCausalLM(LlamaConfig(**cfg))  # noqa: E731
        if spec.get("model") in QUANTIZED_ONLY:
            model = build_layerwise(make, spec, device)
        else:
            with device:
                model = make()
    finally:
        torch.set_default_dtype(prev)
    model = model.eval()
    if quantized and spec.get("weights") and spec.get("model") not in QUANTIZED_ONLY:
        quantize_model(model, spec)
    model.config._attn_implementation = "sdpa"
    g = torch.Generator(device="cpu").manual_seed(1)
    ids = torch.randint(10, cfg["vocab_size"] - 10, (spec["batch"], spec["prompt"]), generator=g).to(device)
    return model, ids


def torchao_int4(model, group_size):
    """The decoder projections of `model` (a CUDA bf16 model) to torchao's int4 weight-only tinygemm layout, in
    place; the lm_head stays bf16, as tigon.quantize leaves it."""
    from torchao.quantization import Int4WeightOnlyConfig, quantize_

    config = Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d")
    quantize_(model.model.layers, config)
    return model


def quantize_model(model, spec):
    """`tigon.quantize(model, spec["weights"], group_size=spec["group_size"])`, in place (the lm_head stays bf16)."""
    import tigon

    return tigon.quantize(model, spec["weights"], group_size=spec["group_size"])


def build_layerwise(make, spec, device):
    """The model of `make()` (a causal LM with `model.layers`) built on the meta device, then each decoder layer in
    turn materialized on `device`, initialized by the model's `_init_weights` and quantized (`quantize_model`)
    before the next: the peak is the quantized model plus one bf16 layer (a 70B model's bf16 weights would not
    fit). The embeddings, final norm, rotary tables and lm_head are materialized last, in the model dtype."""
    import torch

    from tigon.quant import QuantLinear

    with torch.device("meta"):
        model = make()
    for i, layer in enumerate(model.model.layers):
        _materialize(model, layer, device)
        quantize_model(layer, spec)
        for name, m in layer.named_modules():
            if isinstance(m, QuantLinear):
                m.layer_name = f"model.layers.{i}.{name}"  # as tigon.quantize on the whole model names it
    for part in (model.model.embed_tokens, model.model.norm, model.model.rotary_emb, model.lm_head):
        _materialize(model, part, device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"bench_decode: build_layerwise left {len(left)} tensors on the meta device: {left[:4]}")
    return model


def _materialize(model, module, device):
    """`module`'s tensors allocated on `device` and set as the model's own initialization sets them."""
    import torch

    module.to_empty(device=device)
    with torch.no_grad():
        for m in module.modules():
            model._init_weights(m)


def projection_bytes(model):
    """Bytes of the model's quantized projections a decode step reads: QuantizedWeight.nbytes (codes, scales,
    zeros) summed over its QuantLinear modules."""
    from tigon.quant import QuantLinear

    return sum(m.quantized_weight.nbytes for m in model.modules() if isinstance(m, QuantLinear))


def fused_quantized_layers(model):
    """[layers that ran the fused quantized decode step, decoder layers]: a layer that did holds its stacked
    weights (tigon.quant.stack.STACK); one that did not ran its modules' own forwards."""
    from tigon.quant.stack import STACK

    layers = model.model.layers
    return [sum(STACK in layer.__dict__ for layer in layers), len(layers)]


def _peak_reset(device):
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def _peak_gib(device):
    import torch

    return torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else None


def ttft_repeats(spec) -> int:
    return QUICK["ttft_repeats"] if spec["quick"] else TTFT_REPEATS


def idle_repeats(spec, first_token_s, ids):
    """With spec["ttft_idle"] = S > 0: the prefill-only calls again, each after S seconds with the GPU idle. An
    8k prefill runs at the power cap, and the cap follows the recent power draw: back to back, each prefill
    starts throttled; after an idle second it starts at full clock (the power draw an isolated request sees)."""
    out = []
    for _ in range(ttft_repeats(spec) if spec.get("ttft_idle") else 0):
        time.sleep(spec["ttft_idle"])
        out.append(first_token_s(ids))
    return out


def new_length_prompts(spec, ids):
    """The prompts of the TTFT calls at new lengths: the first P - 1, ..., P - n tokens of the row's prompt
    (spec["ttft_new_lengths"] = n), shapes this process has not run: what a server's next request with another
    prompt length pays (cuDNN plans, Triton specializations, recompiles), where the repeats measure a warm shape."""
    return [ids[:, :ids.shape[1] - k] for k in range(1, spec.get("ttft_new_lengths", 0) + 1)]


def _child_hf(spec, model, ids):
    import torch
    from transformers import StoppingCriteria

    device = ids.device

    class Stamp(StoppingCriteria):
        def __init__(self):
            self.t = []

        def __call__(self, input_ids, scores, **kw):
            sync(device)
            self.t.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

    new = spec["new"]
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0, eos_token_id=None)
    if spec["variant"].endswith("static-compile"):
        kw["cache_implementation"] = "static"
    t = time.perf_counter()
    fallback = None
    try:
        _hf_warm_up(spec, model, ids, kw)
    except Exception as e:  # noqa: BLE001 - a quantized model's static + compile may fail: its eager path then
        if not (spec.get("weights") and kw.get("cache_implementation")):
            raise
        fallback = f"{type(e).__name__}: {e}"[:300]
        _hf_uncompile(model)
        kw.pop("cache_implementation")
        _hf_warm_up(spec, model, ids, kw)
    sync(device)
    warmup_s = time.perf_counter() - t
    _peak_reset(device)
    stamp = Stamp()
    t0 = time.perf_counter()
    model.generate(ids, stopping_criteria=[stamp], **kw)
    sync(device)
    t1 = time.perf_counter()
    ts = stamp.t
    steps = [b - a for a, b in zip(ts, ts[1:])]

    def first_token_s(prompt):  # a prefill-only call's TTFT
        stamp = Stamp()
        t_r = time.perf_counter()
        model.generate(prompt, stopping_criteria=[stamp], **dict(kw, max_new_tokens=1, min_new_tokens=1))
        return stamp.t[0] - t_r

    # the first token alone, again: one call's TTFT is host-noise sensitive
    repeats = [first_token_s(ids) for _ in range(ttft_repeats(spec))]
    idle = idle_repeats(spec, first_token_s, ids)
    fresh = [first_token_s(short) for short in new_length_prompts(spec, ids)]
    out = dict(ttft_s=ts[0] - t0, ttft_repeats_s=repeats, ttft_idle_repeats_s=idle, ttft_new_length_s=fresh,
               step_s=steps, total_s=t1 - t0,
               peak_gib=_peak_gib(device), warmup_s=warmup_s, cuda_graph=None, stats=None)
    if spec.get("weights"):
        out["hf_path"] = hf_path(kw, hasattr(model, "_compiled_call"), fallback)
    return out


def _hf_warm_up(spec, model, ids, kw):
    if kw.get("cache_implementation"):
        model.generate(ids, **kw)  # the full length: the auto-compile's recompiles happen here, not below
    else:
        warm = QUICK["warmup_new"] if spec["quick"] else 8
        model.generate(ids, **dict(kw, max_new_tokens=warm, min_new_tokens=warm))


def _hf_uncompile(model):
    """Forget a failed auto-compile: generate's compiled call and dynamo's caches."""
    import torch

    model.__dict__.pop("_compiled_call", None)
    torch._dynamo.reset()


def hf_path(kw, compiled, fallback=None):
    """How an HF row of a quantized model decoded: its cache, whether generate compiled the decode step, and why
    a failed static + compile fell back to the dynamic cache."""
    if fallback:
        return f"dynamic cache, eager (static cache + compile failed: {fallback})"
    if not kw.get("cache_implementation"):
        return "dynamic cache, eager"
    return "static cache + torch.compile" if compiled else "static cache, eager (generate did not compile)"


def _child_tigon(spec, model, ids):
    import tigon

    model.generation_config.eos_token_id = None  # every new token forced, as the HF rows' min_new_tokens
    report = str(tigon.patch(model))
    variant = spec["variant"]
    kw = dict(max_new_tokens=spec["new"], cuda_graph=not variant.endswith("nograph"), return_stats=True,
              attention="hf" if variant.endswith("hf-attn") else "auto")
    if spec.get("capacity"):
        kw["capacity"] = spec["capacity"]  # the ring (RING_70B at the 70B shape)
    device = ids.device
    t = time.perf_counter()
    warm = dict(kw, max_new_tokens=QUICK["warmup_new"]) if spec["quick"] and ids.device.type == "cpu" else kw
    tigon.generate(model, ids, **warm)  # Triton JIT and autotuning (and the CUDA graph's capture)
    sync(device)
    warmup_s = time.perf_counter() - t
    _peak_reset(device)
    t0 = time.perf_counter()
    seqs, stats = tigon.generate(model, ids, **kw)
    sync(device)
    t1 = time.perf_counter()
    assert seqs.shape == (ids.shape[0], ids.shape[1] + spec["new"]), seqs.shape
    peak = stats["peak_memory_bytes"]
    first_token_s = lambda prompt: tigon.generate(model, prompt, **dict(kw, max_new_tokens=1))[1]["ttft_s"]  # noqa: E731
    repeats = [first_token_s(ids) for _ in range(ttft_repeats(spec))]
    idle = idle_repeats(spec, first_token_s, ids)
    fresh = [first_token_s(short) for short in new_length_prompts(spec, ids)]
    out = dict(ttft_s=stats["ttft_s"], ttft_repeats_s=repeats, ttft_idle_repeats_s=idle, ttft_new_length_s=fresh,
               step_s=list(stats["step_s"]),
               total_s=t1 - t0,
               peak_gib=peak / 2**30 if peak is not None else None, warmup_s=warmup_s,
               cuda_graph=stats["cuda_graph"], attention=stats["attention"], stats=stats,
               patch=report.splitlines()[0] if report else None)
    if spec.get("weights"):
        out["fused_layers"] = fused_quantized_layers(model)
    if spec.get("profile"):
        try:
            steps = QUICK["profile_steps"] if spec["quick"] else PROFILE_STEPS
            out["profile"] = profile_tigon(model, ids, kw, spec, stats, steps)
        except Exception as e:  # noqa: BLE001 - a failing profile is a note; the timed row stands
            out["profile"] = dict(error=f"{type(e).__name__}: {e}"[:600])
    return out


def child(spec):
    """One variant in this process: build, warm up, time; returns the result row."""
    import torch

    from tigon.decode import percentile  # the stats' rule (nearest rank), for the HF rows too

    if spec["variant"] == "fidelity":
        return fidelity(spec)
    if spec["variant"] == TORCHAO_VARIANT:
        model, ids = build(spec, quantized=False)
        torchao_int4(model, spec["group_size"])
        quantized_bytes = None  # the bound counts tigon.quantize's bytes (torchao adds bf16 zero points: +3%)
    else:
        model, ids = build(spec)
        quantized_bytes = projection_bytes(model) if spec.get("weights") else None
    with torch.no_grad():
        r = (_child_tigon if "tigon" in spec["variant"] else _child_hf)(spec, model, ids)
    steps = r.pop("step_s")
    ordered = sorted(steps)
    mean = sum(steps) / len(steps) if steps else float("nan")
    wall_step = (r["total_s"] - r["ttft_s"]) / len(steps) if steps else None
    rep = sorted(r.get("ttft_repeats_s") or [])
    fresh = r.get("ttft_new_length_s") or []
    row = dict(spec, ttft_ms=1e3 * r["ttft_s"], ttft_median_ms=1e3 * rep[len(rep) // 2] if rep else None,
               ttft_repeats_ms=[round(1e3 * v, 2) for v in rep], p50_ms=1e3 * percentile(ordered, 0.5),
               p99_ms=1e3 * percentile(ordered, 0.99), mean_ms=1e3 * mean, tokens_per_s=spec["batch"] / mean,
               wall_ms_per_step=1e3 * wall_step if wall_step else None, total_s=r["total_s"],
               peak_gib=r["peak_gib"], warmup_s=r["warmup_s"], cuda_graph=r["cuda_graph"],
               attention=r.get("attention"), step_ms=[round(1e3 * s, 4) for s in steps])
    if fresh:
        row["ttft_new_length_ms"] = [round(1e3 * v, 2) for v in fresh]
    idle = sorted(r.get("ttft_idle_repeats_s") or [])
    if idle:
        row["ttft_idle_repeats_ms"] = [round(1e3 * v, 2) for v in idle]
        row["ttft_idle_median_ms"] = 1e3 * idle[len(idle) // 2]
    if r.get("patch"):
        row["patch"] = r["patch"]
    if quantized_bytes is not None:
        row["projection_bytes"] = quantized_bytes
    for key in ("hf_path", "fused_layers"):
        if r.get(key):
            row[key] = r[key]
    if r.get("profile"):
        row["profile"] = r["profile"]
    if r["stats"] is not None:
        row["stats"] = {k: v for k, v in r["stats"].items()}
    return row


def group_size(weights, quick):
    """tigon.quantize's group_size for `weights` (GROUP_SIZE; QUICK_GROUP_SIZE with --quick)."""
    return QUICK_GROUP_SIZE if quick else GROUP_SIZE[weights]


def plan(variants, batches, prompt, new, quick, device, swa_batches=None, profile=False, model=DEFAULT_MODEL,
         ttft_new_lengths=0, ttft_idle=0.0, weights="bf16"):
    """One spec per (prompt, variant, batch), prompt outermost; `prompt` is one length or a list. The swa-*
    variants use the Mistral form of the model's config, the long prompt (once, whatever `prompt` is) and
    `swa_batches` (default: `batches`). A variant "name@1+8" runs at batches 1 and 8 only. `profile` marks the
    tigon variants for `profile_tigon`; `model` is a key of MODELS; `ttft_new_lengths` n > 0 adds n TTFT calls at
    the prompt lengths P - 1 ... P - n to every row (`new_length_prompts`); `ttft_idle` S > 0 repeats the
    prefill-only calls each after S idle seconds (`idle_repeats`). `weights` other than bf16 puts `weights` and
    `group_size` in every spec (the model is quantized so); a QUANTIZED_ONLY model needs them, has no swa-*
    variants, and its specs hold the tigon rows' ring, `capacity` (RING_70B; unset with --quick)."""
    if model not in MODELS:
        raise SystemExit(f"bench_decode: unknown model {model!r}; choose from {', '.join(MODELS)}")
    if weights not in WEIGHTS:
        raise SystemExit(f"bench_decode: unknown weights {weights!r}; choose from {', '.join(WEIGHTS)}")
    if model in QUANTIZED_ONLY and weights == "bf16":
        raise SystemExit(f"bench_decode: --model {model} is built quantized only (its bf16 weights would not fit "
                         "one GPU): pass --weights int4, nf4 or fp8")
    names = {v.partition("@")[0] for v in variants}
    if weights == "bf16" and "tigon-bf16" in names:
        raise SystemExit("bench_decode: tigon-bf16 is the bf16 reference of a quantized run: pass --weights int4, "
                         "nf4 or fp8 (with bf16 weights the tigon variant is that row)")
    if model in QUANTIZED_ONLY and "tigon-bf16" in names:
        raise SystemExit(f"bench_decode: --model {model} is built quantized only: no tigon-bf16 row")
    if weights != "int4" and TORCHAO_VARIANT in names:
        raise SystemExit(f"bench_decode: {TORCHAO_VARIANT} is torchao's int4 weight-only model: pass --weights int4")
    if model in QUANTIZED_ONLY and any(v.startswith("swa-") for v in variants):
        raise SystemExit(f"bench_decode: --model {model} runs the Llama variants only, not swa-*")
    window = QUICK["window"] if quick else WINDOW
    swa_prompt = QUICK["swa_prompt"] if quick else SWA_PROMPT
    prompts = [prompt] if isinstance(prompt, int) else list(prompt)
    parsed = []
    for item in variants:
        v, _, only = item.partition("@")
        if v not in VARIANTS:
            raise SystemExit(f"bench_decode: unknown variant {v!r}; choose from {', '.join(VARIANTS)}")
        try:
            own = [int(b) for b in only.split("+")] if only else None
        except ValueError:
            raise SystemExit(f"bench_decode: {item!r}: batches after @ are integers joined by +") from None
        parsed.append((v, own))
    specs = []
    for i, length in enumerate(prompts):
        for v, own in parsed:
            swa = v.startswith("swa-")
            if swa and i:
                continue
            for b in own or ((swa_batches or batches) if swa else batches):
                spec = dict(variant=v, family="mistral" if swa else "llama", batch=b,
                            prompt=swa_prompt if swa else length, new=new,
                            window=None if (not swa or v == "swa-tigon-full") else window, quick=quick,
                            device=device, model=model)
                if profile and "tigon" in v:
                    spec["profile"] = True
                if ttft_new_lengths:
                    if ttft_new_lengths >= spec["prompt"]:
                        raise SystemExit(f"bench_decode: --ttft-new-lengths {ttft_new_lengths} must be below the "
                                         f"prompt length {spec['prompt']}")
                    spec["ttft_new_lengths"] = ttft_new_lengths
                if ttft_idle:
                    spec["ttft_idle"] = ttft_idle
                if weights != "bf16" and v != "tigon-bf16":
                    spec.update(weights=weights, group_size=group_size(weights, quick))
                if model in QUANTIZED_ONLY and not quick:
                    spec["capacity"] = RING_70B
                specs.append(spec)
    return specs


def _row(spec, p_stdout, p_stderr, rc):
    line = [x for x in p_stdout.splitlines() if x.startswith("RESULT ")]
    if line:
        return json.loads(line[-1][7:])
    tail = [x for x in p_stderr.strip().splitlines() if x.strip()][-3:]
    return dict(spec, error=" | ".join(tail)[-600:] or f"exit {rc}")


def _run_inline(specs, log):
    """--quick on a CPU: every variant in this process (a smoke run of the code paths; starting a process per
    variant costs ~4 s of imports each). Tigon patches instances only, and each variant builds its own model."""
    rows = []
    for spec in sorted(specs, key=lambda s: "tigon" in s["variant"]):
        t = time.time()
        try:
            row = child(spec)
        except Exception as e:  # noqa: BLE001 - a failing variant is a row, as in a subprocess
            row = dict(spec, error=f"{type(e).__name__}: {e}"[:600])
        row["process_s"] = time.time() - t
        rows.append(row)
        log(f"{'FAILED' if 'error' in row else 'DONE'} {spec['variant']} batch {spec['batch']} (in process)")
    return rows


def run_plan(specs, budget_s, timeout_s=300, log=print, inline=False):
    """Each spec in its own process, one after the other; a spec that no longer fits the budget is skipped."""
    if inline:
        return _run_inline(specs, log)
    rows = []
    deadline = time.time() + budget_s
    for spec in specs:
        left = deadline - time.time()
        need = 0 if spec["quick"] else round(NEED_SCALE.get(spec.get("model"), 1.0) * (
            NEED_S.get(spec["variant"], NEED_DEFAULT_S) + (PROFILE_NEED_S if spec.get("profile") else 0)))
        label = f"{spec['variant']} batch {spec['batch']} prompt {spec['prompt']}"
        if left < need:
            row = dict(spec, skipped=f"time budget: {left:.0f} s left, needs ~{need} s")
            log(f"SKIP {label}: {row['skipped']}")
            rows.append(row)
            continue
        t = time.time()
        try:
            # the tigon this process imported and this benchmarks package (checkout.child_env)
            p = checkout.run_module(__file__, ["--child", json.dumps(spec)], timeout=max(10, min(timeout_s, left)))
            row = _row(spec, p.stdout, p.stderr, p.returncode)
        except subprocess.TimeoutExpired:
            row = dict(spec, error=f"timeout after {time.time() - t:.0f} s")
        row["process_s"] = time.time() - t
        rows.append(row)
        log(f"{'FAILED' if 'error' in row else 'DONE'} {label} ({row['process_s']:.0f} s): "
            + (row.get("error") or _done(row)))
    return rows


def _done(row):
    if "kl_mean" in row:
        return f"KL {row['kl_mean']:.3g}, top-1 agreement {100 * row['top1_agreement']:.1f}%"
    return f"p50 {row['p50_ms']:.3f} ms/step, TTFT {row['ttft_ms']:.1f} ms"


def fidelity_spec(model, weights, quick, device):
    """The spec of the fidelity process (`fidelity`): batch 1, one FIDELITY_PROMPT-token prompt."""
    return dict(variant="fidelity", family="llama", batch=1, prompt=QUICK["prompt"] if quick else FIDELITY_PROMPT,
                new=0, window=None, quick=quick, device=device, model=model, weights=weights,
                group_size=group_size(weights, quick))


def fidelity(spec):
    """The bf16 model's next-token logits over the spec's prompt, then the same model quantized in place and its
    logits again: `logit_fidelity` of the two (one copy of the weights in memory at a time)."""
    import torch

    if spec.get("model") in QUANTIZED_ONLY:
        raise ValueError(f"bench_decode: fidelity needs the bf16 model, which {spec['model']} is never built as")
    model, ids = build(spec, quantized=False)
    with torch.no_grad():
        ref = model(ids).logits[0].float()
        quantize_model(model, spec)
        got = model(ids).logits[0].float()
    return dict(spec, **logit_fidelity(ref, got))


def logit_fidelity(ref, got):
    """{kl_mean, kl_max, top1_agreement, positions} of [positions, vocab] logits: KL(softmax(ref) ||
    softmax(got)) per position in fp32 (its mean and max), and the fraction of positions whose argmax agrees."""
    import torch

    lp, lq = torch.log_softmax(ref.float(), -1), torch.log_softmax(got.float(), -1)
    kl = (lp.exp() * (lp - lq)).sum(-1)
    top1 = (ref.argmax(-1) == got.argmax(-1)).float().mean()
    return dict(kl_mean=kl.mean().item(), kl_max=kl.max().item(), top1_agreement=top1.item(),
                positions=int(ref.shape[0]))


def build_parser(prog="bench_decode"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=DEFAULT_MODEL, choices=tuple(MODELS),
                   help=f"the Llama shape (default {DEFAULT_MODEL}; llama3-8b: Llama-3-8B's, random init; "
                        "llama3-70b: the 70B shape, with --weights other than bf16 only)")
    p.add_argument("--weights", default="bf16", choices=WEIGHTS,
                   help="the projections' weights: bf16 (default), or the model quantized round-to-nearest by "
                        "tigon.quantize (group 128, nf4 64) before each variant runs it")
    p.add_argument("--variants", default=None, help=f"comma-separated, in run order (default {DEFAULT_VARIANTS}; "
                   f"with --model llama3-8b {DEFAULT_VARIANTS_BY_MODEL['llama3-8b']}; all: {','.join(VARIANTS)})")
    p.add_argument("--batches", default=None, help="comma-separated (default 1,8; with --model llama3-70b 1)")
    p.add_argument("--swa-batches", default=None, help="batches of the swa-* variants (default 1)")
    p.add_argument("--prompt", type=int, default=None, help="prompt tokens of the Llama rows (default 512)")
    p.add_argument("--prompts", default=None, help="comma-separated prompt lengths, each a set of Llama rows "
                   "(default 512; with --model llama3-8b 512,8192; 32768 also works); not with --prompt")
    p.add_argument("--new", type=int, default=None, help="new tokens, all forced (default 256)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default ./{DEFAULT_OUT})")
    p.add_argument("--budget", type=float, default=540.0, help="seconds for the whole run (default 540)")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds per variant process (default 300)")
    p.add_argument("--quick", action="store_true", help="a 2-layer toy config and a few tokens (runs on a CPU)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--prometheus", default=None, help="also write the tigon rows' stats in the Prometheus text format")
    p.add_argument("--profile", action="store_true", help="also profile each tigon variant's decode step and TTFT "
                   "(torch.profiler, kernel time by bucket; a section in decode.md)")
    p.add_argument("--ttft-new-lengths", type=count, default=0, metavar="N",
                   help="after the TTFT repeats, N prefill-only calls at prompt lengths P-1 ... P-N, each a shape "
                        "the process has not run (default 0: none)")
    p.add_argument("--ttft-idle", type=float, default=0.0, metavar="S",
                   help="also repeat the prefill-only calls each after S seconds of idle GPU, beside the back-to-back "
                        "ones (the power cap follows recent draw; default 0: not done)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    return p


def count(text) -> int:
    """An integer >= 0 (argparse type)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"an integer >= 0, got {text!r}")
    return value


def int_list(text, flag):
    """Positive integers from "1,8"; SystemExit naming the flag otherwise."""
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = None
    if values is None or any(v <= 0 for v in values):
        raise SystemExit(f"bench_decode: {flag} takes positive integers joined by commas, got {text!r}")
    return values


def prompt_lengths(prompt, prompts, model, quick):
    """The prompt lengths of the Llama rows: --prompts, else --prompt, else the model's DEFAULT_PROMPTS (the
    toy's with --quick)."""
    if prompt is not None and prompts is not None:
        raise SystemExit("bench_decode: give --prompt or --prompts, not both")
    if prompts is not None:
        return int_list(prompts, "--prompts")
    if prompt is not None:
        return int_list(str(prompt), "--prompt")
    return [QUICK["prompt"]] if quick else int_list(DEFAULT_PROMPTS[model], "--prompts")


def main(argv=None, log=print, prog="bench_decode"):
    a = build_parser(prog).parse_args(argv)
    if a.child:
        print("RESULT " + json.dumps(child(json.loads(a.child))), flush=True)
        return 0
    import torch

    device = a.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cpu" and not a.quick:
        log(f"bench_decode: no CUDA device: the {a.model} config on a CPU would take hours; use --quick")
        return 2
    quick, model = a.quick, a.model
    variants = [v for v in (a.variants or DEFAULT_VARIANTS_BY_MODEL.get(model, DEFAULT_VARIANTS)).split(",") if v]
    batches = int_list(a.batches or (QUICK["batches"] if quick else DEFAULT_BATCHES.get(model, "1,8")), "--batches")
    swa_batches = int_list(a.swa_batches or ("" if quick else "1"), "--swa-batches") or None
    prompts = prompt_lengths(a.prompt, a.prompts, model, quick)
    new = a.new or (QUICK["new"] if quick else 256)
    if not a.ttft_idle >= 0:
        raise SystemExit(f"bench_decode: --ttft-idle must be >= 0 seconds, got {a.ttft_idle}")
    out = a.out
    os.makedirs(out, exist_ok=True)
    t0 = time.time()
    specs = plan(variants, batches, prompts, new, quick, device, swa_batches, profile=a.profile, model=model,
                 ttft_new_lengths=a.ttft_new_lengths, ttft_idle=a.ttft_idle, weights=a.weights)
    inline = quick and device == "cpu"
    rows = run_plan(specs, a.budget, a.timeout, log=log, inline=inline)
    name = "" if model == DEFAULT_MODEL or quick else f", {model}"
    name += f", {a.weights} weights" if a.weights != "bf16" else ""
    meta = dict(title="tigon.generate vs HF generate" + name + (" (quick toy on " + device + ")" if quick else ""),
                device=torch.cuda.get_device_name() if device == "cuda" else "cpu", torch=torch.__version__,
                model=model, prompts=prompts, wall_s=time.time() - t0,
                targets=TARGETS_QUANT if a.weights != "bf16" else TARGETS_BY_MODEL[model],
                reference_timings=REFERENCE_TIMINGS)
    if a.weights != "bf16":
        meta.update(weights=a.weights, group_size=group_size(a.weights, quick))
        if model not in QUANTIZED_ONLY:  # it takes the bf16 model's logits: not at the 70B shape
            left = a.budget - (time.time() - t0)
            (meta["fidelity"],) = run_plan([fidelity_spec(model, a.weights, quick, device)], left, a.timeout,
                                           log=log, inline=inline)
        meta["wall_s"] = time.time() - t0
    try:  # after the variants: the parent's own CUDA context and 4 GiB are gone before any child starts
        meta["copy_ceiling"] = copy_ceiling(device, quick)
    except Exception as e:  # noqa: BLE001 - a failed ceiling leaves the bound columns out, the rows stand
        meta["copy_ceiling_error"] = f"{type(e).__name__}: {e}"[:300]
    for r in rows:
        if "p50_ms" in r and meta.get("copy_ceiling"):
            r.update(read_bound(r, model_config(r), meta["copy_ceiling"]["GBps"]))
    try:
        import transformers

        meta["transformers"] = transformers.__version__
    except ImportError:
        pass
    with open(os.path.join(out, "decode.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = markdown(rows, meta)
    with open(os.path.join(out, "decode.md"), "w") as f:
        f.write(md)
    if not plot(rows, os.path.join(out, "decode_latency.png")):
        md += "(no decode_latency.png: matplotlib is not installed, or no row finished)\n"
    if a.prometheus:
        with open(a.prometheus, "w") as f:
            f.write(prometheus_rows(rows))
    log(md)
    return 0 if any("p50_ms" in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
