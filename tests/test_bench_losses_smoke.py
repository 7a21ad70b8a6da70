"""benchmarks/bench_losses.py --smoke on CPU (the kernels through the interpreter): the DPO rows for
every provider that runs here, written as markdown and JSON (DPO only: each interpreted Tigon call is ~1 s; the
GRPO and JSD sections run the same harness calls)."""

import json
import os
import sys

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks")


def test_bench_losses_smoke(tmp_path):
    if BENCH not in sys.path:
        sys.path.insert(0, BENCH)
    import bench_losses

    assert bench_losses.main(["--out", str(tmp_path), "--smoke", "--budget", "120", "--only", "dpo"]) == 0
    rows = json.loads((tmp_path / "losses.json").read_text())["rows"]
    tigon = {r["op"]: r for r in rows if r["provider"] == "tigon"}
    assert set(tigon) == {"dpo"} and all(r["fb_us"] > 0 for r in tigon.values())
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    md = (tmp_path / "losses.md").read_text()
    assert "### dpo:" in md and "| tigon |" in md
