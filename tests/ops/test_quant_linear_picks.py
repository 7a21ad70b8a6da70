"""quant_linear's measured picks: the lookup order (user cache, shipped table, rule), `_plan` taking a pick only for
the default launch of 16-bit x on a CUDA device, the cache's quant_linear section (round trip, a bad entry ignored with
one warning, files without it), `tigon env`'s line and `tigon tune --quant-linear` (--dry-run; the winners written)."""

import importlib
import json
import math

import pytest
import torch

from tigon import cli
from tigon.cli import env, tune
from tigon.ops import QuantLinearConfig, tuned_cache
from tigon.ops import quant_linear_picks as picks

ql = importlib.import_module("tigon.ops.quant_linear")
FAKE_GPU = "FAKE GPU"
# Llama-3-8B's o_proj (K 4096 -> 4096) in int4 groups of 128, one row (the GEMV)
KEY = (4096, 4096, 1, "int4", 128, False)
SHIPPED = (0, 32, 512, 4, 0, 4, -1, 1, -1)
TUNED = (0, 128, 256, 8, 0, 2, -1, 0, -1)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty TIGON_CACHE_DIR, read afresh by this test's first lookup; `_plan` uncached and on a fake GPU."""
    monkeypatch.setenv("TIGON_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(ql._launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(ql, "_gpu_name", lambda index: FAKE_GPU)
    monkeypatch.setattr(ql, "_plan", ql._plan.__wrapped__)  # not the cache: the fakes above
    tuned_cache.reset()
    yield tmp_path
    tuned_cache.reset()


def test_buckets_and_formats():
    rows = (1, 2, 8, 16, 17, 32, 33, 128, 129)
    assert [picks.rows_bucket(m) for m in rows] == [1, 16, 16, 16, 32, 32, 128, 128, None]
    assert [picks.format_of(k, z) for k, z in (("int4", False), ("int4", True), ("nf4", False), ("fp8", False))] \
        == list(picks.FORMATS)


@pytest.mark.parametrize("gpu, key", [(g, k) for g, rows in picks.MEASURED_PICKS.items() for k in rows])
def test_every_shipped_pick_is_a_launch_that_computes_the_product(device, gpu, key):
    """Each shipped row's key is one the lookup can ask for, and its config, launched at the row's K (a few output
    columns, odd), gives the product within the kernels' error model: a pick moves speed only."""
    from tests.ops.test_quant_linear import _check, _on, _weight, _x

    K, n_out, bucket, fmt, group, glu = key
    assert bucket in picks.ROWS_BUCKETS and fmt in picks.FORMATS and group >= 0 and isinstance(glu, bool)
    cfg = QuantLinearConfig(*picks.MEASURED_PICKS[gpu][key])
    kind = "int4" if fmt.startswith("int4") else fmt
    qw = _on(_weight(kind, group, fmt == "int4_zeros", False, 2 * 37 if glu else 37, K, torch.bfloat16), device)
    x = _x({1: 1, 16: 8, 32: 17, 128: 33}[bucket], K, dtype=torch.bfloat16).to(device)  # a bucket's odd row counts
    act = "silu" if glu else None
    _check(f"{gpu} {key}", ql.quant_linear(x, qw, activation=act, config=cfg), x, qw, activation=act, config=cfg)


def test_lookup_order_user_cache_then_shipped_then_rule(monkeypatch, cache_dir):
    other = (4096, 4096, 16, "int4", 128, False)
    monkeypatch.setitem(picks.MEASURED_PICKS, FAKE_GPU, {KEY: SHIPPED, other: SHIPPED})
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 128, False) == SHIPPED
    assert env.launch_text("quant_linear", FAKE_GPU).startswith("shipped table (FAKE GPU row")
    tuned_cache.write(FAKE_GPU, quant_linear={KEY: TUNED})
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 128, False) == TUNED  # the user cache first
    assert picks.lookup(FAKE_GPU, 4096, 4096, 8, "int4", 128, False) == SHIPPED  # not cached: the shipped row
    assert picks.lookup(FAKE_GPU, 4096, 4096, 17, "int4", 128, False) is None  # past the buckets: the rule
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4_zeros", 128, False) is None
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 64, False) is None
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 128, True) is None
    assert picks.lookup("OTHER GPU", 4096, 4096, 1, "int4", 128, False) is None
    assert picks.lookup(None, 4096, 4096, 1, "int4", 128, False) is None
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 128, False, picks.MEASURED_PICKS) == SHIPPED  # alone
    text = env.launch_text("quant_linear", FAKE_GPU)
    assert text.startswith(f"user cache ({cache_dir / 'tuned.json'}: 1 shapes), then shipped table (FAKE GPU row")
    assert "else the shape rule (quant_linear._plan; int4 at 2-16 rows on Hopper: the code-MMA kernel)" in text
    assert "over 128 rows or with a config passed: the rule" in text


