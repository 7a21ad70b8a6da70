"""benchmarks prefill-chunks --smoke: the quantized prefill dequantized and multiplied in chunks of W gives the whole
path's product (checked inside the run, within one bf16 rounding a side) at each chunk size, with a time for every
path."""

import json
import math

import pytest

from benchmarks.generation import bench_prefill_chunks as bench


def test_smoke_times_every_path_and_each_chunk_matches_the_whole(tmp_path):
    out = tmp_path / "chunks.json"
    result = bench.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text())["rows"] == json.loads(json.dumps(result["rows"]))
    (row,) = result["rows"]
    assert set(row["chunks"]) == {16, 32}  # 48 output rows: chunks of 16 and 32 (the last one short)
    times = [row["whole_us"], row["whole_t_us"], row["gemm_bf16_us"]] + [c["us"] for c in row["chunks"].values()]
    assert all(math.isfinite(t) and t > 0 for t in times)
    # one bf16 rounding of each side at the largest output: the bound the run itself enforces
    assert all(c["max_abs_diff"] <= 2 ** -7 * row["max_abs_out"] for c in row["chunks"].values())


def test_a_chunk_that_differs_is_an_error(monkeypatch):
    real = bench._paths

    def broken(qw, x, plan):
        whole, whole_t, chunked = real(qw, x, plan)
        return whole, whole_t, lambda c: (lambda: chunked(c)() * 2)

    monkeypatch.setattr(bench, "_paths", broken)
    with pytest.raises(AssertionError, match="prefill-chunks: chunk 16 of tiny differs"):
        bench.main(["--smoke"])
