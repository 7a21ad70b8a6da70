"""Packaging: the license file matches the metadata, the version lives in one place, the extras exist and the
transformers floor holds what tigon imports; TIGON_LOG prints Tigon's log records (in a fresh interpreter)."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="reads pyproject.toml with Python 3.11's tomllib")

ROOT = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


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
