"""The test environment itself: no module changes os.environ at import, and the check that CUDA tests ran
compiled (not interpreted) Triton kernels can see an interpreted kernel."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import interpreted_kernels

ROOT = Path(__file__).resolve().parents[1]


def _environ_writes(path: Path) -> list[int]:
    """Lines where module-level code (outside functions and `if __name__ == "__main__":`) writes os.environ."""
    tree = ast.parse(path.read_text())
    lines = []

    def visit(nodes):
        for node in nodes:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                continue
            if isinstance(node, ast.If) and "__main__" in ast.dump(node.test):
                continue
            if isinstance(node, (ast.If, ast.Try, ast.With)):
                visit(node.body + getattr(node, "orelse", []) + getattr(node, "finalbody", []))
                for handler in getattr(node, "handlers", []):
                    visit(handler.body)
                continue
            text = ast.dump(node)
            if "environ" in text and (isinstance(node, (ast.Assign, ast.AugAssign, ast.Delete))
                                      or any(w in text for w in ("setdefault", "update", "putenv", "pop"))):
                lines.append(node.lineno)

    visit(tree.body)
    return lines


def test_no_module_sets_the_environment_at_import():
    files = [p for d in ("src", "tests", "benchmarks") for p in (ROOT / d).rglob("*.py")
             if p != ROOT / "tests" / "conftest.py"]
    offenders = [f"{p.relative_to(ROOT)}:{line}" for p in files for line in _environ_writes(p)]
    assert not offenders, f"module-level os.environ writes: {offenders}"


def test_the_environment_check_catches_a_module_that_sets_it(tmp_path):
    (tmp_path / "test_sets_env.py").write_text(
        'import os\nos.environ["TIGON_TEST_LEAK"] = "1"\n\ndef test_nothing():\n    pass\n')
    env = {k: v for k, v in os.environ.items() if k != "TIGON_TEST_LEAK"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    run = subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-q", "--collect-only",
                          "-p", "no:cacheprovider", str(tmp_path)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0, run.stdout
    assert "changed os.environ ['TIGON_TEST_LEAK']" in run.stdout + run.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter is on only where there is no CUDA device")
def test_interpreted_kernels_are_detected():
    import tigon.ops  # noqa: F401  (imports the kernel modules)

    assert os.environ.get("TRITON_INTERPRET") == "1"
    found = interpreted_kernels()
    assert any(name.startswith("tigon.ops.rms_norm.") for name in found), found


@pytest.mark.gpu
def test_gpu_kernels_are_compiled():
    import tigon.ops  # noqa: F401

    assert os.environ.get("TRITON_INTERPRET", "0") in ("", "0")
    assert interpreted_kernels() == []
