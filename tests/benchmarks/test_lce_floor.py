"""benchmarks/ops/bench_lce_floor.py: its floor arithmetic, and a clear refusal without a GPU (the timing itself runs
on the H200: benchmarks/results/h200_lce_floor.json)."""


import pytest
import torch

from benchmarks.ops import bench_lce_floor


@pytest.fixture(scope="module")
def floor():
    return bench_lce_floor


def test_chunk_floor_adds_the_chunk_gemms_and_the_row_bytes_at_the_ceiling(floor):
    # 4 chunks of 256 rows; one chunk's GEMMs take 1 + 2 + 3 ms; the row kernel reads + writes 1024 x 1000 bf16
    got = floor.chunk_floor(256, {"logits": 1.0, "dh": 2.0, "dW accumulate": 3.0, "dW plain": 99.0}, 0.5,
                            copy_gbs=4.096, n=1024, h=64, v=1000)
    assert got["chunk_gemms_ms"] == pytest.approx(24.0)
    assert got["row_kernel_ms"] == pytest.approx(2.0)
    assert got["row_kernel_at_ceiling_ms"] == pytest.approx(2 * 1024 * 1000 * 2 / 4.096e6)
    assert got["floor_ms"] == pytest.approx(24.0 + got["row_kernel_at_ceiling_ms"])
    assert got["peak_extra_mib"] == pytest.approx((1024 * 64 + 1000 * 64 + 256 * 1000) * 2 / 2 ** 20)


def test_the_8b_head_default_chunk_is_the_one_timed(floor):
    from tigon.ops.linear_cross_entropy import chunk_rows

    assert chunk_rows(floor.N, floor.V, 2) == 768
    assert floor.chunk_floor(768, {"logits": 1, "dh": 1, "dW accumulate": 1}, 1, 4000)["peak_extra_mib"] < 1331


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without a GPU")
def test_refuses_without_a_gpu(floor):
    with pytest.raises(SystemExit, match="bench_lce_floor: needs a CUDA GPU"):
        floor.main([])
