"""The rule for unmeasured cards checked on measured ones: each GPU's table row hidden, is any choice slower than
HF's pick?

Training attention picks a backend per mask kind from `tigon.hf.attention_table`: a measured GPU's own row, else
`unmeasured_rule` (the backends that beat HF's pick on every measured GPU), else HF's pick. This tool takes the
results of `python -m benchmarks training-attention` from two or more GPUs and, for each GPU in turn, derives the
rule from the OTHER GPUs' rows alone (each results file's "fastest", the row `--write-table` writes), as if this
card had never been measured. For every case that card ran it then compares the time of the backend the rule picks
(its first backend with a time for the case, as the dispatch takes the first that can run the call) with the time
of HF's pick on the same card in the same run. A kind the rule has no entry for runs HF's pick itself (ratio 1).

    python -m benchmarks attention-rule benchmarks/results/h100_training_attention.json \\
        benchmarks/results/h200_training_attention.json

Prints one markdown table; the exit status is 1 when some pick is slower than HF's by more than MARGIN (the
timings' run-to-run spread, as the table's own rows use), else 0. No GPU is needed: the times are the files'.
"""

from __future__ import annotations

import argparse
import json
import sys

MARGIN = 1.03  # bench_training_attention.MARGIN: a backend enters a row only beyond this speedup


def backend_times(rows: list) -> dict:
    """{case: {backend: fwd+bwd us}} of one results file's rows: the table's backends, the fastest provider of
    each (cuDNN alone is not what HF's sdpa runs, as in bench_training_attention.fastest)."""
    from tigon.hf.attention_table import BACKENDS

    times: dict = {}
    for r in rows:
        backend = r.get("backend_of", {}).get(r["provider"])
        if r.get("fb_us") and backend in BACKENDS and r["provider"] != "cudnn":
            case = times.setdefault((r["kind"], r["case"]), {})
            case[backend] = min(r["fb_us"], case.get(backend, float("inf")))
    return times


def leave_one_out(results: dict) -> list:
    """results: {gpu name: a training-attention results dict (its "rows" and "fastest")}. One row a (gpu, case):
    the rule derived without that gpu, the backend it picks there, its time, HF's pick's time and the ratio."""
    from tigon.hf.attention_table import hf_pick, unmeasured_rule

    out = []
    for gpu, res in results.items():
        others = {(g, kind): row for g, r in results.items() if g != gpu for kind, row in r["fastest"].items()}
        rule = unmeasured_rule(others)
        for (kind, case), times in backend_times(res["rows"]).items():
            hf = hf_pick(kind)
            if hf not in times:
                continue
            ranked = [b for b in rule.get(kind, ()) if b in times]
            pick = ranked[0] if ranked else hf
            out.append(dict(gpu=gpu, kind=kind, case=case, rule=list(rule.get(kind, ())), pick=pick,
                            pick_us=times[pick], hf_pick=hf, hf_us=times[hf], ratio=times[pick] / times[hf]))
    return out


def table(rows: list) -> str:
    lines = ["| GPU (row hidden) | mask kind | case | rule from the other GPUs | picked | us | HF's pick | us | "
             "time vs HF's pick |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        rule = ", ".join(r["rule"]) or "none: HF's pick"
        lines.append(f"| {r['gpu']} | {r['kind']} | {r['case']} | {rule} | {r['pick']} | {r['pick_us']:.1f} | "
                     f"{r['hf_pick']} | {r['hf_us']:.1f} | {r['ratio']:.3f}x |")
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("results", nargs="+", help="training-attention results JSON files, one a GPU (two at least)")
    a = p.parse_args(argv)
    results = {}
    for path in a.results:
        with open(path) as f:
            res = json.load(f)
        results[res["gpu"]] = res
    if len(results) < 2:
        p.error("give the results of two GPUs at least: one is hidden, the others make the rule")
    rows = leave_one_out(results)
    print(table(rows))
    slow = [r for r in rows if r["ratio"] > MARGIN]
    print(f"\n{len(rows)} cases on {len(results)} GPUs; slower than HF's pick by more than {MARGIN:.2f}x: {len(slow)}")
    return 1 if slow else 0


if __name__ == "__main__":
    sys.exit(main())
