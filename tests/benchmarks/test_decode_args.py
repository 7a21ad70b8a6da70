"""benchmarks/generation/bench_decode.py's CPU-checkable parts at the Llama-3-8B shape: the model and prompt options,
the plan, the weight + KV read bound's arithmetic (against the parameters of the models it describes, built on the meta
device) and the 8B targets. The timing needs a GPU (benchmarks/run_gpu.sh decode-8b)."""

import pytest
import torch

from benchmarks.generation import bench_decode, bench_hf_generate


@pytest.fixture(scope="module")
def core():
    return bench_decode


def _param_bytes_without_input_embedding(cfg, dtype_bytes, monkeypatch):
    from transformers import LlamaConfig, LlamaForCausalLM

    # conftest's NaN-poisoning torch.empty does not follow a device context (it would allocate 8B parameters on
    # the host); meta tensors hold nothing to poison, so the plain factory builds them.
    monkeypatch.setattr(torch, "empty", torch._C._VariableFunctions.empty)
    with torch.device("meta"):  # the real module tree, no memory
        model = LlamaForCausalLM(LlamaConfig(**cfg))
    assert not model.config.tie_word_embeddings and {p.device.type for p in model.parameters()} == {"meta"}
    skip = model.get_input_embeddings().weight
    return dtype_bytes * sum(p.numel() for p in model.parameters() if p is not skip)


@pytest.mark.parametrize("name", ["llama-1.5b", "llama3-8b", "toy"])
def test_weight_bytes_are_the_models_parameters(core, name, monkeypatch):
    cfg = core.TOY if name == "toy" else core.MODELS[name]
    assert core.weight_read_bytes(cfg, 2) == _param_bytes_without_input_embedding(cfg, 2, monkeypatch)


def test_the_8b_shape_and_its_bound(core):
    cfg = core.MODELS["llama3-8b"]
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"], cfg["vocab_size"], cfg["rope_theta"]) == (
        4096, 14336, 32, 32, 8, 128256, 500000.0)
    weights = core.weight_read_bytes(cfg, 2)
    # Llama-3-8B: 8.03 B parameters, 525 M of them the input embedding, read 2 bytes each.
    assert weights == pytest.approx(2 * (8.03e9 - 128256 * 4096), rel=2e-3)
    per_token = 32 * 2 * 8 * 128 * 2  # layers, K and V, KV heads, head dim, bf16: 128 KiB a cached token
    # 255 decode steps after a 512-token prompt attend over 513 .. 767 tokens: 640 on average.
    assert core.kv_read_bytes(cfg, 1, 512, 256, None, 2) == per_token * 640
    assert core.kv_read_bytes(cfg, 8, 8192, 256, None, 2) == 8 * per_token * (8192 + 128)
    assert core.kv_read_bytes(cfg, 1, 4096, 256, 1024, 2) == per_token * 1024  # the window caps the context
    mean = sum(min(1000 + j, 1024) for j in range(1, 51)) / 50  # 1001 .. 1024, then the window's 1024
    assert core.kv_read_bytes(cfg, 1, 1000, 51, 1024, 2) == pytest.approx(per_token * mean)
    row = dict(variant="tigon", family="llama", batch=1, prompt=512, new=256, window=None, quick=False,
               device="cuda", model="llama3-8b", p50_ms=5.0)
    got = core.read_bound(row, copy_GBps=4000.0)
    assert got["weight_read_bytes"] == weights and got["kv_read_bytes"] == per_token * 640
    assert got["bound_ms"] == pytest.approx((weights + per_token * 640) / 4e12 * 1e3)
    assert got["pct_of_bound"] == pytest.approx(100 * got["bound_ms"] / 5.0)
    assert 3.5 < got["bound_ms"] < 4.0  # ~15 GB at 4 TB/s


