"""decode_linear's measured-picks table: the lookup, the fall-back to the rule, and that every pick is a launch the
kernel runs as named (whole BLOCK_K steps per split, its shared memory within Hopper's limit)."""

import ast
import importlib

import pytest
import torch
import triton

from tigon.ops import decode_linear_picks as picks
from tigon.ops.config import DecodeLinearConfig

dl = importlib.import_module("tigon.ops.decode_linear")
FAKE_GPU = "FAKE GPU"
# Llama-3-8B's q/k/v launch (K 4096, 4096 + 2 x 1024 columns) at batch 1, as bench_decode_ops --emit-picks keys it.
FAKE_KEY = (4096, 6144, 1, "norm")
FAKE_PICK = (64, 256, 4, 4, 2)
# The rule's launches at the 1.5B Llama shapes on an H200 (132 SMs), bf16, snapshotted before the picks table:
# use -> (K, N, glu, norm, residual, config). They must not change while the table holds no 1.5B entry.
RULE_1B5 = {
    "qkv": (2048, 3072, False, True, False, (32, 256, 4, 4, 1)),
    "o_proj": (2048, 2048, False, False, True, (16, 256, 4, 4, 1)),
    "gate_up": (2048, 8192, True, True, False, (32, 256, 4, 3, 1)),
    "down": (8192, 2048, False, False, True, (64, 256, 4, 4, 4)),
    "lm_head": (2048, 128256, False, False, False, (32, 256, 4, 4, 1)),
}


def problems(key, ints) -> list:
    """What keeps a table entry from being the launch it names at its shape (empty: none)."""
    K, N, bucket, kind = key
    glu, norm = "glu" in kind, "norm" in kind
    found = []
    if bucket not in picks.BATCH_BUCKETS:
        found.append(f"batch bucket {bucket} not in {picks.BATCH_BUCKETS}")
    if kind != picks.kind("norm" in kind, glu, "residual" in kind):
        found.append(f"kind {kind!r} is not one kind() spells")
    try:
        cfg = DecodeLinearConfig(*ints)
    except (TypeError, ValueError) as e:
        return found + [str(e)]
    if cfg.block_n > triton.next_power_of_2(N) or cfg.block_k > triton.next_power_of_2(K):
        found.append(f"blocks {cfg.block_n} x {cfg.block_k} past the padded N {N} / K {K}")
    k_split, split = dl._split_of(K, cfg.block_k, cfg.split_k)
    if K % cfg.block_k or k_split * split != K or split != cfg.split_k:  # the kernel's EVEN_K, and no fewer splits
        found.append(f"split_k {cfg.split_k} does not tile K {K} in whole {cfg.block_k}-wide steps")
    if glu and cfg.split_k != 1:
        found.append("a GLU launch ignores split_k: it must be 1")
    if dl._fit_smem(cfg, 2, glu, norm) != cfg:
        found.append(f"{dl._smem_bytes(cfg, 2, glu, norm)} bytes of shared memory past {dl.SMEM_LIMIT}")
    return found


