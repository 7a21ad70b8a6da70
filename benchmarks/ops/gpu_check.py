"""One run on a GPU machine: the test suite, every op benchmark, one report.

    PYTHONPATH=src python -m benchmarks gpu-check [--out DIR] [--budget SECONDS] [--quick]    (or: tigon bench)

1. `pytest tests` (GPU tests included) in a subprocess with a timeout: pass/fail counts and the tail.
2. The device ceilings (D2D copy, bf16 8192^3 mm), then each benchmark section in priority order. On
   CUDA the sections run in a child process, so a kernel that corrupts the CUDA context (an illegal
   address is sticky) or hangs costs its own section only: the parent watches each section's deadline,
   kills a child that overruns, and starts a fresh child for the sections left.
3. Writes into --out (default ./tigon-bench-results): <tag>.md (versions, ceilings, tests, one table per op),
   <tag>.json (every raw number), gpu_check.log (the children's and the tests' full output) and PNGs of the
   sweeps (<gpu>_flce_tokens.png, <gpu>_rms_norm_hidden.png). <gpu> is the GPU's short name
   ("h200"), "cpu" on a CPU; <tag> is --tag, default <gpu>. benchmarks/run_gpu.sh passes --tag <gpu>_ops,
   the names of benchmarks/results/<gpu>_ops.json and of the ops section of benchmarks/results/<gpu>.md.

--budget bounds the whole run: sections that would not fit are skipped with a note, never cut silently.
--quick runs tiny shapes (a CPU smoke test of the harness; kernels through Triton's interpreter). A CPU run's
report gives host wall times only, says they are not representative, and leaves out every rate (GB/s, TFLOP/s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

from benchmarks.tools import checkout
from benchmarks.tools.checkout import DEFAULT_OUT

REPO = str(checkout.ROOT)


@dataclass(frozen=True)
class Section:
    name: str
    module: str
    function: str
    min_s: float  # not started with less than this left in the budget
    cap_s: float  # its own deadline: killed (isolated) or cut short (in-process) after this


# Priority order: when the budget runs short, the last ones are skipped.
SECTIONS = [
    Section("ceilings", "benchmarks.tools.harness", "run_ceilings", 5, 60),
    Section("rms_norm", "benchmarks.ops.bench_norms", "run_rms_norm", 20, 100),
    Section("add_rms_norm", "benchmarks.ops.bench_norms", "run_add_rms_norm", 20, 100),
    Section("layer_norm", "benchmarks.ops.bench_norms", "run_layer_norm", 20, 100),
    Section("rope", "benchmarks.ops.bench_rope", "run_rope", 20, 100),
    Section("qk_norm_rope", "benchmarks.ops.bench_norms", "run_qk_norm_rope", 30, 150),
    Section("swiglu", "benchmarks.ops.bench_glu", "run_swiglu", 20, 100),
    Section("geglu", "benchmarks.ops.bench_glu", "run_geglu", 20, 100),
    Section("cross_entropy", "benchmarks.ops.bench_cross_entropy", "run_cross_entropy", 25, 120),
    Section("linear_cross_entropy", "benchmarks.ops.bench_cross_entropy", "run_linear_cross_entropy", 60, 200),
    Section("rolling_buffer", "benchmarks.tools.harness", "run_rolling_buffer", 15, 60),
    Section("flce_token_sweep", "benchmarks.ops.bench_cross_entropy", "run_flce_token_sweep", 45, 150),
    Section("flce_heads", "benchmarks.ops.bench_cross_entropy", "run_flce_heads", 60, 150),
    Section("rms_norm_hidden_sweep", "benchmarks.ops.bench_norms", "run_rms_norm_hidden_sweep", 30, 100),
]
BY_NAME = {s.name: s for s in SECTIONS}
GRACE_S = 20.0  # past a section's deadline before its child is killed (it checks the deadline itself)
WRITE_RESERVE_S = 8.0  # kept at the end for the report and the plots
MIN_BENCH_S = 240.0  # the tests never eat into this much of the benchmarks' budget


def _say(msg: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _child_env() -> dict:
    """The environment of the test run and the section children (both start in the checkout's root): PYTHONPATH
    leads with the checkout's src/ (the tigon under test) and holds the root (the benchmarks package)."""
    env = dict(os.environ)
    parts = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    for first in (REPO, os.path.join(REPO, "src")):
        if os.path.isdir(first) and os.path.abspath(first) not in [os.path.abspath(p) for p in parts]:
            parts.insert(0, first)
    env["PYTHONPATH"] = os.pathsep.join(parts)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tag(meta: dict) -> str:
    gpu = meta.get("gpu")
    if not gpu:
        return "cpu"
    s = re.sub(r"[^a-z0-9]+", "_", gpu.lower().replace("nvidia", "")).strip("_")
    return s or "gpu"


# ----------------------------------------------------------------------------- meta


def collect_meta(args, cuda: bool) -> dict:
    from importlib import metadata

    import torch

    meta = {"date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
            "python": platform.python_version(), "argv": sys.argv[1:], "quick": args.quick,
            "budget_s": args.budget, "TRITON_INTERPRET": os.environ.get("TRITON_INTERPRET", "unset")}
    for pkg in ("torch", "triton", "transformers", "liger-kernel", "cut-cross-entropy", "tigon", "matplotlib"):
        try:
            meta[pkg] = metadata.version(pkg)
        except Exception:  # noqa: BLE001
            meta[pkg] = None
    if meta["tigon"] is None:
        try:
            import tigon

            meta["tigon"] = tigon.__version__
        except Exception as e:  # noqa: BLE001
            meta["tigon"] = f"not importable: {e}"
    meta["cuda"] = torch.version.cuda
    meta["device"] = "cuda" if cuda else "cpu"
    if cuda:
        props = torch.cuda.get_device_properties(0)
        meta.update(gpu=torch.cuda.get_device_name(0), sms=props.multi_processor_count,
                    gpu_mem_GiB=round(props.total_memory / 2**30, 1))
        meta["driver"] = _driver_version()
    meta["git"] = checkout.git_commit()
    return meta


def _driver_version() -> str | None:
    """The NVIDIA driver's version, as torch.utils.collect_env reads it (nvidia-smi), under a 15 s timeout."""
    from torch.utils import collect_env

    def run(cmd):
        q = subprocess.run(cmd, shell=isinstance(cmd, str), capture_output=True, text=True, timeout=15)
        return q.returncode, q.stdout.strip(), q.stderr.strip()

    try:
        return collect_env.get_nvidia_driver_version(run)
    except Exception:  # noqa: BLE001 - no nvidia-smi, or it hangs: the report says None
        return None


# ----------------------------------------------------------------------------- tests


def _count_tests(out: str) -> dict:
    """Counts from pytest's closing line, or from the progress characters when it was killed."""
    for line in reversed(out.splitlines()):
        if re.search(r"\d+ (passed|failed|error|skipped)", line) and re.search(r" in [\d.]+s", line):
            return {k: int(n) for n, k in re.findall(r"(\d+) (passed|failed|errors?|skipped|xfailed|xpassed|"
                                                     r"deselected|warnings?)", line)}
    counts: dict = {}
    names = {".": "passed", "F": "failed", "E": "error", "s": "skipped", "x": "xfailed", "X": "xpassed"}
    for line in out.splitlines():
        m = re.match(r"^([.FEsxX]+)\s*(\[\s*\d+%\])?\s*$", line.strip())
        if m:
            for ch in m.group(1):
                counts[names[ch]] = counts.get(names[ch], 0) + 1
    return counts


def run_tests(args, timeout: float, log) -> dict:
    import importlib.util

    res = {"timeout_s": round(timeout)}
    if importlib.util.find_spec("pytest") is None:
        res["status"] = "pytest not installed: install it (pip install pytest) to run the tests"
        return res
    cmd = [sys.executable, "-m", "pytest", "tests", "-q", "-rfE", "-p", "no:cacheprovider",
           f"--maxfail={args.maxfail}"]
    if args.test_workers > 0 and importlib.util.find_spec("xdist") is not None:
        cmd += ["-n", str(args.test_workers)]
    if importlib.util.find_spec("pytest_timeout") is not None:
        cmd += [f"--timeout={args.test_case_timeout}"]
    cmd += shlex.split(args.pytest_args or "")
    res["cmd"] = " ".join(cmd)
    _say(f"tests: {res['cmd']} (timeout {timeout:.0f} s)")
    t0 = time.time()
    p = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                         text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=timeout)
        res["timed_out"] = False
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        res["timed_out"] = True
    res.update(rc=p.returncode, seconds=round(time.time() - t0, 1), counts=_count_tests(out or ""))
    lines = (out or "").splitlines()
    res["tail"] = lines[-60:]
    log.write("\n===== pytest =====\n" + (out or "") + "\n")
    log.flush()
    res["status"] = ("timed out" if res["timed_out"] else "passed" if p.returncode == 0 else
                     f"failed (rc {p.returncode})")
    _say(f"tests: {res['status']}, {res['counts']} in {res['seconds']} s")
    return res


