import pytest
import torch

from tests._grid import DTYPES, KernelSpy, assert_bound, assert_no_sync_and_deterministic, fp64_copy, grads, randn
from tigon import ops
from tigon.ops import reference

# (head dim, rotary dim): full rotary at tiny, odd-block and real sizes, then partial rotary
DIMS = [(2, 2), (8, 8), (64, 64), (64, 32), (10, 6)]
LAYOUTS = ["hf", "contiguous", "bthd", "fused_qkv"]


def _qk(layout, B, Hq, Hkv, T, D, dtype, device):
    """q, k in the memory layouts HF hands over, with requires_grad, and the unsqueeze_dim to use."""
    if layout == "hf":  # x.view(B, T, H, D).transpose(1, 2): stride(1) = D, stride(2) = H * D
        q = randn(B, T, Hq, D, dtype=dtype, device=device).transpose(1, 2)
        k = randn(B, T, Hkv, D, dtype=dtype, device=device).transpose(1, 2)
        ud = 1
    elif layout == "contiguous":
        q = randn(B, Hq, T, D, dtype=dtype, device=device)
        k = randn(B, Hkv, T, D, dtype=dtype, device=device)
        ud = 1
    elif layout == "bthd":  # unsqueeze_dim=2: q [B, T, H, D]
        q = randn(B, T, Hq, D, dtype=dtype, device=device)
        k = randn(B, T, Hkv, D, dtype=dtype, device=device)
        ud = 2
    else:  # slices of one fused qkv projection: not dense; the outputs are dense in the same dim order
        qkv = randn(B, T, Hq + 2 * Hkv, D, dtype=dtype, device=device)
        q, k, ud = qkv[:, :, :Hq].transpose(1, 2), qkv[:, :, Hq:Hq + Hkv].transpose(1, 2), 1
    return q.requires_grad_(True), k.requires_grad_(True), ud


def _cos_sin(Bc, T, rd, dtype, device, strided=False):
    """Random cos/sin (halves differ, so the backward's half swap is tested), optionally not unit-stride."""
    if strided:
        cos = randn(Bc, rd, T, dtype=dtype, device=device).transpose(1, 2)
        sin = randn(Bc, rd, T, dtype=dtype, device=device).transpose(1, 2)
    else:
        cos, sin = randn(Bc, T, rd, dtype=dtype, device=device), randn(Bc, T, rd, dtype=dtype, device=device)
    return cos, sin


def _eager(q, k, cos, sin, ud):
    """The HF formula in the activation dtype (HF casts cos/sin to it first), partial rotary as GPT-NeoX's."""
    cos, sin, rd = cos.to(q.dtype), sin.to(q.dtype), cos.shape[-1]
    q_rot, k_rot = reference.eager_apply_rope(q[..., :rd], k[..., :rd], cos, sin, ud)
    return torch.cat([q_rot, q[..., rd:]], dim=-1), torch.cat([k_rot, k[..., rd:]], dim=-1)


def _check(q, k, cos, sin, ud, dtype, eager_fn=None):
    """Forward and both gradients: kernel vs fp64 reference vs the HF formula in dtype."""
    eager_fn = eager_fn or (lambda q, k, c, s: _eager(q, k, c, s, ud))
    outs = ops.apply_rope(q, k, cos, sin, ud)
    ref_in = fp64_copy(q, k, cos, sin)
    refs = reference.apply_rope(*ref_in, ud)
    eager_in = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, cos, sin)]
    eags = eager_fn(*eager_in)
    for name, o, e, r, x in zip(("q_embed", "k_embed"), outs, eags, refs, (q, k), strict=True):
        assert o.dtype == x.dtype, f"{name}: dtype {o.dtype} != {x.dtype}"
        assert_bound(f"apply_rope {name}", o, e, r, dtype)
    gos = [torch.randn(o.shape, dtype=torch.float32, device=o.device).to(o.dtype) for o in outs]
    g_k = grads(outs, (q, k), gos)
    g_r = grads(refs, ref_in[:2], [g.double() for g in gos])
    g_e = grads(eags, eager_in[:2], gos)
    for name, a, b, c in zip(("dq", "dk"), g_k, g_e, g_r, strict=True):
        assert_bound(f"apply_rope {name}", a, b, c, dtype)
    return outs


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("dims", DIMS)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_apply_rope(device, dtype, dims, layout):
    D, rd = dims
    torch.manual_seed(D + rd)
    B, T = 2, 3
    q, k, ud = _qk(layout, B, 4, 2, T, D, dtype, device)
    q0, k0 = q.detach().clone(), k.detach().clone()
    # cos/sin in fp32 beside bf16/fp16 q (the kernel reads either); strided cos/sin with the fused layout
    cos, sin = _cos_sin(B, T, rd, torch.float32 if dtype == torch.bfloat16 else dtype, device,
                        strided=layout == "fused_qkv")
    q_embed, k_embed = _check(q, k, cos, sin, ud, dtype)
    assert torch.equal(q, q0) and torch.equal(k, k0), "q and k must not be modified"
    # the outputs keep the input's strides when it is dense, else its dim order, densely: coalesced writes
    for x, y in ((q, q_embed), (k, k_embed)):
        assert y.shape == x.shape
        if layout == "fused_qkv":
            assert y.transpose(1, 2).is_contiguous()
        else:
            assert y.stride() == x.stride()


