"""The report of the decode benchmark (benchmarks/generation/bench_decode.py): what turns its finished rows into
numbers and text. The byte model of a decode step (weights and KV read, bf16 or quantized) and its read bound over
the copy ceiling; the targets each row is checked on; and decode.md's tables and sections, the latency plot and
the Prometheus rows. Nothing here builds or runs a model: the rows come from bench_decode's processes."""

import math
import time

from benchmarks.generation.decode_profile import BUCKETS, PROFILE_STEPS

DEFAULT_MODEL = "llama-1.5b"  # the shape of a row without "model"; its labels and targets are the plain ones
TORCHAO_VARIANT = "torchao-static-compile"  # torchao's int4 model under HF's generate (bench_decode's VARIANTS)
TTFT_REPEATS = 5  # prefill-only calls after the timed one; their median is the TTFT the targets are checked on
QUICK_TTFT_REPEATS = 1  # the same with --quick (bench_decode's QUICK["ttft_repeats"])
COPY_ELEMENTS = 1 << 30  # bf16: a 2 GiB copy (4 GiB read + written), as the ops benchmarks' copy ceiling
# The 1.5B Llama's targets: p50 ms/step at batch 1 and 8, p99 over p50, TTFT at prompt 512, the ring past
# capacity against the full cache.
TARGETS = dict(b1_ms=1.0, b8_ms=1.4, p99_over_p50=1.15, ttft_ms=15.0, ring_over_full=1.05)
# Issue 18's targets at the Llama-3-8B shape: % of the read bound, speedup and TTFT ratio against
# hf-static-compile at the same batch and prompt.
TARGETS_8B = dict(pct_of_bound=85.0, over_hf=1.5, p99_over_p50=1.1, ttft_over_hf=0.8, ring_over_full=1.05)
# Issue 42's targets of quantized weights: % of the format's read bound, speedup against HF's own generate on the
# same quantized model, batch 8 against batch 1, and at the 8B shape, batch 1, prompt 512, the H200's ms/token.
TARGETS_QUANT = dict(pct_of_bound=80.0, over_hf=3.0, over_torchao=1.5, b8_over_b1=1.3, p99_over_p50=1.1,
                     ms_8b_h200={"int4": 1.4, "fp8": 2.35}, ttft_over_bf16=1.3)
TARGETS_BY_MODEL = {"llama-1.5b": TARGETS, "llama3-8b": TARGETS_8B, "llama3-70b": TARGETS_QUANT}
# HF's own rows measured with this method, to check a run against (tigon's rows are this benchmark's).
REFERENCE_TIMINGS = ("Peer reference timings (same method, H200, torch 2.11, transformers 5.17): HF eager "
                     "DynamicCache p50 64-68 ms/step (batch 1), 55.6 (batch 8); HF static cache + compile 2.70 ms "
                     "(batch 1), 3.93 ms (batch 8); Mistral sliding window 1024, prompt 4096, static + compile "
                     "2.87 ms (batch 1).")


def projection_shapes(cfg):
    """[(out_features, in_features)] of one decoder layer's projections of a Llama-style config: q, k, v, o, gate,
    up, down."""
    h, i = cfg["hidden_size"], cfg["intermediate_size"]
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or h // heads
    return [(heads * d, h), (kv_heads * d, h), (kv_heads * d, h), (h, heads * d), (i, h), (i, h), (h, i)]


def weight_read_bytes(cfg, dtype_bytes):
    """Bytes of the weights one decode step reads for a Llama-style config: every projection, norm and the
    lm_head once; the untied input embedding left out (a lookup reads B rows of it), as decode_profile's
    weight_bytes counts a model's parameters."""
    projections = cfg["num_hidden_layers"] * sum(n * k for n, k in projection_shapes(cfg))
    return dtype_bytes * projections + unquantized_read_bytes(cfg, dtype_bytes)


