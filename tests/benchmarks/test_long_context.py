"""benchmarks/training/bench_long_context.py on the CPU: the arguments, the slope fit and the table, and one
tigon-offload child stepping a tiny model (Tigon's kernels interpreted). The measurement needs a GPU."""

import pytest
import torch

from benchmarks.training import bench_long_context as bench

pytest.importorskip("peft")


def test_arguments_and_variants():
    a = bench.parse_args([])
    assert a.seqs == [16384, 32768, 65536] and a.variants.split(",") == list(bench.VARIANTS)
    assert bench.parse_args(["--smoke"]).seqs == [64, 96]
    with pytest.raises(SystemExit):
        bench.parse_args(["--variants", "tigon,unsloth"])


def test_slope_is_the_least_squares_line():
    rows = [dict(seq=s, peak_gib=10 + 0.4 * s / 1e3) for s in (16384, 32768, 65536)]
    b, c = bench.slope(rows)
    assert b == pytest.approx(0.4) and c == pytest.approx(10.0)
    assert bench.slope(rows[:1]) is None and bench.slope([dict(seq=1, error="OOM")]) is None
    a = bench.parse_args([])
    md = bench.markdown([dict(variant="tigon", **r) for r in rows] + [dict(variant="hf", seq=16384, error="OOM")], a)
    assert "| tigon | 0.400 | 175000 |" in md and "OOM" in md


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU smoke of the bench: a GPU runs the bench itself")
def test_offload_child_steps_a_tiny_model():
    rows = bench.child("tigon-offload", bench.parse_args(["--smoke", "--seqs", "48", "--steps", "0"]))
    assert len(rows) == 1 and rows[0]["seq"] == 48 and rows[0]["step_ms"] > 0
    from tigon.memory.tiling import CPU_AUTO_TILE_TOKENS

    assert rows[0]["tile_tokens"] == CPU_AUTO_TILE_TOKENS  # "auto" on a CPU (48 tokens fit one tile)
    assert torch.isfinite(torch.tensor(rows[0]["loss"]))


def test_qlora_variants_and_the_curve_table():
    assert bench.parse_variant("tigon-offload-qlora") == ("tigon-offload", True)
    assert bench.parse_variant("liger-tiled") == ("liger-tiled", False)
    a = bench.parse_args(["--variants", "tigon-qlora,tigon-offload-qlora", "--curve-steps", "3"])
    assert a.curve_variants.split(",")[:2] == ["tigon", "tigon"]
    with pytest.raises(SystemExit):
        bench.parse_args(["--longest-variant", "unsloth-qlora"])
    curves = [dict(variant="tigon", seq=64, curve=True, losses=[3.0, 2.5, 2.0]),
              dict(variant="tigon-offload", seq=64, curve=True, losses=[3.0, 2.5, 2.001]),
              dict(variant="tigon-offload-notile", seq=64, curve=True, error="OOM")]
    md = bench.markdown(curves, a)
    assert "| 1: tigon-offload | 3.000000 | 2.001000 | 0.001 | 2/3 |" in md
    assert "| 2: tigon-offload-notile | - | - | - | OOM |" in md
    assert "GiB per 1K tokens |" in md and "| tigon | " not in md.split("GiB per 1K tokens")[1].split("Loss")[0]