@pytest.mark.parametrize("B,T,Bc", [(1, 3, 1), (1, 5, 1), (2, 5, 1), (2, 5, 2), (3, 1, 3)])
def test_batch_length_and_cos_batch(device, B, T, Bc):
    torch.manual_seed(B * 10 + T)
    q, k, ud = _qk("hf", B, 4, 2, T, 8, torch.bfloat16, device)
    cos, sin = _cos_sin(Bc, T, 8, torch.bfloat16, device)
    _check(q, k, cos, sin, ud, torch.bfloat16)


@pytest.mark.parametrize("partial", [False, True])
def test_matches_transformers(device, partial):
    # Llama's apply_rotary_pos_emb (full rotary) and GPT-NeoX's (partial), fed by LlamaRotaryEmbedding.
    transformers = pytest.importorskip("transformers")
    if partial:
        from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb
    else:
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    B, Hq, Hkv, T, D = 2, 4, 2, 5, 16
    rd = 8 if partial else D
    cfg = transformers.LlamaConfig(hidden_size=rd * Hq, num_attention_heads=Hq, num_key_value_heads=Hkv,
                                   head_dim=rd, max_position_embeddings=64)
    rotary = LlamaRotaryEmbedding(cfg, device=device)
    q, k, ud = _qk("hf", B, Hq, Hkv, T, D, torch.bfloat16, device)
    position_ids = torch.stack([torch.arange(3, 3 + T), torch.arange(7, 7 + T)]).to(device)
    cos, sin = rotary(q, position_ids)
    assert cos.shape == (B, T, rd) and cos.dtype == torch.bfloat16
    _check(q, k, cos, sin, ud, torch.bfloat16, eager_fn=apply_rotary_pos_emb)


def test_cos_sin_requiring_grad_run_the_reference(device):
    q, k, ud = _qk("hf", 1, 2, 1, 3, 8, torch.float32, device)
    cos, sin = _cos_sin(1, 3, 8, torch.float32, device)
    cos.requires_grad_(True)
    before = ops.dispatch_counts[("apply_rope", "reference")]
    q_embed, k_embed = ops.apply_rope(q, k, cos, sin)
    assert ops.dispatch_counts[("apply_rope", "reference")] == before + 1
    (dcos,) = torch.autograd.grad((q_embed.sum() + k_embed.sum()), cos)
    c64 = cos.detach().double().requires_grad_(True)
    r = reference.apply_rope(q.detach().double(), k.detach().double(), c64, sin.double())
    (dcos64,) = torch.autograd.grad(r[0].sum() + r[1].sum(), c64)
    torch.testing.assert_close(dcos.double(), dcos64)
    with torch.no_grad():  # no graph to build: the kernel runs
        ops.apply_rope(q, k, cos, sin)
    assert ops.dispatch_counts[("apply_rope", "reference")] == before + 1


def test_runs_the_kernel_on_this_device(device):
    q, k, _ = _qk("hf", 1, 2, 1, 2, 4, torch.float32, device)
    cos, sin = _cos_sin(1, 2, 4, torch.float32, device)
    before = ops.dispatch_counts[("apply_rope", "triton")]
    ops.apply_rope(q, k, cos, sin)
    assert ops.dispatch_counts[("apply_rope", "triton")] == before + 1