def unquantized_read_bytes(cfg, dtype_bytes):
    """Bytes of what `tigon.quantize` leaves in the model dtype and a decode step reads: each layer's two norms,
    the final norm and the lm_head (the input embedding is a lookup of B rows, left out)."""
    h = cfg["hidden_size"]
    return dtype_bytes * (cfg["num_hidden_layers"] * 2 * h + h + cfg["vocab_size"] * h)


def quantized_weight_bytes(n, k, weights, group, scale_bytes):
    """QuantizedWeight.nbytes of an [n, k] weight quantized by tigon.quantize (symmetric: no zero points):
    int4 / nf4 two codes a byte and one scale of `scale_bytes` (the model dtype's) per `group` along K; fp8 a
    byte an element and one fp32 scale per `group` x `group` block (per row with group 0)."""
    if weights == "fp8":
        blocks = n if group == 0 else -(-n // group) * -(-k // group)
        return n * k + 4 * blocks
    return n * k // 2 + n * (k // group) * scale_bytes


def quantized_read_bytes(cfg, weights, group, dtype_bytes):
    """Bytes of the weights a decode step of the quantized model reads: its projections' QuantizedWeight.nbytes
    (`quantized_weight_bytes`, scales in the model dtype) plus `unquantized_read_bytes`."""
    layer = sum(quantized_weight_bytes(n, k, weights, group, dtype_bytes) for n, k in projection_shapes(cfg))
    return cfg["num_hidden_layers"] * layer + unquantized_read_bytes(cfg, dtype_bytes)


def kv_read_bytes(cfg, batch, prompt, new, window, dtype_bytes):
    """Mean bytes of keys and values one decode step's attention reads: decode step j (1 .. new - 1) attends
    over prompt + j cached tokens (at most the window's), every layer, K and V, every row."""
    d = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = cfg["num_hidden_layers"] * 2 * cfg["num_key_value_heads"] * d * dtype_bytes
    contexts = [min(prompt + j, window) if window else prompt + j for j in range(1, new)]
    mean = sum(contexts) / len(contexts) if contexts else prompt
    return batch * per_token * mean


def read_bound(row, cfg, copy_GBps):
    """{weight_read_bytes, kv_read_bytes, bound_ms, pct_of_bound} of a finished row of the model config `cfg`
    (bench_decode's model_config of the row) at the copy ceiling: the bound is (weights + KV) / ceiling,
    pct_of_bound = 100 x bound / p50 (100 = every step at the ceiling). A quantized row's weights are its
    projections' bytes measured on the model (row["projection_bytes"], else `quantized_read_bytes`'s count of them)
    plus `unquantized_read_bytes`; it also gets the model's bound in the model dtype (bf16_bound_ms, for
    reference)."""
    dtype_bytes = 2 if row["device"].startswith("cuda") else 4  # bf16 on CUDA, fp32 on a CPU, as bench_decode builds
    weights = full = weight_read_bytes(cfg, dtype_bytes)
    if row.get("weights"):
        if row.get("projection_bytes") is not None:
            weights = row["projection_bytes"] + unquantized_read_bytes(cfg, dtype_bytes)
        else:
            weights = quantized_read_bytes(cfg, row["weights"], row["group_size"], dtype_bytes)
    kv = kv_read_bytes(cfg, row["batch"], row["prompt"], row["new"], row["window"], dtype_bytes)
    ms = lambda nbytes: nbytes / (copy_GBps * 1e9) * 1e3  # noqa: E731
    out = dict(weight_read_bytes=weights, kv_read_bytes=kv, bound_ms=ms(weights + kv),
               pct_of_bound=100 * ms(weights + kv) / row["p50_ms"])
    if row.get("weights"):
        out["bf16_bound_ms"] = ms(full + kv)
    return out


def copy_ceiling(device, quick):
    """The copy ceiling: GB/s of `dst.copy_(src)`, (read + write) bytes / time. On CUDA a 2 GiB bf16 copy timed by
    triton.testing.do_bench (median); with --quick or on a CPU 32 MiB, median of 5 perf_counter copies (a smoke
    run of the arithmetic, not a ceiling)."""
    import torch

    device = torch.device(device)
    n = COPY_ELEMENTS if device.type == "cuda" and not quick else 1 << 24
    ms, how = _time_copy(torch, device, n)
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the 4 GiB of the copy back to the device
    moved = 2 * n * 2
    return dict(GBps=moved / (ms * 1e-3) / 1e9, bytes=moved, ms=ms, how=f"{n * 2 / 2**20:.0f} MiB copy, {how}")


def _time_copy(torch, device, n):
    src = torch.ones(n, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    if device.type == "cuda":
        from triton.testing import do_bench

        return do_bench(lambda: dst.copy_(src), warmup=25, rep=200, return_mode="median"), "do_bench median"
    times = []
    for _ in range(5):
        t = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t)
    return 1e3 * sorted(times)[2], "perf_counter median of 5"


def bound_lines(rows, ceiling):
    """The read-bound section: each finished row's weight + KV bytes per step, bound and % of it."""
    done = [r for r in rows if r.get("bound_ms") is not None]
    if not done:
        return []
    quant = any(r.get("weights") for r in done)
    lines = ["", "### Weight + KV read bound", "",
             f"Copy ceiling {ceiling['GBps']:.0f} GB/s ({ceiling['how']}, (read + write) / time, this run). Bound = "
             "(weights + mean KV a decode step reads) / ceiling; % of bound = bound / p50."
             + (" Quantized weights: the projections' QuantizedWeight.nbytes (codes and scales) measured on the "
                "model, plus the norms and lm_head in the model dtype (bf16; fp32 on a CPU); bf16 bound: the same "
                "model's bound unquantized, for reference." if quant else ""), "",
             "| model | variant | batch | prompt | weights MB | KV MB/step | bound ms/step | p50 ms/step "
             "| % of bound |" + (" bf16 bound ms/step |" if quant else ""),
             "|" + "---|" * (10 if quant else 9)]
    for r in done:
        lines.append(f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} | "
                     f"{r['weight_read_bytes'] / 1e6:.1f} | {r['kv_read_bytes'] / 1e6:.1f} | {r['bound_ms']:.3f} | "
                     f"{r['p50_ms']:.3f} | {r['pct_of_bound']:.1f}% |"
                     + (f" {_num(r.get('bf16_bound_ms'), '.3f')} |" if quant else ""))
    return lines


