"""The `tigon` command: --version, usage, `tigon env`, `tigon bench` (its help, output folder, missing benchmarks
folder, the `python -m benchmarks NAME` child it starts, CPU wording), `tigon demo`, missing packages, and bad option
values (usage errors with exit status 2, never tracebacks)."""

import argparse
import importlib
import importlib.util
import json
import os
import subprocess
import sys
import types

import pytest

import tigon
from benchmarks.tools import checkout, harness
from tigon import cli
from tigon.cli import bench, env

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def _env(**extra) -> dict:
    """This process's environment with src/ first on PYTHONPATH, for a `python -m tigon.cli` subprocess."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]), **extra}


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"tigon {tigon.__version__}"


def test_bare_tigon_exits_2_with_usage(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: tigon") and "{env,bench,demo,tune}" in err


def test_env_names_every_public_op_its_path_and_launch(capsys):
    from tigon import ops

    assert cli.main(["env"]) == 0
    out = capsys.readouterr().out
    for word in ("torch", "triton", "tigon", "TRITON_INTERPRET", "training attention"):
        assert word in out
    assert ("no CUDA device" in out) or ("GPU 0" in out)
    lines = {ln.split()[0]: ln for ln in out.splitlines() if ln.startswith("  ")}
    public = [n for n in ops.__all__ if callable(getattr(ops, n)) and not isinstance(getattr(ops, n), type)]
    assert set(env.public_ops()) == set(public) - {"backend_for"}
    for op in env.public_ops():
        assert op in lines, f"{op} missing from `tigon env`"
        assert lines[op].split()[1] in ("triton", "reference")
    assert "RMSNormConfig defaults" in lines["rms_norm"] and "rule" in lines["decode_linear"]


def test_env_names_measured_tables_for_a_measured_gpu():
    assert "measured picks for NVIDIA H200" in env.launch_text("decode_linear", "NVIDIA H200")
    assert "no measured picks" in env.launch_text("decode_linear", "NVIDIA A100-SXM4-80GB")
    assert "hf/attention_table.py rows for NVIDIA H200" in env.attention_text("NVIDIA H200")
    assert "Hugging Face's pick" in env.attention_text(None)


def test_env_path_text_names_the_backend():
    import torch

    assert "reference" in env.path_text("reference", torch.device("cpu"))
    assert "interpreter" in env.path_text("triton", torch.device("cpu"))
    assert "compiled" in env.path_text("triton", torch.device("cuda"))


def test_env_without_torch_says_what_to_install(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "torch", None)  # makes `import torch` fail
    assert cli.main(["env"]) == 1
    captured = capsys.readouterr()
    assert "tigon" in captured.out and "pip install torch" in captured.err and "Traceback" not in captured.err


def test_env_piped_into_head_has_no_broken_pipe_traceback():
    p = subprocess.Popen([sys.executable, "-m", "tigon.cli", "env"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env=_env())
    assert p.stdout.readline().startswith(b"python")
    p.stdout.close()  # what `head -1` does
    err = p.stderr.read().decode()
    p.wait(timeout=120)
    assert "Traceback" not in err and "BrokenPipe" not in err, err


def test_bench_help_describes_its_subcommands(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert "decode" in out and "the decode benchmark" in out and "op benchmarks" in out
    assert "tigon-bench-results" in out and "$OUT" not in out


def test_bench_writes_to_a_named_folder_by_default(monkeypatch):
    seen = {}
    monkeypatch.setenv("OUT", "/somewhere/else")
    monkeypatch.setattr(bench, "run_benchmark", lambda name, argv: seen.setdefault(name, argv) and 0)
    assert cli.main(["bench", "--quick"]) == 0 and cli.main(["bench", "decode", "--quick"]) == 0
    assert seen["gpu-check"][seen["gpu-check"].index("--out") + 1] == "tigon-bench-results"
    assert seen["decode"] == ["--quick"]  # bench_decode's own default: the same folder
    assert bench.DEFAULT_OUT == checkout.DEFAULT_OUT == "tigon-bench-results"
    seen.clear()  # an explicit folder is kept
    assert cli.main(["bench", "decode", "--out", "mine"]) == 0 and seen["decode"] == ["--out", "mine"]


def test_bench_decode_options_go_after_decode(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", "--quick", "decode"])
    assert e.value.code == 2 and "takes its options after `decode`" in capsys.readouterr().err


def test_cpu_bench_report_says_its_timings_are_not_representative():
    row = dict(op="rms_norm", case="4x64", provider="tigon", device="cpu", fwd_us=10.0, fb_us=30.0,
               fwd_GBps=1.0, fb_GBps=2.0, fb_pct_ceiling=3.0)
    text = "\n".join(harness.markdown_tables([row], {}))
    assert "not representative" in text and "CUDA event" not in text
    assert "n/a (CPU)" in text and "| 2.00 |" not in text and "3.00%" not in text
    assert "not representative" in harness.timing_note(True) and "CUDA-event" in harness.timing_note(False)
    gpu_text = "\n".join(harness.markdown_tables([dict(row, device="cuda")], {}))
    assert "n/a" not in gpu_text and "| 2.00 |" in gpu_text


def test_bench_without_benchmarks_folder_says_where_to_get_it(monkeypatch, capsys):
    # An installed package: no benchmarks/ folder beside it, under the current directory or at $TIGON_BENCHMARKS.
    monkeypatch.setattr(bench, "benchmarks_dir", lambda: None)
    for argv in (["bench", "--quick"], ["bench", "decode", "--quick", "--device", "cpu"]):
        assert cli.main(argv) == 2
        err = capsys.readouterr().err
        assert "tigon bench needs the benchmarks/ folder of a source checkout" in err and "git clone" in err


def test_benchmarks_dir_is_the_checkouts_folder(monkeypatch, tmp_path):
    monkeypatch.delenv("TIGON_BENCHMARKS", raising=False)
    assert bench.benchmarks_dir() == os.path.join(os.path.dirname(SRC), "benchmarks")
    monkeypatch.setenv("TIGON_BENCHMARKS", str(tmp_path))  # a folder without the tools is passed over
    assert bench.benchmarks_dir() == os.path.join(os.path.dirname(SRC), "benchmarks")
    for name in ("gpu_check.py", "bench_decode.py"):  # and so is the flat layout of older checkouts
        (tmp_path / name).write_text("")
    assert bench.benchmarks_dir() == os.path.join(os.path.dirname(SRC), "benchmarks")


def test_bench_runs_python_m_benchmarks_of_the_checkout_with_this_tigon(capsys):
    root = os.path.dirname(SRC)
    assert bench.child_command("decode", ["--quick"]) == [sys.executable, "-m", "benchmarks", "decode", "--quick"]
    env = bench.child_env(root, {"PYTHONPATH": os.pathsep.join(["/elsewhere", root])})
    assert env["PYTHONPATH"].split(os.pathsep) == [SRC, root, "/elsewhere"] and env["PYTHONUNBUFFERED"] == "1"
    # a real child: its output comes back through this process's streams, its exit status is the command's
    assert bench.run_benchmark("render-table", ["--topic", "moe"]) == 0
    assert "| Tigon (" in capsys.readouterr().out
    assert bench.run_benchmark("no-such-bench", []) == 2
    assert "unknown benchmark 'no-such-bench'" in capsys.readouterr().err


def test_import_tigon_loads_nothing_from_benchmarks():
    code = ("import sys, tigon, tigon.cli; bench = [m for m, v in list(sys.modules.items()) if 'benchmarks' in "
            "str(getattr(v, '__file__', '') or '')]; heavy = [m for m in ('torch', 'transformers') if m in "
            "sys.modules]; print(bench, heavy); sys.exit(1 if bench or heavy else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=_env(PYTHONPATH=SRC),
                       timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def test_demo_without_transformers_says_which_extra(monkeypatch, capsys, tmp_path):
    monkeypatch.setitem(sys.modules, "transformers", None)  # makes `import transformers` fail
    assert cli.main(["demo", "--steps", "1"]) == 2
    err = capsys.readouterr().err
    assert "tigon demo needs the 'transformers' package" in err and 'pip install "tigon[hf]"' in err
    from tigon.cli import demo

    args = argparse.Namespace(steps=1, seq_len=None, batch_size=None, model=None, lr=None, device="cpu",
                              out=str(tmp_path))
    with pytest.raises(ImportError, match=r'tigon demo needs .* pip install "tigon\[hf\]"'):
        demo.run(args)


def test_bench_decode_without_transformers_says_which_extra(monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "transformers" else
                        real(name, *a))
    monkeypatch.setattr(bench, "run_benchmark", lambda name, argv: pytest.fail("started without transformers"))
    assert cli.main(["bench", "decode", "--quick"]) == 2
    assert 'tigon bench decode needs the \'transformers\' package' in capsys.readouterr().err


def test_patch_and_generate_without_transformers_say_which_extra(monkeypatch):
    real = importlib.import_module

    def without_transformers(name, package=None):
        if name in ("tigon.decode", "tigon.hf.patching"):
            raise ModuleNotFoundError("No module named 'transformers'", name="transformers")
        return real(name, package)

    monkeypatch.setattr(importlib, "import_module", without_transformers)
    monkeypatch.delitem(vars(tigon), "patch", raising=False)  # published by its first access
    for name in ("patch", "generate", "DecodeSettings"):
        with pytest.raises(ImportError, match=rf'tigon.{name} needs the \'transformers\' package.*"tigon\[hf\]"'):
            getattr(tigon, name)
    with pytest.raises(AttributeError):
        tigon.no_such_name  # noqa: B018


def test_tigon_patch_without_transformers_says_which_extra(monkeypatch):
    def missing(name):
        raise ModuleNotFoundError("No module named 'transformers'", name="transformers")

    for module in ("tigon.decode", "tigon.hf.patching"):
        fake = types.ModuleType(module)
        fake.__getattr__ = missing  # `from .decode import hf_graph` fails as it does without transformers
        monkeypatch.setitem(sys.modules, module, fake)
    for name in ("patch", "unpatch"):
        message = (rf'^tigon.{name} needs the \'transformers\' package, which is not installed: '
                   r'pip install "tigon\[hf\]"$')
        monkeypatch.delitem(vars(tigon), name, raising=False)
        with pytest.raises(ImportError, match=message):
            getattr(tigon, name)  # the first access reads tigon.hf.patching
        with pytest.raises(ImportError, match=message):
            getattr(tigon, f"_{name}")(None)  # the call imports tigon.hf and tigon.decode


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
    assert 'tigon_generate_time_to_first_token_seconds_count{batch="1",model="llama-toy",variant="tigon"} 1.0' in text
    assert "hf-eager" not in text  # only tigon rows carry generate's stats


def test_bench_decode_help_and_unknown_options_are_the_benchmarks_own(capsys):
    assert cli.main(["bench", "decode", "--help"]) == 0
    out = capsys.readouterr().out
    assert "--prompts" in out and "default ./tigon-bench-results" in out
    assert cli.main(["bench", "decode", "--bogus"]) == 2
    err = capsys.readouterr().err
    assert "unrecognized arguments: --bogus" in err and "Traceback" not in err


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
    r = subprocess.run([sys.executable, "-m", "tigon.cli", "demo", "--steps", "0"], capture_output=True, text=True,
                       env=_env(), timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert "usage: tigon demo" in r.stderr and "Traceback" not in r.stderr
    assert "argument --steps: expected a positive integer, got 0" in r.stderr


def test_demo_keeps_the_values_it_is_given(monkeypatch, tmp_path, capsys):
    # `--steps 1` runs 1 step (a 0 used to fall back to the default 20); unset values take the CPU defaults.
    from tigon.cli import demo

    seen = []

    def fake_run_variant(args, use_tigon, data, device, dtype):
        seen.append((args.steps, args.seq_len, args.batch_size, tuple(data.shape)))
        return dict(losses=[1.0] * args.steps, tokens_per_s=1.0, peak_gib=None, step_ms=1.0, report="report")

    monkeypatch.setattr(demo, "run_variant", fake_run_variant)
    assert demo.main(["--steps", "1", "--batch-size", "3", "--device", "cpu", "--out", str(tmp_path)]) == 0
    assert seen == [(1, 64, 3, (1, 3, 64))] * 2
    assert "not how fast Tigon is" in capsys.readouterr().out  # a CPU's timings are not representative
    assert json.loads((tmp_path / "demo.json").read_text())["timings_representative"] is False
    parsed = argparse.Namespace(steps=0, seq_len=None, batch_size=None, model=None, lr=None, device="cpu",
                                out=str(tmp_path))
    with pytest.raises(ValueError, match="tigon.demo.run: steps must be an int >= 1, got 0"):
        demo.run(parsed)
