"""tigon.memory.tiling: the tiled node against the module run tile by tile (bitwise: the same GEMM shapes), Tigon's
MLP tiled against the untiled one and an fp64 reference (the fp32 error model; bf16 by assert_bound), RNG and
autocast replayed in the recompute, a tiny Llama with gradient checkpointing, PEFT LoRA, install/uninstall, and
the working set bounded by the tile (the largest tensor any op makes)."""

import copy
import pickle
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import tigon
from tests._grid import U32, assert_bound, assert_tol, matmul_tol
from tests.hf._tiny import batch, op_calls, tiny_model
from tigon.memory import (
    auto_tile_tokens,
    install_tiled_mlp,
    tiled_apply,
    tiled_mlp_installed,
    tiling,
    uninstall_tiled_mlp,
)
from tigon.modules import SwiGLUMLP

H, I = 16, 24


class TorchMLP(nn.Module):
    """LlamaMLP in plain torch (down(silu(gate(x)) * up(x))), with dropout on its input as LoRA has."""

    def __init__(self, h=H, i=I, dropout=0.0, dtype=torch.float32):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(h, i, bias=False), nn.Linear(h, i, bias=False)
        self.down_proj, self.drop = nn.Linear(i, h, bias=False), nn.Dropout(dropout)
        self.to(dtype)

    def forward(self, x):
        x = self.drop(x)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _tile_by_tile(fn, x, tile, dy, params):
    """The tiled result the plain way: fn on each tile under autograd, the tiles' outputs and dx concatenated, the
    tiles' parameter gradients summed in fp32 in tile order and rounded once."""
    ys, dxs, sums = [], [], [None] * len(params)
    for s in range(0, x.shape[-2], tile):
        x_t = x.detach()[..., s:s + tile, :].requires_grad_()
        y_t = fn(x_t)
        g = torch.autograd.grad(y_t, [x_t, *params], dy[..., s:s + tile, :])
        ys.append(y_t.detach())
        dxs.append(g[0])
        sums = [gi.float() if a is None else a + gi for a, gi in zip(sums, g[1:])]
    return torch.cat(ys, -2), torch.cat(dxs, -2), [a.to(p.dtype) for a, p in zip(sums, params)]


def _tiled(fn, x, tile, dy, params):
    y = tiled_apply(fn, x, tile)
    assert type(y.grad_fn).__name__ == "_TiledFunctionBackward"
    return y.detach(), *torch.autograd.grad(y, [x, *params], dy)


