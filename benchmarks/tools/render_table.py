"""The results tables, rendered from the committed JSON (standard library only).

    python -m benchmarks render-table [path/to/<gpu>_ops.json]     the compact ops table of one gpu_check run
    python -m benchmarks render-table --topic NAME                  one topic's current table (TOPICS)
    python -m benchmarks render-table --check [FILE.md]             exit 1 if a rendered block of FILE drifted
    python -m benchmarks render-table --write [FILE.md]             re-render every block of FILE in place

A block in a results page is the text between `<!-- rendered: NAME -->` and `<!-- end rendered -->`; FILE
defaults to benchmarks/results/h200.md; the JSON is read from --results (default benchmarks/results). A block's
"Measured by" names the command of its commit, as it was then (the scripts' paths before benchmarks/ was a package).
"""

import argparse
import json
import math
import os
import re
import sys

from benchmarks.tools import checkout

RESULTS = str(checkout.RESULTS)
DEFAULT = os.path.join(RESULTS, "h200_ops.json")
DEFAULT_PAGE = os.path.join(RESULTS, "h200.md")
COLUMNS = ("tigon", "eager", "torch.compile", "liger")
NAMES = {"tigon": "Tigon", "eager": "eager (HF)", "torch.compile": "torch.compile", "liger": "Liger-Kernel"}
BLOCK = re.compile(r"(<!-- rendered: ([\w.-]+) -->\n)(.*?)(<!-- end rendered -->)", re.DOTALL)


def _time(us):
    if not isinstance(us, (int, float)):
        return None
    return f"{us / 1e3:.1f} ms" if us >= 1e4 else f"{us:.0f} us"


def _sig(x, digits=3) -> str:
    """x to `digits` significant digits, trailing zeros kept (9.20), one decimal from 100 up (219.6)."""
    if x >= 100:
        return f"{x:.1f}"
    decimals = max(0, digits - 1 - math.floor(math.log10(abs(x)))) if x else digits - 1
    return f"{x:.{decimals}f}"


def _int(x) -> str:
    """Whole numbers, thousands separated from 10,000 up (3646, 24,048)."""
    return f"{x:,.0f}" if x >= 1e4 else f"{x:.0f}"


def _table(head, rows) -> list:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)] + ["| " + " | ".join(r) + " |" for r in rows]


def cpu_run(result: dict) -> bool:
    """Whether the result was measured on a CPU: its meta says so, or every row does."""
    rows = result.get("rows", [])
    return result.get("meta", {}).get("device") == "cpu" or bool(rows) and all(r.get("device") == "cpu" for r in rows)


def _ops_rows(rows, cpu: bool) -> list:
    cases: dict = {}
    for r in rows:
        if r.get("group"):
            continue
        cases.setdefault((r["op"], r["case"]), {})[r["provider"]] = r
    out = []
    for (op, case), provs in cases.items():
        cells = [op, case]
        for c in COLUMNS:
            r = provs.get(c)
            t = _time(r.get("fb_us")) if r else None
            cells.append(t or ("n/a" if r is None else "error" if r.get("error") else "-"))
        t = (provs.get("tigon") or {}).get("fb_us")
        others = [p.get("fb_us") for n, p in provs.items()
                  if not n.startswith("tigon") and "floor" not in n and isinstance(p.get("fb_us"), (int, float))]
        if cpu:  # interpreted kernels against eager PyTorch: a ratio that says nothing about a GPU
            cells.append("n/a (CPU)")
        else:
            cells.append(f"{min(others) / t:.2f}x" if isinstance(t, (int, float)) and others else "-")
        out.append(cells)
    return out


OPS_HEAD = ["op", "shape", *(f"{NAMES[c]} fwd+bwd" for c in COLUMNS), "Tigon speedup vs best other"]
SPEEDUP_NOTE = ("Speedup: the fastest other provider's time over Tigon's (every non-Tigon provider, incl. "
                "cut-cross-entropy and Liger's variants).")


