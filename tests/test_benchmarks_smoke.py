"""The benchmark harness's --quick path on CPU (kernels through the interpreter): one small op end to end
through `tigon bench`, plus the harness's promise that a failing or missing provider is a note, not a crash."""

import json
import os
import sys

import pytest
import torch

from tigon import cli

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


@pytest.fixture(scope="module")
def harness():
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import _harness

    return _harness


def test_quick_bench_writes_a_table_with_the_tigon_row(tmp_path, capsys, harness):
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--sections", "rms_norm", "--device", "cpu", "--out", str(out), "--budget", "60"]
    assert cli.main(argv) == 0
    assert sorted(os.listdir(out)) == ["cpu.json", "cpu.md", "gpu_check.log"]
    md = (out / "cpu.md").read_text()
    assert "## Ceilings" in md and "### rms_norm:" in md
    tigon_rows = [ln for ln in md.splitlines() if ln.startswith("| tigon |")]
    assert len(tigon_rows) == 1
    cells = [c.strip() for c in tigon_rows[0].strip("|").split("|")]
    assert float(cells[2].replace(",", "")) > 0  # fwd+bwd time
    assert cells[10].startswith("y ")  # rel errors vs fp64 are reported
    result = json.loads((out / "cpu.json").read_text())
    rows = {r["provider"]: r for r in result["rows"] if r["op"] == "rms_norm"}
    assert rows["tigon"]["fb_us"] > 0 and rows["tigon"]["err"]["dx"] < 0.05
    assert rows["eager"]["fb_us"] > 0
    assert "needs CUDA" in rows["liger"]["note"]  # peers are skipped with a note on a CPU
    assert result["ceilings"]["copy_GBps"] > 0
    import render_table

    compact = render_table.compact(result)
    assert "| rms_norm |" in compact
    assert "Tigon fwd+bwd" in capsys.readouterr().out  # gpu_check ends with the compact table


def test_a_failing_provider_is_a_cell_note(harness):
    ctx = harness.Context(device="cpu", quick=True)
    x = torch.randn(4, 8, requires_grad=True)

    def ok():
        return harness.Call(lambda: (x * 2).sum(), (x,))

    def boom():
        raise RuntimeError("CUDA out of memory. Tried to allocate 31.3 GiB")

    def missing():
        return harness.Call(harness.import_first("no_such_package_xyz:Thing"), (x,))

    harness.measure(ctx, "toy", "x [4, 8]", [("tigon", ok), ("oom", boom), ("peer", missing)],
                    bytes_fb=64, host_column=False)
    rows = {r["provider"]: r for r in ctx.rows}
    assert rows["tigon"]["fb_us"] > 0
    assert "out of memory" in rows["oom"]["error"]
    assert "not importable" in rows["peer"]["note"]
    table = "\n".join(harness.op_table(ctx.rows, {}))
    assert "| oom | RuntimeError: CUDA out of memory" in table
