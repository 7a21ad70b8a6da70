"""The `tigon` command.

    tigon env                       versions, the GPU, and which path each op takes here
    tigon bench [--quick] [--out DIR] [--budget S] [--sections A,B] [--device D] [--tests]
                                    the benchmarks of benchmarks/gpu_check.py (a source checkout's folder)
    tigon bench decode [--quick] [--model llama-1.5b|llama3-8b] [--variants V] [--batches 1,8]
                       [--prompts 512,8192 | --prompt N] [--new N] [--out DIR] [--budget S] [--prometheus FILE]
                                    the decode benchmark (benchmarks/bench_decode.py: HF generate vs tigon.generate,
                                    the 1.5B Llama or the Llama-3-8B shape); prints the table, writes
                                    decode.json/md/png and, with --prometheus, the tigon rows' stats in the
                                    Prometheus text format
    tigon demo [...]                fine-tune a small model with Tigon off, then on (tigon.demo)

`tigon bench` runs tools of a source checkout's benchmarks/ folder (found beside src/, under the current
directory or at $TIGON_BENCHMARKS); an installed package without that folder says so and exits with 2.
Only the standard library is imported up front; torch, triton and the rest load inside each command.
"""

import argparse
import importlib
import os
import platform
import sys
from pathlib import Path

from .argtypes import device, name_list, positive_float, positive_int, positive_int_list

OPS = ("rms_norm", "add_rms_norm", "layer_norm", "apply_rope", "swiglu", "geglu", "swiglu_mlp", "geglu_mlp",
       "cross_entropy", "linear_cross_entropy", "decode_attention", "decode_linear", "rope_kv_write",
       "rope_kv_append", "adamw_step_", "grad_norm", "qk_norm_rope")


def _version(dist: str):
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def cmd_env(args) -> int:
    import torch

    import tigon

    print(f"python         {platform.python_version()} ({sys.executable})")
    print(f"torch          {torch.__version__} (built for CUDA {torch.version.cuda})")
    try:
        import triton

        print(f"triton         {triton.__version__}")
    except ImportError:
        print("triton         not installed (every op runs its PyTorch reference)")
    for dist in ("transformers", "liger-kernel", "cut-cross-entropy"):
        v = _version(dist)
        if v or dist == "transformers":
            print(f"{dist:<14} {v or 'not installed'}")
    print(f"tigon          {tigon.__version__} ({os.path.dirname(tigon.__file__)})")
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            print(f"GPU {i}          {p.name}, compute capability {p.major}.{p.minor}, "
                  f"{p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} GiB")
        device = torch.device("cuda")
    else:
        print("GPU            no CUDA device")
        device = torch.device("cpu")
    interp = os.environ.get("TRITON_INTERPRET", "")
    on = interp not in ("", "0")
    print(f"TRITON_INTERPRET={interp or 'unset'}: "
          + ("on, CPU tensors run the Triton kernels through the interpreter (slow: for tests)" if on else "off"))
    try:
        from tigon import ops
        from tigon.ops import _library
    except Exception as e:  # noqa: BLE001
        print(f"ops: cannot import tigon.ops: {type(e).__name__}: {e}")
        return 1
    path = _library.backend_for(device)
    what = "Triton kernels" if path == "triton" else "PyTorch reference (no CUDA device, interpreter off)"
    print(f"ops on the default device ({device}):")
    for op in OPS:
        status = what if callable(getattr(ops, op, None)) else "missing from tigon.ops"
        print(f"  {op:<22} {path:<10} {status}")
    return 0


BENCHMARKS_MISSING = ("tigon bench needs the benchmarks/ folder of a source checkout: git clone Tigon's repository "
                      "and run `tigon bench` from it (or with PYTHONPATH=src inside it), or point TIGON_BENCHMARKS "
                      "at its benchmarks/ folder. The installed package does not ship the benchmarks.")


