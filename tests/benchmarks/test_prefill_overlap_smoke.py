"""benchmarks/generation/bench_prefill_overlap.py on the CPU (--quick: tiny shapes, the dequantization kernel through
Triton's interpreter, no second stream): the three layer functions run, the serial layer's products are the
dequantized weights' (checked against quant_linear's own reference), and the table and JSON land. The overlap itself
needs a GPU (benchmarks/run_gpu.sh prefill-overlap)."""

import json

import pytest
import torch

from benchmarks.generation import bench_prefill_overlap as bench


def test_quick_run_writes_the_table_and_json(tmp_path, capsys):
    out = tmp_path / "overlap.json"
    assert bench.main(["--quick", "--rows", "5", "--kinds", "int4", "fp8", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["kind"], r["rows"]) for r in rows] == [("int4", 5), ("fp8", 5)]
    assert all(r["serial_ms"] > 0 and r["overlapped_ms"] > 0 and r["floor_ms"] > 0 for r in rows)
    assert "| int4 | 5 |" in capsys.readouterr().out


@pytest.mark.parametrize("kind", ["int4", "fp8"])
def test_the_serial_layer_multiplies_the_dequantized_weights(kind):
    from tigon.ops.quant_linear import quant_linear_reference

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    gen = torch.Generator(device).manual_seed(3)
    serial, overlapped, _ = bench.layer_fns(7, kind, bench.QUICK, device, gen)
    got, again = serial(), overlapped()
    gen = torch.Generator(device).manual_seed(3)  # the same inputs and weights again, for the reference
    xs = [torch.randn(7, K, generator=gen, device=device).to(torch.bfloat16) for _, _, K in bench.QUICK]
    qws = [bench.make_weight(kind, N, K, torch.bfloat16, device, gen) for _, N, K in bench.QUICK]
    for y, y2, x, qw in zip(got, again, xs, qws):
        assert torch.equal(y, y2)
        torch.testing.assert_close(y, quant_linear_reference(x, qw), rtol=2e-2, atol=2e-2)


def test_without_a_gpu_the_timed_run_says_so(capsys):
    if torch.cuda.is_available():
        pytest.skip("the CPU message")
    assert bench.main(["--rows", "512"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().out
