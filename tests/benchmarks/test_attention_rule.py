"""benchmarks/training/attention_rule.py: the rule for unmeasured cards, checked with each GPU's row hidden."""

import json

import pytest

from benchmarks.training import attention_rule

RESULTS = ["benchmarks/results/h100_training_attention.json", "benchmarks/results/h200_training_attention.json"]


def test_the_committed_results_pick_nothing_slower_than_hf(capsys):
    """Each measured GPU with its row hidden: every case runs the rule's pick no slower than HF's pick."""
    assert attention_rule.main(RESULTS) == 0
    out = capsys.readouterr().out
    assert "slower than HF's pick by more than 1.03x: 0" in out
    results = {}
    for path in RESULTS:
        res = json.load(open(path))
        results[res["gpu"]] = res
    rows = attention_rule.leave_one_out(results)
    assert {r["gpu"] for r in rows} == set(results) and len(rows) >= 20
    assert all(r["ratio"] <= attention_rule.MARGIN for r in rows)
    assert any(r["pick"] != r["hf_pick"] for r in rows)  # the rule does choose something


def _res(gpu, fastest, flex_us):
    """A results dict of one packed case: HF's sdpa 100 us, flex `flex_us`."""
    rows = [dict(kind="packed", case="c", provider=p, fb_us=us, backend_of={p: p})
            for p, us in (("sdpa", 100.0), ("flex", flex_us))]
    return dict(gpu=gpu, rows=rows, fastest=fastest)


def test_a_backend_that_loses_on_the_hidden_card_is_reported(tmp_path, capsys):
    """GPU a: flex beats sdpa (its row); GPU b: flex loses (no row). Hiding a, the rule from b alone is empty, so a
    runs HF's pick; hiding b, the rule from a picks flex, 1.5x slower there: the check fails and says so."""
    paths = []
    for gpu, fastest, flex in (("a", {"packed": "flex"}, 50.0), ("b", {}, 150.0)):
        paths.append(tmp_path / f"{gpu}.json")
        paths[-1].write_text(json.dumps(_res(gpu, fastest, flex)))
    assert attention_rule.main([str(p) for p in paths]) == 1
    rows = {r["gpu"]: r for r in attention_rule.leave_one_out({g: _res(g, f, t) for g, f, t in
                                                               (("a", {"packed": "flex"}, 50.0), ("b", {}, 150.0))})}
    assert rows["a"]["pick"] == "sdpa" and rows["a"]["ratio"] == 1.0
    assert rows["b"]["pick"] == "flex" and rows["b"]["ratio"] == pytest.approx(1.5)
    assert "by more than 1.03x: 1" in capsys.readouterr().out


def test_one_gpu_is_refused(capsys):
    with pytest.raises(SystemExit):
        attention_rule.main(RESULTS[:1])
    assert "two GPUs at least" in capsys.readouterr().err
