"""benchmarks/ops/bench_optim.py --quick on the CPU (the AdamW kernels through the interpreter): every provider's row,
with and without clipping, and the byte model behind its GB/s."""

import json

from benchmarks.ops import bench_optim


def test_quick_optim_bench_writes_every_row(tmp_path, capsys):
    out = tmp_path / "optim.json"
    assert bench_optim.main(["--quick", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    got = {(r["provider"], r["clip"]) for r in rows}
    names = ("torch fused", "torch foreach", "tigon", "torch fused, fp32 params", "tigon, fp32 masters + moments")
    assert got == {(p, c) for p in names for c in (None, 1.0)} | {("tigon + the Trainer's norm pass", 1.0)}
    assert all(r["ms"] > 0 and r["GBps"] > 0 for r in rows)
    # the byte model: 14 bytes a bf16 parameter, + 6 for torch's clipping, + 2 for the fused one
    n = rows[0]["params"]
    by = {(r["provider"], r["clip"]): r["bytes"] for r in rows}
    assert by[("tigon", None)] == 14 * n and by[("torch fused", 1.0)] == 20 * n and by[("tigon", 1.0)] == 16 * n
    assert by[("tigon, fp32 masters + moments", None)] == by[("torch fused, fp32 params", None)] == 28 * n
    assert by[("tigon + the Trainer's norm pass", 1.0)] == 18 * n  # the Trainer's logging-only norm reads the grads
    assert "| tigon | 1.0 |" in capsys.readouterr().out
