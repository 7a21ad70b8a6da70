"""Test setup: run the Triton kernels through the interpreter when there is no GPU, and poison every
buffer the kernels allocate with NaN, so a masked-out or forgotten store shows up as a failure.

This file is the only place that sets the process environment. Triton picks interpreter or compiler when a
kernel is decorated (`triton.jit` reads TRITON_INTERPRET at import), so a test module that set it while being
collected would turn every kernel imported later into an interpreted one, CUDA tests included: collection
fails on any module that changes os.environ, and on a CUDA machine every CUDA test checks afterwards that no
Tigon kernel is an interpreted one.
"""

import os
import sys

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
if not torch.cuda.is_available() and os.environ.get("PYTEST_XDIST_WORKER"):
    # `pytest -n N` on N cores: one intra-op thread a worker, not N (oversubscribed: the registry rows ran 46 s
    # with torch's default of 2 threads a worker on 2 cores, 32 s with 1)
    torch.set_num_threads(1)

import pytest  # noqa: E402
from torch.utils._device import _device_constructors  # noqa: E402

_empty, _empty_like = torch.empty, torch.empty_like
# `with torch.device(...)` redirects the factories it lists at its first use, and caches that list: listed while
# the fixture below has torch.empty patched, the list would hold the patch, and every later device context would
# leave torch.empty's tensors on the CPU (a meta-device model build in one test after another's device context).
# Listed now, it holds torch's own factories, which the patch calls.
_device_constructors()


def _nan_fill(t):
    if t.is_floating_point() and t.numel():
        with torch.no_grad():  # inductor allocates leaves that require grad through torch.empty
            t.fill_(float("nan"))
    return t


@pytest.fixture(autouse=True)
def nan_poisoned_allocations(monkeypatch):
    monkeypatch.setattr(torch, "empty", lambda *a, **k: _nan_fill(_empty(*a, **k)))
    monkeypatch.setattr(torch, "empty_like", lambda *a, **k: _nan_fill(_empty_like(*a, **k)))
    yield


# Process-wide numeric switches a library may flip for the rest of the process. transformers' TrainingArguments with
# torch_compile=True on a machine with an Ampere+ GPU (use_cpu or not) sets torch.backends.fp32_precision = "tf32"
# (torch's newer API); accelerate sets torch.backends.cuda.matmul.allow_tf32 = True (the legacy one) for a CUDA
# Trainer compiled without mixed precision. Every later fp32 test on that xdist worker then compared TF32 matmuls
# (relative error ~1e-3) against an fp64 spec: on the H200 the packed-flex fp32 bounds of
# tests/hf/test_packed_attention.py failed in the whole suite and passed alone. Both APIs are read and set back,
# the legacy switches first: torch's legacy getters raise while its two APIs disagree (a newer-API value over a
# legacy write, or torch.backends.fp32_precision = "tf32" under legacy defaults), and a legacy write undone by a
# legacy write leaves the newer value "ieee" where it was "none", which the newer-API pass then sets back.
_PRECISION_OWNERS = {full: owner for full, owner in (
    ("torch.backends", torch.backends),
    ("torch.backends.cuda.matmul", torch.backends.cuda.matmul),
    ("torch.backends.cudnn", torch.backends.cudnn),
    ("torch.backends.cudnn.conv", getattr(torch.backends.cudnn, "conv", None)),
    ("torch.backends.cudnn.rnn", getattr(torch.backends.cudnn, "rnn", None)),
) if owner is not None and hasattr(owner, "fp32_precision")}
_LEGACY_FLAGS = {
    "torch.backends.cuda.matmul.allow_tf32": (torch.backends.cuda.matmul, "allow_tf32"),
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
        (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
        (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    "torch.backends.cudnn.allow_tf32": (torch.backends.cudnn, "allow_tf32"),
}


def _legacy(owner, name):
    try:
        return getattr(owner, name)
    except RuntimeError:  # torch's legacy and newer precision APIs disagree: the legacy getter refuses
        return None


def numeric_flags() -> dict:
    flags = {f"{full}.fp32_precision": owner.fp32_precision for full, owner in _PRECISION_OWNERS.items()}
    flags.update({full: _legacy(owner, name) for full, (owner, name) in _LEGACY_FLAGS.items()})
    return flags


def restore_numeric_flags(saved: dict, now: dict | None = None) -> list[str]:
    """Set back what differs from `saved` (numeric_flags() taken before; `now`, the current ones if already
    read); returns the names that differed."""
    now = numeric_flags() if now is None else now
    changed = [k for k, v in now.items() if v != saved[k]]
    if not changed:
        return []
    for full, (owner, name) in _LEGACY_FLAGS.items():  # a legacy write (accelerate) is undone by one
        if now[full] is not None and saved[full] is not None and now[full] != saved[full]:
            setattr(owner, name, saved[full])
    for full, owner in _PRECISION_OWNERS.items():  # then the newer API's values; torch.backends first
        if owner.fp32_precision != saved[f"{full}.fp32_precision"]:
            owner.fp32_precision = saved[f"{full}.fp32_precision"]
    return changed


def loosened(saved: dict, now: dict) -> list[str]:
    """The switches that went from exact to reduced precision (TF32, reduced-precision reductions)."""
    return [k for k, v in now.items() if (v == "tf32" or v is True) and saved[k] != v]


@pytest.fixture(autouse=True)
def numeric_flags_restored(request):
    """A test (or a library it runs) that turns TF32 or reduced-precision reductions on does not leave them on for
    the tests after it on the same worker; a warning names the test. What it set to exact precision explicitly
    (benchmarks/_harness.py's allow_tf32 = False) is set back quietly."""
    import warnings

    saved = numeric_flags()
    yield
    now = numeric_flags()
    looser = loosened(saved, now)
    restore_numeric_flags(saved, now)
    if looser:
        warnings.warn(f"{request.node.nodeid} turned on {looser}; set back", RuntimeWarning, stacklevel=1)


@pytest.fixture(params=["cuda"] if torch.cuda.is_available() else ["cpu"])
def device(request):
    return torch.device(request.param)


# Tests that take 10-80 s on a CI core (pytest --durations on the 2-core CI machine), longest first. They run
# before the rest, so that xdist's workers are not left waiting on one of them at the end of the run.
LONG_FIRST = (
    "tests/benchmarks/test_smoke.py::test_decode_bench_quick",
    "tests/distributed/",
    "tests/test_cli.py::test_bench_decode_quick",
    "tests/benchmarks/test_training_attention_smoke.py",
    "tests/memory/test_kv_cache.py::test_lazy_cache_under_the_fused_decode_layer",
    "tests/decode/test_hf_generate_graph.py",
    "tests/benchmarks/test_smoke.py::test_quick_bench",
    "tests/hf/test_training_extras.py::test_trl_sft_trainer",
    "tests/benchmarks/test_lora_smoke.py",
    "tests/benchmarks/test_smoke.py::test_decode_bench_ttft_at_new_prompt_lengths",
    "tests/benchmarks/test_optim_smoke.py",
    "tests/decode/test_specializations.py::test_new_prompt_lengths_add_no_specialization",
    "tests/ops/test_compile_targets.py::test_every_kernel_compiles_for",
)


def _long_first_rank(item) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))


