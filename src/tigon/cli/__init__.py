"""The `tigon` command.

    tigon --version
    tigon env                       versions, the GPU, every op of tigon.ops: its path here, its launch settings
    tigon bench [--quick] [--out DIR] [--budget S] [--sections A,B] [--device D] [--tests]
                                    the op benchmarks (python -m benchmarks gpu-check of a source checkout)
    tigon bench decode [...]        the decode benchmark (python -m benchmarks decode: HF generate vs
                                    tigon.generate); `tigon bench decode --help` lists its options
    tigon demo [...]                fine-tune a small model with Tigon off, then on (tigon.cli.demo)
    tigon tune [--attention] [--decode-linear] [--quant-linear] [--model M] [--dry-run] [--cache PATH]
                                    time this GPU's attention backends and decode_linear launches and write
                                    the winners to the per-user cache Tigon reads first (tigon.cli.tune)

Only the standard library is imported up front; torch, triton and the rest load inside each command.
"""

import argparse
import importlib
import os
import sys

from .. import __version__, _log
from . import bench, tune
from .env import cmd_env

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tigon", description="Fused Triton kernels for Hugging Face LLM training "
                                "and inference.")
    p.add_argument("--version", action="version", version=f"tigon {__version__}")
    sub = p.add_subparsers(dest="command", metavar="{env,bench,demo,tune}", required=True)
    sub.add_parser("env", help="versions, the GPU, and for every op its path here and its launch settings",
                   description="Versions, the GPU, and for every public op of tigon.ops the path it takes here "
                               "(Triton kernel, interpreter or PyTorch reference) and where its launch settings "
                               "come from (a measured table, a rule, the config defaults).")
    b = sub.add_parser("bench", help="run the benchmarks of a source checkout (`tigon bench --help`)",
                       description="Without a subcommand: the op benchmarks of benchmarks/ops/gpu_check.py (every op "
                                   "against torch eager, torch.compile and Liger-Kernel, one markdown and JSON "
                                   "report in --out). On a CPU the timings only check that the harness runs.",
                       epilog=f"{bench.BENCHMARKS_MISSING.split(':')[0]} (beside src/, under the current "
                              "directory, or at $TIGON_BENCHMARKS).")
    bench.add_arguments(b)
    bench_sub = b.add_subparsers(dest="bench_command", title="subcommands", metavar="{decode}")
    bench_sub.add_parser("decode", add_help=False,
                         help="the decode benchmark: HF generate against tigon.generate on a Llama shape, "
                              "tokens/s, time to first token, decode.json/md/png (`tigon bench decode --help`)")
    sub.add_parser("demo", add_help=False, help="fine-tune a small model with Tigon off, then on, and compare "
                                               "(`tigon demo --help`)")
    tune.add_arguments(sub.add_parser(
        "tune", help="time this GPU's choices and write the winners to the per-user cache Tigon reads first",
        description=tune.SUMMARY + " Without --attention, --decode-linear or --quant-linear: the first two. On a "
                    "CPU it exits with status 2 (`--dry-run` works anywhere).",
        epilog="The cache is read before the shipped tables (docs/tuning.md); `tigon env` names the source of "
               "each choice."))
    return p


def cmd_demo(rest) -> int:
    """tigon.cli.demo's main with the options after `tigon demo`; a missing package is a message, exit 2."""
    try:
        with _log.requires_extra("tigon demo"):
            demo = importlib.import_module("tigon.cli.demo")
            importlib.import_module("transformers")
    except ModuleNotFoundError as e:
        print(f"tigon: {e}", file=sys.stderr)
        return 2
    return demo.main(rest)


def _run(argv) -> int:
    p = build_parser()
    args, rest = p.parse_known_args(argv)
    if args.command == "demo":  # what follows `demo` belongs to the demo's own parser
        return cmd_demo(rest)
    if args.command == "bench" and args.bench_command == "decode":  # and to bench_decode's
        given = argv[argv.index("bench") + 1:argv.index("decode")]
        if given:
            p.error(f"`tigon bench decode` takes its options after `decode`, got {' '.join(given)} before it")
        return bench.cmd_bench_decode(rest)
    if rest:
        p.parse_args(argv)  # the usage error argparse gives for unrecognized arguments
    if args.command == "tune":
        return tune.cmd_tune(args)
    return cmd_env(args) if args.command == "env" else bench.cmd_bench(args)


def main(argv=None) -> int:
    """The console script: `tigon ...`. Returns the exit status (argparse's usage errors exit with 2)."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        return _run(argv)
    except BrokenPipeError:
        # the reader (`tigon env | head`) has gone: no traceback, and no second error when Python flushes stdout
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