def test_model_and_prompt_options_and_the_plan(core):
    parsed = core.build_parser().parse_args(["--model", "llama3-8b", "--prompts", "512,8192"])
    assert parsed.model == "llama3-8b" and parsed.prompts == "512,8192"
    with pytest.raises(SystemExit):
        core.build_parser().parse_args(["--model", "llama3-70b"])
    assert core.prompt_lengths(None, "512,8192,32768", "llama3-8b", quick=False) == [512, 8192, 32768]
    assert core.prompt_lengths(None, None, "llama3-8b", quick=False) == [512, 8192]
    assert core.prompt_lengths(None, None, "llama-1.5b", quick=False) == [512]
    assert core.prompt_lengths(1024, None, "llama-1.5b", quick=False) == [1024]
    assert core.prompt_lengths(None, None, "llama3-8b", quick=True) == [core.QUICK["prompt"]]
    with pytest.raises(SystemExit, match="--prompt or --prompts, not both"):
        core.prompt_lengths(512, "512", "llama3-8b", quick=False)
    for bad in ("512,x", "0", "512,-1"):
        with pytest.raises(SystemExit, match="--prompts takes positive integers"):
            core.prompt_lengths(None, bad, "llama3-8b", quick=False)
    specs = core.plan(["tigon", "hf-static-compile@1", "swa-tigon"], [1, 8], [512, 8192], 256, quick=False,
                      device="cuda", swa_batches=[1], model="llama3-8b")
    assert [(s["prompt"], s["variant"], s["batch"]) for s in specs] == [
        (512, "tigon", 1), (512, "tigon", 8), (512, "hf-static-compile", 1), (core.SWA_PROMPT, "swa-tigon", 1),
        (8192, "tigon", 1), (8192, "tigon", 8), (8192, "hf-static-compile", 1)]  # swa-* once, at its own prompt
    assert {s["model"] for s in specs} == {"llama3-8b"} and specs[3]["window"] == core.WINDOW
    assert core.plan(["tigon"], [1], 512, 8, quick=False, device="cuda")[0]["model"] == "llama-1.5b"
    with pytest.raises(SystemExit, match="unknown model 'llama-70b'"):
        core.plan(["tigon"], [1], 512, 8, quick=False, device="cuda", model="llama-70b")
    names = {core._model_name(dict(s, quick=False)) for s in specs}
    assert names == {"llama3-8b", "mistral-8b-swa1024"}
    skipped = core.run_plan(specs[:2], budget_s=0, log=lambda s: None)  # the 8B rows' guessed need, nothing runs
    assert all(r["skipped"].startswith("time budget") for r in skipped)


def test_the_8b_targets_and_the_bound_section(core):
    def row(variant, batch, prompt, p50, ttft, ttft_median=None):
        r = dict(variant=variant, family="llama", batch=batch, prompt=prompt, new=256, window=None, quick=False,
                 device="cuda", model="llama3-8b", ttft_ms=ttft, ttft_median_ms=ttft_median, ttft_repeats_ms=[],
                 p50_ms=p50, p99_ms=1.05 * p50, mean_ms=p50, tokens_per_s=batch / p50 * 1e3, wall_ms_per_step=p50,
                 peak_gib=20.0, cuda_graph=variant == "tigon")
        r.update(core.read_bound(r, copy_GBps=4200.0))
        return r

    rows = [row("hf-static-compile", 1, 512, 7.3, 36.5), row("tigon", 1, 512, 4.2, 30.0, ttft_median=28.0),
            row("hf-static-compile", 1, 8192, 9.0, 400.0), row("tigon", 1, 8192, 5.0, 350.0)]
    checks = {t: (v, ok) for t, v, ok in core.targets(rows)}
    bound = rows[1]["bound_ms"]
    assert checks["tigon batch 1 prompt 512 >= 85% of the weight + KV read bound"] == (
        f"{100 * bound / 4.2:.1f}% ({bound:.3f} of 4.200 ms)", 100 * bound / 4.2 >= 85)
    assert checks["tigon batch 1 prompt 512 p50 >= 1.5x hf-static-compile"] == ("x1.74", True)
    assert checks["tigon batch 1 prompt 512 TTFT <= 0.8x hf-static-compile's"] == (
        "0.77x (28.0 vs 36.5 ms)", True)  # tigon's median of the prefill-only calls
    assert checks["tigon batch 1 prompt 8192 p50 >= 1.5x hf-static-compile"] == ("x1.80", True)
    assert checks["tigon batch 1 prompt 8192 TTFT <= 0.8x hf-static-compile's"] == ("0.88x (350.0 vs 400.0 ms)", False)
    assert checks["tigon batch 1 prompt 512 p99 <= 1.1x p50"] == ("1.050x", True)
    assert not any("<= 1.0 ms/step" in t for t in checks)  # the 1.5B's targets stay off the 8B rows
    ceiling = dict(GBps=4200.0, bytes=4 * 2**30, ms=1.0, how="2048 MiB copy, do_bench median")
    md = core.markdown(rows, dict(copy_ceiling=ceiling))
    section = md.split("### Weight + KV read bound")[1]
    assert "Copy ceiling 4200 GB/s (2048 MiB copy, do_bench median" in section
    assert f"| llama3-8b | tigon | 1 | 8192 | {rows[3]['weight_read_bytes'] / 1e6:.1f} |" in section
    assert "| llama3-8b | tigon | 1 | 512 | 256 | 30.0 | 28.0 | 4.200 |" in md
    assert "### Weight + KV read bound" not in core.markdown(rows, {})  # no ceiling measured, no section