def test_only_k_needs_grad_and_double_backward(device):
    q, k, _ = _qk("hf", 1, 2, 1, 3, 8, torch.float32, device)
    q = q.detach()
    cos, sin = _cos_sin(1, 3, 8, torch.float32, device)
    _, k_embed = ops.apply_rope(q, k, cos, sin)
    g = torch.randn_like(k_embed, requires_grad=True)
    (dk,) = torch.autograd.grad(k_embed, k, g, create_graph=True)
    # the backward is linear in g, and its own backward is the forward rotation again
    v = torch.randn_like(dk)
    (dg,) = torch.autograd.grad(dk, g, v)
    k64 = k.detach().double()
    _, v_rot = reference.apply_rope(k64, v.double(), cos.double(), sin.double())
    torch.testing.assert_close(dg.double(), v_rot, rtol=1e-5, atol=1e-5)


def test_empty(device):
    for B, T in ((0, 3), (2, 0)):
        q, k, ud = _qk("hf", B, 2, 1, T, 8, torch.float32, device)
        cos, sin = _cos_sin(max(B, 1), T, 8, torch.float32, device)
        q_embed, k_embed = ops.apply_rope(q, k, cos, sin)
        assert q_embed.shape == q.shape and k_embed.shape == k.shape
        (q_embed.sum() + k_embed.sum()).backward()
        assert q.grad.shape == q.shape


def test_compile_fullgraph_aot_eager(device):
    from torch._dynamo.testing import CompileCounterWithBackend

    q, k, ud = _qk("hf", 1, 2, 1, 3, 8, torch.float32, device)
    cos, sin = _cos_sin(1, 3, 8, torch.float32, device)
    counter = CompileCounterWithBackend("aot_eager")
    q_embed, k_embed = torch.compile(ops.apply_rope, fullgraph=True, backend=counter)(q, k, cos, sin)
    assert "tigon.rope" in counter.graphs[0].code
    r = reference.apply_rope(q, k, cos, sin)
    torch.testing.assert_close(q_embed, r[0])
    torch.testing.assert_close(k_embed, r[1])
    (q_embed.sum() + k_embed.sum()).backward()
    assert q.grad.shape == q.shape


def _rope_args(d, B=2, T=3, D=8, rd=8, Bc=None, q_dtype=torch.float32):
    q = torch.ones(B, 4, T, D, dtype=q_dtype, device=d)
    k = torch.ones(B, 2, T, D, device=d)
    c = torch.ones(B if Bc is None else Bc, T, rd, device=d)
    return q, k, c, c.clone()


@pytest.mark.parametrize(
    "call,exc,match",
    [
        (lambda d: ops.apply_rope(torch.ones(2, 3, 8, device=d), *_rope_args(d)[1:]), ValueError, "q must"),
        (lambda d: ops.apply_rope(*_rope_args(d, q_dtype=torch.long)), TypeError, "q must be float"),
        (lambda d: ops.apply_rope(_rope_args(d)[0], torch.ones(1, 2, 3, 8, device=d), *_rope_args(d)[2:]),
         ValueError, "k"),
        (lambda d: ops.apply_rope(_rope_args(d)[0], torch.ones(2, 2, 4, 8, device=d), *_rope_args(d)[2:]),
         ValueError, "k"),
        (lambda d: ops.apply_rope(*_rope_args(d, Bc=3)), ValueError, "cos"),
        (lambda d: ops.apply_rope(*_rope_args(d, rd=7)), ValueError, "rotary_dim 7"),
        (lambda d: ops.apply_rope(*_rope_args(d, rd=10)), ValueError, "rotary_dim 10"),
        (lambda d: ops.apply_rope(*_rope_args(d)[:3], torch.ones(2, 3, 6, device=d)), ValueError, "sin"),
        (lambda d: ops.apply_rope(*_rope_args(d)[:2], torch.ones(2, 3, 8, dtype=torch.int32, device=d),
                                  _rope_args(d)[3]), TypeError, "cos"),
        (lambda d: ops.apply_rope(*_rope_args(d)[:3], torch.ones(2, 3, 8, device="meta")), ValueError,
         "sin is on meta"),
        (lambda d: ops.apply_rope(*_rope_args(d), unsqueeze_dim=3), ValueError, "unsqueeze_dim"),
        (lambda d: ops.apply_rope(_rope_args(d)[0], None, *_rope_args(d)[2:]), TypeError, "k must be a"),
    ],
)
def test_bad_input(device, call, exc, match):
    with pytest.raises(exc, match=f"apply_rope: .*{match}"):
        call(device)


