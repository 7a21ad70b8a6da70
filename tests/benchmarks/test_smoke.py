"""The benchmark harness's --quick path on CPU (kernels through the interpreter): one small op end to end
through `tigon bench`, plus the harness's promise that a failing or missing provider is a note, not a crash."""

import json
import os
from pathlib import Path

import pytest
import torch

from benchmarks.generation import bench_decode as core
from benchmarks.generation import decode_profile as profiling
from benchmarks.generation import decode_report as report
from benchmarks.generation import sdpa_new_shapes
from benchmarks.ops import gpu_check
from benchmarks.tools import checkout, render_table
from benchmarks.tools import harness as harness_module
from benchmarks.training import step_profile
from tigon import cli


@pytest.fixture(scope="module")
def harness():
    return harness_module


def test_quick_bench_writes_a_table_with_the_tigon_row(tmp_path, capsys, harness):
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--sections", "rms_norm", "--device", "cpu", "--out", str(out), "--budget", "60"]
    assert cli.main(argv) == 0
    assert sorted(os.listdir(out)) == ["cpu.json", "cpu.md", "gpu_check.log"]
    md = (out / "cpu.md").read_text()
    assert "## Ceilings" in md and "### rms_norm:" in md
    tigon_rows = [ln for ln in md.splitlines() if ln.startswith("| tigon |")]
    assert len(tigon_rows) == 1
    cells = [c.strip() for c in tigon_rows[0].strip("|").split("|")]
    assert float(cells[2].replace(",", "")) > 0  # fwd+bwd time
    assert cells[10].startswith("y ")  # rel errors vs fp64 are reported
    result = json.loads((out / "cpu.json").read_text())
    rows = {r["provider"]: r for r in result["rows"] if r["op"] == "rms_norm"}
    assert rows["tigon"]["fb_us"] > 0 and rows["tigon"]["err"]["dx"] < 0.05
    assert rows["eager"]["fb_us"] > 0
    assert "needs CUDA" in rows["liger"]["note"]  # peers are skipped with a note on a CPU
    assert result["ceilings"]["copy_GBps"] > 0
    # a CPU run says so and gives no rates: no CUDA-event method, no ceilings, no TFLOP/s or speedups
    assert "not representative" in md and "CUDA-event" not in md and "TFLOP/s |" not in md
    assert "Not given on a CPU run" in md and "n/a (CPU)" in md
    compact = render_table.compact(result)
    assert "| rms_norm |" in compact
    assert "CPU smoke run" in compact and "not representative" in compact
    assert "GPU time" not in compact and "TFLOP/s" not in compact and "GB/s" not in compact
    assert compact.splitlines()[2].endswith("| n/a (CPU) |")
    assert "Tigon fwd+bwd" in capsys.readouterr().out  # gpu_check ends with the compact table


def test_gpu_reports_keep_their_method_and_rates(harness):
    row = dict(op="rms_norm", case="4x64", provider="tigon", device="cuda", fwd_us=10.0, fb_us=30.0, fb_GBps=2.0)
    peer = dict(row, provider="eager", fb_us=60.0)
    result = dict(meta=dict(date="today", python="3", torch="2", triton="3", transformers="5", device="cuda",
                            gpu="NVIDIA H200", argv=[], budget_s=1.0, TRITON_INTERPRET="unset",
                            **{"liger-kernel": None, "cut-cross-entropy": None, "tigon": "0"}),
                  ceilings=dict(copy_GBps=4000.0, copy_bytes=4, mm_TFLOPs=800.0, mm_shape=8192),
                  rows=[row, peer], extras={}, notes=[], section_s={})
    md = gpu_check._md(result)
    assert "CUDA-event" in md and "800 TFLOP/s |" in md and "not representative" not in md
    compact = render_table.compact(result)
    assert "Median GPU time" in compact and "smoke" not in compact and compact.splitlines()[2].endswith("| 2.00x |")
    cpu_rows = [dict(r, device="cpu") for r in (row, peer)]
    cpu = dict(result, meta=dict(result["meta"], device="cpu", gpu=None), rows=cpu_rows)
    md = gpu_check._md(cpu)
    assert md.count("not representative") == 1 and "CUDA-event" not in md and "TFLOP/s |" not in md


def test_gpu_check_writes_to_the_named_folder_by_default(monkeypatch):
    monkeypatch.setenv("OUT", "/somewhere/else")
    assert gpu_check.parse_args([]).out == "tigon-bench-results"