def quantized_lines(rows, meta):
    """A quantized run's notes: how each HF row decoded (hf_path) and the fidelity of the quantized logits."""
    lines = []
    paths = [r for r in rows if r.get("hf_path")]
    if paths:
        lines += ["", "HF rows on the quantized model (QuantLinear's module forward):", ""]
        lines += [f"- {_model_name(r)} {r['variant']} batch {r['batch']} prompt {r['prompt']}: {r['hf_path']}"
                  for r in paths]
    fused = [r for r in rows if r.get("fused_layers")]
    if fused:
        lines += ["", "Tigon rows' decoder layers that ran the fused quantized decode step (the rest ran their "
                  "modules' forwards): " + ", ".join(f"{r['variant']} batch {r['batch']} prompt {r['prompt']} "
                                                     f"{r['fused_layers'][0]} of {r['fused_layers'][1]}"
                                                     for r in fused) + "."]
    f = meta.get("fidelity")
    if not f:
        return lines
    head = f"### Fidelity: {f['weights']} weights against the bf16 model"
    if "kl_mean" not in f:
        return lines + ["", head, "", f"not measured: {f.get('skipped') or f.get('error')}"]
    return lines + ["", head, "", f"Next-token distributions of one {f['prompt']}-token random prompt (batch 1), the "
                    "same random-init model before and after tigon.quantize (round-to-nearest); reported, not a "
                    "target.", "",
                    "| model | weights | group size | positions | KL(bf16 \\|\\| quantized) mean | KL max "
                    "| top-1 agreement |", "|" + "---|" * 7,
                    f"| {_model_name(dict(f, weights=None))} | {f['weights']} | {f['group_size']} | {f['positions']} | "
                    f"{f['kl_mean']:.3g} | {f['kl_max']:.3g} | {100 * f['top1_agreement']:.1f}% |"]


