"""Where the checkout's folders are, and how a benchmark starts a child process of itself.

A benchmark that runs each variant in its own process (a crash, an OOM or a broken CUDA context costs that variant
only) starts `python -m benchmarks.<wing>.<module> ...` from the checkout's root, with PYTHONPATH leading with the
folder of the tigon package this process imported (src/ of a checkout, or site-packages) and the checkout's root
(the benchmarks package): the child measures the same tigon with the same benchmark code as its parent.
"""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the checkout: src/, tests/, benchmarks/
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"
SRC = ROOT / "src"
# where a benchmark writes when --out is not given (under the current directory); `tigon bench` says the same
DEFAULT_OUT = "tigon-bench-results"


def module_name(file: str) -> str:
    """The dotted module name of a file of the benchmarks package: .../benchmarks/ops/gpu_check.py ->
    benchmarks.ops.gpu_check."""
    return ".".join(Path(file).resolve().relative_to(ROOT).with_suffix("").parts)


def module_command(file: str, *args: str) -> list[str]:
    """The command line that runs the benchmark module at `file` (pass `__file__`) with args, as a child process."""
    return [sys.executable, "-m", module_name(file), *args]


def child_env(env: dict | None = None) -> dict:
    """`env` (default: this process's environment) with PYTHONPATH leading with the folder of the tigon package this
    process imported and the checkout's root; PYTHONUNBUFFERED set, so a killed child's last lines are kept."""
    import tigon

    env = dict(os.environ if env is None else env)
    first = [str(Path(tigon.__file__).resolve().parents[1]), str(ROOT)]
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
    env["PYTHONPATH"] = os.pathsep.join(first + rest)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def git_commit() -> str | None:
    """The checkout's short commit hash; None outside a git checkout."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def run_module(file: str, args, *, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """Run the benchmark module at `file` with args in a child process from the checkout's root (module_command,
    child_env); its output captured as text. subprocess.TimeoutExpired past `timeout` seconds."""
    return subprocess.run(module_command(file, *args), cwd=ROOT, env=child_env(env), capture_output=True, text=True,
                          timeout=timeout)


def print_child_result(make, error_row) -> None:
    """The child side of a per-variant process: print `RESULT <json>` of make(), or of error_row(message) when it
    raises, so the parent reports the failure in its table instead of losing the variant."""
    import json

    try:
        result = make()
    except Exception as e:  # noqa: BLE001 - any failure becomes the variant's row
        result = error_row(f"{type(e).__name__}: {str(e)[:300]}")
    print("RESULT " + json.dumps(result), flush=True)
