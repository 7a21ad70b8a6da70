"""benchmarks/ops/bench_losses.py --smoke on CPU (the kernels through the interpreter): the DPO rows for
every provider that runs here, written as markdown and JSON (DPO only: each interpreted Tigon call is ~1 s; the
GRPO and JSD sections run the same harness calls). A peer that cannot be imported (TRL without `datasets`, as on
the H200 image) is a row note, never an error."""

import json
import sys

import torch

from benchmarks.ops import bench_losses


def test_bench_losses_smoke(tmp_path, monkeypatch):
    # One timed call per stage instead of the smoke run's warm-up + estimate + 3: the harness's repetition logic is
    # tests/benchmarks/test_smoke.py's; here each interpreted fwd+bwd of every provider costs ~1 s, and the rows,
    # notes and tables below come out the same (5 calls a provider instead of 11).
    bench = bench_losses.H.bench
    monkeypatch.setattr(bench_losses.H, "bench", lambda *a, **k: bench(*a, **dict(k, min_rep=1, max_rep=1, warmup=0)))
    assert bench_losses.main(["--out", str(tmp_path), "--smoke", "--budget", "120", "--only", "dpo"]) == 0
    rows = json.loads((tmp_path / "losses.json").read_text())["rows"]
    tigon = {r["op"]: r for r in rows if r["provider"] == "tigon"}
    assert set(tigon) == {"dpo"} and all(r["fb_us"] > 0 for r in tigon.values())
    assert all("error" not in r for r in rows), [r for r in rows if "error" in r]
    # every provider has a row: timed, or a note saying why not (not installed, needs CUDA); on a GPU the GEMM floor
    floor = {"4-GEMM floor"} if torch.cuda.is_available() else set()
    assert {r["provider"] for r in rows} == {"eager", "trl", "liger", "tigon"} | floor
    assert all(r.get("fb_us", 0) > 0 or r.get("note") for r in rows), rows
    md = (tmp_path / "losses.md").read_text()
    assert "### dpo:" in md and "| tigon |" in md


def test_unimportable_trl_is_a_note(monkeypatch):
    """TRL's log-prob forward imports trl.trainer.utils (and so `datasets`) at call time: with that import failing,
    the provider's factory raises Skip before any timing and the harness writes a note, while Tigon's row runs."""
    H = bench_losses.H
    monkeypatch.setitem(sys.modules, "trl.trainer.utils", None)  # what a missing `datasets` makes of it
    ctx = H.Context(device="cpu", quick=True)

    def trl():
        bench_losses._trl_fn()
        raise AssertionError("unreachable: the import above must fail")

    def tigon():
        x = H.randn((4, 8), ctx, requires_grad=True)
        return H.Call(lambda: (x * x).sum(), (x,))

    H.measure(ctx, "dpo", "tiny", [("trl", trl), ("tigon", tigon)], do_fwd=False)
    by = {r["provider"]: r for r in ctx.rows}
    assert "error" not in by["trl"] and by["trl"]["note"].startswith("not installed:"), by["trl"]
    assert by["tigon"]["fb_us"] > 0 and "error" not in by["tigon"]