def test_ttft_after_idle_is_planned_checked_and_reported(core):
    # --ttft-idle S: the specs carry S, the 8B targets get a line for the idle medians when both rows have them,
    # and decode.md lists them beside the back-to-back median.
    specs = core.plan(["tigon", "hf-static-compile"], [1], [8192], 8, False, "cuda", model="llama3-8b",
                      ttft_idle=1.0)
    assert [s["ttft_idle"] for s in specs] == [1.0, 1.0]
    assert "ttft_idle" not in core.plan(["tigon"], [1], [8192], 8, False, "cuda", model="llama3-8b")[0]

    def row(variant, median, idle):
        r = dict(variant=variant, family="llama", batch=1, prompt=8192, new=8, window=None, quick=False,
                 device="cuda", model="llama3-8b", ttft_ms=median, ttft_median_ms=median, ttft_repeats_ms=[median],
                 p50_ms=5.0, p99_ms=5.2, mean_ms=5.0, tokens_per_s=200.0, wall_ms_per_step=5.0, peak_gib=20.0,
                 cuda_graph=variant == "tigon", ttft_idle=1.0)
        if idle:
            r.update(ttft_idle_repeats_ms=idle, ttft_idle_median_ms=idle[len(idle) // 2])
        return r

    rows = [row("hf-static-compile", 250.0, [240.0, 245.0, 246.0]), row("tigon", 205.0, [192.0, 194.0, 196.0])]
    checks = {t: (v, ok) for t, v, ok in core.targets(rows)}
    assert checks["tigon batch 1 prompt 8192 TTFT <= 0.8x hf-static-compile's"] == ("0.82x (205.0 vs 250.0 ms)",
                                                                                    False)
    assert checks["tigon batch 1 prompt 8192 TTFT after 1 s idle <= 0.8x hf-static-compile's"] == (
        "0.79x (194.0 vs 245.0 ms)", True)
    md = core.markdown(rows, {})
    assert "| llama3-8b | tigon | 1 | 8192 | 205.0 | 192.0, 194.0, 196.0 | 194.0 |" in md
    rows[0].pop("ttft_idle_median_ms")
    assert not any("idle" in t for t, _, _ in core.targets(rows))  # one side without it: no ratio
    with pytest.raises(SystemExit, match="--ttft-idle must be >= 0"):
        core.main(["--quick", "--ttft-idle", "-1"])


def test_copy_ceiling_on_the_cpu_is_the_arithmetic(core):
    got = core.copy_ceiling("cpu", quick=True)
    assert got["bytes"] == 2 * 2 * (1 << 24) and got["ms"] > 0
    assert got["GBps"] == pytest.approx(got["bytes"] / (got["ms"] * 1e-3) / 1e9)
    assert got["how"].startswith("32 MiB copy")


def test_cli_forwards_the_model_and_checks_prompts(capsys):
    from tigon import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "decode", "--prompts", "512,0"])
    assert e.value.code == 2
    assert "argument --prompts: expected comma-separated positive integers" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "decode", "--model", "llama-70b"])
    assert e.value.code == 2 and "invalid choice: 'llama-70b'" in capsys.readouterr().err


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the copy ceiling of a GPU")
def test_copy_ceiling_on_a_gpu(core):
    got = core.copy_ceiling("cuda", quick=False)
    assert got["bytes"] == 4 * 2**30 and got["how"] == "2048 MiB copy, do_bench median"
    assert 100 < got["GBps"] < 20000  # a sanity range for HBM (the H200's is ~4.2 TB/s by the ops benchmarks)


def test_decode_benches_write_to_the_named_folder_by_default(core, monkeypatch, capsys):
    monkeypatch.setenv("OUT", "/somewhere/else")  # a generic variable of the environment is not the default
    assert core.build_parser().parse_args([]).out == "tigon-bench-results"
    with pytest.raises(SystemExit) as e:
        bench_hf_generate.main(["--help"])
    help_text = capsys.readouterr().out
    assert e.value.code == 0 and "default ./tigon-bench-results" in help_text and "$OUT" not in help_text