CASES = {"batch 2, T 13, tile 5": ((2, 13), 5, False), "packed [1, 13], tile 4": ((1, 13), 4, False),
         "non-contiguous x": ((3, 7), 3, True)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tiles_equal_the_module_run_tile_by_tile(case, dtype, device):
    shape, tile, transposed = CASES[case]
    torch.manual_seed(0)
    mlp = TorchMLP(dtype=dtype).to(device)
    params = list(mlp.parameters())
    x = torch.randn(*shape[:-1], H, shape[-1]).transpose(-1, -2) if transposed else torch.randn(*shape, H)
    x = x.to(device, dtype).requires_grad_()
    dy = torch.randn(*shape, H).to(device, dtype)
    got, want = _tiled(mlp, x, tile, dy, params), _tile_by_tile(mlp, x, tile, dy, params)
    for name, g, w in zip(["y", "dx", "dW_gate", "dW_up", "dW_down"], [got[0], got[1], *got[2:]],
                          [want[0], want[1], *want[2]]):
        assert g.dtype == w.dtype and torch.equal(g, w), name


def test_a_sequence_within_one_tile_runs_fn_as_it_is():
    mlp = TorchMLP()
    for t in (0, 5):
        x = torch.randn(2, t, H, requires_grad=True)
        y = tiled_apply(mlp, x, 5)
        assert torch.equal(y, mlp(x)) and type(y.grad_fn).__name__ != "_TiledFunctionBackward"
    with torch.no_grad():  # no gradient wanted: a plain loop over the tiles, no autograd node
        y = tiled_apply(mlp, torch.randn(2, 13, H), 5)
    assert y.grad_fn is None and y.shape == (2, 13, H)


def _swiglu_model(x, wg, wu, wd, dy):
    """fp64 values of down(silu(x Wg^T) * (x Wu^T)) and its VJP for dy, each with the fp32 error model's tolerance
    per element (tests/_grid.py): the GEMMs by matmul_tol, first-order propagation through silu (|silu'| <= 1.1,
    |silu''| <= 0.5), 4 ulps for sigmoid's exp and divide, one rounding per product."""
    x, dy = x.detach().double().reshape(-1, x.shape[-1]), dy.detach().double().reshape(-1, dy.shape[-1])
    wg, wu, wd = (w.detach().double() for w in (wg, wu, wd))
    g, g_tol, u, u_tol = x @ wg.T, matmul_tol(x, wg.T), x @ wu.T, matmul_tol(x, wu.T)
    sig = torch.sigmoid(g)
    s, d = g * sig, sig * (1 + g * (1 - sig))
    s_tol, d_tol = 1.1 * g_tol + 4 * U32 * s.abs(), 0.5 * g_tol + 4 * U32 * (1 + g.abs())
    h = s * u
    h_tol = u.abs() * s_tol + s.abs() * u_tol + U32 * h.abs()
    dh, dh_tol = dy @ wd, matmul_tol(dy, wd)
    du, dg = dh * s, dh * u * d
    du_tol = s.abs() * dh_tol + dh.abs() * s_tol + U32 * du.abs()
    dg_tol = (u * d).abs() * dh_tol + (dh * d).abs() * u_tol + (dh * u).abs() * d_tol + 2 * U32 * dg.abs()
    dx = dg @ wg + du @ wu
    dx_tol = matmul_tol(dg, wg, a_tol=dg_tol) + matmul_tol(du, wu, a_tol=du_tol) + U32 * dx.abs()
    return {"y": (h @ wd.T, matmul_tol(h, wd.T, a_tol=h_tol)), "dx": (dx, dx_tol),
            "dW_gate": (dg.T @ x, matmul_tol(dg.T, x, a_tol=dg_tol.T)),
            "dW_up": (du.T @ x, matmul_tol(du.T, x, a_tol=du_tol.T)),
            "dW_down": (dy.T @ h, matmul_tol(dy.T, h, b_tol=h_tol))}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tigon_mlp_tiled_matches_untiled_and_fp64(dtype, device):
    """Tigon's SwiGLUMLP (its Triton kernels: the interpreter on a CPU) tiled in 3 tiles of 5 rows (the last 3)."""
    torch.manual_seed(0)
    mlp = SwiGLUMLP(hidden_size=H, intermediate_size=I).to(device, dtype)
    for w in mlp.parameters():
        nn.init.normal_(w, 0.0, 0.3)
    params = [mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight]
    x = torch.randn(2, 13, H).to(device, dtype).requires_grad_()
    dy = torch.randn(2, 13, H).to(device, dtype)
    tiled = dict(zip(["y", "dx", "dW_gate", "dW_up", "dW_down"], _tiled(mlp, x, 5, dy, params)))
    y = mlp(x)
    untiled = dict(zip(tiled, [y.detach(), *torch.autograd.grad(y, [x, *params], dy)]))
    model = _swiglu_model(x, *params, dy)
    for name, (ref, tol) in model.items():
        got, plain = tiled[name].reshape(ref.shape), untiled[name].reshape(ref.shape)
        if dtype == torch.float32:
            assert_tol(f"tiled {name}", got, ref, tol)
            assert_tol(f"untiled {name}", plain, ref, tol)
            with pytest.raises(AssertionError):  # negative control: 1e-3 off fails the model
                assert_tol(f"{name} * (1 + 1e-3)", got * (1 + 1e-3), ref, tol)
        else:
            assert_bound(f"tiled {name}", got, plain, ref, dtype)


def _rng(device):
    return torch.cuda.get_rng_state(device) if device.type == "cuda" else torch.get_rng_state()


def test_dropout_masks_replay_in_the_recompute_and_the_rng_moves_on_once(device):
    torch.manual_seed(0)
    mlp = TorchMLP(dropout=0.5).to(device)
    params = list(mlp.parameters())
    x = torch.randn(2, 13, H, device=device, requires_grad=True)
    dy = torch.randn(2, 13, H, device=device)
    torch.manual_seed(7)
    want = _tile_by_tile(mlp, x, 5, dy, params)
    after_plain = _rng(device)
    torch.manual_seed(7)
    y = tiled_apply(mlp, x, 5)
    after_forward = _rng(device)
    got = torch.autograd.grad(y, [x, *params], dy)
    assert torch.equal(after_forward, after_plain) and torch.equal(_rng(device), after_forward)
    assert torch.equal(y, want[0]) and torch.equal(got[0], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got[1:], want[2]))


