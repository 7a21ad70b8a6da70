"""Packaging: the license file matches the metadata, the version lives in one place, the extras exist and name
their floors, the transformers floor holds what tigon imports; py.typed ships; the changelog has the current version;
docs/environment.md lists exactly the environment variables src/ reads; TIGON_LOG prints Tigon's log records (in a
fresh interpreter)."""

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
SRC = ROOT / "src" / "tigon"
# what an application needs at run time: each third-party requirement states the lowest version Tigon works with
RUNTIME_EXTRAS = ("hf", "trl", "kernels", "metrics")


def test_license_file_is_the_apache_2_text_the_metadata_names():
    project = PYPROJECT["project"]
    assert project["license"] == "Apache-2.0" and project["license-files"] == ["LICENSE"]
    text = (ROOT / "LICENSE").read_text()
    assert text.split()[:3] == ["Apache", "License", "Version"] and "Version 2.0, January 2004" in text
    assert "END OF TERMS AND CONDITIONS" in text


def test_the_version_has_one_source():
    import tigon

    assert "version" not in PYPROJECT["project"] and "version" in PYPROJECT["project"]["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "tigon.__version__"}
    # setuptools reads the attribute from the source without importing it: it must be a string literal there
    tree = ast.parse((ROOT / "src" / "tigon" / "__init__.py").read_text())
    literals = [node.value.value for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__version__" for t in node.targets)
                and isinstance(node.value, ast.Constant)]
    assert literals == [tigon.__version__]
    parts = tigon.__version__.split(".")
    assert len(parts) == 3 and all(p.isdigit() for p in parts)


def test_extras_cover_each_feature():
    extras = PYPROJECT["project"]["optional-dependencies"]
    assert {"hf", "trl", "kernels", "bench", "metrics", "dev"} <= extras.keys()
    names = {extra: {req.split(">")[0].split("=")[0].split("[")[0].strip() for req in reqs}
             for extra, reqs in extras.items()}
    assert {"transformers", "accelerate", "peft"} <= names["hf"]
    assert "trl" in names["trl"] and "kernels" in names["kernels"] and "prometheus-client" in names["metrics"]
    assert {"liger-kernel", "matplotlib"} <= names["bench"] and {"pytest", "ruff"} <= names["dev"]


def test_the_transformers_floor_has_what_tigon_imports():
    import transformers
    from packaging.version import Version

    floor = next(r for r in PYPROJECT["project"]["optional-dependencies"]["hf"] if r.startswith("transformers"))
    assert floor.startswith("transformers>=")
    assert Version(transformers.__version__) >= Version(floor.split(">=")[1])
    # the newest API among tigon's imports of transformers (tigon.memory.kv_cache)
    from transformers.cache_utils import CacheLayerMixin, get_layer_types_and_kwargs  # noqa: F401
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask  # noqa: F401


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != "TIGON_LOG"}
    environ.update(env)
    environ["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), environ.get("PYTHONPATH", "")])
    return subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=120,
                          cwd=ROOT)


def test_tigon_log_info_prints_the_patch_report():
    out = _run("import tigon; tigon.patch(model_type='llama'); tigon.unpatch()", TIGON_LOG="info")
    assert out.returncode == 0, out.stderr
    assert "INFO tigon: tigon.patch: llama (class)" in out.stderr
    assert "RMSNorm class LlamaRMSNorm" in out.stderr


def test_without_tigon_log_tigon_adds_no_handler_and_reads_the_variable_only_when_configured():
    code = ("import logging, os, tigon, tigon._log as L; lg = logging.getLogger('tigon');"
            "print(len(lg.handlers)); os.environ['TIGON_LOG'] = 'debug'; L.get_logger().debug('late');"
            "L.get_logger(); print(len(lg.handlers))")
    out = _run(code)  # unset at start; set before the first get_logger(): that call reads it, once
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "1"] and "DEBUG tigon: late" in out.stderr
    out = _run("import tigon._log as L; L.get_logger().info('quiet'); L.get_logger().warning('loud')")
    assert out.returncode == 0 and "quiet" not in out.stderr and "loud" in out.stderr  # Python's last resort


@pytest.mark.parametrize("value", ["verbose", "2"])
def test_an_unknown_tigon_log_value_warns_and_adds_no_handler(value):
    out = _run("import logging, tigon._log as L; L.get_logger(); print(len(logging.getLogger('tigon').handlers))",
               TIGON_LOG=value)
    assert out.returncode == 0 and out.stdout.split() == ["0"]
    assert f"TIGON_LOG={value!r} is not one of debug, info, warning, error" in out.stderr


def _is_name(node) -> bool:
    return isinstance(node, ast.Constant) and isinstance(node.value, str)


