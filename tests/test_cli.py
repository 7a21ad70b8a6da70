"""`tigon env`, `tigon bench` without a benchmarks folder, `tigon demo` without tigon.demo."""

import os
import subprocess
import sys

import pytest

from tigon import cli

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def test_env_names_every_op_and_its_path(capsys):
    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "triton", "tigon", "TRITON_INTERPRET"):
        assert word in out
    assert ("no CUDA device" in out) or ("GPU 0" in out)
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    for op in cli.OPS:
        assert op in lines, f"{op} missing from `tigon env`"
        assert lines[op].split()[1] in ("triton", "reference")


def test_env_runs_as_a_command():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "tigon.cli", "env"], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    assert "linear_cross_entropy" in r.stdout


def test_bench_without_benchmarks_folder_says_where_to_get_it(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: None)
    assert cli.main(["bench", "--quick"]) == 2
    assert "benchmarks/ folder" in capsys.readouterr().err


def test_demo_missing_module_is_a_clear_message(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tigon.demo", None)  # makes `import tigon.demo` fail
    assert cli.main(["demo", "--steps", "1"]) == 2
    assert "tigon.demo" in capsys.readouterr().err


def test_unknown_command_exits_with_usage():
    with pytest.raises(SystemExit) as e:
        cli.main(["frobnicate"])
    assert e.value.code == 2


def test_bench_decode_quick_prints_the_table_and_writes_prometheus(tmp_path, capsys):
    out, prom = tmp_path / "out", tmp_path / "decode.prom"
    argv = ["bench", "decode", "--quick", "--device", "cpu", "--variants", "tigon,hf-eager", "--batches", "1",
            "--out", str(out), "--prometheus", str(prom)]
    assert cli.main(argv) == 0
    printed = capsys.readouterr().out
    assert "| llama-toy | tigon | 1 |" in printed and "| llama-toy | hf-eager | 1 |" in printed
    assert (out / "decode.md").read_text() in printed
    text = prom.read_text()
    assert 'tigon_generate_time_to_first_token_seconds{batch="1",model="llama-toy",variant="tigon"}' in text
    assert "hf-eager" not in text  # only tigon rows carry generate's stats


def test_bench_decode_help_names_the_command(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "decode", "--help"])
    assert e.value.code == 0
    assert "tigon bench decode" in capsys.readouterr().out
