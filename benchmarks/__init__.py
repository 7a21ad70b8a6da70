"""Tigon's benchmarks: one package, one entry point (`python -m benchmarks NAME [args]`, from the checkout's root).

Wings: `ops` (each op against its peers, the op run `gpu_check`, launch-setting sweeps), `training` (training steps,
LoRA, packed SFT, training attention), `generation` (decode, prefill, time to first token), `tools` (the timing
harness, the results tables, child processes). Results stay in `benchmarks/results/`.

BENCHMARKS lists every runnable module; its NAME is the module's name without `bench_`, `_` written `-`
(`benchmarks.generation.bench_decode` is `decode`). Nothing heavy is imported here: `python -m benchmarks --list`
reads the modules' docstrings without importing them.
"""

import ast
import importlib
import importlib.util
from pathlib import Path

BENCHMARKS = (
    "benchmarks.ops.gpu_check",
    "benchmarks.ops.bench_norms",
    "benchmarks.ops.bench_rope",
    "benchmarks.ops.bench_glu",
    "benchmarks.ops.bench_cross_entropy",
    "benchmarks.ops.bench_lce_floor",
    "benchmarks.ops.bench_losses",
    "benchmarks.ops.profile_losses",
    "benchmarks.ops.sweep_loss_kernels",
    "benchmarks.ops.bench_optim",
    "benchmarks.ops.bench_moe",
    "benchmarks.ops.bench_rolling_buffer",
    "benchmarks.ops.tune",
    "benchmarks.training.bench_e2e",
    "benchmarks.training.bench_lora",
    "benchmarks.training.bench_long_context",
    "benchmarks.training.bench_sft_packed",
    "benchmarks.training.bench_training_attention",
    "benchmarks.training.bench_attention_backends",
    "benchmarks.training.attention_rule",
    "benchmarks.training.sweep_flex",
    "benchmarks.generation.bench_decode",
    "benchmarks.generation.bench_decode_ops",
    "benchmarks.generation.bench_hf_generate",
    "benchmarks.generation.bench_quant_linear",
    "benchmarks.generation.prefill_host",
    "benchmarks.generation.profile_ttft",
    "benchmarks.generation.sdpa_new_shapes",
    "benchmarks.tools.render_table",
)


def name_of(module: str) -> str:
    """The NAME of `python -m benchmarks NAME` for a module of BENCHMARKS: `...bench_decode_ops` -> `decode-ops`."""
    return module.rpartition(".")[2].removeprefix("bench_").replace("_", "-")


BY_NAME = {name_of(m): m for m in BENCHMARKS}


def summary(module: str, width: int = 100) -> str:
    """The first sentence of a module's docstring, read from its source (the module is not imported), cut to about
    `width` characters at a word."""
    spec = importlib.util.find_spec(module)
    doc = ast.get_docstring(ast.parse(Path(spec.origin).read_text(encoding="utf-8"))) or ""
    text = " ".join(doc.split("\n\n")[0].split())
    text = text.split(". ")[0].removesuffix(".").rstrip(",:;")
    return text if len(text) <= width else text[:width].rsplit(" ", 1)[0].rstrip(",:;") + " ..."


def load(name: str):
    """The module behind a NAME (its `main(argv)` runs it). ValueError naming the choices for an unknown NAME."""
    if name not in BY_NAME:
        raise ValueError(f"benchmarks.load: unknown benchmark {name!r}; expected one of {', '.join(BY_NAME)} "
                         "(python -m benchmarks --list)")
    return importlib.import_module(BY_NAME[name])