def test_autocast_replays_in_the_recompute(device):
    torch.manual_seed(0)
    mlp = TorchMLP().to(device)
    params = list(mlp.parameters())
    x = torch.randn(2, 13, H, device=device, requires_grad=True)
    dy = torch.randn(2, 13, H, device=device).bfloat16()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        y = tiled_apply(mlp, x, 5)
        want = _tile_by_tile(mlp, x, 5, dy, params)
    got = torch.autograd.grad(y, [x, *params], dy)  # the backward outside autocast, as a Trainer runs it
    assert y.dtype == torch.bfloat16 and all(g.dtype == torch.float32 for g in got)
    assert torch.equal(y, want[0]) and torch.equal(got[0], want[1])
    assert all(torch.equal(g, w) for g, w in zip(got[1:], want[2]))


def test_parameter_gradients_reach_autograd_once_a_backward():
    mlp = TorchMLP()
    calls = []
    for p in mlp.parameters():
        p.register_post_accumulate_grad_hook(lambda p: calls.append(p))
    x = torch.randn(2, 13, H, requires_grad=True)
    tiled_apply(mlp, x, 5).square().sum().backward()
    assert len(calls) == 3  # one per parameter, not one per tile
    grads = torch.autograd.grad(tiled_apply(mlp, x, 5).square().sum(), list(mlp.parameters()))
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, mlp.parameters()))


def test_a_trainable_tensor_outside_params_is_an_error():
    mlp, scale = TorchMLP(), torch.ones(H, requires_grad=True)
    x = torch.randn(2, 13, H, requires_grad=True)
    y = tiled_apply(lambda t: mlp(t) * scale, x, 5, params=list(mlp.parameters()))
    with pytest.raises(ValueError, match=r"tiled_apply: fn uses a tensor of shape \(16,\) that requires grad"):
        y.sum().backward()
    with pytest.raises(ValueError, match="tiled_apply: fn uses a tensor that requires grad and is not in params"):
        tiled_apply(lambda t: mlp(t), x.detach(), 5)  # a lambda has no parameters of its own
    w0 = torch.randn(H, H, requires_grad=True)
    w = w0 * 2  # a weight computed from another: an input of the node like any parameter, its gradient flows on
    tiled_apply(lambda t: t @ w, x, 5, params=[w]).sum().backward()
    torch.testing.assert_close(w0.grad, 2 * x.detach().reshape(-1, H).T @ torch.ones(26, H))


def _gate_calls(model):
    calls = []
    for name, m in model.named_modules():
        if name.endswith("mlp.gate_proj"):  # PEFT's lora.Linear, or the Linear itself
            m.register_forward_pre_hook(lambda m, a: calls.append(a[0].shape[-2]))
    return calls


def _llama_step(model, b=2, t=7):
    ids, labels = batch(b=b, t=t)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    return loss.detach(), grads


@pytest.mark.parametrize("patched, reentrant", [(False, False), (False, True), (True, False)],
                         ids=["hf", "hf-reentrant", "tigon.patch"])
