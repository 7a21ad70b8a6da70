"""Tuned tables: the attention rule for unmeasured cards, the per-user cache `tigon tune` writes (read before the
shipped tables, a bad file ignored with one warning, never read while dynamo traces), `tigon env` naming each
choice's source, and `tigon tune` itself on a CPU (exit 2, --dry-run) with its selection logic on fake timings."""

import dataclasses
import importlib
import json
import math
import warnings

import pytest
import torch

from tigon import cli
from tigon.cli import env, tune
from tigon.hf import attention_table as table
from tigon.ops import decode_linear_picks as picks
from tigon.ops import tuned_cache
from tigon.ops.config import DecodeLinearConfig

dl = importlib.import_module("tigon.ops.decode_linear")
TWO_GPUS = {  # A and B both measured; C measured with one row only
    ("GPU A", "packed"): ("flex", "varlen", "flash_attn"),
    ("GPU B", "packed"): ("flash_attn", "flex", "varlen"),
    ("GPU A", "sliding"): "varlen",
    ("GPU B", "sliding"): ("flex", "varlen"),
    ("GPU A", "packed+sliding"): ("varlen", "flex"),
    ("GPU B", "packed+sliding"): "flex",
    ("GPU A", "causal+softcap"): "flex",  # B has no row: HF's pick was fastest there
}


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    """An empty TIGON_CACHE_DIR, read afresh by this test's first lookup."""
    monkeypatch.setenv("TIGON_CACHE_DIR", str(tmp_path))
    tuned_cache.reset()
    yield tmp_path
    tuned_cache.reset()
    dl._pick_config.cache_clear()


def test_rule_is_the_intersection_ordered_by_the_cards_fastest():
    rule = table.unmeasured_rule(TWO_GPUS)
    # packed: flex and flash_attn are each fastest on one card; flex's mean place is better (0 and 1 against 2 and 0)
    assert rule == {"packed": ("flex", "flash_attn", "varlen"), "sliding": ("varlen",), "packed+sliding": ("flex",)}
    three = {**TWO_GPUS, ("GPU C", "packed"): ("varlen", "flex")}  # of the two left, flex is faster on A and B
    assert table.unmeasured_rule(three) == {"packed": ("flex", "varlen")}  # the other kinds: no row on GPU C
    one = {k: v for k, v in TWO_GPUS.items() if k[0] == "GPU A"}  # one measured GPU: the rule is its row
    assert table.unmeasured_rule(one) == {kind: table._as_row(v) for (_, kind), v in one.items()}
    assert table.unmeasured_rule({}) == {}


def test_an_unmeasured_gpu_runs_the_rule_and_a_measured_one_its_rows(monkeypatch, cache_dir):
    monkeypatch.setattr(table, "MEASURED", TWO_GPUS)
    assert table.ranking("GPU Z", "packed") == ("flex", "flash_attn", "varlen", "sdpa")
    assert table.ranking("GPU Z", "causal+softcap") == ("eager",)  # not on every measured card: HF's pick
    assert table.ranking("GPU Z", "causal") == ("sdpa",) and table.ranking(None, "packed") == ("sdpa",)
    assert table.ranking("GPU B", "causal+softcap") == ("eager",)  # measured card, no row: HF's pick
    assert table.ranking("GPU A", "sliding") == ("varlen", "sdpa") and table.pick("GPU B", "sliding") == "flex"
    assert table.source("GPU Z", "packed") == "rule (unmeasured card: faster than HF's pick on every measured GPU: " \
                                             "GPU A, GPU B)"
    assert "none faster" in table.source("GPU Z", "causal")
    assert table.source("GPU A", "packed") == "shipped table (GPU A row)"
    assert table.source("GPU B", "causal+softcap") == "shipped table (GPU B: no backend beat HF's pick)"
    assert table.source(None, "packed") == "no GPU: HF's pick"