def _num(x, fmt=".2f"):
    return "-" if x is None or (isinstance(x, float) and not math.isfinite(x)) else format(x, fmt)


def _model_name(r):
    """The model column: the shape's name (llama-toy with --quick), its weights after it when quantized."""
    model = r.get("model", DEFAULT_MODEL)
    if r["family"] == "llama":
        name = model if not r["quick"] else "llama-toy"
    else:
        size = "" if r["quick"] or model == DEFAULT_MODEL else model.split("-")[-1] + "-"
        name = f"mistral-{size}" + (f"swa{r['window']}" if r["window"] else "full")
    return f"{name} {r['weights']}" if r.get("weights") else name


def _peer(rows, r, variant, same_weights=True):
    """`variant`'s measured row at r's model, batch and prompt (and r's weights, unless same_weights is False)."""
    return next((x for x in rows if x["variant"] == variant and x["batch"] == r["batch"] and x["prompt"] == r["prompt"]
                 and x.get("model") == r.get("model") and "p50_ms" in x
                 and (not same_weights or x.get("weights") == r.get("weights"))), None)


def _baseline(rows, r):
    """hf-static-compile's row (swa-hf-static-compile's for swa-*) at r's model, weights, batch and prompt."""
    return _peer(rows, r, "swa-hf-static-compile" if r["variant"].startswith("swa-") else "hf-static-compile")


def _ttft(r):
    """The row's TTFT for the targets: the median of the prefill-only calls, else the timed call's."""
    return r["ttft_median_ms"] if r.get("ttft_median_ms") is not None else r["ttft_ms"]


def targets(rows):
    """(target, value, verdict) for each target with its rows present; a row's model picks its targets
    (TARGETS_BY_MODEL)."""
    out = []
    ok = {r["variant"] + str(r["batch"]): r for r in rows if "p50_ms" in r}
    for r in rows:
        if "p50_ms" not in r or r["variant"] != "tigon":
            continue
        if r.get("weights"):
            out += _targets_quant(rows, r)
            continue
        if r.get("model", DEFAULT_MODEL) == "llama3-8b":
            out += _targets_8b(rows, r)
            continue
        limit = TARGETS["b1_ms"] if r["batch"] == 1 else TARGETS["b8_ms"] if r["batch"] == 8 else None
        if limit is not None:
            out.append((f"tigon batch {r['batch']} p50 <= {limit} ms/step", f"{r['p50_ms']:.3f} ms",
                        r["p50_ms"] <= limit))
        if r["prompt"] == 512:
            median = r.get("ttft_median_ms")
            how = (f" (median of {len(r['ttft_repeats_ms'])} prefill-only calls)" if median is not None
                   else " (the timed call)")
            out.append((f"tigon batch {r['batch']} TTFT <= {TARGETS['ttft_ms']:.0f} ms (prompt 512)",
                        f"{_ttft(r):.1f} ms{how}", _ttft(r) <= TARGETS["ttft_ms"]))
    for r in rows:
        if "p50_ms" in r and r["variant"] in ("tigon", "swa-tigon", "swa-tigon-full"):
            model = r.get("model", DEFAULT_MODEL)
            limit = (TARGETS_QUANT if r.get("weights") else TARGETS_BY_MODEL[model])["p99_over_p50"]
            at = f" prompt {r['prompt']}" if model != DEFAULT_MODEL else ""  # the 1.5B's labels as before
            ratio = r["p99_ms"] / r["p50_ms"]
            out.append((f"{r['variant']} batch {r['batch']}{at} p99 <= {limit}x p50", f"{ratio:.3f}x", ratio <= limit))
    for r in ok.values():
        full = ok.get("swa-tigon-full" + str(r["batch"]))
        if r["variant"] == "swa-tigon" and full:
            ratio = r["p50_ms"] / full["p50_ms"]
            out.append((f"batch {r['batch']}: ring past capacity p50 <= {TARGETS['ring_over_full']}x full cache",
                        f"{ratio:.3f}x ({r['p50_ms']:.3f} vs {full['p50_ms']:.3f} ms)",
                        ratio <= TARGETS["ring_over_full"]))
    return out


