"""install_as_liger_kernel: transformers' Trainer with use_liger_kernel=True runs Tigon's patch; the aliases never
outlive the process that made them (the Trainer case runs in a fresh interpreter, since the real liger-kernel is
imported by other tests here). Without transformers, tigon.compat.liger says which extra to install."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tigon.compat import liger, liger_alias

ROOT = Path(__file__).resolve().parents[2]


def _python(args, **kw):
    # the Tigon kernels take the CPU reference path there: the patch is what is tested, not the kernels
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
                          **kw)


def test_trainer_use_liger_kernel_runs_tigon_after_install(tmp_path):
    pytest.importorskip("transformers")
    run = _python(["-m", "tests.compat._trainer_with_liger_flag", str(tmp_path)])
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["available"] and result["resolved"] and result["monkey_patch"]
    assert result["patched"], "the Trainer's model kept HF's RMSNorm"
    assert result["left"] == [], "uninstall left liger_kernel aliases in sys.modules"


def test_install_refuses_when_the_real_liger_kernel_is_imported():
    pytest.importorskip("liger_kernel")
    import liger_kernel  # noqa: F401

    before = dict(sys.modules)
    with pytest.raises(RuntimeError, match="install_as_liger_kernel: the liger-kernel package is already imported"):
        liger.install_as_liger_kernel()
    assert not liger_alias.is_installed()
    assert sys.modules["liger_kernel"] is before["liger_kernel"]


def test_uninstall_without_install_is_a_no_op():
    before = {n: m for n, m in sys.modules.items() if n.startswith("liger_kernel")}
    liger.uninstall_as_liger_kernel()
    assert {n: m for n, m in sys.modules.items() if n.startswith("liger_kernel")} == before


def test_import_without_transformers_names_the_extra():
    code = ("import sys; sys.modules['transformers'] = None\n"
            "try:\n    import tigon.compat.liger\n"
            "except ImportError as e:\n    print('ImportError:', e)\n")
    run = _python(["-c", code])
    assert run.returncode == 0, run.stderr[-3000:]
    assert 'tigon.compat.liger needs transformers: pip install "tigon[hf]"' in run.stdout