# ----------------------------------------------------------------------------- sections


def run_sections(ctx, names, deadline: float) -> bool:
    """Run the named sections in this process; False when the CUDA context broke (the caller must stop)."""
    import importlib

    from benchmarks.tools import harness as H

    ctx.extras.setdefault("section_s", {})
    for name in names:
        sec = BY_NAME[name]
        left = deadline - time.time()
        if left < sec.min_s:
            ctx.note(f"section {name}: skipped ({left:.0f} s left in the budget, it needs {sec.min_s:.0f} s)")
            ctx.done.append(name)
            continue
        ctx.deadline = min(deadline, time.time() + sec.cap_s)
        ctx.current = {"name": name, "deadline": ctx.deadline}
        ctx.dump()
        t0 = time.time()
        print(f"SECTION {name} start", flush=True)
        try:
            getattr(importlib.import_module(sec.module), sec.function)(ctx)
        except H.CudaBroken as e:
            ctx.note(f"section {name}: {e}; the sections after it run in a fresh process")
            ctx.done.append(name)
            ctx.dump()
            return False
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            ctx.note(f"section {name}: {H.short_error(e)}")
        ctx.extras["section_s"][name] = round(time.time() - t0, 1)
        ctx.done.append(name)
        ctx.current = None
        ctx.dump()
        H.free(ctx)
        try:
            H.check_cuda(ctx)
        except H.CudaBroken as e:
            ctx.note(f"after section {name}: {e}")
            return False
    return True