def _bound_check(r, label, what, pct):
    """[the % of the read bound check of row r] (none without a bound): label >= pct% of the `what` read bound."""
    if r.get("pct_of_bound") is None:
        return []
    return [(f"{label} >= {pct:.0f}% of the {what} read bound",
             f"{r['pct_of_bound']:.1f}% ({r['bound_ms']:.3f} of {r['p50_ms']:.3f} ms)", r["pct_of_bound"] >= pct)]


def _targets_8b(rows, r):
    """Issue 18's targets of one tigon row at the Llama-3-8B shape."""
    t, at = TARGETS_8B, f"batch {r['batch']} prompt {r['prompt']}"
    out = []
    out += _bound_check(r, f"tigon {at}", "weight + KV", t["pct_of_bound"])
    base = _baseline(rows, r)
    if base:
        speed = base["p50_ms"] / r["p50_ms"]
        out.append((f"tigon {at} p50 >= {t['over_hf']}x hf-static-compile", f"x{speed:.2f}", speed >= t["over_hf"]))
        ratio = _ttft(r) / _ttft(base)
        out.append((f"tigon {at} TTFT <= {t['ttft_over_hf']}x hf-static-compile's",
                    f"{ratio:.2f}x ({_ttft(r):.1f} vs {_ttft(base):.1f} ms)", ratio <= t["ttft_over_hf"]))
        if r.get("ttft_idle_median_ms") and base.get("ttft_idle_median_ms"):
            a, b = r["ttft_idle_median_ms"], base["ttft_idle_median_ms"]
            out.append((f"tigon {at} TTFT after {r['ttft_idle']:g} s idle <= {t['ttft_over_hf']}x "
                        "hf-static-compile's", f"{a / b:.2f}x ({a:.1f} vs {b:.1f} ms)", a / b <= t["ttft_over_hf"]))
    return out


def _targets_quant(rows, r):
    """Issue 42's targets of one tigon row of a quantized model (TARGETS_QUANT)."""
    t, fmt, at = TARGETS_QUANT, r["weights"], f"batch {r['batch']} prompt {r['prompt']}"
    out = []
    limit = t["ms_8b_h200"].get(fmt)
    if r.get("model") == "llama3-8b" and not r["quick"] and (r["batch"], r["prompt"]) == (1, 512) and limit:
        out.append((f"tigon {fmt} {at} p50 <= {limit} ms/token (the H200's target)", f"{r['p50_ms']:.3f} ms",
                    r["p50_ms"] <= limit))
    out += _bound_check(r, f"tigon {fmt} {at}", fmt, t["pct_of_bound"])
    base = _baseline(rows, r)
    if base:
        speed = base["p50_ms"] / r["p50_ms"]
        out.append((f"tigon {fmt} {at} p50 >= {t['over_hf']:g}x HF generate on the same {fmt} model",
                    f"x{speed:.2f}", speed >= t["over_hf"]))
    ao = _peer(rows, r, TORCHAO_VARIANT, same_weights=False)  # torchao's own int4 model of the bf16 weights
    if ao and fmt == "int4":
        speed = ao["p50_ms"] / r["p50_ms"]
        out.append((f"tigon int4 {at} p50 >= {t['over_torchao']:g}x torchao int4 + torch.compile", f"x{speed:.2f}",
                    speed >= t["over_torchao"]))
    ref = _peer(rows, r, "tigon-bf16", same_weights=False)
    if ref:
        ratio = _ttft(r) / _ttft(ref)
        out.append((f"tigon {fmt} {at} TTFT <= {t['ttft_over_bf16']:g}x the bf16 model's (tigon-bf16)",
                    f"{ratio:.3f}x ({_ttft(r):.2f} vs {_ttft(ref):.2f} ms)", ratio <= t["ttft_over_bf16"]))
    one = next((x for x in rows if x["variant"] == "tigon" and x["batch"] == 1 and x["prompt"] == r["prompt"]
                and x.get("model") == r.get("model") and x.get("weights") == fmt and "p50_ms" in x), None)
    if r["batch"] == 8 and one:
        ratio = r["p50_ms"] / one["p50_ms"]
        out.append((f"tigon {fmt} batch 8 prompt {r['prompt']} p50 <= {t['b8_over_b1']}x batch 1's",
                    f"{ratio:.2f}x ({r['p50_ms']:.3f} vs {one['p50_ms']:.3f} ms)", ratio <= t["b8_over_b1"]))
    return out


