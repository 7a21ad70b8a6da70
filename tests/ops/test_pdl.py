"""Programmatic dependent launch (ops/_pdl.py) and the projections' L2 prefetch budget."""

import importlib
import types

import pytest
import torch

from tigon import ops
from tigon.ops import _pdl

dl = importlib.import_module("tigon.ops.decode_linear")
CUDA = types.SimpleNamespace(type="cuda")  # a device object for the launch-option logic (no GPU needed)


class _Kernel:
    """kernel[grid](*args, **kw) stand-in: records the calls, fails the ones that ask for what `refuse` names."""

    def __init__(self, refuse=()):
        self.calls, self.refuse = [], refuse

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append(kw)
            if any(kw.get(k) for k in self.refuse):
                raise RuntimeError(f"refused {sorted(kw)}")
            return "ran"
        return run


def test_options_off_on_cpu_and_when_disabled(monkeypatch):
    assert _pdl.options(torch.device("cpu")) == dict(PDL=False)
    monkeypatch.setattr(_pdl, "ENABLED", True)
    assert _pdl.options(torch.device("cpu")) == dict(PDL=False)  # never on a CPU, whatever the switch
    assert _pdl.options(CUDA) == dict(PDL=True, launch_pdl=True)
    monkeypatch.setattr(_pdl, "ENABLED", False)
    assert _pdl.options(CUDA) == dict(PDL=False)


def test_launch_falls_back_once_when_only_pdl_fails(monkeypatch, caplog):
    monkeypatch.setattr(_pdl, "ENABLED", True)
    k = _Kernel(refuse=("launch_pdl",))
    assert _pdl.launch(k, (1,), (), dict(BLOCK=4), CUDA) == "ran"
    assert k.calls == [dict(BLOCK=4, PDL=True, launch_pdl=True), dict(BLOCK=4, PDL=False)]
    assert _pdl.ENABLED is False and "without programmatic dependent launch" in caplog.text
    _pdl.launch(k, (1,), (), dict(BLOCK=4), CUDA)  # off from now on: one plain launch
    assert k.calls[-1] == dict(BLOCK=4, PDL=False) and len(k.calls) == 3


def test_launch_reraises_when_the_plain_launch_fails_too(monkeypatch):
    monkeypatch.setattr(_pdl, "ENABLED", True)
    with pytest.raises(RuntimeError, match="refused"):
        _pdl.launch(_Kernel(refuse=("BLOCK",)), (1,), (), dict(BLOCK=4), CUDA)
    assert _pdl.ENABLED is True  # the error was not PDL's: the switch stays


@pytest.mark.parametrize("budget", [0, 1 << 20, 24 << 20, 1 << 40])
@pytest.mark.parametrize("esize", [2, 4])
@pytest.mark.parametrize("rows,K,k_split,block_k", [(3072, 2048, 2048, 256), (16384, 2048, 2048, 256),
                                                    (2048, 8192, 2048, 256), (40, 130, 192, 64), (9, 40, 16, 16)])
def test_prefetch_budget(monkeypatch, budget, esize, rows, K, k_split, block_k):
    monkeypatch.setattr(dl, "PREFETCH_BYTES", budget)
    p = dl._prefetch(rows, K, k_split, block_k, esize)
    n, step = p["PREFETCH_K"], p["PF_LINES"] * p["PF_LINE"]
    assert p["PF_LINE"] * esize == 128 and p["PF_LINES"] >= 1 and p["PF_LINES"] & (p["PF_LINES"] - 1) == 0
    assert step >= min(2 * block_k, p["PF_LINE"])  # a loop step covers two K steps (at least one line)
    assert n % step == 0 and step <= n <= -(-k_split // step) * step  # whole loop steps, one to the split
    splits = -(-K // k_split)
    if n > step:  # more than the minimum: within the budget
        assert n * rows * splits * esize <= budget
    if budget >= rows * K * esize:
        assert n >= k_split  # the whole weight fits the budget: all of it


@pytest.mark.gpu
def test_decode_chain_in_a_graph_is_the_same_with_and_without_pdl(monkeypatch):
    """A decode layer's chain (q/k/v projection, RoPE + cache write, attention advancing the position, o
    projection, GLU MLP) captured in a CUDA graph and replayed over several steps: PDL on (prefetching
    the whole weights) gives the same bits as PDL off."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    H, Hq, Hkv, D, inter, C = 512, 8, 2, 64, 1408, 96
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dt)

    wq, wk, wv, wo = rnd(Hq * D, H, scale=H ** -0.5), rnd(Hkv * D, H, scale=H ** -0.5), \
        rnd(Hkv * D, H, scale=H ** -0.5), rnd(H, Hq * D, scale=H ** -0.5)
    gate, up, down = rnd(inter, H, scale=H ** -0.5), rnd(inter, H, scale=H ** -0.5), rnd(H, inter, scale=inter ** -0.5)
    nw = rnd(H) * 0.1 + 1
    ang = torch.rand(1, 1, D // 2, generator=g).to(dev) * 3
    cos, sin = torch.cat((ang.cos(), ang.cos()), -1).to(dt), torch.cat((ang.sin(), ang.sin()), -1).to(dt)
    x0 = rnd(1, H)

    def run(pdl_on):
        monkeypatch.setattr(_pdl, "ENABLED", None if pdl_on else False)
        monkeypatch.setattr(dl, "PREFETCH_BYTES", 1 << 30)
        kc, vc = torch.zeros(1, Hkv, C, D, dtype=dt, device=dev), torch.zeros(1, Hkv, C, D, dtype=dt, device=dev)
        pos = torch.full((C,), -1, dtype=torch.int64, device=dev)
        nxt = torch.zeros(1, dtype=torch.int64, device=dev)
        x = x0.clone()

        def step():
            qkv = ops.decode_linear(x, [wq, wk, wv], norm_weight=nw, eps=1e-5)
            q = qkv[:, :Hq * D].view(1, Hq, 1, D)
            k = qkv[:, Hq * D:(Hq + Hkv) * D].view(1, Hkv, 1, D)
            v = qkv[:, (Hq + Hkv) * D:].view(1, Hkv, 1, D)
            q = ops.rope_kv_append(k, v, cos, sin, kc, vc, pos, nxt, query=q)
            a = ops.decode_attention(q, kc, vc, pos, nxt, advance_q_pos=True)
            h = ops.decode_linear(a.reshape(1, -1), wo, residual=x)
            m = ops.decode_linear(h, [gate, up], norm_weight=nw, eps=1e-5, activation="silu")
            x.copy_(ops.decode_linear(m, down, residual=h))

        with torch.no_grad():
            step()  # JIT and first step outside the graph
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            outs = []
            for _ in range(5):
                graph.replay()
                outs.append(x.clone())
        torch.cuda.synchronize()
        return torch.stack(outs), pos.clone(), nxt.clone()

    on, off = run(True), run(False)
    assert on[2].item() == 6 and torch.equal(on[1][:6].cpu(), torch.arange(6))
    for a, b in zip(on, off):
        assert torch.equal(a, b)
