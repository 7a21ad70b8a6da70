"""tigon._log: each record shown once whatever the application's logging setup, verbose reports printed or
logged (never both), and the message for a missing optional package."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tigon import _log

SRC = str(Path(__file__).resolve().parents[1] / "src")


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items() if k != "TIGON_LOG"}
    environ.update(env, PYTHONPATH=SRC)
    r = subprocess.run([sys.executable, "-c", code], env=environ, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r


@pytest.mark.parametrize("setup,shown_by", [
    ("", "tigon's handler"),
    ("logging.basicConfig(level=logging.INFO)", "the application's"),
    ("logging.basicConfig()", "the application's (its handler takes every level the tigon logger passes)"),
    ("h = logging.StreamHandler(); h.setLevel(logging.ERROR); logging.getLogger().addHandler(h)", "tigon's handler"),
], ids=["no-config", "basicConfig-info", "basicConfig", "app-handler-at-error"])
def test_tigon_log_with_the_applications_logging_prints_each_line_once(setup, shown_by):
    for order in ("before", "after"):  # logging configured before or after Tigon's handler is added
        first, second = (setup, "L.get_logger()") if order == "before" else ("L.get_logger()", setup)
        r = _run(f"import logging, tigon._log as L\n{first}\n{second}\nL.get_logger().info('the line')",
                 TIGON_LOG="info")
        assert r.stderr.count("the line") == 1, (order, shown_by, r.stderr)


@pytest.mark.parametrize("env,setup,stdout,stderr", [
    ({}, "", 1, 0),  # nothing shows INFO: printed
    ({"TIGON_LOG": "info"}, "", 0, 1),  # Tigon's handler shows it: logged only
    ({}, "logging.basicConfig(level=logging.INFO)", 0, 1),  # the application's logging shows it: logged only
    ({"TIGON_LOG": "warning"}, "", 1, 0),
], ids=["plain", "tigon-log-info", "basicConfig-info", "tigon-log-warning"])
def test_verbose_report_is_printed_or_logged_not_both(env, setup, stdout, stderr):
    r = _run(f"import logging, tigon._log as L\n{setup}\nL.report('the report', verbose=True)", **env)
    assert (r.stdout.count("the report"), r.stderr.count("the report")) == (stdout, stderr)


def test_report_without_verbose_only_logs():
    assert _run("import tigon._log as L; L.report('the report')").stdout == ""
    assert _run("import tigon._log as L; L.report('the report')", TIGON_LOG="info").stderr.count("the report") == 1


def test_missing_package_names_the_extra():
    e = _log.missing_package(ModuleNotFoundError("No module named 'transformers'", name="transformers.cache_utils"),
                             "tigon.patch")
    assert isinstance(e, ImportError) and e.name == "transformers.cache_utils"
    assert str(e) == "tigon.patch needs the 'transformers' package, which is not installed: pip install \"tigon[hf]\""
    e = _log.missing_package(ModuleNotFoundError(name="prometheus_client"), "tigon.decode.metrics")
    assert 'pip install "tigon[metrics]"' in str(e)
    assert "pip install torch" in str(_log.missing_package(ModuleNotFoundError(name="torch"), "tigon env"))
    assert _log.missing_package(ModuleNotFoundError(name="tigon.nothing"), "tigon.patch") is None


def test_requires_extra_rewrites_only_optional_packages(monkeypatch):
    monkeypatch.setitem(sys.modules, "trl", None)
    with pytest.raises(ImportError, match=r'tigon.hf.trl needs the \'trl\' package.*pip install "tigon\[trl\]"') as e:
        _log.import_optional("trl", "tigon.hf.trl")
    assert isinstance(e.value.__cause__, ModuleNotFoundError)
    monkeypatch.setitem(sys.modules, "tigon_no_such_module", None)
    with pytest.raises(ModuleNotFoundError, match="tigon_no_such_module"):  # a bug, not a missing extra: as is
        with _log.requires_extra("tigon.patch"):
            import tigon_no_such_module  # noqa: F401
