"""torchao int4 weight-only tensors: each layout imported against torchao's own dequantize or its module forward
(IntxUnpackedToInt8Tensor and the CPU tinygemm Int4OpaqueTensor, both built by torchao here; Int4Tensor, which
needs mslk's CUDA kernels to build, from known codes in its documented packing), adopt() on a tiny Llama against
torchao's forward, the layouts not read refused with their reason, and on a GPU the CUDA-only layouts."""

import importlib.util

import pytest
import torch
from torch import nn

from tests._grid import U32, UNIT_ROUNDOFF
from tests.hf._tiny import prompt_ids, tiny_model
from tigon.ops import _library
from tigon.ops.quantized_weight import dequantize, linear_reference, unpack_int4
from tigon.quant import IMPORTERS, QuantLinear, adopt, format_of
from tigon.quant.importers import import_torchao

tq = pytest.importorskip("torchao.quantization")
tao_int4 = pytest.importorskip("torchao.prototype.quantization.int4")

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="torchao's tinygemm tile and mslk layouts: CUDA")


@pytest.fixture
def reference_path(monkeypatch):
    """The import is under test, not the kernel (tests/ops/test_quant_linear.py): the reference quant_linear."""
    monkeypatch.setattr(_library, "use_kernels", lambda *args: False)


def _linear(n, k, dtype, config, *, bias=True, seed=0, device="cpu"):
    """An nn.Linear quantized by torchao. The configs that have it get set_inductor_config=False: the default sets
    torch._inductor's global config for the rest of the process."""
    torch.manual_seed(seed)
    m = nn.Linear(k, n, bias=bias).to(device=device, dtype=dtype)
    tq.quantize_(m, config)
    return m


def _forward_weight(m):
    """The [N, K] weight torchao's own forward multiplies by: its F.linear on the identity."""
    k = m.weight.shape[1]
    eye = torch.eye(k, dtype=m.weight.dtype, device=m.weight.device)
    return torch.nn.functional.linear(eye, m.weight).T.float()


def _tinygemm_magnitude(qw, sz):
    """|(q - 8) s| + |z| per element, from torchao's scale_and_zero [G, N, 2]: what torchao's roundings of
    (q - 8) * s + z are relative to."""
    g = qw.group_size
    s, z = sz[..., 0].T.double(), sz[..., 1].T.double()
    q = unpack_int4(qw.data).double()
    return (q - 8).abs() * s.repeat_interleave(g, 1) + z.abs().repeat_interleave(g, 1)


def _layout_magnitude(qw):
    """(|q| + |z'|) s per element: what Tigon's roundings (z' = 8 - z / s to fp32, q - z', the product) are
    relative to: 3 roundings, each within 2^-24 of it."""
    g = qw.group_size
    s = qw.scales.double().repeat_interleave(g, 1)
    return (unpack_int4(qw.data).double() + qw.zeros.double().abs().repeat_interleave(g, 1)) * s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("n,k,granularity,mapping", [
    (20, 96, 32, "ASYMMETRIC"), (7, 64, 16, "SYMMETRIC"), (12, 96, None, "ASYMMETRIC")])
def test_intx_int4_matches_torchao(n, k, granularity, mapping, dtype):
    gran = tq.PerAxis(0) if granularity is None else tq.PerGroup(granularity)
    config = tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=gran,
                                     mapping_type=getattr(tq.MappingType, mapping))
    m = _linear(n, k, dtype, config)
    w = m.weight
    assert type(w).__name__ == "IntxUnpackedToInt8Tensor" and format_of(m) == "torchao"
    qdata = w.qdata.clone()
    qw = import_torchao(m)
    assert (qw.kind, qw.group_size, qw.shape, qw.dtype) == ("int4", granularity or k, (n, k), dtype)
    assert (qw.zeros is None) == (mapping == "SYMMETRIC")
    assert torch.equal(w.qdata, qdata)  # the module is left as it was
    # torchao's own dequantize: (q - zp) * s rounded once to the dtype, which Tigon's exact fp32 value rounds to
    assert torch.equal(dequantize(qw).to(dtype), w.dequantize())
    x = torch.randn(3, k, dtype=dtype)
    ref = x.double() @ dequantize(qw).double().T + m.bias.double()
    tol = (U32 * 4 * k + 4 * UNIT_ROUNDOFF[dtype]) * (x.double().abs() @ dequantize(qw).double().abs().T
                                                      + m.bias.double().abs())
    assert ((linear_reference(x, qw, m.bias).double() - ref).abs() <= tol).all()
    assert ((m(x).double() - ref).abs() <= tol).all()  # torchao's forward: F.linear on its dequantized weight


def test_intx_with_int8_activations_reads_the_weights():
    config = tq.Int8DynamicActivationIntxWeightConfig(weight_dtype=torch.int4, weight_granularity=tq.PerGroup(32))
    m = _linear(16, 64, torch.float32, config)
    assert m.weight.activation_quantization is not None
    assert torch.equal(dequantize(import_torchao(m)), m.weight.dequantize())