def test_the_user_cache_comes_before_the_shipped_rows(monkeypatch, cache_dir):
    monkeypatch.setattr(table, "MEASURED", TWO_GPUS)
    path = tuned_cache.write("GPU A", attention={"packed": ("varlen",), "sliding": (), "causal": ("cudnn9", "flex")})
    assert path == cache_dir / "tuned.json" and [p.name for p in cache_dir.iterdir()] == ["tuned.json"]
    assert table.ranking("GPU A", "packed") == ("varlen", "sdpa")
    assert table.ranking("GPU A", "sliding") == ("sdpa",)  # measured here: HF's pick, whatever the shipped row says
    assert table.ranking("GPU A", "causal") == ("flex", "sdpa")  # a name this Tigon does not know is passed over
    assert table.ranking("GPU A", "packed+sliding") == ("varlen", "flex", "sdpa")  # not in the cache: shipped row
    assert table.ranking("GPU Z", "packed")[0] == "flex"  # another card: the rule
    assert table.source("GPU A", "packed") == f"user cache ({path})"
    # decode_linear picks merge into the same entry; the attention rows stay
    tuned_cache.write("GPU A", decode_linear={(4096, 6144, 1, "norm"): (64, 256, 4, 4, 2, 0)})
    rows = tuned_cache.for_gpu("GPU A")
    assert rows.attention["packed"] == ("varlen",) and rows.decode_linear == {(4096, 6144, 1, "norm"):
                                                                              (64, 256, 4, 4, 2, 0)}
    # an entry of another torch is kept in the file but not read
    data = json.loads(path.read_text())
    data["entries"][0]["torch"] = "0.0.1"
    path.write_text(json.dumps(data))
    tuned_cache.reset()
    assert table.ranking("GPU A", "packed") == ("flex", "varlen", "flash_attn", "sdpa")
    assert "under torch 0.0.1" in env.cache_text("GPU A") and "not read" in env.cache_text("GPU A")


BAD_FILES = ["{not json", json.dumps({"format": 99, "entries": []}), json.dumps([1, 2]),
             json.dumps({"format": 1, "entries": [{"gpu": "GPU A", "torch": torch.__version__, "triton": None,
                                                   "decode_linear": [{"key": [1, 2, 1, "norm"],
                                                                      "config": [48, 256, 4, 4, 1]}]}]})]


@pytest.mark.parametrize("text", BAD_FILES, ids=["json", "format", "list", "config"])
def test_a_bad_cache_file_is_ignored_with_one_warning(text, monkeypatch, cache_dir):
    monkeypatch.setattr(table, "MEASURED", TWO_GPUS)
    (cache_dir / "tuned.json").write_text(text)
    with pytest.warns(RuntimeWarning, match="ignoring the tuned-table cache") as caught:
        assert table.ranking("GPU A", "packed") == ("flex", "varlen", "flash_attn", "sdpa")
        assert table.ranking("GPU A", "sliding") == ("varlen", "sdpa")
        assert picks.lookup("GPU A", 1, 2, 1, "norm") is None
    assert len(caught) == 1
    assert "ignored" in env.cache_text("GPU A")
    with pytest.warns(RuntimeWarning, match="could not be read"):  # tune replaces it
        tuned_cache.write("GPU A", attention={"packed": ("varlen",)})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert table.ranking("GPU A", "packed") == ("varlen", "sdpa")


def test_no_file_is_read_while_dynamo_traces(cache_dir):
    tuned_cache.write("GPU A", attention={"packed": ("varlen",)})
    calls = []

    def f(x):
        calls.append(tuned_cache.for_gpu("GPU A"))
        return x + 1

    torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))
    assert calls == [None] and tuned_cache._STATE is None
    assert tuned_cache.for_gpu("GPU A").attention == {"packed": ("varlen",)}  # eager: read once, then kept


@pytest.fixture
def fake_gpu(monkeypatch):
    """_pick_config as on a CUDA device named "FAKE GPU" with 132 SMs."""
    monkeypatch.setattr(dl._launch, "sm_count", lambda index: 132)
    monkeypatch.setattr(dl, "_gpu_name", lambda index: "FAKE GPU")
    dl._pick_config.cache_clear()
    yield lambda M, K, N, glu, norm, residual=False: dl._pick_config(
        M, K, N, glu, norm, 2, torch.device("cuda", 0), dl.SMEM_LIMIT, residual=residual)
    dl._pick_config.cache_clear()


def test_decode_linear_launches_the_cached_pick(fake_gpu, monkeypatch, cache_dir):
    rule = fake_gpu(1, 4096, 6144, False, True)
    assert rule == dl._rule_config(4096, 6144, False, True, 132)
    monkeypatch.setitem(picks.MEASURED_PICKS, "FAKE GPU", {(4096, 6144, 1, "norm"): (64, 256, 4, 4, 2),
                                                           (4096, 4096, 1, "residual"): (32, 128, 4, 4, 2)})
    tuned_cache.write("FAKE GPU", decode_linear={(4096, 6144, 1, "norm"): (128, 256, 8, 3, 1, 0)})
    dl._pick_config.cache_clear()
    assert fake_gpu(1, 4096, 6144, False, True) == DecodeLinearConfig(128, 256, 8, 3, 1, 0)  # the cache's
    assert fake_gpu(1, 4096, 4096, False, False, residual=True) == DecodeLinearConfig(32, 128, 4, 4, 2)  # shipped
    assert fake_gpu(8, 4096, 6144, False, True) == rule  # another bucket: the rule
    text = env.launch_text("decode_linear", "FAKE GPU")
    assert text.startswith(f"user cache ({cache_dir / 'tuned.json'}: 1 shapes), then shipped table (FAKE GPU row")