def test_a_failing_provider_is_a_cell_note(harness):
    ctx = harness.Context(device="cpu", quick=True)
    x = torch.randn(4, 8, requires_grad=True)

    def ok():
        return harness.Call(lambda: (x * 2).sum(), (x,))

    def boom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 31.3 GiB")

    def missing():
        return harness.Call(harness.import_first("no_such_package_xyz:Thing"), (x,))

    harness.measure(ctx, "toy", "x [4, 8]", [("tigon", ok), ("oom", boom), ("peer", missing)],
                    bytes_fb=64, host_column=False)
    rows = {r["provider"]: r for r in ctx.rows}
    assert rows["tigon"]["fb_us"] > 0
    assert "out of memory" in rows["oom"]["error"]
    assert "not importable" in rows["peer"]["note"]
    table = "\n".join(harness.op_table(ctx.rows, {}))
    assert "| oom | RuntimeError: CUDA out of memory" in table


# bench_decode --quick's variants in groups xdist runs side by side (each tigon row takes ~20-40 s a batch size
# under the interpreter, a compiled HF row a CPU compile), with the batch sizes each group's checks need.
DECODE_GROUPS = {
    "hf": (("hf-eager",), "1,2"),
    "compiled": (("hf-static-compile", "swa-hf-static-compile"), "1"),
    "tigon": (("tigon",), "1"),  # batch 2 on a CPU (no CUDA graph) is the nograph row's path
    "nograph": (("tigon-nograph",), "2"),
    "hf-attn": (("tigon-hf-attn", "swa-tigon-hf-attn"), "1"),
    "swa": (("swa-tigon", "swa-tigon-full"), "1"),
}


def test_decode_groups_cover_every_variant(harness):
    # torchao-static-compile is torchao's int4 model in the tinygemm layout, a CUDA kernel: its plan and target rows
    # are checked in tests/benchmarks/test_decode_args.py, its run on the GPU (run_gpu.sh decode-int4); tigon-bf16
    # runs beside quantized rows only (test_decode_args.py::test_quick_quantized_run)
    grouped = [v for variants, _ in DECODE_GROUPS.values() for v in variants]
    assert sorted(grouped + [report.TORCHAO_VARIANT, "tigon-bf16"]) == sorted(core.VARIANTS)


@pytest.mark.parametrize("group", list(DECODE_GROUPS))
def test_decode_bench_quick_runs_every_variant(tmp_path, harness, group):

    variants, batches = DECODE_GROUPS[group]
    out = tmp_path / "decode"
    lines = []
    # The swa-* rows at batch 1 only (--swa-batches): the interpreter runs their tigon decode kernels slowly.
    argv = ["--quick", "--device", "cpu", "--out", str(out), "--variants", ",".join(variants),
            "--batches", batches, "--swa-batches", "1"]
    assert core.main(argv, log=lines.append) == 0
    files = set(os.listdir(out))
    assert {"decode.json", "decode.md"} <= files
    rows = json.loads((out / "decode.json").read_text())["rows"]
    assert [(r["variant"], r["batch"]) for r in rows if "error" in r] == []
    expect = {(v, int(b)) for v in variants for b in ("1" if v.startswith("swa-") else batches).split(",")}
    assert {(r["variant"], r["batch"]) for r in rows} == expect and len(rows) == len(expect)
    md = (out / "decode.md").read_text()
    for r in rows:
        assert r["ttft_ms"] > 0 and 0 < r["p50_ms"] <= r["p99_ms"] and r["tokens_per_s"] > 0
        assert len(r["step_ms"]) == r["new"] - 1  # one latency per decode step after the first token
        assert ("stats" in r) == ("tigon" in r["variant"])
        if "tigon" in r["variant"]:  # generate's default runs the tigon attention; *-hf-attn asks for HF's
            assert r["attention"] == ("hf" if r["variant"].endswith("hf-attn") else "tigon")
            assert len(r["ttft_repeats_ms"]) == core.QUICK["ttft_repeats"]
        model = ("llama-toy" if not r["variant"].startswith("swa-") else
                 "mistral-full" if r["variant"] == "swa-tigon-full" else f"mistral-swa{core.QUICK['window']}")
        assert f"| {model} | {r['variant']} | {r['batch']} |" in md
    assert "### Decode-step profile" not in md  # only with --profile
    if group == "tigon":
        assert "| target | measured | met |" in md and "tigon batch 1 p50 <=" in md
    if group == "nograph":
        assert "### TTFT by phase" in md and "| llama-toy | tigon-nograph | 2 |" in md.split("### TTFT by phase")[1]
    if group == "swa":
        swa = {r["variant"]: r for r in rows}
        assert swa["swa-tigon"]["window"] == core.QUICK["window"] and swa["swa-tigon-full"]["window"] is None
        assert swa["swa-tigon"]["prompt"] == core.QUICK["swa_prompt"] > core.QUICK["window"]  # the ring wraps
        assert "ring past capacity" in md
    try:
        import matplotlib  # noqa: F401

        assert "decode_latency.png" in files
    except ImportError:
        assert "decode_latency.png" not in files


