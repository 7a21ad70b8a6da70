"""Programmatic dependent launch (ops/_pdl.py): where it is on, and a chain of decode kernels replayed from a CUDA
graph, each reading the previous one's output (a read before the wait would see the previous replay's rows)."""
import importlib

import pytest
import torch

from tigon import ops
from tigon.ops import reference
from tigon.ops.rms_norm import rms_norm_rows

_pdl = importlib.import_module("tigon.ops._pdl")


def test_off_without_a_gpu():
    assert not _pdl.enabled(torch.device("cpu"))


@pytest.mark.gpu
def test_on_from_sm90_gpu():
    assert _pdl.enabled(torch.device("cuda")) == (torch.cuda.get_device_capability() >= (9, 0))


def _layer(x, w, ref):
    """One decoder-shaped chain: norm + q/k/v-like projection, residual projection, norm, GLU, split-K down."""
    lin = reference.decode_linear if ref else ops.decode_linear
    h = lin(x, [w["q"], w["k"]], norm_weight=w["n1"], eps=1e-6)
    h = lin(h, [w["o"]], residual=x)
    n = reference.rms_norm(h, w["n2"], 1e-6) if ref else rms_norm_rows(h, w["n2"], 1e-6)[0]
    m = lin(n, [w["gate"], w["up"]], activation="silu")
    return lin(m, [w["down"]], residual=h)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 8])
def test_chain_replayed_from_a_cuda_graph_gpu(rows):
    torch.manual_seed(0)
    dev, dt, H, inner = "cuda", torch.bfloat16, 1024, 8192  # inner 8192: the down projection splits K

    def rand(*shape, scale):
        return (torch.randn(*shape, device=dev) * scale).to(dt)

    layers = [dict(q=rand(512, H, scale=H ** -0.5), k=rand(512, H, scale=H ** -0.5), o=rand(H, H, scale=H ** -0.5),
                   gate=rand(inner, H, scale=H ** -0.5), up=rand(inner, H, scale=H ** -0.5),
                   down=rand(H, inner, scale=inner ** -0.5), n1=rand(H, scale=1.0) + 1, n2=rand(H, scale=1.0) + 1)
              for _ in range(4)]
    x = rand(rows, H, scale=1.0)

    def chain(x, ref=False):
        for w in layers:
            x = _layer(x, {k: t.float() for k, t in w.items()} if ref else w, ref)
        return x

    with torch.no_grad():
        # compile, and allocate the split-K scratch (pinned per stream), on the stream the capture then uses
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            chain(x)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            y = chain(x)
        for _ in range(3):
            x.copy_(rand(rows, H, scale=1.0))
            graph.replay()
            eager = chain(x)
            torch.cuda.synchronize()
            assert torch.equal(y, eager)
            want = chain(x.float(), ref=True)
            # 4 layers of bf16 roundings (each projection, norm and GLU output, 2^-8 relative, ~20 of them along
            # the chain: ~2^-8 * sqrt(20) in norm); a stale row is uncorrelated with the reference (error ~1)
            err = ((y.float() - want).norm() / want.norm()).item()
            assert err < 0.03, err


def test_launch_option_only_with_pdl():
    """A Triton without PDL (< 3.3) refuses the launch_pdl keyword: it is passed only when PDL is on."""
    assert _pdl.launch_options(False) == {}
    assert _pdl.launch_options(True) == {"launch_pdl": True}


def _pdl_kernels():
    """Every Triton kernel that takes the PDL constexpr, as (name, function AST)."""
    import ast
    import inspect

    found = []
    for mod in ("decode_linear", "decode_attention", "kv_write", "rms_norm"):
        module = importlib.import_module(f"tigon.ops.{mod}")
        for name, obj in vars(module).items():
            fn = getattr(obj, "fn", None)  # a triton.JITFunction's Python function
            if fn is not None and "PDL" in inspect.signature(fn).parameters:
                tree = ast.parse(inspect.getsource(fn).lstrip())
                found.append((f"{mod}.{name}", tree.body[0]))
    return found


def _is_pdl_call(node, what):
    import ast

    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == what
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "_pdl")


def test_every_pdl_kernel_touches_memory_only_after_its_wait():
    """A load or store before `_pdl.wait` races with the previous kernel on a GPU (rarely: the interpreter and most
    runs would not show it). Before the wait only index arithmetic: no tl.load / tl.store / tl.atomic_*, and no
    call of a helper (a name starting with "_") that might hold one."""
    import ast

    kernels = _pdl_kernels()
    assert {name for name, _ in kernels} >= {"decode_linear._decode_linear_kernel", "kv_write._rope_kv_write_kernel",
                                             "decode_attention._decode_attention_split_kernel",
                                             "decode_attention._decode_attention_merge_kernel",
                                             "rms_norm._rms_norm_fwd_kernel"}
    for name, fn in kernels:
        before = []
        for stmt in fn.body:
            if any(_is_pdl_call(n, "wait") for n in ast.walk(stmt)):
                break
            before.append(stmt)
        else:
            raise AssertionError(f"{name}: no _pdl.wait in its top-level statements")
        for stmt in before:
            for n in ast.walk(stmt):
                if not isinstance(n, ast.Call) or _is_pdl_call(n, "start"):
                    continue
                f = n.func
                touches = (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "tl"
                           and (f.attr in ("load", "store") or f.attr.startswith("atomic")))
                helper = isinstance(f, ast.Name) and f.id.startswith("_")
                assert not (touches or helper), f"{name}: {ast.unparse(n)} before _pdl.wait"


def test_release_placement_is_the_measured_one():
    """The projections and the attention split release the next kernel after their main loop; the short kernels
    never call start (they release at exit). Released first thing, the step measured slower (ops/_pdl.py)."""
    import ast

    for name, fn in _pdl_kernels():
        starts = [i for i, stmt in enumerate(fn.body) if any(_is_pdl_call(n, "start") for n in ast.walk(stmt))]
        if name in ("decode_linear._decode_linear_kernel", "decode_attention._decode_attention_split_kernel"):
            loops = [i for i, stmt in enumerate(fn.body) if isinstance(stmt, ast.For)]
            assert len(starts) == 1 and loops and starts[0] > max(loops), name
        else:
            assert not starts, name