def test_env_names_the_source_of_each_choice(monkeypatch, cache_dir):
    monkeypatch.setattr(table, "MEASURED", TWO_GPUS)
    tuned_cache.write("GPU A", attention={"causal": ("varlen",)})
    text = env.attention_text("GPU A")
    lines = {ln.split()[0]: ln for ln in text.splitlines()[1:]}
    assert text.startswith("hf/attention_table.py rows for GPU A") and set(lines) == set(env.MASK_KINDS)
    assert "varlen > sdpa" in lines["causal"] and f"user cache ({cache_dir / 'tuned.json'})" in lines["causal"]
    assert "flex > varlen > flash_attn > sdpa" in lines["packed"] and "shipped table (GPU A row)" in lines["packed"]
    assert "shipped table (GPU A: no backend" in lines["packed+softcap"]
    other = env.attention_text("GPU Z")
    assert other.startswith("no row for GPU Z") and "rule (unmeasured card" in other
    assert "Hugging Face's pick" in env.attention_text(None)
    assert env.launch_text("decode_linear", "GPU Z").startswith("rule (unmeasured card: the shape rule")
    assert env.launch_text("decode_attention", "GPU Z").startswith("rule (every card")
    assert "rows for GPU A (attention: 1 mask kinds" in env.cache_text("GPU A")
    assert "no rows for GPU Z" in env.cache_text("GPU Z")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU message")
def test_tune_on_a_cpu_exits_2_and_says_it_needs_a_gpu(capsys, cache_dir):
    assert cli.main(["tune", "--decode-linear"]) == 2
    err = capsys.readouterr().err
    assert "tigon tune needs a CUDA GPU" in err and "--dry-run" in err and "Traceback" not in err
    assert not (cache_dir / "tuned.json").exists()


def test_tune_dry_run_lists_the_work(capsys, tmp_path, cache_dir):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(dict(hidden_size=96, num_attention_heads=6, num_key_value_heads=2,
                                      intermediate_size=160)))
    assert cli.main(["tune", "--dry-run", "--model", str(tmp_path), "--kinds", "packed,causal+softcap"]) == 0
    out = capsys.readouterr().out
    assert "nothing is timed or written" in out and str(cache_dir / "tuned.json") in out
    assert "packed                   sdpa (HF's pick) against varlen, flex, flash_attn" in out
    assert "causal+softcap           eager (HF's pick) against flex, flash_attn" in out and "sliding" not in out
    assert "norm+qkv           batch 1  K 96     N 160    kind norm" in out  # q 96 + k 32 + v 32
    assert "gate_up+glu        batch 8  K 96     N 160    kind glu" in out
    assert cli.main(["tune", "--dry-run", "--attention"]) == 0 and "decode_linear" not in capsys.readouterr().out
    assert cli.main(["tune", "--dry-run", "--kinds", "dense"]) == 2 and "unknown mask kind" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        cli.main(["tune", "--model", str(tmp_path / "missing.json")])
    assert e.value.code == 2 and "argument --model: expected llama3-8b or 1.5b" in capsys.readouterr().err


def test_selection_keeps_only_winners_2_percent_faster():
    assert tune.attention_winners("packed", {"sdpa": 10.0, "flex": 2.0, "varlen": 3.0, "flash_attn": 9.9}) == (
        "flex", "varlen")  # flash_attn: 1% faster, not a winner
    assert tune.attention_winners("packed", {"sdpa": 1.0, "flex": 2.0, "varlen": "no varlen_attn"}) == ()
    assert tune.attention_winners("causal+softcap", {"eager": "OutOfMemoryError: ...", "flex": 1.0}) is None
    rule, other, shipped = (DecodeLinearConfig(32, 256, 4, 4, 1), DecodeLinearConfig(64, 256, 4, 4, 2),
                            DecodeLinearConfig(16, 256, 4, 4, 1))
    assert tune.decode_choice({rule: 10.0, other: 9.0}, rule, None) == other
    assert tune.decode_choice({rule: 10.0, other: 9.9}, rule, None) is None
    assert tune.decode_choice({rule: 10.0, shipped: 9.9}, rule, shipped) == rule  # the shipped pick is not faster
    assert tune.decode_choice({rule: math.inf}, rule, shipped) is None