def test_decode_bench_quick_profile_writes_the_section(tmp_path, harness, monkeypatch):
    # On a CPU the profiler sees CPU ops, not CUDA kernels: the same code path and tables over aten ops. The
    # graph path's bookkeeping runs on the CPU (test_generate's fake capture), so the decode traces take the
    # GPU's route: the profiler starts right after the capture.

    from tests.decode.test_generate import _fake_capture
    from tigon.decode import loop

    monkeypatch.setattr(loop, "_graphs_available", lambda device: True)
    monkeypatch.setattr(loop, "_capture", _fake_capture)

    out = tmp_path / "decode"
    argv = ["--quick", "--device", "cpu", "--out", str(out), "--variants", "tigon@1", "--profile"]
    assert core.main(argv, log=lambda s: None) == 0
    (row,) = json.loads((out / "decode.json").read_text())["rows"]
    assert row["batch"] == 1 and row["cuda_graph"] and row["profile"]["activity"].startswith("cpu ops")
    phases = row["stats"]["ttft_phases_s"]
    assert sum(phases.values()) * 1e3 == pytest.approx(row["ttft_ms"], rel=1e-6)
    decode, prefill = row["profile"]["decode"], row["profile"]["prefill"]
    assert decode["steps"] == core.QUICK["profile_steps"] and decode["located"] == "last kernels"
    assert decode["cuda_graph"] and decode["traced_from"] == "after the capture"
    assert decode["kernels"] > 0 and decode["kernel_ms"] > 0 and decode["span_ms"] >= decode["kernel_ms"] * 0.5
    assert set(decode["buckets_ms"]) == {name for name, _ in profiling.BUCKETS}
    assert sum(decode["buckets_ms"].values()) == pytest.approx(decode["kernel_ms"])
    assert decode["buckets_ms"]["gemm"] > 0 and decode["gemm_GBps"] > 0  # aten::mm on a CPU
    assert decode["gap_ms"] == pytest.approx(decode["measured_p50_ms"] - decode["kernel_ms"])
    assert 0 < decode["gemm_weight_bytes"] < decode["param_bytes"]  # the untied input embedding is left out
    assert prefill["kernels"] > 0 and prefill["measured_ttft_ms"] == pytest.approx(row["ttft_ms"])
    md = (out / "decode.md").read_text()
    for section in ("### TTFT by phase", "### Decode-step profile", "### TTFT profile", "Top ops per decode step"):
        assert section in md
    assert "| llama-toy | tigon | 1 |" in md.split("### Decode-step profile")[1]


def test_decode_bench_profile_section_with_failed_rows(harness):
    # A variant that failed keeps its spec's `profile=True` (a bool, no profile dict): the section skips it, where
    # it once raised "argument of type 'bool' is not iterable" and lost the whole run's tables; a row whose
    # profiling failed (a dict with an error) gets its line.

    failed = dict(model="llama-1.5b", family="llama", quick=False, window=None, variant="tigon", batch=1, prompt=8,
                  profile=True, error="ModuleNotFoundError")
    assert report.profile_lines([failed]) == []
    broken = dict(failed, profile=dict(error="RuntimeError: no trace"))
    del broken["error"]
    lines = report.profile_lines([failed, broken])
    assert any("profile failed: RuntimeError: no trace" in line for line in lines)


