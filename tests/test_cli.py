"""`tigon env`, `tigon bench` without a benchmarks folder, `tigon demo` without tigon.demo, and bad option values
(usage errors with exit status 2, never tracebacks)."""

import argparse
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


@pytest.mark.parametrize("argv", [["bench", "--quick"], ["bench", "decode", "--quick", "--device", "cpu"]])
def test_bench_without_benchmarks_folder_says_where_to_get_it(monkeypatch, capsys, argv):
    # An installed package: no benchmarks/ folder beside it, under the current directory or at $TIGON_BENCHMARKS.
    monkeypatch.setattr(cli, "_benchmarks_dir", lambda: None)
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert "tigon bench needs the benchmarks/ folder of a source checkout" in err and "git clone" in err


def test_benchmarks_dir_is_the_checkouts_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TIGON_BENCHMARKS", raising=False)
    assert cli._benchmarks_dir() == os.path.join(os.path.dirname(SRC), "benchmarks")
    monkeypatch.setenv("TIGON_BENCHMARKS", str(tmp_path))  # a folder without the tools is passed over
    assert cli._benchmarks_dir() == os.path.join(os.path.dirname(SRC), "benchmarks")


def test_import_tigon_loads_nothing_from_benchmarks():
    env = dict(os.environ, PYTHONPATH=SRC)
    code = ("import sys, tigon, tigon.cli; bench = [m for m, v in list(sys.modules.items()) if 'benchmarks' in "
            "str(getattr(v, '__file__', '') or '')]; print(bench); sys.exit(1 if bench else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


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


BAD_VALUES = [
    (["demo", "--steps", "0"], "argument --steps: expected a positive integer, got 0"),
    (["demo", "--steps", "-1"], "argument --steps: expected a positive integer, got -1"),
    (["demo", "--steps", "x"], "argument --steps: expected a positive integer, got 'x'"),
    (["demo", "--seq-len", "2.5"], "argument --seq-len: expected a positive integer"),
    (["demo", "--batch-size", "0"], "argument --batch-size: expected a positive integer"),
    (["demo", "--lr", "nan"], "argument --lr: expected a positive finite number"),
    (["demo", "--lr", "-0.001"], "argument --lr: expected a positive finite number"),
    (["demo", "--device", "tpu"], "argument --device: expected cpu, cuda or cuda:N, got 'tpu'"),
    (["demo", "--device", "cpu:0"], "argument --device: expected cpu, cuda or cuda:N"),
    (["demo", "--model", "/no/such/checkpoint"], "argument --model: '/no/such/checkpoint' is not a checkpoint"),
    (["demo", "--bogus"], "unrecognized arguments: --bogus"),
    (["bench", "--device", "tpu"], "argument --device: expected cpu or cuda, got 'tpu'"),
    (["bench", "--budget", "-5"], "argument --budget: expected a positive finite number"),
    (["bench", "--budget", "x"], "argument --budget: expected a positive number, got 'x'"),
    (["bench", "--sections", ","], "argument --sections: expected comma-separated names"),
    (["bench", "decode", "--batches", "x"], "argument --batches: expected comma-separated positive integers"),
    (["bench", "decode", "--batches", "1,0"], "argument --batches: expected comma-separated positive integers"),
    (["bench", "decode", "--batch", "1,,8"], "argument --batches: expected comma-separated positive integers"),
    (["bench", "decode", "--swa-batches", "-1"], "argument --swa-batches: expected comma-separated positive"),
    (["bench", "decode", "--prompt", "-1"], "argument --prompt: expected a positive integer, got -1"),
    (["bench", "decode", "--new", "0"], "argument --new: expected a positive integer, got 0"),
    (["bench", "decode", "--timeout", "0"], "argument --timeout: expected a positive finite number"),
    (["bench", "decode", "--device", "tpu"], "argument --device: expected cpu or cuda, got 'tpu'"),
    (["bench", "decode", "--bogus"], "unrecognized arguments: --bogus"),
    (["env", "extra"], "unrecognized arguments: extra"),
]
if not __import__("torch").cuda.is_available():
    BAD_VALUES += [(["demo", "--device", "cuda"], "argument --device: 'cuda': no CUDA device here"),
                   (["bench", "--device", "cuda"], "argument --device: 'cuda': no CUDA device here")]


@pytest.mark.parametrize("argv,message", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_bad_values_are_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: tigon" in err and message in err and "Traceback" not in err


def test_bad_value_in_a_subprocess_is_a_usage_message_without_traceback():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-m", "tigon.cli", "demo", "--steps", "0"], capture_output=True, text=True,
                       env=env, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "usage: tigon demo" in r.stderr and "Traceback" not in r.stderr
    assert "argument --steps: expected a positive integer, got 0" in r.stderr


def test_demo_keeps_the_values_it_is_given(monkeypatch, tmp_path):
    # `--steps 1` runs 1 step (a 0 used to fall back to the default 20); unset values take the CPU defaults.
    import tigon.demo as demo

    seen = []

    def fake_run_variant(args, use_tigon, data, device, dtype):
        seen.append((args.steps, args.seq_len, args.batch_size, tuple(data.shape)))
        return dict(losses=[1.0] * args.steps, tokens_per_s=1.0, peak_gib=None, step_ms=1.0, report="report")

    monkeypatch.setattr(demo, "run_variant", fake_run_variant)
    assert demo.main(["--steps", "1", "--batch-size", "3", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert seen == [(1, 64, 3, (1, 3, 64))] * 2
    parsed = argparse.Namespace(steps=0, seq_len=None, batch_size=None, model=None, lr=None, device="cpu",
                                out=str(tmp_path))
    with pytest.raises(ValueError, match="tigon.demo.run: steps must be an int >= 1, got 0"):
        demo.run(parsed)