def pytest_addoption(parser):
    parser.addoption("--failure-log", default=None, metavar="PATH",
                     help="append each failure's traceback to PATH as it happens (a run cut short still names why)")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report, path = outcome.get_result(), item.config.getoption("--failure-log", None)
    if path and report.failed:  # O_APPEND: each xdist worker's record lands whole
        with open(path, "a") as f:
            f.write(f"===== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not torch.cuda.is_available():
            item.add_marker(skip_gpu)
    items.sort(key=_long_first_rank)  # stable: the same order on every xdist worker


# What a test module must never change at import: Triton's and Tigon's switches and the visible devices (libraries
# may set others for themselves: torch sets CUDA_MODULE_LOADING when CUDA starts)
_WATCHED = ("TRITON_", "TIGON_", "CUDA_VISIBLE_DEVICES")


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    before = dict(os.environ)
    outcome = yield
    after = dict(os.environ)
    changed = sorted(k for k in before.keys() | after.keys()
                     if before.get(k) != after.get(k) and k.startswith(_WATCHED))
    if changed:
        for k in changed:  # undo it, so the rest of the session is not affected
            if k in before:
                os.environ[k] = before[k]
            else:
                os.environ.pop(k, None)
        report = outcome.get_result()
        report.outcome = "failed"
        report.longrepr = (f"{collector.nodeid or collector.path}: importing it changed os.environ {changed}; tests "
                           "may set the environment only in tests/conftest.py or in a subprocess's env")


def interpreted_kernels() -> list[str]:
    """Names of the loaded Tigon kernels that Triton built as interpreted functions (autotuner and heuristics
    wrappers unwrapped)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return []
    found = []
    for name, module in list(sys.modules.items()):
        if not name.startswith("tigon.") or module is None:
            continue
        for attr, value in list(vars(module).items()):
            while hasattr(value, "fn") and not isinstance(value, InterpretedFunction):
                value = value.fn
            if isinstance(value, InterpretedFunction):
                found.append(f"{name}.{attr}")
    return found


@pytest.fixture(autouse=True)
def cuda_cache_returned():
    """The suite's workers share one GPU: each hands its cached blocks back after every test, so a worker between
    tests holds none of the memory a large test on another worker needs."""
    yield
    if torch.cuda.is_initialized():
        torch.cuda.empty_cache()


@pytest.fixture(autouse=True)
def cuda_kernels_are_native(request):
    """On a CUDA device the GPU suite must test compiled kernels: fail a CUDA test if any Tigon kernel was built
    by Triton's interpreter."""
    yield
    params = getattr(request.node, "callspec", None)
    on_cuda = params is not None and any(
        (isinstance(v, torch.device) and v.type == "cuda") or (isinstance(v, str) and v.startswith("cuda"))
        for v in params.params.values())
    if on_cuda or "gpu" in request.node.keywords:
        interpreted = interpreted_kernels()
        assert not interpreted, f"CUDA test ran with interpreted Triton kernels: {interpreted[:5]}"


@pytest.fixture(autouse=True)
def _no_user_tuned_cache(tmp_path_factory, monkeypatch):
    """Tests read the shipped tables only: a `tigon tune` cache of the machine running them stays out."""
    from tigon.ops import tuned_cache

    monkeypatch.setenv("TIGON_CACHE_DIR", str(tmp_path_factory.mktemp("tigon-cache")))
    tuned_cache.reset()
    yield
    tuned_cache.reset()