def test_decode_bench_profile_buckets_and_plan(harness):

    names = {"nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "gemm", "void gemv2T_kernel_val<int, int, __nv_bfloat16>": "gemm",
             "void cutlass::Kernel2<cutlass_80_wmma_tensorop>": "gemm", "_decode_attention_split_kernel": "attention",
             "_decode_attention_merge_kernel": "attention", "_rope_kv_write_kernel": "rope_kv_write",
             "_rms_norm_fwd_kernel": "norms", "_glu_fwd_kernel": "glu", "triton_poi_fused_add_0": "other triton",
             "void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<long>>": "other torch",
             "Memcpy DtoD (Device -> Device)": "other torch", "aten::argmax": "other torch"}
    assert {n: profiling._bucket(n) for n in names} == names
    # The per-name fallback (kernel counts that differ from step to step): 2 steps of 3 kernels past a short call.
    ev = lambda t, name: (t, t + 1.0, name, 1.0)
    small = [ev(0, "prefill"), ev(1, "a")]
    big = small + [ev(2 + i, n) for i, n in enumerate("abcabc")]
    assert [(e[0], e[2]) for e in profiling._by_name_difference(big, small)] == list(enumerate("abcabc", start=2))
    # Programmatic dependent launch: b starts while a runs and waits; the overlap is a's, b keeps the rest.
    chain = profiling._on_the_chain([(0.0, 10.0, "a", 10.0), (4.0, 12.0, "b", 8.0), (15.0, 16.0, "c", 1.0)])
    assert [e[3] for e in chain] == [10.0, 2.0, 1.0] and [e[4] for e in chain] == [10.0, 8.0, 1.0]
    summary = profiling._summary(chain, 1)
    assert summary["kernel_ms"] == pytest.approx(0.013) and summary["launched_ms"] == pytest.approx(0.019)
    specs = core.plan(["tigon", "hf-static-compile@1", "tigon-nograph@2+4"], [1, 8], 512, 256, quick=False,
                      device="cuda", profile=True)
    assert [(s["variant"], s["batch"], s.get("profile", False)) for s in specs] == [
        ("tigon", 1, True), ("tigon", 8, True), ("hf-static-compile", 1, False), ("tigon-nograph", 2, True),
        ("tigon-nograph", 4, True)]
    with pytest.raises(SystemExit, match="integers joined by"):
        core.plan(["tigon@x"], [1], 512, 256, quick=False, device="cuda")


def test_decode_bench_ttft_at_new_prompt_lengths(tmp_path, harness):
    # --ttft-new-lengths N: after the repeats, N prefill-only calls at P - 1 ... P - N tokens, per row, and a
    # table of them beside the warm median.

    out = tmp_path / "decode"
    argv = ["--quick", "--device", "cpu", "--out", str(out), "--variants", "tigon,hf-eager", "--batches", "1",
            "--new", "3", "--ttft-new-lengths", "2"]
    assert core.main(argv, log=lambda s: None) == 0
    rows = json.loads((out / "decode.json").read_text())["rows"]
    assert sorted(r["variant"] for r in rows) == ["hf-eager", "tigon"] and not [r for r in rows if "error" in r]
    for r in rows:
        assert r["ttft_new_lengths"] == 2 and len(r["ttft_new_length_ms"]) == 2
        assert all(v > 0 for v in r["ttft_new_length_ms"])
    md = (out / "decode.md").read_text()
    assert "TTFT at new prompt lengths" in md and "| llama-toy | tigon | 1 | 16 |" in md
    prompts = [p.shape[1] for p in core.new_length_prompts({"ttft_new_lengths": 3}, torch.zeros(2, 16))]
    assert prompts == [15, 14, 13] and core.new_length_prompts({}, torch.zeros(2, 16)) == []
    with pytest.raises(SystemExit, match="must be below the prompt length 16"):
        core.plan(["tigon"], [1], 16, 4, quick=True, device="cpu", ttft_new_lengths=16)
    with pytest.raises(SystemExit) as usage:  # argparse: "an integer >= 0, got '-1'" on stderr
        core.main(argv[:-1] + ["-1"], log=lambda s: None)
    assert usage.value.code == 2


def test_sdpa_new_shapes_layouts_and_cpu_refusal(harness, capsys):
    # benchmarks/generation/sdpa_new_shapes.py times CUDA kernels only: on a CPU it says so and exits 2. Its three
    # K/V layouts at one prompt length: contiguous, and the first P slots of rings of P + 1 and P + 256 slots.
    assert [slots for _, slots in sdpa_new_shapes.layouts(512)] == [512, 513, 768]
    if not torch.cuda.is_available():
        assert sdpa_new_shapes.main([]) == 2 and "needs a CUDA GPU" in capsys.readouterr().out


def test_decode_bench_child_process_runs_this_module(harness):
    # Off --quick-on-a-CPU each variant is a child process: `python -m benchmarks.generation.bench_decode --child
    # SPEC` from the checkout's root, with PYTHONPATH leading with the tigon package's folder and the checkout's root.
    import tigon

    assert checkout.module_command(core.__file__, "--child", "{}")[1:] == [
        "-m", "benchmarks.generation.bench_decode", "--child", "{}"]
    env = checkout.child_env({"PYTHONPATH": "elsewhere"})["PYTHONPATH"].split(os.pathsep)
    assert env == [str(Path(tigon.__file__).resolve().parents[1]), str(checkout.ROOT), "elsewhere"]
    (spec,) = core.plan(["hf-eager"], [1], 8, 4, quick=True, device="cpu")
    (row,) = core.run_plan(specs=[spec], budget_s=120, timeout_s=120, log=lambda s: None)
    assert "error" not in row, row.get("error")
    assert row["variant"] == "hf-eager" and row["p50_ms"] > 0 and len(row["step_ms"]) == 3