def compact(result: dict) -> str:
    """The markdown table (and a line on where the numbers come from). A CPU run's table says it is a smoke
    run: host wall times, no speedups or rates."""
    cpu = cpu_run(result)
    lines = _table(OPS_HEAD, _ops_rows(result.get("rows", []), cpu))
    m = result.get("meta", {})
    c = result.get("ceilings", {})
    where = (f"\n{m.get('gpu') or 'CPU'}, {m.get('date')}; torch {m.get('torch')}, triton {m.get('triton')}, "
             f"liger-kernel {m.get('liger-kernel')}. ")
    if cpu:
        note = ("CPU smoke run: median host wall time of fwd+bwd (Triton kernels through the interpreter, or the "
                "PyTorch reference), which checks that the benchmarks run; not representative of Tigon on a GPU, "
                "so no speedups or rates are given.")
    else:
        note = (f"Median GPU time of fwd+bwd with host run-ahead and the L2 flushed; ceilings measured in the same "
                f"run: D2D copy {c.get('copy_GBps', 0):.0f} GB/s, bf16 mm {c.get('mm_TFLOPs', 0):.0f} TFLOP/s. "
                + SPEEDUP_NOTE)
    return "\n".join(lines) + "\n" + where + note


def _load(folder, name):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def _source(commit, date, command, raw) -> str:
    when = f"{commit}, {date}" if date else commit
    code = f"`` {command} ``" if "`" in command else f"`{command}`"
    return f"- {when}: {code}; raw {raw}"


def topic_ops(folder) -> str:
    """The training ops: gpu_check's run for all but the fused linear cross-entropy, whose rows come from the
    later `lce` runs. At the completion-only shape Tigon is `skip_ignored=True`, what the patched model runs."""
    ops, lce = _load(folder, "h200_ops.json"), _load(folder, "h200_lce.json")
    rows = [r for r in ops["rows"] if r["op"] != "linear_cross_entropy"]
    completion = {r["case"] for r in lce["rows"] if r["provider"] == "tigon skip_ignored=True"}
    for r in lce["rows"] + lce["heads"]["data"]["rows"]:
        if r["case"] in completion and r["provider"] in ("tigon", "tigon skip_ignored=True"):
            r = dict(r, provider="tigon" if r["provider"] != "tigon" else "tigon, every row")
        rows.append(r)
    m, c = ops["meta"], ops["ceilings"]
    head = (f"{m['gpu']}; torch {m['torch']}, triton {m['triton']}, liger-kernel {m['liger-kernel']}, "
            f"cut-cross-entropy {m['cut-cross-entropy']}. Measured by:\n"
            + _source(m["git"], m["date"][:10], "bash benchmarks/run_gpu.sh ops", "`h200_ops.json`") + " (all but "
            "linear_cross_entropy; ceilings of that run: D2D copy "
            f"{c['copy_GBps']:.0f} GB/s, bf16 mm {c['mm_TFLOPs']:.0f} TFLOP/s)\n"
            + _source(lce["commit"], lce["date"], lce["command"], "`h200_lce.json`") + " (the Llama-3-8B head)\n"
            + _source(lce["heads"]["commit"], lce["heads"]["date"], lce["heads"]["command"], "`h200_lce.json` `heads`")
            + " (the Qwen-2.5-7B and Gemma-3 heads)\n\n")
    note = ("\nMedian GPU time of fwd+bwd with host run-ahead and the L2 flushed. " + SPEEDUP_NOTE
            + " At the -100 shape Tigon is `skip_ignored=True`, the patched model's call.")
    return head + "\n".join(_table(OPS_HEAD, _ops_rows(rows, False))) + "\n" + note


E2E_VARIANTS = {
    "tigon": "HF + tigon.patch",
    "liger": "HF + Liger {liger}",
    "eager": "HF eager",
    "tigon_adamw": "tigon.patch + tigon.optim.AdamW",
    "tigon_compile": "tigon.patch, then torch.compile",
    "tigon_compile_graphs": 'tigon.patch, then torch.compile(mode="reduce-overhead")',
    "tigon_compile_graphs_adamw": 'tigon.patch, torch.compile(mode="reduce-overhead"), tigon.optim.AdamW',
}
E2E_MODELS = {"llama": "1.5B Llama", "qwen3": "Qwen3-style 1.5B", "gemma2": "Gemma-2-style 1.5B (softcap)"}
# the training step's current calls, one per setting (h200_e2e.json `measurements`)
E2E_CURRENT = ("llama_profile_kernels_e3731b9", "llama_ckpt_profile_68d8fd1", "llama_clip_best_ded039b",
               "qwen3_qk_norm_rope_8d522b2", "qwen3_qk_norm_rope_clip_8d522b2", "gemma2_softcap_side_by_side")