def test_plan_takes_a_pick_only_for_the_default_launch_on_a_gpu(cache_dir):
    cuda, cpu, default = torch.device("cuda", 0), torch.device("cpu"), QuantLinearConfig()
    rule = ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default, True)
    assert rule == ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default)  # no pick anywhere: the rule
    tuned_cache.write(FAKE_GPU, quant_linear={KEY: TUNED, (4096, 4096, 16, "fp8", 128, False): (0, 64, 128, 8, 0, 2,
                                                                                                 -1, 1, -1)})
    picked = ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default, True)
    want = ql._plan(1, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(*TUNED))
    assert picked == want and picked != rule
    assert (picked.block_n, picked.gw * picked.gpt, picked.num_warps, picked.split) == (128, 256, 8, 2)
    assert ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default) == rule  # no picks: a config passed, fp32 x
    assert ql._plan(1, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(block_n=32), True) == \
        ql._plan(1, 4096, 4096, "int4", 128, False, cuda, QuantLinearConfig(block_n=32))  # not the default config
    assert ql._plan(1, 4096, 4096, "int4", 128, False, cpu, default, True) == \
        ql._plan(1, 4096, 4096, "int4", 128, False, cpu, default)  # the CPU: the interpreter's launch
    assert ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default, True, True) == rule  # int4 with zeros: no pick
    fp8 = ql._plan(8, 4096, 4096, "fp8", 128, False, cuda, default, True)  # 2..16 rows share the bucket of 16
    assert fp8 == ql._plan(8, 4096, 4096, "fp8", 128, False, cuda, QuantLinearConfig(0, 64, 128, 8, 0, 2, -1, 1, -1))
    assert (fp8.block_n, fp8.num_warps, fp8.split, fp8.prefetch) == (64, 8, 2, True)
    assert ql._plan(17, 4096, 4096, "fp8", 128, False, cuda, default, True) == \
        ql._plan(17, 4096, 4096, "fp8", 128, False, cuda, default)  # past 16 rows: the rule


def test_launch_kernel_asks_for_picks_only_without_a_config_in_16_bits(monkeypatch, device):
    seen, plan = [], ql._plan.__wrapped__
    monkeypatch.setattr(ql, "_plan", lambda *a: seen.append(a[7:]) or plan(*a))
    N, K = 64, 256
    data, ones = torch.zeros(N, K // 2, dtype=torch.uint8, device=device), torch.ones(N, K // 128, device=device)
    qw = ql.QuantizedWeight("int4", data, ones.bfloat16(), 0 * ones.bfloat16(), 128, (N, K), torch.bfloat16)
    x = torch.randn(1, K, dtype=torch.bfloat16, device=device)
    ql.quant_linear(x, qw)
    ql.quant_linear(x, qw, config=QuantLinearConfig(block_n=32))
    assert seen == [(QuantLinearConfig(), True, True, True), (QuantLinearConfig(block_n=32), False, True, True)]


def test_cache_round_trip_and_older_files(cache_dir):
    tuned_cache.write(FAKE_GPU, decode_linear={(4096, 6144, 1, "norm"): (64, 256, 4, 4, 2, 0)})
    data = json.loads((cache_dir / "tuned.json").read_text())
    assert "quant_linear" not in data["entries"][0] and data["format"] == 1  # as files were before the section
    assert tuned_cache.for_gpu(FAKE_GPU).quant_linear == {}
    tuned_cache.write(FAKE_GPU, quant_linear={KEY: TUNED})
    data = json.loads((cache_dir / "tuned.json").read_text())
    assert data["entries"][0]["quant_linear"] == [{"key": [4096, 4096, 1, "int4", 128, False], "config": list(TUNED)}]
    rows = tuned_cache.for_gpu(FAKE_GPU)
    assert rows.quant_linear == {KEY: TUNED} and rows.decode_linear == {(4096, 6144, 1, "norm"): (64, 256, 4, 4, 2, 0)}
    assert "quant_linear: 1 shapes" in env.cache_text(FAKE_GPU)


BAD = [dict(key=[4096, 4096, 1, "int4", 128, False], config=[0, 48, 512, 4, 0, 4, -1, 1, -1]),  # block_n 48
       dict(key=[4096, 4096, 1, "int4", 128, False], config=[0, 32, 512, 4, 0, 4, -1, 1]),  # 8 ints
       dict(key=[4096, 4096, 1, "int4", 128, 0], config=list(TUNED)),  # glu not a bool
       dict(key=[4096, 4096, 1, "int4"], config=list(TUNED)),
       "not an object"]


@pytest.mark.parametrize("entry", BAD, ids=["block_n", "config_length", "glu", "key_length", "object"])
def test_a_bad_quant_linear_entry_makes_the_file_ignored_with_one_warning(entry, monkeypatch, cache_dir):
    monkeypatch.setitem(picks.MEASURED_PICKS, FAKE_GPU, {KEY: SHIPPED})
    (cache_dir / "tuned.json").write_text(json.dumps({"format": 1, "entries": [
        {"gpu": FAKE_GPU, "torch": torch.__version__, "triton": tuned_cache.versions()[1], "quant_linear": [entry]}]}))
    with pytest.warns(RuntimeWarning, match="ignoring the tuned-table cache") as caught:
        assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 128, False) == SHIPPED
        assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "int4", 128, False) == SHIPPED
    assert len(caught) == 1 and "quant_linear" in str(caught[0].message)
    assert "ignored" in env.cache_text(FAKE_GPU)