def test_decode_bench_budget_skips_and_targets(harness):

    specs = core.plan(["tigon", "hf-static-compile"], [1, 8], 512, 256, quick=False, device="cuda")
    rows = core.run_plan(specs, budget_s=0, log=lambda s: None)  # nothing fits: no process is started
    assert len(rows) == 4 and all(r["skipped"].startswith("time budget") for r in rows)
    md = report.markdown(rows, {})
    assert "Skipped for the time budget: tigon b1, tigon b8" in md
    swa = core.plan(["tigon", "swa-tigon"], [1, 8], 512, 256, quick=False, device="cuda", swa_batches=[1])
    assert [(s["variant"], s["batch"], s["prompt"], s["window"]) for s in swa] == [
        ("tigon", 1, 512, None), ("tigon", 8, 512, None), ("swa-tigon", 1, core.SWA_PROMPT, core.WINDOW)]

    def row(variant, batch, p50, p99, ttft=10.0, family="llama", window=None, prompt=512):
        return dict(variant=variant, family=family, batch=batch, prompt=prompt, new=256, window=window, quick=False,
                    ttft_ms=ttft, p50_ms=p50, p99_ms=p99, mean_ms=p50, tokens_per_s=batch / p50 * 1e3,
                    wall_ms_per_step=p50, peak_gib=3.0, cuda_graph=True)

    rows = [row("hf-static-compile", 1, 2.7, 3.5), row("tigon", 1, 0.9, 1.0, ttft=12.0), row("tigon", 8, 1.5, 1.6),
            row("swa-tigon", 1, 1.04, 1.1, family="mistral", window=1024, prompt=4096),
            row("swa-tigon-full", 1, 1.0, 1.05, family="mistral", prompt=4096)]
    verdict = {t: ok for t, _, ok in report.targets(rows)}
    assert verdict["tigon batch 1 p50 <= 1.0 ms/step"] and not verdict["tigon batch 8 p50 <= 1.4 ms/step"]
    assert verdict["tigon batch 1 TTFT <= 15 ms (prompt 512)"]
    assert verdict["batch 1: ring past capacity p50 <= 1.05x full cache"]
    md = report.markdown(rows, {})
    assert "| llama-1.5b | tigon | 1 | 512 | 256 | 12.0 | - | 0.900 |" in md and "x3.00 |" in md
    # With prefill-only repeats the target reads their median, not the single timed call.
    rows[1].update(ttft_ms=40.0, ttft_median_ms=14.0, ttft_repeats_ms=[13.0, 14.0, 14.5, 15.5, 30.0])
    checks = {t: (v, ok) for t, v, ok in report.targets(rows)}
    assert checks["tigon batch 1 TTFT <= 15 ms (prompt 512)"] == ("14.0 ms (median of 5 prefill-only calls)", True)
    assert "| 40.0 | 14.0 | 0.900 |" in report.markdown(rows, {})


def test_training_step_kernel_table_keeps_every_kernel_over_the_threshold_by_bucket(harness):
    kernel_table = step_profile.kernel_table

    add = "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add>"
    totals = [("_glu_bwd_kernel", 16, 6280.0), ("nvjet_sm90_tst_128x256_bz_NTN", 48, 41750.0), (add, 33, 1200.0),
              ("Memset (Device)", 3, 40.0)]  # 0.04 ms: under the 0.05 ms threshold
    assert kernel_table(totals) == [("gemm", "nvjet_sm90_tst_128x256_bz_NTN", 48, 41.75),
                                    ("triton kernels", "_glu_bwd_kernel", 16, 6.28),
                                    ("elementwise", add, 33, 1.2)]
    assert kernel_table(totals, min_ms=0.0)[-1] == ("copy/memset", "Memset (Device)", 3, 0.04)


def test_training_step_timeline_counts_overlaps_once_and_names_the_gaps(harness):
    timeline = step_profile.timeline

    kernels = [(20, 30, "c"), (0, 10, "a"), (5, 12, "b"), (30, 31, "d"), (100, 101, "e")]  # unsorted, b overlaps a
    tl = timeline(kernels, n_gaps=1)
    assert tl["span_ms"] == 0.101 and tl["busy_ms"] == 0.024 and tl["idle_ms"] == 0.077
    assert tl["gaps"] == [(0.069, "d", "e")]
    assert timeline([])["idle_ms"] == 0.0
