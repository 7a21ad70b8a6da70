"""benchmarks/training/bench_training_attention.py --smoke: every mask kind gets a row with HF's pick timed (on a CPU
the GPU backends say why they did not run, on a GPU they are timed too), the FLOP model counts what the masks allow, and
--write-table's rewrite keeps the table importable."""

import importlib.util
import json

import torch

from benchmarks.training import bench_training_attention as bench
from tigon.hf import training_attention as ta


def test_smoke_run_writes_every_mask_kind(tmp_path):
    # the budget cuts the tail of the cases: wide enough for a GPU shared by a dozen test workers (flex compiles)
    assert bench.main(["--smoke", "--out", str(tmp_path), "--budget", "500"]) == 0
    result = json.loads((tmp_path / "training_attention.json").read_text())
    kinds = {r["op"] for r in result["rows"]}
    assert kinds == {"causal", "packed", "sliding", "packed+sliding", "causal+softcap", "packed+softcap"}
    cuda = torch.cuda.is_available()
    for r in result["rows"]:
        hf_pick = "eager" if r["op"].endswith("softcap") else "sdpa"
        timed = r.get("fb_us", 0) > 0 and r.get("fb_TFLOPs", 0) > 0
        if r["provider"] == hf_pick:
            assert timed, r
        elif r["provider"] == "flash_attn" and "not installed" in r.get("note", ""):
            assert not ta._has_flash_attn(), r
        elif cuda:  # cuDNN, compiled flex (head 64, 256 tokens on a GPU) and an installed flash_attn all run,
            assert timed or r.get("note") or r.get("error"), r  # or the row says why not
        else:
            assert "needs CUDA" in r.get("note", ""), r
    packed = next(r for r in result["rows"] if r["op"] == "packed")
    assert int(packed["case"].split(", ")[2].split()[0]) > 1  # several documents in the smoke row
    assert "| packed |" in (tmp_path / "training_attention.md").read_text()


def test_flop_model_and_lengths():
    assert bench.pairs([4]) == 10 and bench.pairs([4], window=2) == 1 + 2 + 2 + 2
    lengths = bench.lengths_lognormal(16384)
    assert sum(lengths) == 16384 and max(lengths) <= 4096 and min(lengths[:-1]) >= 16
    assert lengths == bench.lengths_lognormal(16384)  # fixed seed


def test_write_table_rewrites_only_the_measured_block(tmp_path):
    path = tmp_path / "attention_table.py"
    path.write_text(open(bench.TABLE).read())
    bench.write_table("Test GPU", {"packed": "flex", "sliding": "flex"}, str(path))
    spec = importlib.util.spec_from_file_location("table_copy", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.MEASURED[("Test GPU", "packed")] == "flex"
    assert table.pick("Test GPU", "packed") == "flex" and table.pick("Test GPU", "causal") == "sdpa"
    # a card without a row runs the rule: the backends in every measured GPU's row, this new one's included
    assert table.pick("Other GPU", "packed") == table.unmeasured_rule()["packed"][0] == "flex"