def _environ_reads(source: str) -> set[str]:
    """Names of the environment variables `source` reads: os.environ.get/[]/in/setdefault/pop, os.getenv, and the
    same on any expression that names an environ (`(os.environ if e is None else e).get(...)`)."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and node.args and _is_name(node.args[0]):
            f = node.func
            if (isinstance(f, ast.Name) and f.id == "getenv") or (
                    isinstance(f, ast.Attribute) and (f.attr == "getenv" or "environ" in ast.unparse(f.value))):
                found.add(node.args[0].value)
        elif isinstance(node, ast.Subscript) and _is_name(node.slice) and "environ" in ast.unparse(node.value):
            found.add(node.slice.value)
        elif (isinstance(node, ast.Compare) and _is_name(node.left) and isinstance(node.ops[0], (ast.In, ast.NotIn))
              and "environ" in ast.unparse(node.comparators[0])):
            found.add(node.left.value)
    return found


def _table_names() -> set[str]:
    rows = (ROOT / "docs" / "environment.md").read_text().splitlines()
    return {m.group(1) for line in rows if (m := re.match(r"\| `([A-Z][A-Z0-9_]*)` \|", line))}


def test_environ_reads_finds_every_form():
    source = """
import os
from os import getenv
a = os.environ.get("A", "0")
b = os.environ["B"]
c = "C" in os.environ
d = os.getenv("D")
e = getenv("E")
f = (os.environ if env is None else env).get("F", "")
g = os.environ.setdefault("G", "1")
other = {"H": 1}.get("H")
"""
    assert _environ_reads(source) == set("ABCDEFG")


def test_every_environment_variable_read_is_in_the_table():
    read = {}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if "environ" not in text and "getenv" not in text:  # every form _environ_reads knows names one of them
            continue
        for name in _environ_reads(text):
            read.setdefault(name, []).append(str(path.relative_to(SRC.parent)))
    assert {"TIGON_LOG", "TIGON_VALIDATE", "TRITON_INTERPRET"} <= read.keys()
    table = _table_names()
    missing = {name: where for name, where in read.items() if name not in table}
    assert not missing, f"read in src/ but not in docs/environment.md's table: {missing}"
    assert table <= read.keys(), f"docs/environment.md lists variables nothing reads: {table - read.keys()}"


def test_extras_name_their_floors():
    extras = PYPROJECT["project"]["optional-dependencies"]
    for extra in RUNTIME_EXTRAS:
        for text in extras[extra]:
            req = Requirement(text)
            if req.name == "tigon":
                assert req.extras <= extras.keys(), f"[{extra}] includes an unknown extra: {text}"
                continue
            assert any(s.operator in (">=", "==", "~=") for s in req.specifier), \
                f"[{extra}] requires {text!r} without a lowest version"


def test_trl_floor_is_the_first_with_the_fused_head():
    """tigon.hf.trl replaces what TRL's add_fused_lm_head calls (`_ChunkedLogProbFunction.apply(..., outputs)`, five
    results): both came in TRL 1.15; TRL 1.14's trainers never call that function, so they would skip Tigon."""
    trl = next(Requirement(t) for t in PYPROJECT["project"]["optional-dependencies"]["trl"] if t.startswith("trl"))
    assert "1.15" in trl.specifier and "1.14.2" not in trl.specifier


def test_py_typed_ships():
    classifiers = PYPROJECT["project"]["classifiers"]
    assert (SRC / "py.typed").is_file()
    assert "py.typed" in PYPROJECT["tool"]["setuptools"]["package-data"]["tigon"]
    assert "Typing :: Typed" in classifiers
    # PEP 639: with a license expression, a License :: classifier is an error for setuptools >= 77
    assert not any(c.startswith("License ::") for c in classifiers)


def test_changelog_has_unreleased_and_the_current_version():
    import tigon

    headings = re.findall(r"^## \[([^\]]+)\]", (ROOT / "CHANGELOG.md").read_text(), flags=re.M)
    assert headings[0] == "Unreleased"
    assert tigon.__version__ in headings


def test_entry_points_are_typed():
    """tigon.patch, tigon.unpatch and tigon.generate annotate every named parameter and their return (py.typed
    ships, so type checkers read these)."""
    import inspect

    import tigon

    for fn in (tigon.patch, tigon.unpatch, tigon.generate):
        sig = inspect.signature(fn)
        missing = [p.name for p in sig.parameters.values()
                   if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.annotation is inspect.Parameter.empty]
        assert not missing, f"{fn.__qualname__}: no annotation on {missing}"
        assert sig.return_annotation is not inspect.Signature.empty, fn.__qualname__