def test_the_search_finds_the_fastest_launch_it_may_time():
    p = next(p for p in tune.projections(tune.MODELS["llama3-8b"]) if p.name == "down+residual" and p.batch == 1)
    target = DecodeLinearConfig(32, 512, 8, 3, 2)
    rule = DecodeLinearConfig(64, 256, 4, 4, 4)

    def time_of(cfg):  # a bowl around the target: every field off costs
        return 1.0 + sum(a != b for a, b in zip(cfg.ints(), target.ints()))

    times = tune.search(p, time_of, [rule], dl.SMEM_LIMIT)
    assert min(times, key=times.get) == target and 20 < len(times) < 40
    assert all(tune.feasible(c, p, dl.SMEM_LIMIT) for c in times if c != rule)
    seeded = tune.search(p, time_of, [rule], dl.SMEM_LIMIT, seeds=sorted(times, key=times.get)[:4])
    assert len(seeded) == 5 and min(seeded, key=seeded.get) == target
    glu = next(p for p in tune.projections(tune.MODELS["1.5b"]) if p.kind == "norm+glu")
    assert all(c.split_k == 1 for c in tune.stage_configs(glu, 0, [], dl.SMEM_LIMIT))


def test_tune_writes_the_winners_and_prints_a_table(monkeypatch, capsys, cache_dir):
    """cmd_tune on fake timings (the measuring itself needs a GPU): the table, and only the winners cached."""
    rule, fast = DecodeLinearConfig(32, 256, 4, 4, 1), DecodeLinearConfig(64, 256, 4, 4, 2)
    qkv, o = (p for p in tune.projections(tune.MODELS["1.5b"])[:2])
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda index=None: "FAKE GPU")
    monkeypatch.setattr(tune, "measure_attention", lambda kinds, device: {
        "packed": {"sdpa": 10.0, "varlen": 2.0, "flex": 1.0, "flash_attn": "flash_attn cannot take it here"},
        "sliding": {"sdpa": 1.0, "varlen": 1.0, "flex": 3.0},
        "causal+softcap": {"eager": "OutOfMemoryError: ...", "flex": 1.0}})
    monkeypatch.setattr(tune, "measure_decode", lambda model, device, gpu: [
        (qkv, {rule: 0.020, fast: 0.015}, rule, None), (o, {rule: 0.010, fast: 0.0099}, rule, None)])
    times = cache_dir / "times.json"
    assert cli.main(["tune", "--model", "1.5b", "--kinds", "packed,sliding,causal+softcap", "--times",
                     str(times)]) == 0
    out = capsys.readouterr().out
    every = json.loads(times.read_text())  # every launch timed, the losers too
    assert every["gpu"] == "FAKE GPU"
    assert [r["launch"]["name"] for r in every["decode_linear"]] == ["norm+qkv", "o+residual"]
    assert every["decode_linear"][1]["times"] == {str(tuple(rule.ints())): 0.010, str(tuple(fast.ints())): 0.0099}
    assert every["decode_linear"][0]["rule"] == list(rule.ints())
    assert "| packed | 10.000 ms | 2.000 ms | 1.000 ms | flash_attn cannot take it here | flex > varlen |" in out
    assert "| sliding | 1.000 ms | 1.000 ms | 3.000 ms | - | HF's pick |" in out
    assert "not written: HF's pick did not run" in out
    assert f"| norm+qkv | 1 | 2048 | 3072 | norm | {tuple(rule.ints())} | 20.00 | {tuple(fast.ints())} | 15.00 |" in out
    rows = tuned_cache.for_gpu("FAKE GPU")
    assert rows.attention == {"packed": ("flex", "varlen"), "sliding": ()}
    assert rows.decode_linear == {(2048, 3072, 1, "norm"): tuple(fast.ints())}
    assert f"to {cache_dir / 'tuned.json'}" in out


@pytest.mark.parametrize("fmt", ["int4", "fp8"])
@pytest.mark.parametrize("rows,cfg", [(1, dict(block_n=32, block_k=256, split_k=2, prefetch=1)),
                                      (3, dict(block_n=64, block_k=128, prefetch=1))])
def test_a_launch_is_timed_only_where_it_computes_the_rules_product(fmt, rows, cfg):
    from tigon import ops
    from tigon.ops import QuantLinearConfig

    p = tune.QuantLaunch("o", rows, 256, 96, False, fmt, 128)
    w = tune._quant_weight(p, "cpu", torch.Generator().manual_seed(0))
    x = torch.randn(rows, p.K, dtype=torch.bfloat16)
    expected = ops.quant_linear(x, w, config=QuantLinearConfig()).float()
    assert tune.same_product(ops.quant_linear(x, w, config=QuantLinearConfig(**cfg)), expected)
    wrong = dataclasses.replace(w, scales=w.scales.flip(-1))  # a launch reading the wrong groups' scales
    assert not tune.same_product(ops.quant_linear(x, wrong, config=QuantLinearConfig(**cfg)), expected)
    assert not tune.same_product(torch.full_like(expected, math.nan), expected)
