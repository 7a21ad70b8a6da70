"""Each importer against a synthetic module laid out per its format's documented packing (tests/quant/_formats.py):
the repacked weight dequantizes to the known weight bit for bit, the module's tensors are untouched, a
linear through the layout's reference matches the module's own forward, and what the layout cannot hold is refused
with the reason."""

import dataclasses
import types

import pytest
import torch

from tests._grid import assert_tol, matmul_tol
from tigon.ops.quantized_weight import dequantize, linear_reference
from tigon.quant import format_of, import_awq, import_compressed_tensors, import_fp8, import_gptq

from . import _formats


def _snapshot(module):
    return {k: v.clone() for k, v in module.state_dict().items()}


def _check(module, qw, w, tensors_before):
    """dequantize == w exactly (columns in stored order), tensors untouched, forward == the module's own."""
    perm = qw.perm if qw.perm is not None else torch.arange(w.shape[1])
    assert torch.equal(dequantize(qw), w[:, perm])
    after = module.state_dict()
    assert tensors_before.keys() == after.keys()
    assert all(torch.equal(tensors_before[k], after[k]) for k in after)
    x = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(5))
    bias = module.bias.float() if module.bias is not None else None
    got = linear_reference(x, dataclasses.replace(qw, dtype=torch.float32), bias)  # fp32 out: no final rounding
    ref = x.double() @ w.double().T + (0 if bias is None else bias.double())
    assert_tol("import forward", got, ref, matmul_tol(x, w.T))
    assert_tol("module forward", module(x), ref, matmul_tol(x, w.T))


@pytest.mark.parametrize("fmt,act_order,symmetric,pack_dtype", [
    (2, False, False, torch.int32), (1, False, False, torch.int32), (2, True, False, torch.int32),
    (2, False, True, torch.int16)])
def test_gptq(fmt, act_order, symmetric, pack_dtype):
    m, w = _formats.gptq(40, 64, 16, fmt=fmt, act_order=act_order, symmetric=symmetric, pack_dtype=pack_dtype)
    before = _snapshot(m)
    assert format_of(m) == "gptq"
    qw = import_gptq(m)
    assert (qw.kind, qw.group_size, qw.shape, qw.dtype) == ("int4", 16, (40, 64), torch.float16)
    assert (qw.perm is not None) == act_order
    assert (qw.zeros is None) == symmetric  # a symmetric checkpoint's zeros (all 8) are dropped: fewer bytes
    _check(m, qw, w, before)


def test_gptq_v1_from_auto_gptq_class_and_whole_row_group():
    class QuantLinear(_formats._Stand):
        QUANT_TYPE = "cuda"

    QuantLinear.__module__ = "auto_gptq.nn_modules.qlinear.qlinear_cuda"  # auto-gptq keeps v1 zeros (z - 1)
    m, w = _formats.gptq(16, 48, 48, fmt=1, cls=QuantLinear)
    m.group_size = -1
    _check(m, import_gptq(m, dtype=torch.bfloat16), w, _snapshot(m))


def test_gptq_refusals():
    m, _ = _formats.gptq(16, 32, 16)
    type(m).QUANT_TYPE = "exllamav2"  # a kernel that shuffles qweight in place when it loads
    try:
        with pytest.raises(ValueError, match=r"tigon.quant.import_gptq: kernel 'exllamav2'"):
            import_gptq(m)
    finally:
        type(m).QUANT_TYPE = "torch"
    m.bits = 8
    with pytest.raises(ValueError, match="only 4-bit"):
        import_gptq(m)
    m.bits, m.fmt = 4, None
    with pytest.raises(ValueError, match="zero-point convention"):
        import_gptq(m)
    m.fmt, m.in_features = 2, 30
    with pytest.raises(ValueError, match="padded"):
        import_gptq(m)
    m.in_features, m.group_size = 32, 12
    with pytest.raises(ValueError, match="do not cover in_features 32"):
        import_gptq(m)
    m, _ = _formats.gptq(16, 32, 16, act_order=True)
    m.g_idx[:3] = 0  # groups of unequal size: no column order makes them contiguous groups of group_size
    with pytest.raises(ValueError, match="exactly group_size=16"):
        import_gptq(m)


def test_awq_interleaved_order():
    m, w = _formats.awq(24, 64, 32)
    assert format_of(m) == "awq"
    qw = import_awq(m)
    assert qw.zeros is not None and qw.perm is None
    _check(m, qw, w, _snapshot(m))
    m.w_bit = 3
    with pytest.raises(ValueError, match="tigon.quant.import_awq: only 4-bit weights are supported, got w_bit=3"):
        import_awq(m)