def test_checkpointed_llama_matches_untiled_and_fp64(patched, reentrant):
    ref = tiny_model("llama", num_hidden_layers=1)
    ref64 = copy.deepcopy(ref).double()
    if patched:
        tigon.patch(ref)  # Tigon's SwiGLUMLP, RMSNorm, RoPE and loss: its kernels, the interpreter on a CPU
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": reentrant})
        m.train()
    assert install_tiled_mlp(model, tile_tokens=3) == 1 and tiled_mlp_installed(model)
    calls = [] if patched else _gate_calls(model)  # (a hook on gate_proj turns Tigon's one-node MLP off)
    before = (op_calls("swiglu"), op_calls("swiglu_mlp"))
    got = _llama_step(model)
    glu_calls = (op_calls("swiglu") - before[0], op_calls("swiglu_mlp") - before[1])
    plain, exact = _llama_step(ref), _llama_step(ref64)
    if patched:  # the forward's tiles through the GLU kernel, the backward's through the one-node MLP, none between
        assert glu_calls == (3, 3)
    else:  # the 3 tiles (3, 3, 1 rows) in the forward and the backward; the non-reentrant checkpoint's recompute
        # stops at the kept input, the reentrant one reruns the layer and the tiles' forward with it
        assert calls == [3, 3, 1] * (3 if reentrant else 2)
    assert_bound("loss", got[0], plain[0], exact[0], torch.float32)
    for name, g in got[1].items():
        assert_bound(name, g, plain[1][name], exact[1][name], torch.float32)


def test_peft_lora_llama_with_checkpointing_matches_untiled():
    peft = pytest.importorskip("peft")
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    models = []
    for _ in range(3):
        torch.manual_seed(0)
        m = peft.get_peft_model(tiny_model("llama", num_hidden_layers=1),
                                peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets))
        with torch.no_grad():
            for n, p in m.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.2, generator=torch.Generator().manual_seed(len(n)))
        m.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.enable_input_require_grads()
        models.append(m.train())
    model, ref, ref64 = models[0], models[1], models[2].double()
    assert install_tiled_mlp(model, tile_tokens=4) == 1
    calls = _gate_calls(model)
    got, plain, exact = _llama_step(model), _llama_step(ref), _llama_step(ref64)
    assert calls == [4, 3] * 2
    assert set(got[1]) == set(plain[1]) and all("lora_" in n for n in got[1])  # the frozen base gets no grads
    assert_bound("loss", got[0], plain[0], exact[0], torch.float32)
    for name, g in got[1].items():
        assert_bound(name, g, plain[1][name], exact[1][name], torch.float32)


def test_eval_runs_untiled_and_training_without_grad_tiles():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    install_tiled_mlp(model, tile_tokens=3)
    calls = _gate_calls(model)
    ids, _ = batch(b=2, t=7)
    with torch.no_grad():
        assert torch.equal(model.eval()(ids).logits, ref.eval()(ids).logits)
        assert calls == [7, 7]
        model.train()(ids)  # a reentrant checkpoint's first pass: no grad, training
    assert calls[2:] == [3, 3, 1] * 2


class _Layer(nn.Module):
    def __init__(self, mlp):
        super().__init__()
        self.mlp = mlp


def test_uninstall_restores_the_forward_each_mlp_had():
    plain, hooked, experts = TorchMLP(), TorchMLP(), TorchMLP()
    experts.experts = nn.ModuleList([TorchMLP()])  # an MoE block: left alone
    own = lambda x: TorchMLP.forward(hooked, x)  # noqa: E731  (another library's forward, set before the install)
    hooked.forward = own
    model = nn.ModuleList([_Layer(plain), _Layer(hooked), _Layer(experts)])
    assert install_tiled_mlp(model, tile_tokens=4) == 2 and install_tiled_mlp(model, tile_tokens=5) == 2
    assert "forward" not in experts.__dict__
    assert plain.forward.plan.tile_tokens == 5 and hooked.forward.inner is own
    copied, loaded = copy.deepcopy(model), pickle.loads(pickle.dumps(nn.ModuleList([model[0]])))
    assert tiled_mlp_installed(copied) and copied[0].mlp.forward.module is copied[0].mlp
    assert loaded[0].mlp.forward.module is loaded[0].mlp and loaded[0].mlp.forward.plan.tile_tokens == 5
    assert uninstall_tiled_mlp(model) == 2 and not tiled_mlp_installed(model)
    assert "forward" not in plain.__dict__ and hooked.forward is own and uninstall_tiled_mlp(model) == 0
    # a forward set over the tiled one after the install stays; the tiled one under it passes calls through
    install_tiled_mlp(model, tile_tokens=4)
    tiled_forward = plain.forward
    plain.forward = lambda x: tiled_forward(x)
    uninstall_tiled_mlp(model)
    calls = _gate_calls(model)
    model[0].mlp(torch.randn(1, 9, H))
    assert calls == [9]