def test_intx_float_zero_points():
    g = torch.Generator().manual_seed(0)
    q = torch.randint(-8, 8, (8, 64), generator=g, dtype=torch.int8)
    s = torch.rand(8, 2, generator=g) * 0.02 + 0.005
    zp = torch.randn(8, 2, generator=g) * 3  # in code units, not integers
    m = nn.Linear(64, 8, bias=False)
    m.weight = nn.Parameter(tq.IntxUnpackedToInt8Tensor(q, s, zp, torch.int4, (1, 32), torch.float32, None),
                            requires_grad=False)
    qw = import_torchao(m)
    assert qw.zeros.dtype == torch.float32
    exact = (q.double() - zp.double().repeat_interleave(32, 1)) * s.double().repeat_interleave(32, 1)
    assert ((dequantize(qw).double() - exact).abs() <= 4 * U32 * _layout_magnitude(qw)).all()
    assert ((m.weight.dequantize().double() - exact).abs() <= 4 * U32 * _layout_magnitude(qw)).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n,k,group_size,algorithm", [
    (48, 96, 32, "tinygemm"), (16, 64, 64, "tinygemm"), (144, 128, 128, "tinygemm"), (80, 64, 32, "hqq")])
def test_int4_cpu_tinygemm_matches_torchao_forward(n, k, group_size, algorithm, dtype):
    config = tao_int4.PrototypeInt4WeightOnlyConfig(group_size=group_size, int4_choose_qparams_algorithm=algorithm,
                                                    set_inductor_config=False)
    m = _linear(n, k, dtype, config)
    w = m.weight
    assert type(w).__name__ == "Int4OpaqueTensor" and format_of(m) == "torchao"
    qw = import_torchao(m)
    assert (qw.kind, qw.group_size, qw.shape, qw.dtype) == ("int4", group_size, (n, k), dtype)
    assert qw.zeros.dtype == torch.float32  # 8 - z / s: torchao's zero points are in the float domain
    ours = 4 * U32 * _layout_magnitude(qw)
    # the conversion itself: within a few fp32 ulps of torchao's formula (q - 8) s + z, evaluated in fp64
    s, z = (w.scale_and_zero[..., i].T.double().repeat_interleave(group_size, 1) for i in (0, 1))
    exact = (unpack_int4(qw.data).double() - 8) * s + z
    assert ((dequantize(qw).double() - exact).abs() <= ours).all()
    # torchao's forward (the CPU tinygemm kernel) computes that formula in the dtype: two roundings at most
    theirs = 2 * UNIT_ROUNDOFF[dtype] * _tinygemm_magnitude(qw, w.scale_and_zero)
    assert ((dequantize(qw).double() - _forward_weight(m).double()).abs() <= ours + theirs).all()


