"""Each module against the transformers / torch module it replaces: forward and the gradients of the input
and every parameter (kernel vs fp64 vs the HF module in dtype), state_dict both ways (strict), from_hf."""

import copy

import pytest
import torch

from tests._grid import assert_bound, grads, randn
from tigon import modules, ops
from tigon.ops import reference

pytest.importorskip("transformers")

DTYPES = [torch.float32, torch.bfloat16]


def _hf(name):
    import importlib

    module, cls = name.rsplit(".", 1)
    return getattr(importlib.import_module(f"transformers.models.{module}"), cls)


def _compare(name, ours, theirs, ref, x, dtype):
    """ours and theirs in dtype, ref a float64 callable of (x64, params in theirs' order): forward and
    the gradients of x and of every parameter, by the op contract's bound."""
    x = x.detach().requires_grad_(True)
    x_hf = x.detach().clone().requires_grad_(True)
    x64 = x.detach().double().requires_grad_(True)
    p_ours = dict(ours.named_parameters())
    p_hf = dict(theirs.named_parameters())
    assert p_ours.keys() == p_hf.keys()
    names = list(p_hf)
    p64 = [p_hf[n].detach().double().requires_grad_(True) for n in names]
    y, y_hf, y64 = ours(x), theirs(x_hf), ref(x64, p64)
    assert y.dtype == y_hf.dtype
    assert_bound(f"{name} out", y, y_hf, y64, dtype)
    go = torch.randn(y.shape, device=y.device).to(y.dtype)
    g = grads(y, [x] + [p_ours[n] for n in names], go)
    g_hf = grads(y_hf, [x_hf] + [p_hf[n] for n in names], go)
    g64 = grads(y64, [x64] + p64, go.double())
    for n, a, b, c in zip(["x"] + names, g, g_hf, g64):
        assert_bound(f"{name} grad {n}", a, b, c, dtype)


def _state_dicts_interchange(ours, theirs):
    twin = copy.deepcopy(theirs)
    for p in twin.parameters():
        torch.nn.init.normal_(p)
    ours.load_state_dict(twin.state_dict(), strict=True)
    theirs.load_state_dict(ours.state_dict(), strict=True)
    for k, v in twin.state_dict().items():
        assert torch.equal(theirs.state_dict()[k], v)