def markdown(rows, meta):
    lines = [f"## Decode: {meta.get('title', 'tigon.generate vs HF generate')}", "",
             "| model | variant | batch | prompt | new | TTFT ms | TTFT median ms | p50 ms/step | p99 ms/step "
             "| p99/p50 | mean ms/step | wall ms/step | tokens/s | peak GiB | graph "
             "| speedup vs hf-static-compile (p50) |",
             "|" + "---|" * 16]
    for r in rows:
        head = f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} | {r['new']} |"
        if "p50_ms" not in r:
            lines.append(head + f" {r.get('skipped') or 'error: ' + str(r.get('error'))[:200]} |" + " |" * 10)
            continue
        base = _baseline(rows, r)
        speed = f"x{base['p50_ms'] / r['p50_ms']:.2f}" if base else "-"
        graph = "-" if r.get("cuda_graph") is None else ("yes" if r["cuda_graph"] else "no")
        lines.append(head + f" {_num(r['ttft_ms'], '.1f')} | {_num(r.get('ttft_median_ms'), '.1f')} | "
                     f"{_num(r['p50_ms'], '.3f')} | {_num(r['p99_ms'], '.3f')} | "
                     f"{_num(r['p99_ms'] / r['p50_ms'], '.2f')} | {_num(r['mean_ms'], '.3f')} | "
                     f"{_num(r.get('wall_ms_per_step'), '.3f')} | {_num(r['tokens_per_s'], '.0f')} | "
                     f"{_num(r['peak_gib'])} | {graph} | {speed} |")
    checks = targets(rows)
    if checks:
        lines += ["", "| target | measured | met |", "|---|---|---|"]
        lines += [f"| {t} | {v} | {'yes' if ok else '**no**'} |" for t, v, ok in checks]
    skipped = [r for r in rows if r.get("skipped")]
    lines += ["", REFERENCE_TIMINGS,
              "tokens/s = batch / mean decode step (the reference timings' definition). TTFT: prefill + first token "
              "(tigon: from the call, cache allocation included), in the timed call; TTFT median: of "
              f"{TTFT_REPEATS} prefill-only calls after it ({QUICK_TTFT_REPEATS} with --quick; "
              "max_new_tokens=1; one call's TTFT moves with the host's noise). wall ms/step: host clock around "
              "the timed call minus TTFT, over the decode steps (a cross-check of the per-step timer). The graph "
              "path's first decode step includes the CUDA-graph capture."]
    lines += new_length_lines(rows) + idle_lines(rows)
    if skipped:
        names = ", ".join(f"{r['variant']} b{r['batch']}" for r in skipped)
        lines.append(f"Skipped for the time budget: {names}.")
    if meta.get("copy_ceiling"):
        lines += bound_lines(rows, meta["copy_ceiling"])
    lines += quantized_lines(rows, meta) + ttft_phase_lines(rows) + profile_lines(rows)
    return "\n".join(lines) + "\n"


def idle_lines(rows):
    """The prefill-only calls made after an idle pause (--ttft-idle), beside the back-to-back median."""
    done = [r for r in rows if r.get("ttft_idle_repeats_ms")]
    if not done:
        return []
    lines = ["", f"TTFT of prefill-only calls each after {done[0]['ttft_idle']:g} s of idle GPU (ms; the median above "
             "is of back-to-back calls):", "", "| model | variant | batch | prompt | back-to-back median | after idle, "
             "sorted | median |", "|---|---|---|---|---|---|---|"]
    for r in done:
        lines.append(f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} | "
                     f"{_num(r.get('ttft_median_ms'), '.1f')} | {', '.join(map(str, r['ttft_idle_repeats_ms']))} | "
                     f"{_num(r['ttft_idle_median_ms'], '.1f')} |")
    return lines