def _merge(result: dict, state: dict) -> None:
    result["ceilings"].update(state.get("ceilings") or {})
    result["rows"] += state.get("rows") or []
    secs = (state.get("extras") or {}).pop("section_s", {})
    result["section_s"].update(secs)
    result["extras"].update(state.get("extras") or {})
    result["notes"] += state.get("notes") or []


def _read(path: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def run_isolated(args, result, names, deadline, log, write) -> None:
    """Each batch of sections in a child process; a crash, a broken CUDA context or an overrun ends the
    child, and the sections it had not done go to a fresh one."""
    pending = list(names)
    tmp = tempfile.mkdtemp(prefix="tigon_gpu_check_")
    k = 0
    while pending:
        if deadline - time.time() < min(BY_NAME[n].min_s for n in pending):
            for n in pending:
                result["notes"].append(f"section {n}: skipped (time budget)")
            break
        k += 1
        part = os.path.join(tmp, f"part{k}.json")
        cmd = checkout.module_command(__file__, "--child", "--sections", ",".join(pending), "--part", part,
                                      "--deadline", repr(deadline), "--ceilings", json.dumps(result["ceilings"]))
        if args.quick:
            cmd.append("--quick")
        if args.device:
            cmd += ["--device", args.device]
        log.write(f"\n===== child {k}: {', '.join(pending)} =====\n")
        log.flush()
        p = subprocess.Popen(cmd, cwd=REPO, env=_child_env(), stdout=log, stderr=subprocess.STDOUT,
                             start_new_session=True)
        killed, last = None, None
        while p.poll() is None:
            time.sleep(0.5)
            st = _read(part)
            cur = st.get("current")
            if cur and cur.get("name") != last:
                last = cur["name"]
                _say(f"section {last} (deadline in {cur['deadline'] - time.time():.0f} s)")
            over = cur and time.time() > cur["deadline"] + GRACE_S
            if over or time.time() > deadline + GRACE_S:
                killed = (cur or {}).get("name", "?")
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        st = _read(part)
        done = list(st.get("done") or [])
        cur = (st.get("current") or {}).get("name")
        _merge(result, st)
        if killed:
            result["notes"].append(f"section {killed}: killed {GRACE_S:.0f} s after its deadline "
                                   "(what it had measured is kept)")
        elif p.returncode not in (0, None) and cur and cur not in done:
            result["notes"].append(f"section {cur}: its process died (exit code {p.returncode}); see gpu_check.log")
        failed = killed or (cur if cur not in done else None)
        new_pending = [n for n in pending if n not in done and n != failed]
        if len(new_pending) == len(pending):  # nothing advanced: the child could not even start
            result["notes"].append(f"child process failed before any section (exit code {p.returncode}); "
                                   "see gpu_check.log")
            break
        pending = new_pending
        write()


def run_inprocess(args, result, names, deadline) -> None:
    from benchmarks.tools import harness as H

    ctx = H.Context(device=args.device, quick=args.quick, deadline=deadline, ceilings=result["ceilings"])
    ok = run_sections(ctx, names, deadline)
    _merge(result, ctx.state())
    if not ok:
        rest = [n for n in names if n not in ctx.done]
        result["notes"] += [f"section {n}: not run (CUDA context lost; use isolation)" for n in rest]


# ----------------------------------------------------------------------------- report


def _md(result: dict) -> str:
    from benchmarks.tools import harness as H

    m = result["meta"]
    lines = [f"# Tigon benchmarks: {m.get('gpu') or 'CPU'}", ""]
    gpu = f"{m.get('gpu')}, {m.get('sms')} SMs, {m.get('gpu_mem_GiB')} GiB" if m.get("gpu") else "none"
    lines += [f"- date: {m['date']}; GPU: {gpu}; driver {m.get('driver')}; CUDA {m.get('cuda')}",
              f"- python {m['python']}, torch {m['torch']}, triton {m['triton']}, transformers "
              f"{m['transformers']}, liger-kernel {m['liger-kernel']}, cut-cross-entropy {m['cut-cross-entropy']}, "
              f"tigon {m['tigon']} (git {m.get('git')}); TRITON_INTERPRET={m['TRITON_INTERPRET']}",
              f"- run: `gpu_check.py {' '.join(m['argv'])}`, budget {m['budget_s']:.0f} s, elapsed "
              f"{result.get('elapsed_s', 0):.0f} s; seconds per section: "
              + ", ".join(f"{k} {v}" for k, v in result["section_s"].items()), ""]
    c = result["ceilings"]
    cpu = m.get("device") == "cpu" or H.on_cpu(result["rows"])
    lines += ["## Ceilings", ""]
    if cpu:  # a host's copy and matmul rates say nothing about a GPU's: measured to exercise the harness only
        lines += ["Not given on a CPU run.", ""]
    else:
        lines += ["Measured in this run.", "", "| ceiling | value |", "|---|---|",
                  f"| D2D copy, {c.get('copy_bytes', 0) / 2 / 2**30:.3g} GiB -> same, (read + write) / time | "
                  f"{H.num(c.get('copy_GBps'))} GB/s |",
                  f"| bf16 torch.mm {c.get('mm_shape')}^3, L2 flushed, median | {H.num(c.get('mm_TFLOPs'))} TFLOP/s |",
                  ""]
    t = result.get("tests")
    lines += ["## Tests", ""]
    if not t:
        lines += ["not run", ""]
    else:
        lines += [f"`{t.get('cmd', 'pytest')}`: **{t.get('status')}**, {t.get('counts')} in {t.get('seconds')} s "
                  f"(timeout {t.get('timeout_s')} s)", "", "```"] + [ln[:200] for ln in t.get("tail", [])[-25:]]
        lines += ["```", ""]
    tables = H.markdown_tables(result["rows"], c)
    # markdown_tables opens CPU rows with the CPU note itself
    lines += ["## Results", ""] + ([] if H.on_cpu(result["rows"]) else [H.timing_note(cpu), ""]) + tables
    rb = result["extras"].get("rolling_buffer")
    if rb:
        lines += ["## Rolling buffer", "", rb.get("table") or json.dumps(rb)[:2000], ""]
    if result["notes"]:
        lines += ["## Notes", ""] + [f"- {n}" for n in result["notes"]] + [""]
    return "\n".join(lines)


def _plots(result: dict, out: str, gpu: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001
        result["notes"].append(f"no plots: matplotlib not importable ({e})")
        return []
    made = []
    groups: dict = {}
    for r in result["rows"]:
        if r.get("group") and isinstance(r.get("fb_us"), (int, float)):
            groups.setdefault(r["group"], []).append(r)
    for group, rows in groups.items():
        flce = "linear_cross_entropy" in group
        fname = f"{gpu}_flce_tokens.png" if flce else f"{gpu}_rms_norm_hidden.png"
        provs = list(dict.fromkeys(r["provider"] for r in rows))
        fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
        for p in provs:
            rs = sorted((r for r in rows if r["provider"] == p), key=lambda r: r["x"])
            xs = [r["x"] for r in rs]
            style = dict(marker="o", linestyle="--" if "floor" in p else "-")
            if flce:
                axes[0].plot(xs, [r["fb_us"] / 1e3 for r in rs], label=p, **style)
                pk = [(r["x"], r["fb_peak_MiB"] / 1024) for r in rs if isinstance(r.get("fb_peak_MiB"), (int, float))]
                if pk:
                    axes[1].plot(*zip(*pk), label=p, **style)
            else:
                axes[0].plot(xs, [r["fb_us"] for r in rs], label=p, **style)
                axes[1].plot(xs, [r.get("fb_GBps") or 0 for r in rs], label=p, **style)
        axes[0].set_ylabel("fwd+bwd ms" if flce else "fwd+bwd us")
        axes[1].set_ylabel("fwd+bwd peak GiB" if flce else "fwd+bwd GB/s (byte model)")
        if not flce and result["ceilings"].get("copy_GBps"):
            axes[1].axhline(result["ceilings"]["copy_GBps"], color="gray", linestyle=":", label="D2D copy")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xlabel("tokens" if flce else "hidden size")
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        if flce:
            for ax in axes:
                if ax.lines:
                    ax.set_yscale("log")
        fig.suptitle(f"{group} on {result['meta'].get('gpu') or 'CPU'}")
        fig.tight_layout()
        fig.savefig(os.path.join(out, fname), dpi=110)
        plt.close(fig)
        made.append(fname)
    return made


def write_outputs(result: dict, out: str, tag: str, plots=False) -> None:
    from benchmarks.tools import harness as H

    result["elapsed_s"] = round(time.time() - result["t0"], 1)
    if plots:
        result["plots"] = _plots(result, out, _tag(result["meta"]))  # named by the GPU, whatever the tag
    H.write_json(os.path.join(out, f"{tag}.json"), {k: v for k, v in result.items() if k != "t0"})
    with open(os.path.join(out, f"{tag}.md"), "w") as f:
        f.write(_md(result) + "\n")


# ----------------------------------------------------------------------------- main


def parse_args(argv=None):
    p = argparse.ArgumentParser(prog="gpu_check", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: ./{DEFAULT_OUT})")
    p.add_argument("--budget", type=float, default=None, help="seconds for the whole run (default 550; quick 240)")
    p.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (CPU: Triton's interpreter)")
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when available)")
    p.add_argument("--sections", default=None, help="comma-separated subset of: " + ",".join(BY_NAME))
    p.add_argument("--tests", action=argparse.BooleanOptionalAction, default=None,
                   help="run the test suite first (default: on, off with --quick)")
    p.add_argument("--test-timeout", type=float, default=150.0, help="seconds for the whole test suite")
    p.add_argument("--test-case-timeout", type=float, default=120.0, help="per test, when pytest-timeout is there")
    p.add_argument("--test-workers", type=int, default=None, help="pytest-xdist workers (default: 4 on CUDA, 0)")
    p.add_argument("--maxfail", type=int, default=50)
    p.add_argument("--pytest-args", default="", help="extra pytest arguments, one string")
    iso = p.add_mutually_exclusive_group()
    iso.add_argument("--isolate", dest="isolate", action="store_true", default=None,
                     help="sections in child processes (default on CUDA)")
    iso.add_argument("--inproc", dest="isolate", action="store_false", help="sections in this process")
    p.add_argument("--tag", default=None,
                   help="stem of the .md and .json (default: the GPU's short name; run_gpu.sh: <gpu>_ops)")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", help=argparse.SUPPRESS)
    p.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    p.add_argument("--ceilings", default="{}", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def _child_main(args) -> int:
    from benchmarks.tools import harness as H

    ctx = H.Context(device=args.device, quick=args.quick, deadline=args.deadline,
                    ceilings=json.loads(args.ceilings), part_path=args.part, verbose=True)
    ok = run_sections(ctx, args.sections.split(","), args.deadline)
    return 0 if ok else 3


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    cuda = torch.cuda.is_available() and not (args.device or "cuda").startswith("cpu")
    if args.quick and not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        os.environ["TRITON_INTERPRET"] = "1"  # before tigon (and its @triton.jit) is imported
    if args.child:
        return _child_main(args)
    t0 = time.time()
    budget = args.budget if args.budget is not None else (240.0 if args.quick else 550.0)
    args.budget = budget
    deadline = t0 + budget - WRITE_RESERVE_S
    tests = args.tests if args.tests is not None else not args.quick
    if args.test_workers is None:
        args.test_workers = 4 if cuda else 0
    isolate = args.isolate if args.isolate is not None else cuda
    names = [s.name for s in SECTIONS]
    if args.sections:
        wanted = [n.strip() for n in args.sections.split(",") if n.strip()]
        bad = [n for n in wanted if n not in BY_NAME]
        if bad:
            print(f"gpu_check: unknown section(s) {bad}; choose from {names}", file=sys.stderr)
            return 2
        names = ["ceilings"] + [n for n in wanted if n != "ceilings"]
    out = args.out
    os.makedirs(out, exist_ok=True)
    meta = collect_meta(args, cuda)
    tag = args.tag or _tag(meta)
    result = {"t0": t0, "meta": meta, "ceilings": {}, "tests": None, "rows": [], "extras": {}, "notes": [],
              "section_s": {}}
    _say(f"{meta.get('gpu') or 'CPU'}; torch {meta['torch']}, triton {meta['triton']}; liger-kernel "
         f"{meta['liger-kernel']}, cut-cross-entropy {meta['cut-cross-entropy']}; budget {budget:.0f} s; out {out}")

    def write(plots=False):
        write_outputs(result, out, tag, plots=plots)

    with open(os.path.join(out, "gpu_check.log"), "a") as log:
        write()
        if tests:
            left = deadline - time.time()
            result["tests"] = run_tests(args, max(30.0, min(args.test_timeout, left - MIN_BENCH_S)), log)
            write()
        _say(f"benchmarks: {', '.join(names)} ({'child processes' if isolate else 'in process'})")
        if isolate:
            run_isolated(args, result, names, deadline, log, write)
        else:
            run_inprocess(args, result, names, deadline)
        write(plots=True)
    _say(f"done in {time.time() - t0:.0f} s: {out}/{tag}.md, {tag}.json, gpu_check.log"
         + "".join(f", {p}" for p in result.get("plots", [])))
    from benchmarks.tools import render_table

    print(render_table.compact(result))
    t = result.get("tests")
    if t:
        print(f"\ntests: {t.get('status')} {t.get('counts')}")
        print("\n".join(t.get("tail", [])[-15:]))
    for n in result["notes"]:
        print("note:", n)
    return 0


if __name__ == "__main__":
    sys.exit(main())
