"""`tigon bench` and `tigon bench decode`: run the benchmarks of a source checkout (its benchmarks/ folder, found
beside src/, under the current directory or at $TIGON_BENCHMARKS) through the checkout's one entry point, as a child
process: `python -m benchmarks gpu-check ...` and `python -m benchmarks decode ...`.

The package never imports the benchmarks: they are not installed with it, and they import tigon, so the command line
is the whole contract between the two. The child runs in the current directory (an --out folder is where the
command was typed), with PYTHONPATH leading with the folder of this tigon package and the checkout's root, so it
measures the tigon that runs this command. Its output comes back line by line through this process's sys.stdout
and sys.stderr, so a caller that redirects them (a notebook, a test's capture) sees it.
"""

import argparse
import importlib.util
import os
import subprocess
import sys
import threading
from pathlib import Path

from .. import _log
from .argtypes import device, name_list, positive_float, positive_int, positive_int_list

DEFAULT_OUT = "tigon-bench-results"  # the benchmarks' own default (benchmarks/tools/checkout.py); a test ties them
BENCHMARKS_MISSING = ("tigon bench needs the benchmarks/ folder of a source checkout: git clone Tigon's repository "
                      "and run `tigon bench` from it (or with PYTHONPATH=src inside it), or point TIGON_BENCHMARKS "
                      "at its benchmarks/ folder. The installed package does not ship the benchmarks.")
PACKAGE_HOME = Path(__file__).resolve().parents[2]  # the folder holding this tigon package: src/ or site-packages
# `tigon bench decode --weights`: bench_decode's WEIGHTS (bf16, or tigon.quantize's formats); a test ties them
DECODE_WEIGHTS = ("bf16", "int4", "nf4", "fp8")


def add_arguments(b: argparse.ArgumentParser) -> None:
    """The options of `tigon bench` (the op benchmarks of benchmarks/ops/gpu_check.py)."""
    b.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (works on a CPU)")
    b.add_argument("--out", default=DEFAULT_OUT, help=f"output folder (default: ./{DEFAULT_OUT})")
    b.add_argument("--budget", type=positive_float, default=None, help="seconds for the whole run (default 550)")
    b.add_argument("--sections", type=name_list, default=None, help="comma-separated subset, e.g. rms_norm,swiglu")
    b.add_argument("--device", type=device, default=None, help="cuda or cpu (default: cuda when available)")
    b.add_argument("--tests", action="store_true", help="run the test suite first, as gpu_check does")


def benchmarks_dir():
    """benchmarks/ of a source checkout: $TIGON_BENCHMARKS, beside src/ (editable install or PYTHONPATH=src),
    or under the current directory; None when none of them holds the benchmarks package."""
    candidates = [os.environ.get("TIGON_BENCHMARKS"), PACKAGE_HOME.parent / "benchmarks", Path.cwd() / "benchmarks"]
    for c in candidates:
        if c and all((Path(c) / f).is_file() for f in ("__init__.py", "__main__.py", "ops/gpu_check.py",
                                                         "generation/bench_decode.py")):
            return str(c)
    return None


def child_command(name: str, argv) -> list[str]:
    """The command line of `python -m benchmarks NAME argv...` with this Python."""
    return [sys.executable, "-m", "benchmarks", name, *argv]


def child_env(root: str, environ=None) -> dict:
    """`environ` (default: this process's environment) with PYTHONPATH leading with the folder of this tigon package
    and the checkout's `root` (which holds the benchmarks package); PYTHONUNBUFFERED set, so lines come back live."""
    env = dict(os.environ if environ is None else environ)
    first = [str(PACKAGE_HOME), root]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _relay(source, sink_of) -> None:
    """Copy the child's lines to sink_of() (the sys.stdout or sys.stderr of the moment). A reader that has gone
    (`tigon bench | head`) stops the copying, not the draining: the child never blocks on a full pipe."""
    copying = True
    for line in source:
        if copying:
            try:
                sink = sink_of()
                sink.write(line)
                sink.flush()
            except (OSError, ValueError):
                copying = False
    source.close()


def run_benchmark(name: str, argv) -> int:
    """Run `python -m benchmarks NAME argv...` of the checkout (benchmarks_dir) as a child process and return its
    exit status; 2, after BENCHMARKS_MISSING on stderr, when there is no checkout's benchmarks/ folder."""
    where = benchmarks_dir()
    if where is None:
        print(BENCHMARKS_MISSING, file=sys.stderr)
        return 2
    root = str(Path(where).resolve().parent)
    child = subprocess.Popen(child_command(name, argv), env=child_env(root), stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, encoding="utf-8", errors="replace")
    relays = [threading.Thread(target=_relay, args=(child.stdout, lambda: sys.stdout), daemon=True),
              threading.Thread(target=_relay, args=(child.stderr, lambda: sys.stderr), daemon=True)]
    for relay in relays:
        relay.start()
    try:
        return child.wait()
    finally:
        if child.poll() is None:  # this process was interrupted (Ctrl-C): the child stops with it
            child.terminate()
            child.wait()
        for relay in relays:
            relay.join()


def cmd_bench(args) -> int:
    argv = ["--quick"] if args.quick else []
    argv += ["--out", args.out]
    if args.budget is not None:
        argv += ["--budget", str(args.budget)]
    if args.sections:
        argv += ["--sections", args.sections]
    if args.device:
        argv += ["--device", args.device]
    argv.append("--tests" if args.tests else "--no-tests")
    return run_benchmark("gpu-check", argv)


def _check_bench_decode_values(rest) -> None:
    """Usage errors (exit status 2) for bad values of `tigon bench decode`'s options, before the child starts:
    bench_decode's own parser takes them as plain strings and ints. Options not named here pass through to it."""
    check = argparse.ArgumentParser(prog="tigon bench decode", add_help=False,
                                    usage="tigon bench decode [options] (`tigon bench decode --help` lists them)")
    for flag, kind in (("--batches", positive_int_list), ("--swa-batches", positive_int_list),
                       ("--prompt", positive_int), ("--prompts", positive_int_list), ("--new", positive_int),
                       ("--budget", positive_float), ("--timeout", positive_float), ("--device", device),
                       ("--variants", name_list)):
        check.add_argument(flag, type=kind)
    check.add_argument("--weights", choices=DECODE_WEIGHTS)
    check.parse_known_args(rest)


def cmd_bench_decode(rest) -> int:
    """benchmarks/generation/bench_decode.py with the options after `tigon bench decode`: its own parser reads them
    (and answers --help); its --out defaults to the same folder as `tigon bench`'s."""
    _check_bench_decode_values(rest)
    if importlib.util.find_spec("transformers") is None:
        missing = _log.missing_package(ModuleNotFoundError(name="transformers"), "tigon bench decode")
        print(f"tigon: {missing}", file=sys.stderr)
        return 2
    return run_benchmark("decode", rest)