def new_length_lines(rows):
    """The TTFT calls at prompt lengths the process had not run, beside the warm median (--ttft-new-lengths)."""
    done = [r for r in rows if r.get("ttft_new_length_ms")]
    if not done:
        return []
    lines = ["", "TTFT at new prompt lengths (P - 1, P - 2, ...: shapes the process had not run; ms):", "",
             "| model | variant | batch | prompt | warm median | at new lengths | worst / warm |", "|" + "---|" * 7]
    for r in done:
        fresh, warm = r["ttft_new_length_ms"], _ttft(r)
        lines.append(f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} | {_num(warm, '.1f')} | "
                     f"{', '.join(f'{v:.1f}' for v in fresh)} | {_num(max(fresh) / warm, '.2f')} |")
    return lines


def ttft_phase_lines(rows):
    """The tigon rows' TTFT split by phase (stats["ttft_phases_s"] / ["ttft_host_phases_s"])."""
    done = [r for r in rows if (r.get("stats") or {}).get("ttft_phases_s")]
    if not done:
        return []
    from tigon.decode import TTFT_PHASES

    lines = ["", "### TTFT by phase (timed call; ms, device / host)", "",
             "| model | variant | batch | prompt | TTFT | " + " | ".join(TTFT_PHASES) + " |",
             "|" + "---|" * (5 + len(TTFT_PHASES))]
    for r in done:
        dev, host = r["stats"]["ttft_phases_s"], r["stats"].get("ttft_host_phases_s") or {}
        cells = [f"{_num(1e3 * dev[k], '.2f')} / {_num(1e3 * host[k] if k in host else None, '.2f')}"
                 for k in TTFT_PHASES]
        lines.append(f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} | "
                     f"{_num(r['ttft_ms'], '.1f')} | "
                     + " | ".join(cells) + " |")
    lines.append("device: CUDA-event interval between the phase's boundaries (when the stream reached them; sums "
                 "to TTFT); host: perf_counter wall time of the phase. host ~ device: the GPU waited on the host "
                 "(host-bound); device > host: GPU-bound, or queued behind earlier work. On a CPU both are the "
                 "host clock.")
    return lines