def topic_e2e(folder) -> str:
    """The training step, every current call in one table; 'vs Liger' divides within a call only."""
    d = _load(folder, "h200_e2e.json")
    meta, found = d["meta"], d["measurements"]
    sources, rows = [], []
    for name in E2E_CURRENT:
        m = found[name]
        runs = m.get("run") or m.get("data") or m.get("rows")
        liger = next((r["step_ms"] for r in runs if r["variant"] == "liger"), None)
        sources.append(_source(m["commit"], m.get("date"), m["command"], f"`h200_e2e.json` `{name}`"))
        for r in runs:
            setting = ", ".join(s for s, on in (("checkpointing", r.get("ckpt")), (f"clip {r.get('clip')}",
                                                 r.get("clip"))) if on) or "-"
            rows.append([E2E_MODELS[r["config"]], E2E_VARIANTS[r["variant"]].format(liger=meta["liger-kernel"]),
                         setting, f"{r['step_ms']:.1f}", f"{r['tokens_per_s'] / 1e3:.1f}k", f"{r['peak_gib']:.2f}",
                         f"{liger / r['step_ms']:.3f}x" if liger else "-", m["commit"]])
    head = ["model", "variant", "setting", "step ms", "tokens/s", "peak GiB", "vs Liger (same call)", "commit"]
    return (f"{meta['gpu']}; torch {meta['torch']}, triton {meta['triton']}, transformers {meta['transformers']}, "
            f"liger-kernel {meta['liger-kernel']}. Measured by:\n" + "\n".join(sources) + "\n\n"
            + "\n".join(_table(head, rows)))


LORA_VARIANTS = {"liger": "HF + Liger {liger} + PEFT", "tigon-nolora": "tigon.patch(lora=False)",
                 "tigon": "tigon.patch",
                 "liger-qlora": "HF + Liger {liger} + PEFT QLoRA",
                 "tigon-qlora": "tigon.patch (4-bit LoRA layers on `ops.lora_add`)"}


def topic_lora(folder) -> str:
    """The 8B LoRA and QLoRA jobs (h200_lora.json: the LoRA call's rows, the QLoRA call's entry)."""
    d = _load(folder, "h200_lora.json")
    q = d["qlora_profile_ded039b"]
    v = d["versions"]
    rows = []
    for job, runs in (("LoRA", d["rows"]), ("QLoRA (NF4)", q["data"]["rows"])):
        liger = next(r["step_ms"] for r in runs if r["variant"].startswith("liger"))
        for r in runs:
            name = LORA_VARIANTS[r["variant"]].format(liger=v["liger-kernel"])
            rows.append([job, name, f"{r['step_ms']:.1f}", str(r["tok_s"]), f"{r['peak_gib']:.2f}",
                         f"{r['weights_gib']:.2f}", f"{liger / r['step_ms']:.2f}x",
                         f"{r['loss_first']:.3f} -> {r['loss_last']:.3f}"])
    head = ["job", "variant", "step ms", "tokens/s", "peak GiB", "weights GiB", "vs Liger", "loss first -> last"]
    qv = q["data"]["versions"]
    return (f"NVIDIA H200; torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}, peft "
            f"{v['peft']}, liger-kernel {v['liger-kernel']}, bitsandbytes {qv['bitsandbytes']}. Measured by:\n"
            + _source("cb30b1e", None, "python benchmarks/bench_lora.py --steps 4 --profile", "`h200_lora.json` "
                      "`rows`") + "\n"
            + _source(q["commit"], q["date"], q["command"], "`h200_lora.json` `qlora_profile_ded039b`") + "\n\n"
            + "\n".join(_table(head, rows)))


SFT_VARIANTS = {"padded_hf": "padded HF", "padded_liger": "padded Liger {liger}", "padded_tigon": "padded Tigon",
                "packed_tigon": "packed Tigon (cu_seq_lens)",
                "packed_tigon_position_ids": "packed Tigon (position_ids)"}


