"""benchmarks/ops/bench_moe.py's CPU smoke run (--smoke: tiny shapes, the kernels through Triton's interpreter): every
provider runs fwd+bwd, agrees with the fp32 "eager" loop, and the md + json land in --out. The timing needs a
GPU (benchmarks/run_gpu.sh moe)."""

import json

import pytest

from benchmarks.ops import bench_moe


@pytest.fixture(scope="module")
def bench():
    return bench_moe


def test_smoke_run_writes_md_and_json(bench, tmp_path):
    assert bench.main(["--smoke", "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "moe.json").read_text())
    blocks = [r for r in result["rows"] if r["op"] == "experts"]
    assert [r["provider"] for r in blocks] == list(bench.PROVIDERS)
    for r in blocks:
        assert "error" not in r, r
        # bf16 against the fp32 loop: a few bf16 roundings (u = 2^-8) per value, interpreter casts truncate
        assert max(r["err"].values()) < 0.05, r
        assert r["fwd_bwd_ms"] > 0
    glue = [r for r in result["rows"] if r["op"] == "glue"]
    assert len(glue) == 4 and all("error" not in r and r["GBps"] > 0 for r in glue), glue
    md = (tmp_path / "moe.md").read_text()
    assert "| tigon |" in md and "bytes model" in md


def test_bytes_model(bench):
    p = bench.glue_passes(8)
    assert p["tigon_fwd"]["SH"] == 2.25 and p["grouped_mm_fwd"]["SH"] == 11.125
    assert p["tigon_fwd"]["S2I"] < p["grouped_mm_fwd"]["S2I"]