@pytest.fixture
def fake_gpu(monkeypatch):
    """_pick_config as on a CUDA device named FAKE_GPU with 132 SMs, the table holding FAKE_PICK at FAKE_KEY."""
    monkeypatch.setattr(dl._launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(dl, "_gpu_name", lambda index: FAKE_GPU)
    monkeypatch.setitem(picks.MEASURED_PICKS, FAKE_GPU, {FAKE_KEY: FAKE_PICK})
    dl._pick_config.cache_clear()
    yield lambda M, K, N, glu, norm, esize=2, residual=False: dl._pick_config(
        M, K, N, glu, norm, esize, torch.device("cuda", 0), dl.SMEM_LIMIT, residual=residual)
    dl._pick_config.cache_clear()


def test_batch_buckets_and_kinds():
    assert [picks.batch_bucket(m) for m in (1, 2, 8, 16, 17)] == [1, 16, 16, 16, None]
    assert picks.kind(False, False, False) == "plain"
    assert picks.kind(True, False, False) == "norm"
    assert picks.kind(False, False, True) == "residual"
    assert picks.kind(True, True, False) == "norm+glu"
    assert picks.kind(True, True, True) == "norm+glu+residual"


def test_lookup_finds_only_the_exact_gpu_shape_bucket_and_kind():
    table = {FAKE_GPU: {FAKE_KEY: FAKE_PICK}}
    assert picks.lookup(FAKE_GPU, 4096, 6144, 1, "norm", table) == FAKE_PICK
    assert picks.lookup("OTHER GPU", 4096, 6144, 1, "norm", table) is None
    assert picks.lookup(None, 4096, 6144, 1, "norm", table) is None  # no GPU
    assert picks.lookup(FAKE_GPU, 4096, 6144, 8, "norm", table) is None  # bucket 16: not measured
    assert picks.lookup(FAKE_GPU, 4096, 6144, 1, "norm+residual", table) is None
    assert picks.lookup(FAKE_GPU, 4096, 4096, 1, "norm", table) is None


def test_pick_config_takes_the_measured_pick(fake_gpu):
    assert fake_gpu(1, 4096, 6144, False, True) == DecodeLinearConfig(*FAKE_PICK)
    # the same shape elsewhere: batch 8 (another bucket), a residual added, fp32 (measured in 16 bits), 17 rows
    rule = DecodeLinearConfig(32, 256, 4, 4, 1)
    assert fake_gpu(8, 4096, 6144, False, True) == rule
    assert fake_gpu(1, 4096, 6144, False, True, residual=True) == rule
    assert fake_gpu(17, 4096, 6144, False, True) == rule
    assert fake_gpu(1, 4096, 6144, False, True, esize=4) == dl._fit_smem(rule, 4, False, True)


def test_unmeasured_shapes_fall_back_to_the_rule(fake_gpu, monkeypatch):
    """The 1.5B shapes launch as the rule did before the table (so their outputs keep their bits), on a GPU with
    picks for other shapes, and on the one the real table measured wherever it has no entry for them."""
    for gpu in (FAKE_GPU, *picks.MEASURED_PICKS):
        monkeypatch.setattr(dl, "_gpu_name", lambda index, gpu=gpu: gpu)
        dl._pick_config.cache_clear()
        for use, (K, N, glu, norm, residual, want) in RULE_1B5.items():
            for M in (1, 8, 16):
                entry = picks.lookup(gpu, K, N, M, picks.kind(norm, glu, residual))
                want_m = entry if gpu != FAKE_GPU and entry else want
                assert fake_gpu(M, K, N, glu, norm, residual=residual) == DecodeLinearConfig(*want_m), (gpu, use, M)
                assert dl._rule_config(K, N, glu, norm, 132) == DecodeLinearConfig(*want)


def test_every_table_entry_is_a_launch_the_kernel_runs_as_named():
    entries = [(gpu, key, ints) for gpu, rows in picks.MEASURED_PICKS.items() for key, ints in rows.items()]
    for gpu, key, ints in entries + [(FAKE_GPU, FAKE_KEY, FAKE_PICK)]:
        assert problems(key, ints) == [], (gpu, key, ints)
    # and the check sees what it is for: 16 K steps in 3 splits, a K step wider than K, a split GLU, 5 fat stages
    assert "split_k 3" in problems((4096, 6144, 1, "norm"), (32, 256, 4, 4, 3))[0]
    assert "past the padded" in problems((256, 512, 1, "plain"), (32, 512, 4, 3, 1))[0]
    assert any("GLU" in p for p in problems((4096, 14336, 1, "norm+glu"), (32, 256, 4, 3, 2)))
    assert "shared memory" in problems((4096, 4096, 16, "residual"), (128, 256, 4, 5, 1))[0]


@pytest.fixture(scope="module")
def bench():
    return importlib.import_module("benchmarks.generation.bench_decode_ops")


def test_the_8b_sweep_times_only_launches_the_kernel_runs_as_named(bench):
    """Every config of the first stage at Llama-3-8B's shapes passes the table's checks, and the default is among
    the q/k/v candidates."""
    s = bench.MODELS["llama3-8b"]
    for name, (K, ns, kind) in bench.projections(s).items():
        cfgs = [c for c in bench.stage_configs(s.grid, 0, [], kind) if bench.feasible(c, K, ns, kind, 132)]
        n = ns[0] if "glu" in kind else sum(ns)
        assert cfgs or name == "lm_head"
        for c in cfgs:
            assert problems((K, n, 1, kind), tuple(c.ints())) == [], (name, c)
    K, ns, kind = bench.projections(s)["norm+qkv"]
    assert DecodeLinearConfig(32, 256, 4, 4, 1) in bench.stage_configs(s.grid, 0, [], kind)


def test_emitted_picks_paste_as_valid_table_entries(bench):
    meta = dict(gpu="NVIDIA H200", model="llama3-8b", torch="t", triton="tr", commit="abc")
    row = dict(op="norm+qkv", K=4096, N=6144, kind="norm", default_config=[32, 256, 4, 4, 1], default_us=20.0)
    rows = [dict(row, batch=1, best_config=list(FAKE_PICK), best_us=15.0),
            dict(row, batch=8, best_config=[32, 512, 4, 4, 2], best_us=19.9),  # under 2% faster: the rule stays
            dict(row, op="o+residual", N=4096, kind="residual", batch=8, best_config=[32, 256, 8, 3, 4], best_us=9.0),
            dict(row, batch=32, best_config=[32, 256, 4, 4, 2], best_us=10.0)]  # past the last bucket
    text = bench.picks_literal(rows, meta, 0.02)
    table = ast.literal_eval(text)
    assert table == {FAKE_KEY: FAKE_PICK, (4096, 4096, 16, "residual"): (32, 256, 8, 3, 4)}
    for key, ints in table.items():
        assert problems(key, ints) == []
    assert "MEASURED_PICKS['NVIDIA H200']" in text