def topic_sft(folder) -> str:
    """SFT on the length mix, every variant of one call (h200_sft_llama.json `all_aa81995`)."""
    d = _load(folder, "h200_sft_llama.json")
    meta, m = d["meta"], d["measurements"]["all_aa81995"]
    liger = next(r["useful_tokens_per_s"] for r in m["rows"] if r["variant"] == "padded_liger")
    rows = [[SFT_VARIANTS[r["variant"]].format(liger=meta["liger-kernel"]), f"{r['step_ms']:.1f}",
             f"{r['useful_tokens_per_s']:,.0f}", f"{r['useful_tokens_per_s'] / liger:.2f}x",
             f"{r['computed_tokens_per_step'] / r['useful_tokens_per_step']:.2f}", f"{r['peak_gib']:.1f}"]
            for r in m["rows"]]
    head = ["variant", "median step ms", "useful tokens/s", "vs padded Liger", "tokens computed / useful", "peak GiB"]
    return (f"{meta['gpu']}; torch {meta['torch']}, transformers {meta['transformers']}, liger-kernel "
            f"{meta['liger-kernel']}. Measured by:\n"
            + _source(m["commit"], None, m["command"], "`h200_sft_llama.json` `all_aa81995`") + "\n\n"
            + "\n".join(_table(head, rows)))


LOSS_NAMES = {"eager": "eager", "trl": "TRL", "liger": "Liger", "tigon": "Tigon, 192 MiB chunks",
              "tigon 384 MiB": "Tigon, 384 MiB chunks"}


def topic_losses(folder) -> str:
    """The fused-linear post-training losses, every provider of one call (h200_losses.json)."""
    d = _load(folder, "h200_losses.json")
    rows, last = [], None
    for r in d["rows"]:
        if r.get("fb_us") is None:
            continue
        label = f"{r['op'].upper()}, {r['case']}" if r["op"] != last else ""
        last = r["op"]
        peak = r.get("fb_peak_MiB")
        rows.append([label, LOSS_NAMES.get(r["provider"], r["provider"]), _sig(r["fb_us"] / 1e3),
                     f"{r['fb_TFLOPs']:.0f}", f"{r['fb_pct_floor']:.0f}%", _int(peak) if peak else ""])
    head = ["loss, shape", "provider", "fwd+bwd ms", "TFLOP/s", "% of GEMM floor", "peak MiB"]
    c = d["ceilings"]
    return (f"{d['meta']['device']}; torch {d['meta']['torch']}; ceilings of the call: D2D copy "
            f"{c['copy_GBps']:.0f} GB/s, bf16 mm {c['mm_TFLOPs']:.0f} TFLOP/s. Measured by:\n"
            + _source("dee7388", None, "python benchmarks/bench_losses.py --chunk-mib 384", "`h200_losses.json`")
            + "\n\n" + "\n".join(_table(head, rows)))


MOE_NAMES = {"eager": "HF eager (loop over experts)", "grouped_mm": "HF grouped_mm (transformers' default)",
             "tigon": 'Tigon ("tigon" experts implementation)'}


def topic_moe(folder) -> str:
    """One routed-experts block, fwd and fwd+bwd per implementation (h200_moe.json)."""
    d = _load(folder, "h200_moe.json")
    base = next(r["fwd_bwd_ms"] for r in d["rows"] if r["provider"] == "grouped_mm")
    rows = [[MOE_NAMES.get(r["provider"], r["provider"]), _sig(r["fwd_ms"]), _sig(r["fwd_bwd_ms"]),
             f"{base / r['fwd_bwd_ms']:.2f}x", _int(r["peak_mib"])] for r in d["rows"] if r["op"] == "experts"]
    s, v = d["shape"], d["versions"]
    return (f"{v['gpu']}; torch {v['torch']}, triton {v['triton']}, transformers {v['transformers']}. One "
            f"Qwen3-30B-A3B routed-experts block: T {s['tokens']}, H {s['hidden']}, I {s['inter']}, E {s['experts']}, "
            f"top-k {s['top_k']}, bf16. Measured by:\n"
            + _source("dee7388", None, "bash benchmarks/run_gpu.sh moe", "`h200_moe.json`") + "\n\n"
            + "\n".join(_table(["provider", "fwd ms", "fwd+bwd ms", "vs grouped_mm", "peak MiB"], rows)))