def test_bad_arguments_are_refused_and_change_nothing():
    model = nn.ModuleList([_Layer(TorchMLP())])
    for bad, err in [(0, ValueError), (-3, ValueError), (2.5, TypeError), (True, TypeError), ("big", ValueError),
                     (None, TypeError)]:
        with pytest.raises(err, match="install_tiled_mlp: tile_tokens must be a positive int"):
            install_tiled_mlp(model, tile_tokens=bad)
    no_mlp = nn.Sequential(nn.Linear(4, 4))
    with pytest.raises(ValueError, match="install_tiled_mlp: Sequential has no layer with a dense `.mlp`"):
        install_tiled_mlp(no_mlp)
    with pytest.raises(TypeError, match="install_tiled_mlp: model must be a torch.nn.Module"):
        install_tiled_mlp("llama")
    assert not tiled_mlp_installed(model) and "forward" not in model[0].mlp.__dict__
    x = torch.randn(2, 7, H)
    for kw, err, what in [(dict(fn=3, x=x, tile_tokens=2), TypeError, "fn must be callable"),
                          (dict(fn=abs, x=x[0, 0], tile_tokens=2), ValueError, r"x must have shape \[..., T, H\]"),
                          (dict(fn=abs, x=x, tile_tokens="auto"), TypeError, "tile_tokens must be a positive int"),
                          (dict(fn=abs, x=x, tile_tokens=0), ValueError, "tile_tokens must be a positive int")]:
        with pytest.raises(err, match=f"tigon.memory.tiled_apply: {what}"):
            tiled_apply(**kw)


def test_auto_tile_length():
    # Llama-3-8B's MLP in bf16 with 40 GiB free: 1/16 of it over 4 x 14336 x 2 bytes a token
    assert auto_tile_tokens(14336, 2, 40 << 30) == (40 << 30) // 16 // (4 * 14336 * 2) // 256 * 256 == 23296
    assert auto_tile_tokens(14336, 2, 40 << 30, rows_per_token=4) == 5632
    assert auto_tile_tokens(14336, 2, 1 << 20) == tiling.TILE_ALIGN  # never below one aligned tile
    assert auto_tile_tokens(14336, 2, None) == tiling.CPU_AUTO_TILE_TOKENS
    mlp = TorchMLP()
    install_tiled_mlp(_Layer(mlp))
    assert mlp.forward.plan.tokens(torch.randn(1, 5, H), I) == tiling.CPU_AUTO_TILE_TOKENS


def test_free_memory_respects_the_process_cap(monkeypatch):
    # an 80 GiB card with 70 GiB free, this process capped at 0.3 of it (a 24 GB card emulated) with 6 GiB
    # reserved: 24 - 6 = 18 GiB are left to it, not the driver's 70
    card = SimpleNamespace(total_memory=80 << 30)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 << 30, 80 << 30))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: card)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 << 30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.3)
    dev = torch.device("cuda", 0)
    assert tiling.process_cap_bytes(dev) == int(0.3 * (80 << 30))
    assert tiling.card_free_bytes(dev) == int(0.3 * (80 << 30)) - (6 << 30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    assert tiling.card_free_bytes(dev) == 70 << 30  # no cap: the driver's free bytes
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 79 << 30)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.5)
    assert tiling.card_free_bytes(dev) == 0  # reserved past the cap: nothing, never negative