def _benchmarks_dir():
    """benchmarks/ of a source checkout: $TIGON_BENCHMARKS, beside src/ (editable install or PYTHONPATH=src),
    or under the current directory; None when none of them has the benchmark tools."""
    candidates = [os.environ.get("TIGON_BENCHMARKS"), Path(__file__).resolve().parents[2] / "benchmarks",
                  Path.cwd() / "benchmarks"]
    for c in candidates:
        if c and (Path(c) / "gpu_check.py").is_file() and (Path(c) / "bench_decode.py").is_file():
            return str(c)
    return None


def _benchmark_module(name: str):
    """Import benchmarks/<name>.py of the source checkout (its folder put first on sys.path, so its siblings
    import by plain name); None, after the message on stderr, when there is no benchmarks/ folder."""
    where = _benchmarks_dir()
    if where is None:
        print(BENCHMARKS_MISSING, file=sys.stderr)
        return None
    if where not in sys.path:
        sys.path.insert(0, where)
    return importlib.import_module(name)


def cmd_bench(args) -> int:
    gpu_check = _benchmark_module("gpu_check")
    if gpu_check is None:
        return 2

    argv = ["--quick"] if args.quick else []
    if args.out:
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
    try:
        bench_decode = _benchmark_module("bench_decode")
    except ModuleNotFoundError as e:
        print(f"tigon bench decode: it needs {e.name!r}, which is not installed "
              "(pip install 'tigon[hf]' brings transformers).", file=sys.stderr)
        return 2
    if bench_decode is None:
        return 2
    prog = "tigon bench decode"
    full = bench_decode.build_parser(prog)
    full.parse_args(rest)  # its own usage errors (unknown options, --help) first
    _check_bench_decode_values(full, rest)
    return bench_decode.main(rest, prog=prog)


def cmd_demo(args, rest) -> int:
    try:
        demo = importlib.import_module("tigon.demo")
    except ModuleNotFoundError as e:
        if e.name == "tigon.demo":
            print("tigon demo: this installation has no tigon.demo module.", file=sys.stderr)
        else:
            print(f"tigon demo: it needs {e.name!r}, which is not installed "
                  "(pip install 'tigon[hf]' brings transformers and the rest).", file=sys.stderr)
        return 2
    return demo.main(rest)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="tigon", description="Fused Triton kernels for Hugging Face LLM training.")
    sub = p.add_subparsers(dest="command", metavar="{env,bench,demo}")
    sub.add_parser("env", help="versions, GPU, and the path (Triton or reference) each op takes here")
    b = sub.add_parser("bench", help="run the benchmarks (benchmarks/gpu_check.py of a source checkout); "
                       "`tigon bench decode --help`: the decode benchmark")
    b.add_argument("--quick", action="store_true", help="tiny shapes: a smoke run (works on a CPU)")
    b.add_argument("--out", default=None, help="output folder (default: $OUT, else ./tigon-bench-out)")
    b.add_argument("--budget", type=positive_float, default=None, help="seconds for the whole run (default 540)")
    b.add_argument("--sections", type=name_list, default=None, help="comma-separated subset, e.g. rms_norm,swiglu")
    b.add_argument("--device", type=device, default=None, help="cuda or cpu (default: cuda when available)")
    b.add_argument("--tests", action="store_true", help="run the test suite first, as gpu_check does")
    sub.add_parser("demo", help="fine-tune a small model with Tigon off, then on (options: tigon demo --help)",
                   add_help=False)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["demo"]:  # everything after `demo` belongs to tigon.demo's own parser
        return cmd_demo(None, argv[1:])
    if argv[:2] == ["bench", "decode"]:  # and everything after `bench decode` to bench_decode's
        return cmd_bench_decode(argv[2:])
    p = build_parser()
    args = p.parse_args(argv)
    if args.command == "env":
        return cmd_env(args)
    if args.command == "bench":
        return cmd_bench(args)
    p.print_help()
    return 0 if args.command is None and not argv else 2


if __name__ == "__main__":
    sys.exit(main())