def test_env_prints_the_quant_linear_line(capsys, cache_dir):
    assert cli.main(["env"]) == 0
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.split()[:1] == ["quant_linear"])
    assert "rule" in line and "quant_linear._plan" in line
    assert "no measured picks for GPU Z" in env.launch_text("quant_linear", "GPU Z")


def test_tune_dry_run_lists_the_quant_linear_launches(capsys, cache_dir):
    assert cli.main(["tune", "--dry-run", "--quant-linear", "--model", "llama3-8b"]) == 0
    out = capsys.readouterr().out
    assert "quant_linear at llama3-8b's shapes" in out and "attention," not in out and "decode_linear at" not in out
    assert "int4-g128  qkv          rows 1  K 4096   N 6144" in out
    assert "fp8-g128   gate_up+glu  rows 8  K 4096   N 14336" in out  # N: the GLU's output width
    assert "int4-g128  down         rows 8  K 14336  N 4096" in out
    assert "int4-g128  down         rows 128  K 14336  N 4096" in out  # a serving batch's GEMM
    assert len([ln for ln in out.splitlines() if " rows " in ln]) == 32  # 2 formats x 4 row counts x 4 launches
    assert cli.main(["tune", "--dry-run"]) == 0 and "quant_linear" not in capsys.readouterr().out  # opt-in
    assert cli.main(["tune", "--dry-run", "--quant-linear", "--quant-formats", "int4", "--model", "llama3-70b"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if " rows " in ln]
    assert len(rows) == 16 and all("int4-g128" in ln for ln in rows) and "rows 1  K 8192   N 10240" in rows[0]
    assert cli.main(["tune", "--dry-run", "--quant-linear", "--quant-formats", "int4", "--quant-rows", "8,1"]) == 0
    rows = [ln for ln in capsys.readouterr().out.splitlines() if " rows " in ln]
    assert len(rows) == 8 and " rows 1 " in rows[0] and " rows 8 " in rows[-1]  # QUANT_ROWS' order
    for bad in ("5", "1,x", ""):  # not a rows bucket's count, not a number, none
        with pytest.raises(SystemExit):
            cli.main(["tune", "--dry-run", "--quant-linear", "--quant-rows", bad])
        assert "--quant-rows" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["tune", "--quant-linear", "--quant-formats", "int9"])
    assert "expected comma-separated formats of int4, fp8, got 'int9'" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_tune_quant_linear_on_a_cpu_says_it_needs_a_gpu(capsys, cache_dir):
    assert cli.main(["tune", "--quant-linear"]) == 2
    assert "tigon tune needs a CUDA GPU" in capsys.readouterr().err
    assert not (cache_dir / "tuned.json").exists()


