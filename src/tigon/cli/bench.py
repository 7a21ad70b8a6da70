"""`tigon bench` and `tigon bench decode`: run the benchmarks package of a source checkout (its benchmarks/ folder,
found beside src/, under the current directory or at $TIGON_BENCHMARKS), as `python -m benchmarks gpu-check` and
`python -m benchmarks decode` do from the checkout's root."""

import argparse
import importlib
import os
import sys
from pathlib import Path

from .. import _log
from .argtypes import device, name_list, positive_float, positive_int, positive_int_list

DEFAULT_OUT = "tigon-bench-results"
BENCHMARKS_MISSING = ("tigon bench needs the benchmarks/ folder of a source checkout: git clone Tigon's repository "
                      "and run `tigon bench` from it (or with PYTHONPATH=src inside it), or point TIGON_BENCHMARKS "
                      "at its benchmarks/ folder. The installed package does not ship the benchmarks.")


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
    candidates = [os.environ.get("TIGON_BENCHMARKS"), Path(__file__).resolve().parents[3] / "benchmarks",
                  Path.cwd() / "benchmarks"]
    for c in candidates:
        if c and all((Path(c) / f).is_file() for f in ("__init__.py", "ops/gpu_check.py",
                                                         "generation/bench_decode.py")):
            return str(c)
    return None


def _benchmark_module(name: str):
    """The module of `python -m benchmarks NAME` ("gpu-check", "decode") of the source checkout, whose root goes
    first on sys.path (the one place a checkout's benchmarks package becomes importable); None, after the message
    on stderr, when there is no benchmarks/ folder."""
    where = benchmarks_dir()
    if where is None:
        print(BENCHMARKS_MISSING, file=sys.stderr)
        return None
    root = str(Path(where).resolve().parent)
    if root not in sys.path:
        sys.path.insert(0, root)
    return importlib.import_module("benchmarks").load(name)


def cmd_bench(args) -> int:
    gpu_check = _benchmark_module("gpu-check")
    if gpu_check is None:
        return 2
    argv = ["--quick"] if args.quick else []
    argv += ["--out", args.out]
    if args.budget is not None:
        argv += ["--budget", str(args.budget)]
    if args.sections:
        argv += ["--sections", args.sections]
    if args.device:
        argv += ["--device", args.device]
    argv.append("--tests" if args.tests else "--no-tests")
    return gpu_check.main(argv)


def _check_bench_decode_values(full, rest) -> None:
    """Usage errors for bad values of `tigon bench decode`'s options, before bench_decode (whose parser takes
    them as plain strings and ints) turns them into tracebacks."""
    check = argparse.ArgumentParser(prog=full.prog, usage=full.format_usage().removeprefix("usage: ").strip(),
                                    add_help=False)
    for flag, kind in (("--batches", positive_int_list), ("--swa-batches", positive_int_list),
                       ("--prompt", positive_int), ("--prompts", positive_int_list), ("--new", positive_int),
                       ("--budget", positive_float),
                       ("--timeout", positive_float), ("--device", device), ("--variants", name_list)):
        check.add_argument(flag, type=kind)
    check.parse_known_args(rest)


def cmd_bench_decode(rest) -> int:
    """benchmarks/generation/bench_decode.py with the options after `tigon bench decode` (its own parser reads
    them)."""
    try:
        with _log.requires_extra("tigon bench decode"):
            bench_decode = _benchmark_module("decode")
    except ModuleNotFoundError as e:
        print(f"tigon: {e}", file=sys.stderr)
        return 2
    if bench_decode is None:
        return 2
    prog = "tigon bench decode"
    full = bench_decode.build_parser(prog)
    for action in full._actions:  # the folder this command writes when --out is not given
        if "--out" in action.option_strings:
            action.help = f"output folder (default: ./{DEFAULT_OUT})"
    parsed = full.parse_args(rest)  # its own usage errors (unknown options, --help) first
    _check_bench_decode_values(full, rest)
    if parsed.out is None:
        rest = [*rest, "--out", DEFAULT_OUT]
    return bench_decode.main(rest, prog=prog)