def test_opcheck(device):
    q, k, _ = _qk("hf", 2, 2, 1, 3, 8, torch.float32, device)
    cos, sin = _cos_sin(1, 3, 6, torch.float32, device, strided=True)
    torch.library.opcheck(torch.ops.tigon.rope, (q, k, cos, sin, False))
    torch.library.opcheck(torch.ops.tigon.rope, (q.detach(), None, cos, sin, True))


def _llama_3_8b(B=2, T=4096, dtype=torch.bfloat16):
    q, k, _ = _qk("hf", B, 32, 8, T, 128, dtype, "cuda")
    pos = torch.arange(T, device="cuda", dtype=torch.float32)
    inv_freq = 500000.0 ** -(torch.arange(0, 128, 2, device="cuda", dtype=torch.float32) / 128)
    emb = torch.cat([pos[:, None] * inv_freq] * 2, dim=-1)[None]
    return q, k, emb.cos().to(dtype), emb.sin().to(dtype)


@pytest.mark.gpu
def test_llama_3_8b_shape_bf16():
    torch.manual_seed(0)
    q, k, cos, sin = _llama_3_8b()
    _check(q, k, cos, sin, 1, torch.bfloat16)


@pytest.mark.gpu
def test_compile_fullgraph_gpu():
    q, k, cos, sin = _llama_3_8b(B=1, T=256)
    f = torch.compile(ops.apply_rope, fullgraph=True)
    outs = f(q, k, cos, sin)
    eager = ops.apply_rope(q, k, cos, sin)
    go = [torch.randn_like(o) for o in outs]
    compiled = (*outs, *grads(outs, (q, k), go))
    for a, e in zip(compiled, (*eager, *grads(eager, (q, k), go)), strict=True):
        assert torch.equal(a, e)


@pytest.mark.gpu
def test_no_host_sync_and_deterministic():
    q, k, cos, sin = _llama_3_8b()
    go = [torch.randn_like(q), torch.randn_like(k)]

    def run():
        outs = ops.apply_rope(q, k, cos, sin)
        return (*outs, *grads(outs, (q, k), go))

    assert_no_sync_and_deterministic(run)


def test_config_reaches_forward_and_backward(device, monkeypatch):
    # A RopeConfig's tile sets the heads per program of both launches (forward and the transposed backward): a
    # 16-element tile with rd / 2 = 4 takes 4 heads a step instead of all 8; the rotation is elementwise per
    # head, so the bits match the default's.
    import sys

    from tigon.ops.config import RopeConfig

    mod = sys.modules["tigon.ops.rope"]
    spy = KernelSpy(mod._rope_kernel)
    monkeypatch.setattr(mod, "_rope_kernel", spy)
    q, k, _ = _qk("hf", 1, 8, 2, 3, 8, torch.float32, device)
    cos, sin = _cos_sin(1, 3, 8, torch.float32, device)
    outs = []
    for cfg in (None, RopeConfig(tile=16, num_warps=2)):
        qq, kk = q.detach().clone().requires_grad_(), k.detach().clone().requires_grad_()
        qe, ke = ops.apply_rope(qq, kk, cos, sin, config=cfg)
        outs.append((qe, ke, *grads((qe, ke), (qq, kk), (torch.ones_like(qe), torch.ones_like(ke)))))
    assert [(c["BLOCK_HQ"], c["num_warps"]) for c in spy.calls] == [(8, 4), (8, 4), (4, 2), (4, 2)]
    for a, b in zip(*outs):
        assert torch.equal(a, b)
    with pytest.raises(TypeError, match="apply_rope: config must be"):
        ops.apply_rope(q, k, cos, sin, config={"tile": 16})
    torch.library.opcheck(torch.ops.tigon.rope, (q, k, cos, sin, False, [16, 2]))
