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


# Process-wide numeric switches a library may flip for the rest of the process. accelerate's AcceleratorState turns
# TF32 matmuls on for a CUDA Trainer with torch_compile and no mixed precision: every later fp32 test on that xdist
# worker then compared TF32 results (relative error ~1e-3) against an fp64 spec, and the fp32 error bounds of
# tests/hf/test_packed_attention.py failed by chance on the H200. Read and written through the legacy attributes,
# the API such libraries use (mixing it with torch's fp32_precision API makes the legacy getters raise).
_NUMERIC_FLAGS = {
    "torch.backends.cuda.matmul.allow_tf32": (torch.backends.cuda.matmul, "allow_tf32"),
    "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction":
        (torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction"),
    "torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction":
        (torch.backends.cuda.matmul, "allow_fp16_reduced_precision_reduction"),
    "torch.backends.cudnn.allow_tf32": (torch.backends.cudnn, "allow_tf32"),
}


def numeric_flags() -> dict:
    return {full: getattr(owner, name) for full, (owner, name) in _NUMERIC_FLAGS.items()}


def restore_numeric_flags(saved: dict) -> list[str]:
    """Set back the switches that differ from `saved`; returns their names."""
    changed = [full for full, value in saved.items() if getattr(*_NUMERIC_FLAGS[full]) != value]
    for full in changed:
        setattr(*_NUMERIC_FLAGS[full], saved[full])
    return changed


@pytest.fixture(autouse=True)
def numeric_flags_restored(request):
    """A test (or a library it runs) that flips TF32 or reduced-precision reductions does not leave them flipped
    for the tests after it on the same worker; a warning names the test."""
    import warnings

    saved = numeric_flags()
    yield
    changed = restore_numeric_flags(saved)
    if changed:
        warnings.warn(f"{request.node.nodeid} changed {changed}; restored", RuntimeWarning, stacklevel=1)


@pytest.fixture(params=["cuda"] if torch.cuda.is_available() else ["cpu"])
def device(request):
    return torch.device(request.param)


# Tests that take 10-80 s on a CI core (pytest --durations on the 2-core CI machine), longest first. They run
# before the rest, so that xdist's workers are not left waiting on one of them at the end of the run.
LONG_FIRST = (
    "tests/test_benchmarks_smoke.py::test_decode_bench_quick",
    "tests/distributed/",
    "tests/test_cli.py::test_bench_decode_quick",
    "tests/test_bench_attention_smoke.py",
    "tests/memory/test_kv_cache.py::test_lazy_cache_under_the_fused_decode_layer",
    "tests/decode/test_hf_generate_graph.py",
    "tests/test_benchmarks_smoke.py::test_quick_bench",
    "tests/hf/test_training_extras.py::test_trl_sft_trainer",
    "tests/test_bench_lora_smoke.py",
)


def _long_first_rank(item) -> int:
    return next((i for i, prefix in enumerate(LONG_FIRST) if item.nodeid.startswith(prefix)), len(LONG_FIRST))


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