def _int4_tensor(n, k, group_size, seed=0, dtype=torch.bfloat16, **kwargs):
    """An Int4Tensor from known codes, laid out as mslk's quantizer writes it (torchao's "plain" packing): signed q in
    [-8, 7], two a byte, the even column in the low nibble; scale and zero_point [K / G, N]; w = q * s + z."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (n, k), generator=g, dtype=torch.int8)
    s = (torch.rand(k // group_size, n, generator=g) * 0.02 + 0.005).to(dtype)
    z = (torch.randn(k // group_size, n, generator=g) * 0.05).to(dtype)
    qdata = (q[:, ::2] & 0xF) | (q[:, 1::2] << 4)
    w = (q.double() * s.T.double().repeat_interleave(group_size, 1)
         + z.T.double().repeat_interleave(group_size, 1))
    t = tq.Int4Tensor(qdata, s, z, [1, group_size], torch.Size([n, k]), **kwargs)
    return t, w, s, z


@pytest.mark.parametrize("n,k,group_size", [(12, 96, 32), (5, 256, 128)])
def test_int4_plain_documented_packing(n, k, group_size):
    t, w, s, z = _int4_tensor(n, k, group_size)
    m = nn.Linear(k, n, bias=False)
    m.weight = nn.Parameter(t, requires_grad=False)
    assert format_of(m) == "torchao"
    qw = import_torchao(m)
    assert (qw.group_size, qw.shape, qw.dtype, qw.zeros.dtype) == (group_size, (n, k), torch.bfloat16, torch.float32)
    assert ((dequantize(qw).double() - w).abs() <= 4 * U32 * _layout_magnitude(qw)).all()


def test_adopt_tiny_llama_matches_torchao(reference_path):
    """Every projection int4 through torchao (Intx: the lm_head too, which adopt leaves to torchao): Tigon's
    logits against torchao's forward on the same weights. Both are fp32 GEMMs over the same dequantized values
    (Int4Opaque: within a few ulps), so they differ by the fp32 summation order carried through two layers."""
    ids = prompt_ids(2, 6)
    configs = {
        "intx": (tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32),
                                         mapping_type=tq.MappingType.ASYMMETRIC), None),
        "opaque": (tao_int4.PrototypeInt4WeightOnlyConfig(group_size=32, set_inductor_config=False),
                   lambda mod, fqn: isinstance(mod, nn.Linear) and fqn != "lm_head"),  # N = 131: not 16-aligned
    }
    for config, keep in configs.values():
        model = tiny_model("llama").eval()
        tq.quantize_(model, config, filter_fn=keep)
        with torch.no_grad():
            want = model(ids).logits
            skipped = {}
            names = adopt(model, skipped=skipped)
            got = model(ids).logits
        assert len(names) == 14 and all(isinstance(model.get_submodule(n), QuantLinear) for n in names)
        assert set(skipped) <= {"lm_head"}
        assert (got - want).abs().max() <= 1e-5 * want.abs().max()


def test_refusals():
    assert "torchao" in IMPORTERS
    m = _linear(8, 64, torch.float32, tq.IntxWeightOnlyConfig(weight_dtype=torch.int8, granularity=tq.PerGroup(32)))
    with pytest.raises(ValueError, match=r"tigon.quant.import_torchao: only int4 .* got target_dtype torch.int8"):
        import_torchao(m)
    emb = nn.Embedding(10, 64)
    tq.quantize_(emb, tq.IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=tq.PerGroup(32)),
                 filter_fn=lambda mod, fqn: isinstance(mod, nn.Embedding))
    with pytest.raises(ValueError, match="only nn.Linear modules are read, got Embedding"):
        import_torchao(emb)
    n, k = 16, 256
    shuffled = tq.Int4PreshuffledTensor(torch.zeros(n, k // 2, dtype=torch.int8), torch.ones(2, n), [1, 128],
                                        [n, k], group_zero=torch.zeros(2, n))
    pre_scaled = _int4_tensor(n, k, 128, act_pre_scale=torch.ones(k))[0]
    da8w4 = tao_int4.Int4OpaqueTensor(torch.zeros(n, k // 2, dtype=torch.uint8), torch.ones(2, n, 2), [1, 128],
                                      torch.Size([n, k]), act_mapping_type="asymmetric")
    tiles = tq.Int4TilePackedTo4dTensor(torch.zeros(n // 8, 1, 32, 4, dtype=torch.int32),
                                        torch.ones(8, n, 2, dtype=torch.bfloat16), [1, 128], torch.Size([n, k]))
    cases = [(shuffled, "unsupported torchao layout Int4PreshuffledTensor"),
             (pre_scaled, "act_pre_scale"), (da8w4, r"DA8W4\) packing is not read")]
    if not torch.cuda.is_available():
        cases.append((tiles, "needs CUDA"))
    for t, reason in cases:
        lin = nn.Linear(k, n, bias=False)
        lin.weight = nn.Parameter(t, requires_grad=False)
        assert format_of(lin) == "torchao"
        with pytest.raises(ValueError, match=reason):
            import_torchao(lin)
    with pytest.raises(ValueError, match="must be a torchao tensor, got Parameter"):
        import_torchao(nn.Linear(4, 4))


@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("n,k,group_size,algorithm", [
    (40, 96, 32, "tinygemm"), (256, 1024, 128, "tinygemm"), (72, 2048, 64, "hqq")])
def test_int4_tile_packed_matches_torchao_forward(n, k, group_size, algorithm):
    config = tq.Int4WeightOnlyConfig(group_size=group_size, int4_packing_format="tile_packed_to_4d",
                                     int4_choose_qparams_algorithm=algorithm, set_inductor_config=False)
    m = _linear(n, k, torch.bfloat16, config, device="cuda")
    w = m.weight
    assert type(w).__name__ == "Int4TilePackedTo4dTensor"
    qw = import_torchao(m)
    assert (qw.group_size, qw.shape, qw.dtype) == (group_size, (n, k), torch.bfloat16)
    theirs = 2 * UNIT_ROUNDOFF[torch.bfloat16] * _tinygemm_magnitude(qw, w.scale_and_zero[: k // group_size, :n])
    # tinygemm's forward computes (q - 8) s + z in bf16: two roundings at most
    assert ((dequantize(qw).double() - _forward_weight(m).double()).abs()
            <= theirs + 4 * U32 * _layout_magnitude(qw)).all()


@cuda
@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("mslk") is None, reason="Int4Tensor's quantizer and kernel: mslk")
def test_int4_plain_matches_mslk_forward():
    m = _linear(64, 512, torch.bfloat16, tq.Int4WeightOnlyConfig(group_size=128, set_inductor_config=False),
                device="cuda")
    assert type(m.weight).__name__ == "Int4Tensor"
    qw = import_torchao(m)
    s, z = (t.T.double().repeat_interleave(128, 1) for t in (m.weight.scale, m.weight.zero_point))
    theirs = 2 * UNIT_ROUNDOFF[torch.bfloat16] * ((unpack_int4(qw.data).double() - 8).abs() * s + z.abs())
    assert ((dequantize(qw).double() - _forward_weight(m).double()).abs()
            <= theirs + 4 * U32 * _layout_magnitude(qw)).all()