def test_tune_writes_the_quant_linear_winners(monkeypatch, capsys, cache_dir):
    """cmd_tune on fake timings: only winners >= MIN_GAIN faster than the default are cached, under rows buckets."""
    launches = tune.quant_launches(tune.MODELS["1.5b"])
    o1 = next(p for p in launches if p.name == "o" and p.rows == 1 and p.fmt == "int4")
    gate8 = next(p for p in launches if p.name == "gate_up+glu" and p.rows == 8 and p.fmt == "fp8")
    down128 = next(p for p in launches if p.name == "down" and p.rows == 128 and p.fmt == "int4")
    rule, fast = QuantLinearConfig(), QuantLinearConfig(block_n=128, split_k=4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: FAKE_GPU)
    asked = []
    monkeypatch.setattr(tune, "measure_quant", lambda model, device, gpu, formats=None, row_counts=None: asked.append(
        row_counts) or [(o1, {rule: 0.010, fast: 0.008}, rule, None), (gate8, {rule: 0.020, fast: 0.0199}, rule, None),
                        (o1, {rule: math.inf}, rule, None), (down128, {rule: 0.090, fast: 0.045}, rule, None)])
    assert cli.main(["tune", "--quant-linear", "--model", "1.5b"]) == 0
    out = capsys.readouterr().out
    assert f"| o | int4-g128 | 1 | 2048 | 2048 | 10.00 | {tuple(fast.ints())} | 8.00 | {tuple(fast.ints())} |" in out
    assert "| gate_up+glu | fp8-g128 | 8 | 2048 | 8192 | 20.00 |" in out and "2 quant_linear picks" in out
    assert asked == [tune.QUANT_ROWS]
    assert tuned_cache.for_gpu(FAKE_GPU).quant_linear == {(2048, 2048, 1, "int4", 128, False): tuple(fast.ints()),
                                                          (8192, 2048, 128, "int4", 128, False): tuple(fast.ints())}


def test_measure_quant_times_the_rule_and_the_grid(monkeypatch, cache_dir):
    """measure_quant's loop on the CPU (the interpreter; a graph timer that runs the step once): every launch it times
    runs, and the rule's is among them."""
    import triton.testing

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", lambda step, **kw: step() or 1.0)
    monkeypatch.setattr(tune, "QUANT_FORMATS", (("int4", 32), ("fp8", 32)))
    monkeypatch.setattr(tune, "QUANT_GRAPH_BYTES", 1)
    monkeypatch.setattr(tune, "QUANT_GRID", {"gemv": [dict(block_n=32, split_k=2)], "decode": [dict(block_n=16)],
                                             "gemm": [dict(block_m=16, split_k=2)]})
    monkeypatch.setattr(tune, "QUANT_MMA", [dict(code_mma=1, block_n=16)])
    monkeypatch.setattr(tune, "QUANT_MMA_GEMM", [dict(code_mma=1, block_m=32)])
    model = dict(hidden=64, heads=2, kv_heads=1, head_dim=32, inter=96, name="tiny")
    rows = tune.measure_quant(model, torch.device("cpu"), FAKE_GPU, row_counts=(1, 3, 19))  # GEMV, decode, GEMM
    assert len(rows) == 24 and {p.rows for p, *_ in rows} == {1, 3, 19}
    for p, times, rule, shipped in rows:  # the code-MMA kernel's grid in int4's only
        assert rule == QuantLinearConfig() and shipped is None and len(times) == (3 if p.fmt == "int4" else 2)
        assert all(t == 0.5 for t in times.values()), (p, times)  # 1.0 a graph over 2 copies: every launch ran


def test_a_cached_pick_turns_the_tensor_core_gemv_on(cache_dir):
    cuda, default = torch.device("cuda", 0), QuantLinearConfig()
    mma = QuantLinearConfig(code_mma=1, block_n=64, split_k=4)
    tuned_cache.write(FAKE_GPU, quant_linear={KEY: tuple(mma.ints())})
    assert json.loads((cache_dir / "tuned.json").read_text())["entries"][0]["quant_linear"][0]["config"][-1] == 1
    picked = ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default, True, False, True)
    assert picked.mma and (picked.block_n, picked.split) == (64, 4)
    # the same pick for fp32 x (no picks) or a weight it cannot take (int4 with zeros has no row): the FMA GEMV
    assert not ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default, True, True, True).mma
    assert not ql._plan(1, 4096, 4096, "int4", 128, False, cuda, default, False, False, False).mma