def profile_lines(rows):
    """The --profile section: per decode step and per TTFT, kernel time by bucket."""
    done = [r for r in rows if isinstance(r.get("profile"), dict)]  # a failed variant's row keeps its spec's True
    if not done:
        return []
    names = [name for name, _ in BUCKETS]
    ok = [r for r in done if "decode" in r["profile"]]
    activity = ok[0]["profile"]["activity"] if ok else "cuda kernels"
    unit = "kernels" if activity == "cuda kernels" else "ops"
    steps = ok[0]["profile"]["decode"]["steps"] if ok else PROFILE_STEPS
    lines = ["", f"### Decode-step profile (torch.profiler, {activity}; ms per step over {steps} decode steps)", "",
             f"| model | variant | batch | prompt | {unit}/step | {unit} ms | summed durations | " + " | ".join(names)
             + f" | measured p50 | p50 - {unit} (gaps) | traced span | GEMM GB/s |",
             "|" + "---|" * (11 + len(names))]
    for r in done:
        head = f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} |"
        prof = r["profile"]
        if "decode" not in prof:
            lines.append(head + f" profile failed: {prof.get('error')} |" + " |" * (6 + len(names)))
            continue
        d = prof["decode"]
        lines.append(head + f" {_num(d['kernels'], '.1f')} | {_num(d['kernel_ms'], '.3f')} | "
                     f"{_num(d['launched_ms'], '.3f')} | "
                     + " | ".join(_num(d["buckets_ms"][k], ".3f") for k in names)
                     + f" | {_num(d['measured_p50_ms'], '.3f')} | {_num(d['gap_ms'], '.3f')} | "
                     f"{_num(d['span_ms'], '.3f')} | {_num(d['gemm_GBps'], '.0f')} |")
    lines += ["", f"{unit} ms: the time some kernel ran, overlaps counted once (the buckets too: with programmatic "
              "dependent launch a kernel starts while its predecessor runs and waits; the overlap is the "
              "predecessor's); summed durations: the profiler's kernel durations added up, waits included."]
    blind = [f"{r['variant']} b{r['batch']}" for r in ok if not r["profile"]["decode"]["kernels"]]
    if blind:
        lines += ["", f"No {unit} seen in the decode steps of {', '.join(blind)}: this torch/CUPTI did not trace the "
                  "replayed CUDA graph's kernels (run the *-nograph variant, or Nsight Systems)."]
    lines += ["", "### TTFT profile (one generate call with max_new_tokens=1; ms)", "",
              f"| model | variant | batch | prompt | {unit} | {unit} ms | " + " | ".join(names)
              + " | traced span | TTFT (timed call) | TTFT (traced call) |", "|" + "---|" * (9 + len(names))]
    for r in ok:
        f = r["profile"]["prefill"]
        lines.append(f"| {_model_name(r)} | {r['variant']} | {r['batch']} | {r['prompt']} | "
                     f"{_num(f['kernels'], '.0f')} | "
                     f"{_num(f['kernel_ms'], '.3f')} | " + " | ".join(_num(f["buckets_ms"][k], ".3f") for k in names)
                     + f" | {_num(f['span_ms'], '.3f')} | {_num(f['measured_ttft_ms'], '.2f')} | "
                     f"{_num(f['traced_ttft_ms'], '.2f')} |")
    for r in ok:
        d = r["profile"]["decode"]
        lines += ["", f"Top {unit} per decode step, {r['variant']} batch {r['batch']} prompt {r['prompt']} "
                  f"({d['located']}; GEMM weight "
                  f"bytes {d['gemm_weight_bytes'] / 1e6:.1f} MB of {d['param_bytes'] / 1e6:.1f} MB of parameters):", ""]
        lines += [f"- {t['ms']:.4f} ms, {t['per_step']:g}x, {t['bucket']}: `{t['name']}`" for t in d["top"]]
    lines += ["", f"Buckets by {unit[:-1]} name: gemm (cuBLAS gemm/gemv/nvjet/cutlass), attention (tigon "
              "decode_attention; sdpa/flash in a prefill), rope_kv_write, norms, glu (tigon kernels), other triton "
              "(any other bare kernel name), other torch (ATen kernels, copies, sampling). gaps = measured p50 (the "
              "untraced timed call) minus the kernel time: launch gaps and idle. traced span: first kernel start to "
              "last kernel end over the steps (the profiler adds per-kernel overhead). GEMM GB/s = GEMM weight bytes / "
              "GEMM time per step (the input embedding is a lookup and left out unless tied)."]
    return lines


def plot(rows, path):
    """Latency of each decode step, one line per variant; False when matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    done = [r for r in rows if r.get("step_ms")]
    if not done:
        return False
    fig, ax = plt.subplots(figsize=(10, 5.5))
    ax.set_prop_cycle(color=plt.cm.tab20.colors)  # up to 20 distinct lines (the default plan draws 14)
    for r in done:
        ax.plot(range(1, len(r["step_ms"]) + 1), r["step_ms"], lw=1,
                label=f"{_model_name(r)} {r['variant']} b{r['batch']}")
    ax.set_yscale("log")
    ax.set_xlabel("decode step")
    ax.set_ylabel("ms per step (log)")
    ax.set_title("Decode latency per step")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def prometheus_rows(rows):
    """The tigon rows' stats as one Prometheus exposition, labelled by model, variant and batch."""
    from tigon.decode.metrics import prometheus_text

    runs = [({"model": _model_name(r), "variant": r["variant"], "batch": str(r["batch"])}, r["stats"])
            for r in rows if r.get("stats")]
    return prometheus_text(runs) if runs else ""