@pytest.mark.parametrize("symmetric,packed_zp,act_order", [(True, True, False), (False, True, False),
                                                           (False, False, True)])
def test_compressed_tensors_int4(symmetric, packed_zp, act_order):
    # K = 36: not a multiple of 8 (the last word is padded); N = 20: the packed zero points pad N too
    m, w = _formats.compressed_int4(20, 36, 12, symmetric=symmetric, packed_zp=packed_zp, act_order=act_order)
    assert format_of(m) == "compressed-tensors"
    qw = import_compressed_tensors(m)
    assert (qw.zeros is None) == symmetric and qw.dtype == torch.bfloat16
    _check(m, qw, w, _snapshot(m))


def test_compressed_tensors_refuses_8_bit():
    m, _ = _formats.compressed_int4(16, 32, 16)
    m.quantization_scheme.weights.num_bits = 8
    with pytest.raises(ValueError, match="tigon.quant.import_compressed_tensors: only int 4-bit"):
        import_compressed_tensors(m)


@pytest.mark.parametrize("case", ["blocks", "tensor", "ue8m0", "channel"])
def test_fp8(case):
    if case == "blocks":  # partial blocks on both dimensions
        m, w = _formats.fp8(200, 260)
    elif case == "tensor":
        m, w = _formats.fp8(24, 40, block=None)
    elif case == "ue8m0":
        m, w = _formats.fp8(130, 136, scale_dtype=torch.float8_e8m0fnu)
    else:  # compressed-tensors FP8, one scale per output channel
        m, w = _formats.fp8(24, 40, block=None, scale_name="weight_scale", scale_shape=(24, 1),
                            scale_dtype=torch.bfloat16)
        m.quantization_scheme = types.SimpleNamespace(weights=types.SimpleNamespace(num_bits=8, type="float"))
    assert format_of(m) == ("compressed-tensors" if case == "channel" else "fp8")
    before = _snapshot(m)
    qw = import_compressed_tensors(m) if case == "channel" else import_fp8(m)
    assert qw.group_size == (128 if case in ("blocks", "ue8m0") else 0)
    assert qw.data.data_ptr() == m.weight.data_ptr()  # the weight's bytes are shared, not copied
    _check(m, qw, w, before)


def test_fp8_fbgemm_class_as_transformers_builds_it():
    """transformers' own FbgemmFp8Linear (weight e4m3 [N, K], weight_scale fp32 [N, 1], an fp32 bias): one scale a
    row, the weight's bytes shared. Its forward needs fbgemm_gpu's kernels, so the reference is the layout's
    documented dequantization, weight * weight_scale."""
    fbgemm = pytest.importorskip("transformers.integrations.fbgemm_fp8")
    m = fbgemm.FbgemmFp8Linear(40, 24, True)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        m.weight.copy_((torch.randn(24, 40, generator=gen) * 40).clamp(-448, 448).to(torch.float8_e4m3fn))
        m.weight_scale.copy_(torch.rand(24, 1, generator=gen) * 0.01 + 0.001)
        m.bias.copy_(torch.randn(24, generator=gen))
    assert format_of(m) == "fp8"
    before = _snapshot(m)
    qw = import_fp8(m)
    assert qw.group_size == 0 and qw.data.data_ptr() == m.weight.data_ptr() and qw.dtype == torch.float32
    w = m.weight.float() * m.weight_scale.float()
    assert torch.equal(dequantize(qw), w)
    assert all(torch.equal(before[k], v) for k, v in m.state_dict().items())
    x = torch.randn(3, 40, generator=gen)
    got = linear_reference(x, qw, m.bias.float())
    assert_tol("import forward", got, x.double() @ w.double().T + m.bias.double(), matmul_tol(x, w.T))


def test_fp8_refusals():
    m, _ = _formats.fp8(256, 256, block=(128, 64))
    with pytest.raises(ValueError, match=r"tigon.quant.import_fp8: scales \[2, 4\] are not square blocks"):
        import_fp8(m)
    m, _ = _formats.fp8(16, 16, block=None)
    m.weight = torch.nn.Parameter(m.weight.data.to(torch.float8_e5m2), requires_grad=False)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        import_fp8(m)


def test_a_wrapper_is_not_its_base_layer():
    """PEFT's LoRA layers expose their base layer's `weight`: only the base layer counts as the quantized one."""
    base, _ = _formats.fp8(16, 16, block=None)

    class Wrapper(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.base_layer = base

        @property
        def weight(self):
            return self.base_layer.weight

    assert format_of(Wrapper()) is None and format_of(base) == "fp8"
