"""Print the README's compact results table from a gpu_check JSON (default benchmarks/results/h200_ops.json):
one line per op and shape, fwd+bwd time of tigon, eager, torch.compile and Liger-Kernel, and tigon's
speedup over the fastest of the others. Standard library only.

    python benchmarks/render_table.py [path/to/<gpu>_ops.json]
"""

import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT = os.path.join(HERE, "results", "h200_ops.json")
COLUMNS = ("tigon", "eager", "torch.compile", "liger")
NAMES = {"tigon": "Tigon", "eager": "eager (HF)", "torch.compile": "torch.compile", "liger": "Liger-Kernel"}


def _time(us):
    if not isinstance(us, (int, float)):
        return None
    return f"{us / 1e3:.1f} ms" if us >= 1e4 else f"{us:.0f} us"


def cpu_run(result: dict) -> bool:
    """Whether the result was measured on a CPU: its meta says so, or every row does."""
    rows = result.get("rows", [])
    return result.get("meta", {}).get("device") == "cpu" or bool(rows) and all(r.get("device") == "cpu" for r in rows)


def compact(result: dict) -> str:
    """The markdown table (and a line on where the numbers come from). A CPU run's table says it is a smoke
    run: host wall times, no speedups or rates."""
    cpu = cpu_run(result)
    cases: dict = {}
    for r in result.get("rows", []):
        if r.get("group"):
            continue
        cases.setdefault((r["op"], r["case"]), {})[r["provider"]] = r
    head = ["op", "shape", *(f"{NAMES[c]} fwd+bwd" for c in COLUMNS), "Tigon speedup vs best other"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (op, case), provs in cases.items():
        cells = [op, case]
        for c in COLUMNS:
            r = provs.get(c)
            t = _time(r.get("fb_us")) if r else None
            cells.append(t or ("n/a" if r is None else "error" if r.get("error") else "-"))
        t = (provs.get("tigon") or {}).get("fb_us")
        others = [p.get("fb_us") for n, p in provs.items()
                  if not n.startswith("tigon") and "floor" not in n and isinstance(p.get("fb_us"), (int, float))]
        if cpu:  # interpreted kernels against eager PyTorch: a ratio that says nothing about a GPU
            cells.append("n/a (CPU)")
        else:
            cells.append(f"{min(others) / t:.2f}x" if isinstance(t, (int, float)) and others else "-")
        lines.append("| " + " | ".join(cells) + " |")
    m = result.get("meta", {})
    c = result.get("ceilings", {})
    where = (f"\n{m.get('gpu') or 'CPU'}, {m.get('date')}; torch {m.get('torch')}, triton {m.get('triton')}, "
             f"liger-kernel {m.get('liger-kernel')}. ")
    if cpu:
        note = ("CPU smoke run: median host wall time of fwd+bwd (Triton kernels through the interpreter, or the "
                "PyTorch reference), which checks that the benchmarks run; not representative of Tigon on a GPU, "
                "so no speedups or rates are given.")
    else:
        note = (f"Median GPU time of fwd+bwd with host run-ahead and the L2 flushed; ceilings measured in the same "
                f"run: D2D copy {c.get('copy_GBps', 0):.0f} GB/s, bf16 mm {c.get('mm_TFLOPs', 0):.0f} TFLOP/s. "
                f"Speedup: the fastest other provider's time over Tigon's (every non-Tigon provider, incl. "
                f"cut-cross-entropy and Liger's variants).")
    return "\n".join(lines) + "\n" + where + note


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    path = argv[0] if argv else DEFAULT
    try:
        with open(path) as f:
            result = json.load(f)
    except OSError as e:
        print(f"render_table: cannot read {path}: {e}", file=sys.stderr)
        return 2
    print(compact(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