def _decode(folder, names) -> str:
    """tigon.generate beside HF static cache + torch.compile, paired by batch and prompt within each call."""
    found = _load(folder, "h200_decode.json")["measurements"]
    sources, rows, meta = [], [], None
    for name in names:
        m = found[name]
        meta = meta or m["meta"]
        sources.append(_source(m["commit"], m["date"], m["command"], f"`h200_decode.json` `{name}`"))
        hf = {(r["batch"], r["prompt"]): r for r in m["rows"] if r["variant"] == "hf-static-compile"}
        for t in (r for r in m["rows"] if r["variant"] == "tigon"):
            h = hf.get((t["batch"], t["prompt"]))
            rows.append([str(t["batch"]), str(t["prompt"]), f"{t['p50_ms']:.3f}", f"{t['p99_ms'] / t['p50_ms']:.3f}",
                         f"{t['pct_of_bound']:.1f}%", f"{h['p50_ms']:.3f}" if h else "-",
                         f"{h['p50_ms'] / t['p50_ms']:.2f}x" if h else "-",
                         " / ".join(f"{r['ttft_median_ms']:.1f}" for r in (t, h) if r),
                         " / ".join(f"{r['peak_gib']:.2f}" for r in (t, h) if r), m["commit"]])
    head = ["batch", "prompt", "tigon p50 ms/step", "p99 / p50", "% of the read bound", "HF static + compile p50",
            "speedup", "TTFT median ms, tigon / HF", "peak GiB, tigon / HF", "commit"]
    return (f"{meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}. Measured by:\n"
            + "\n".join(sources) + "\n\n" + "\n".join(_table(head, rows)))


def topic_decode_1b5(folder) -> str:
    """The 1.5B Llama decode step, batch 1, with its kernel profile's call."""
    return _decode(folder, ("llama_1.5b_prompt_512_profile_7983035",))


def topic_decode_8b(folder) -> str:
    """The Llama-3-8B-shape decode step at prompts 512, 8192 and 32768, batch 1."""
    return _decode(folder, ("llama3_8b_prompts_8192_512_idle_68d8fd1", "llama3_8b_prompt_32768_077ff18"))


TOPICS = {"ops": topic_ops, "e2e": topic_e2e, "lora": topic_lora, "sft": topic_sft, "losses": topic_losses,
          "moe": topic_moe, "decode-1.5b": topic_decode_1b5, "decode-8b": topic_decode_8b}


def render_page(text: str, folder: str) -> str:
    """text with every rendered block replaced by what its topic renders now from the JSON in folder."""
    def fill(m):
        if m.group(2) not in TOPICS:
            raise ValueError(f"render_page: unknown topic {m.group(2)!r} (known: {', '.join(TOPICS)})")
        return m.group(1) + TOPICS[m.group(2)](folder) + "\n" + m.group(4)
    return BLOCK.sub(fill, text)


def drifted(text: str, folder: str) -> list:
    """Names of the blocks in text that differ from what their topics render now."""
    fresh = dict((m.group(2), m.group(3)) for m in BLOCK.finditer(render_page(text, folder)))
    return [m.group(2) for m in BLOCK.finditer(text) if fresh[m.group(2)] != m.group(3)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks render-table", description=__doc__.splitlines()[0])
    p.add_argument("ops_json", nargs="?", default=DEFAULT, help="a gpu_check JSON to print the compact ops table of")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--topic", choices=sorted(TOPICS), help="print this topic's current table")
    g.add_argument("--check", nargs="?", const=DEFAULT_PAGE, metavar="FILE.md", help="exit 1 if a block drifted")
    g.add_argument("--write", nargs="?", const=DEFAULT_PAGE, metavar="FILE.md", help="re-render the blocks in place")
    p.add_argument("--results", default=RESULTS, help="the folder of the JSON the topics read")
    a = p.parse_args(argv)
    try:
        if a.topic:
            print(TOPICS[a.topic](a.results))
            return 0
        page = a.check or a.write
        if page:
            with open(page) as f:
                text = f.read()
            if a.check:
                bad = drifted(text, a.results)
                for name in bad:
                    print(f"render_table: {page}: the '{name}' table differs from its JSON "
                          f"(python -m benchmarks render-table --write {page})", file=sys.stderr)
                return 1 if bad else 0
            with open(page, "w") as f:
                f.write(render_page(text, a.results))
            return 0
        with open(a.ops_json) as f:
            result = json.load(f)
    except OSError as e:
        print(f"render_table: cannot read {e.filename}: {e.strerror}", file=sys.stderr)
        return 2
    print(compact(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