class _LargestTensor(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_the_working_set_is_bounded_by_the_tile():
    """The largest tensor any op makes in a checkpointed layer's forward and backward: untiled, the [T, I]
    intermediates; tiled, the [T, H] input and gradients, the [I, H] weights' gradients and [tile, I]."""
    T, h, i, tile = 64, 8, 64, 4
    mlp = TorchMLP(h, i)
    x = torch.randn(T, h, requires_grad=True)
    for tiled, largest in [(False, T * i), (True, max(T * h, h * i, tile * i))]:
        with _LargestTensor() as mode:
            fn = (lambda t: tiled_apply(mlp, t, tile)) if tiled else mlp
            torch.utils.checkpoint.checkpoint(fn, x, use_reentrant=False).sum().backward()
        assert mode.largest == largest, (tiled, mode.largest)


def test_compiled_model_runs_the_mlp_untiled_in_one_graph():
    torch.manual_seed(0)
    layer = _Layer(TorchMLP())
    install_tiled_mlp(layer, tile_tokens=4)
    compiled = torch.compile(lambda x: layer.mlp(x), fullgraph=True, backend="aot_eager")
    x = torch.randn(2, 9, H, requires_grad=True)
    calls = _gate_calls(layer)
    compiled(x).sum().backward()
    got = x.grad
    x.grad = None
    uninstall_tiled_mlp(layer)
    layer.mlp(x).sum().backward()
    assert torch.equal(got, x.grad) and calls[0] == 9  # the traced call saw the whole sequence


@pytest.mark.parametrize("name, act", [("LigerTiledSwiGLUMLP", "silu"), ("LigerTiledGEGLUMLP", "gelu_pytorch_tanh")])
def test_liger_tiled_mlps_shard_as_liger(name, act):
    """Liger's shards: torch.chunk of the tokens into num_shards (None: ceil(T / hidden), below 1: one), in eval
    too; the result is the untiled MLP's. Against Liger's own module where its kernels run (a GPU: they do not
    run in Triton's interpreter)."""
    from tigon.compat import liger

    config = SimpleNamespace(hidden_size=H, intermediate_size=I, hidden_act=act)
    x5 = torch.randn(1, 5, H)
    for shards in (3, 4, 0, None):
        mlp = getattr(liger, name)(config, num_shards=shards).eval()
        calls = _gate_calls(_Layer(mlp))
        with torch.no_grad():
            mlp(x5)
        liger_shards = max(1, -(-5 // H) if shards is None else shards)
        assert calls == [c.shape[-2] for c in torch.chunk(x5, liger_shards, dim=-2)], shards
    with pytest.raises(TypeError, match=f"{name}: num_shards must be None or an int, got float"):
        getattr(liger, name)(config, num_shards=2.0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    tiled = getattr(liger, name)(config, num_shards=3).to(device)
    untiled = type(tiled).__mro__[1](config).to(device)  # LigerSwiGLUMLP / LigerGEGLUMLP: one call
    untiled.load_state_dict(tiled.state_dict())
    mlps = [tiled, untiled]
    if device == "cuda":
        lk = pytest.importorskip("liger_kernel.transformers")
        mlps.append(getattr(lk, name)(config, num_shards=3).cuda())
        mlps[-1].load_state_dict(tiled.state_dict())
    x = torch.randn(2, 13, H, device=device, requires_grad=True)
    dy = torch.randn(2, 13, H, device=device)
    outs = []
    for mlp in mlps:  # .backward, not autograd.grad: Liger's module adds its weight gradients into .grad itself
        x.grad = None
        mlp.zero_grad(set_to_none=True)
        y = mlp(x)
        y.backward(dy)
        outs.append([y.detach(), x.grad.clone(), *(p.grad for p in mlp.parameters())])
    for other in outs[1:]:
        for a, b in zip(outs[0], other):  # fp32, row-independent math: the GEMMs' and kernels' rounding apart
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.gpu
def test_gpu_peak_memory_is_bounded_by_the_tile():
    T, h, i, tile = 32768, 1024, 4096, 2048
    mlp = SwiGLUMLP(hidden_size=h, intermediate_size=i).cuda().bfloat16()
    x = torch.randn(T, h, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    peaks = []
    for tiled in (False, True):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        (tiled_apply(mlp, x, tile) if tiled else mlp(x)).sum().backward()
        torch.cuda.synchronize()
        peaks.append(torch.cuda.max_memory_allocated() - base)
        x.grad = None
        mlp.zero_grad(set_to_none=True)
    # untiled: gate, up and h [T, I] alive at once (3 x 256 MiB); tiled: x-sized buffers (y, dy, dx: 64 MiB
    # each), fp32 weight-gradient sums (3 x 16 MiB), weight gradients, and 6 [tile, I] tensors (16 MiB each)
    model = 2 * (4 * T * h + 6 * tile * i) + 3 * 4 * h * i + 3 * 2 * h * i
    assert peaks[1] <= model, f"tiled peak {peaks[1] / 2**20:.0f} MiB > model {model / 2**20:.0f} MiB"
    assert peaks[0] >= 3 * 2 * T * i