NORMS = [  # HF class, offset, casting_mode
    ("llama.modeling_llama.LlamaRMSNorm", 0.0, "llama"),
    ("gemma.modeling_gemma.GemmaRMSNorm", 1.0, "gemma"),
    ("qwen3.modeling_qwen3.Qwen3RMSNorm", 0.0, "llama"),
    ("mistral.modeling_mistral.MistralRMSNorm", 0.0, "llama"),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hf_name,offset,mode", NORMS)
def test_rms_norm_module(device, dtype, hf_name, offset, mode):
    torch.manual_seed(0)
    H = 37
    hf = _hf(hf_name)(H, eps=1e-5).to(device)
    ours = modules.RMSNorm(H, eps=1e-5, offset=offset, casting_mode=mode, device=device)
    assert torch.equal(ours.weight, hf.weight)  # the same init: ones, or zeros for Gemma's 1 + w
    _state_dicts_interchange(ours, hf)
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = randn(2, 3, H, dtype=dtype, device=device, scale=2.0)

    def ref(x64, p64):
        return reference.rms_norm(x64, p64[0], 1e-5, offset=offset, casting_mode=mode)

    _compare(hf_name, ours, hf, ref, x, dtype)
    # from_hf: shares the Parameter and knows the formula of the HF class without being told
    shared = modules.RMSNorm.from_hf(hf)
    assert shared.weight is hf.weight and shared.eps == 1e-5
    assert (shared.offset, shared.casting_mode) == (offset, mode)
    assert torch.equal(shared(x), ours(x))


def test_rms_norm_module_api(device):
    n = modules.RMSNorm(8, 1e-5, device=device)
    assert n.variance_epsilon == n.eps == 1e-5
    n.variance_epsilon = 1e-3
    assert n.eps == 1e-3 and n.hidden_size == 8
    assert torch.equal(modules.RMSNorm(4, offset=1.0).weight, torch.zeros(4))
    assert "eps=0.001" in repr(n) and "casting_mode='llama'" in repr(n)
    with pytest.raises(ValueError, match="casting_mode"):
        modules.RMSNorm(8, casting_mode="t5")
    with pytest.raises(TypeError, match="from_hf"):
        modules.RMSNorm.from_hf(torch.nn.Linear(2, 2))
    # forward(x, residual) is add_rms_norm: (normed sum, sum)
    x, r = randn(3, 8, device=device), randn(3, 8, device=device)
    y, s = n(x, r)
    y_ref, s_ref = ops.add_rms_norm(x, r, n.weight, 1e-3)
    assert torch.equal(y, y_ref) and torch.equal(s, s_ref)
    # an explicit keyword beats the class-name default (the patcher passes its table's row)
    g = modules.RMSNorm.from_hf(_hf("gemma.modeling_gemma.GemmaRMSNorm")(8), casting_mode="none")
    assert (g.offset, g.casting_mode) == (1.0, "none")


LN_CASES = [dict(), dict(bias=False), dict(elementwise_affine=False)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kw", LN_CASES, ids=["affine", "no_bias", "no_affine"])
def test_layer_norm_module(device, dtype, kw):
    try:
        ops.layer_norm(torch.ones(1, 2), None, None)
    except NotImplementedError:
        pytest.skip("tigon.ops.layer_norm is still a placeholder")
    torch.manual_seed(1)
    H = 45
    theirs = torch.nn.LayerNorm(H, eps=1e-5, device=device, **kw)
    ours = modules.LayerNorm(H, eps=1e-5, device=device, **kw)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    if list(theirs.parameters()):
        _state_dicts_interchange(ours, theirs)
    theirs, ours = theirs.to(dtype), ours.to(dtype)
    x = randn(2, 3, H, dtype=dtype, device=device, scale=2.0) + 0.5
    names = [n for n, _ in theirs.named_parameters()]

    def ref(x64, p64):
        p = dict(zip(names, p64))
        return torch.nn.functional.layer_norm(x64, (H,), p.get("weight"), p.get("bias"), 1e-5)

    _compare("LayerNorm", ours, theirs, ref, x, dtype)
    shared = modules.LayerNorm.from_hf(theirs)
    assert shared.weight is theirs.weight and shared.bias is theirs.bias
    assert torch.equal(shared(x), ours(x))
    assert repr(shared) == repr(ours)


def test_layer_norm_module_api():
    with pytest.raises(ValueError, match="last dim"):
        modules.LayerNorm((4, 5))
    with pytest.raises(TypeError, match="from_hf"):
        modules.LayerNorm.from_hf(torch.nn.Linear(2, 2))
    n = modules.LayerNorm(6)
    with torch.no_grad():
        n.weight.mul_(3)
    n.reset_parameters()
    assert torch.equal(n.weight, torch.ones(6)) and torch.equal(n.bias, torch.zeros(6))


def _config(kind, **kw):
    import transformers

    cls = {"llama": transformers.LlamaConfig, "gemma": transformers.GemmaConfig, "phi3": transformers.Phi3Config}
    return cls[kind](hidden_size=24, intermediate_size=40, num_attention_heads=2, num_key_value_heads=2, **kw)


MLPS = [  # id, HF class, config kind, config kwargs, ours, ours' kwargs
    ("llama", "llama.modeling_llama.LlamaMLP", "llama", {}, modules.SwiGLUMLP, {}),
    ("llama_bias", "llama.modeling_llama.LlamaMLP", "llama", {"mlp_bias": True}, modules.SwiGLUMLP, {}),
    ("gemma", "gemma.modeling_gemma.GemmaMLP", "gemma", {}, modules.GeGLUMLP, {}),
    ("phi3", "phi3.modeling_phi3.Phi3MLP", "phi3", {}, modules.SwiGLUMLP, {"fused_gate_up": True}),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", MLPS, ids=[m[0] for m in MLPS])
def test_mlp_module(device, dtype, case):
    _, hf_name, kind, ckw, cls, okw = case
    torch.manual_seed(2)
    config = _config(kind, **ckw)
    hf = _hf(hf_name)(config).to(device)
    ours = cls(config, device=device, **okw)
    assert ours.state_dict().keys() == hf.state_dict().keys()
    _state_dicts_interchange(ours, hf)
    hf, ours = hf.to(dtype), ours.to(dtype)
    x = randn(2, 3, 24, dtype=dtype, device=device)
    hf64 = copy.deepcopy(hf).double()
    names = [n for n, _ in hf64.named_parameters()]

    def ref(x64, p64):
        return torch.func.functional_call(hf64, dict(zip(names, p64)), (x64,))

    _compare(hf_name, ours, hf, ref, x, dtype)
    shared = cls.from_hf(hf)
    assert all(a is b for a, b in zip(shared.parameters(), hf.parameters()))
    assert dict(shared.named_children()).keys() == dict(hf.named_children()).keys() - {"act_fn", "activation_fn"}
    fused = okw.get("fused_gate_up", False)
    assert (shared.hidden_size, shared.intermediate_size, shared.fused_gate_up) == (24, 40, fused)
    assert torch.equal(shared(x), ours(x))


@pytest.mark.parametrize("fused", [False, True])
def test_mlp_module_backward_writes_over_its_projections(device, fused):
    # The module path runs the in-place backward: the gradient reaching gate_proj's (or gate_up_proj's)
    # output lives in that output's own storage, and the gradients are still the eager ones.
    torch.manual_seed(3)
    mlp = modules.SwiGLUMLP(hidden_size=16, intermediate_size=24, fused_gate_up=fused, device=device)
    proj = mlp.gate_up_proj if fused else mlp.gate_proj
    seen = []

    def keep(_, __, out):
        out.register_hook(lambda g: seen.append(g.data_ptr() == out.data_ptr()))

    handle = proj.register_forward_hook(keep)
    x = randn(2, 5, 16, device=device, requires_grad=True)
    go = torch.randn(2, 5, 16, device=device)
    got = torch.autograd.grad(mlp(x), [x, *mlp.parameters()], go)
    handle.remove()
    assert seen == [True]

    def eager(x):
        if fused:
            g, u = mlp.gate_up_proj(x).chunk(2, -1)
        else:
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
        return mlp.down_proj(torch.nn.functional.silu(g) * u)

    want = torch.autograd.grad(eager(x), [x, *mlp.parameters()], go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_mlp_module_api():
    m = modules.SwiGLUMLP(hidden_size=8, intermediate_size=12, bias=True)
    assert m.gate_proj.bias is not None and m.config is None
    assert "intermediate_size=12" in repr(m)
    m = modules.SwiGLUMLP(_config("llama"), intermediate_size=6)  # the patcher's MoE shared-expert form
    assert m.up_proj.out_features == 6 and m.gate_proj.in_features == 24 and m.gate_proj.bias is None
    with pytest.raises(ValueError, match="hidden_size"):
        modules.SwiGLUMLP()
    with pytest.raises(ValueError, match="gelu_pytorch_tanh"):
        modules.SwiGLUMLP(_config("gemma"))
    with pytest.raises(ValueError, match="silu"):
        modules.GeGLUMLP.from_hf(_hf("llama.modeling_llama.LlamaMLP")(_config("llama")))
    with pytest.raises(TypeError, match="projections"):
        modules.SwiGLUMLP.from_hf(torch.nn.Linear(2, 2))


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("cls,act", [(modules.SwiGLUMLP, torch.nn.functional.silu),
                                     (modules.GeGLUMLP, lambda g: torch.nn.functional.gelu(g, approximate="tanh"))],
                         ids=["swiglu", "geglu"])
def test_mlp_module_output_takes_in_place_writes(device, cls, act, fused):
    # Llama-4's shared expert adds the routed experts into the MLP's output in place (out.add_(routed)): the
    # one-node MLP's output must be a tensor of its own, not a view made inside its autograd.Function.
    torch.manual_seed(4)
    mlp = cls(hidden_size=16, intermediate_size=24, fused_gate_up=fused, device=device)
    x = randn(2, 5, 16, device=device, requires_grad=True)
    out = mlp(x)
    assert type(out.grad_fn).__name__ == "_GLUMLPBackward"  # the one-node op ran, not the three Linears
    assert out._base is None
    out.add_(1)
    go = torch.randn(2, 5, 16, device=device)
    got = torch.autograd.grad(out, [x, *mlp.parameters()], go)

    def eager(x):
        if fused:
            g, u = mlp.gate_up_proj(x).chunk(2, -1)
        else:
            g, u = mlp.gate_proj(x), mlp.up_proj(x)
        return mlp.down_proj(act(g) * u) + 1

    want_out = eager(x)
    torch.testing.assert_close(out.detach(), want_out.detach())
    want = torch.autograd.grad(want_out, [x, *mlp.parameters()], go)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b)


def test_member_reads_as_getattr_does():
    """`modules.mlp.member` (the decode wing's fast read of parameters and submodules) resolves a name as
    nn.Module's getattr does: an instance attribute, then parameters, buffers, submodules; a missing name raises
    AttributeError; and `plain_linear` through it still refuses a bias, a hook or a wrapper."""
    from torch import nn

    from tigon.modules.mlp import member, plain_linear

    lin = nn.Linear(3, 4, bias=False)
    lin.register_buffer("scale", torch.ones(4))
    lin.add_module("inner", nn.Identity())
    for name in ("weight", "bias", "scale", "inner", "in_features"):
        assert member(lin, name) is getattr(lin, name), name
    with pytest.raises(AttributeError, match="nope"):
        member(lin, "nope")
    assert plain_linear(lin)
    assert not plain_linear(nn.Linear(3, 4))  # a bias
    hooked = nn.Linear(3, 4, bias=False)
    hooked.register_forward_hook(lambda *a: None)
    assert not plain_linear(hooked)
    assert not plain_linear(nn.Sequential(nn.Linear(3, 4, bias=False)))
