"""benchmarks/ is one package with one entry point: `python -m benchmarks --list` names every benchmark with what it
measures, every NAME imports and runs through `main(argv)`, an unknown NAME is a usage error, and no file under
benchmarks/ edits sys.path (the package imports its siblings as `benchmarks.<wing>.<module>`)."""

import ast
import importlib.util
import inspect
import os
import subprocess
import sys
from pathlib import Path

import pytest

import benchmarks
from benchmarks import __main__ as entry

ROOT = Path(__file__).resolve().parents[2]


def test_list_names_every_benchmark_with_a_line():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")])}
    r = subprocess.run([sys.executable, "-m", "benchmarks", "--list"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert [line.split()[:2] for line in lines] == [[n, m] for n, m in benchmarks.BY_NAME.items()]
    assert all(len(line.split()) > 3 for line in lines)  # a summary after NAME and module
    by_name = dict(zip(benchmarks.BY_NAME, lines))
    assert "decode" in by_name and "Hugging Face `generate`" in by_name["decode"]
    assert by_name["gpu-check"].split()[1] == "benchmarks.ops.gpu_check"


@pytest.mark.parametrize("name", list(benchmarks.BY_NAME))
def test_every_name_imports_and_runs_through_main(name):
    module = benchmarks.load(name)
    assert module.__name__ == benchmarks.BY_NAME[name]
    params = list(inspect.signature(module.main).parameters)
    assert params and params[0] == "argv", f"{name}: main(argv) runs it"


def test_every_module_with_a_main_is_listed():
    listed = set(benchmarks.BENCHMARKS)
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        tree = ast.parse(path.read_text())
        has_main = any(isinstance(n, ast.FunctionDef) and n.name == "main" for n in tree.body)
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if has_main and path.name != "__main__.py":
            assert module in listed, f"{module} has a main() but no NAME in benchmarks.BENCHMARKS"


def test_unknown_name_and_no_name_are_usage_errors(capsys):
    assert entry.main(["no-such-bench"]) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err
    assert entry.main([]) == 2 and "usage: python -m benchmarks NAME" in capsys.readouterr().out
    with pytest.raises(ValueError, match="benchmarks.load: unknown benchmark 'nope'"):
        benchmarks.load("nope")


def test_the_entry_point_runs_a_benchmark_with_its_own_options(capsys, monkeypatch):
    monkeypatch.setattr(sys, "argv", list(sys.argv))  # the entry point names the command in sys.argv[0]
    assert entry.main(["render-table", "--topic", "moe"]) == 0
    assert "| Tigon (" in capsys.readouterr().out
    assert sys.argv == ["python -m benchmarks render-table", "--topic", "moe"]


def test_no_file_under_benchmarks_touches_sys_path():
    offenders = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "benchmarks").rglob("*"))
                 if p.suffix in (".py", ".sh") for i, line in enumerate(p.read_text().splitlines(), 1)
                 if "sys.path" in line]
    assert offenders == []


def test_modules_are_named_by_their_place():
    for module in benchmarks.BENCHMARKS:
        spec = importlib.util.find_spec(module)
        wing = Path(spec.origin).parent.name
        assert wing in ("ops", "training", "generation", "tools") and module.split(".")[1] == wing
