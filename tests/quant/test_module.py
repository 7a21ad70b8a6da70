"""QuantLinear and round-to-nearest quantization: every element within half a step of its code, the forward against
an fp64 product of the dequantized weight, buffers through state_dict and device/dtype moves, bad input."""

import dataclasses

import pytest
import torch

from tests._grid import DTYPES, UNIT_ROUNDOFF, assert_tol, matmul_tol
from tigon import ops
from tigon.ops.quant_linear import quant_linear
from tigon.ops.quantized_weight import NF4, dequantize
from tigon.quant import QuantLinear, quantize_rtn

CASES = [("int4", 16, True), ("int4", 24, False), ("nf4", 16, True), ("fp8", 0, True), ("fp8", 16, True)]


def _half_step(qw, w):
    """The bound per element of |dequantize - w| for round-to-nearest (tigon.quant.module's docstring)."""
    n, k = qw.shape
    if qw.kind == "fp8":
        s = qw.scales.float()
        s = s[:, None] if qw.group_size == 0 else \
            s.repeat_interleave(qw.group_size, 0).repeat_interleave(qw.group_size, 1)[:n, :k]
        # half an e4m3 ulp of w / s: 2^-4 relative in the normal range, 2^-10 absolute among the subnormals
        return torch.maximum(w.abs() * 2.0**-4, 2.0**-10 * s) * (1 + 1e-6)
    s = qw.scales.float().repeat_interleave(qw.group_size, 1)
    table = torch.tensor(NF4)
    step = 1.0 if qw.kind == "int4" else (table[1:] - table[:-1]).max().item()
    return s * step / 2 * (1 + 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,group_size,symmetric", CASES)
def test_rtn_within_half_a_step(kind, group_size, symmetric, dtype):
    torch.manual_seed(0)
    w = (torch.randn(13, 48) * 0.05).to(dtype)
    w[3, :16] = 0.0  # an all-zero group
    w[5] = w[5].abs()  # a row with no negative weight
    qw = quantize_rtn(w, kind, group_size, symmetric=symmetric)
    assert qw.dtype == dtype and (qw.zeros is None) == symmetric
    if kind != "fp8":
        assert qw.scales.dtype == dtype
    err = (dequantize(qw) - w.float()).abs()
    assert bool((err <= _half_step(qw, w.float())).all()), err.max()
    # negative control: the code of the largest weight flipped to the other sign fails the bound
    n, k = divmod(int(w.float().abs().argmax()), w.shape[1])
    bad = qw.data.clone()
    if kind == "fp8":
        bad[n, k] = (bad[n, k].view(torch.uint8) ^ 0x80).view(torch.float8_e4m3fn)
    else:
        bad[n, k // 2] ^= 8 << (4 * (k % 2))
    off = (dequantize(dataclasses.replace(qw, data=bad)) - w.float()).abs()
    assert not bool((off <= _half_step(qw, w.float())).all())


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter on CPU tensors; a GPU runs the kernels in tests/ops/test_quant_linear.py")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind,group_size,symmetric", CASES[:1] + CASES[2:4])
def test_forward_matches_dequantized_product(kind, group_size, symmetric, dtype):
    torch.manual_seed(1)
    lin = torch.nn.Linear(48, 20).to(dtype)
    q = QuantLinear.from_linear(lin, kind, group_size, symmetric=symmetric)
    w = dequantize(q.quantized_weight)
    x = torch.randn(2, 48, 3).to(dtype).transpose(1, 2)  # [2, 3, 48], not contiguous
    before = ops.dispatch_counts[("quant_linear", "triton")]
    y = q(x)
    assert ops.dispatch_counts[("quant_linear", "triton")] == before + 1  # the kernel ran (the interpreter on CPU)
    assert torch.equal(y, quant_linear(x, q.quantized_weight, bias=q.bias))
    assert y.dtype == dtype and y.shape == (2, 3, 20)
    ref = x.double() @ w.double().T + lin.bias.double()
    # the kernel's model (tigon.ops.quant_linear): weights rounded to x's dtype, fp32 sums, one rounding of y
    u = UNIT_ROUNDOFF[dtype] if dtype != torch.float32 else 0.0
    tol = matmul_tol(x.float(), w.T, b_tol=u * w.T.abs().double()) + UNIT_ROUNDOFF[dtype] * ref.abs()
    assert_tol("QuantLinear", y, ref, tol)
    off = 1e-3 if dtype == torch.float32 else 16 * UNIT_ROUNDOFF[dtype]
    with pytest.raises(AssertionError):  # negative control: a result 1e-3 (fp32) or 16 roundoffs off fails
        assert_tol("off", y.double() * (1 + off), ref, tol)


def test_state_dict_and_moves_keep_the_codes():
    torch.manual_seed(2)
    lin = torch.nn.Linear(32, 16)
    q = QuantLinear.from_linear(lin, "fp8", 0)
    r = QuantLinear.from_linear(torch.nn.Linear(32, 16), "fp8", 0)
    r.load_state_dict(q.state_dict())
    x = torch.randn(4, 32)
    assert torch.equal(r(x), q(x))
    q.half()  # retypes the activations and the bias, never the fp8 bytes or the fp32 scales
    assert q.dtype == torch.float16 and q.bias.dtype == torch.float16 and q.scales.dtype == torch.float32
    assert torch.equal(q.data, r.data) and q.quantized_weight.data.dtype == torch.float8_e4m3fn
    assert q(x.half()).dtype == torch.float16
    s = QuantLinear.from_linear(lin.to(torch.bfloat16), "int4", 16, symmetric=False)
    zeros = s.zeros.clone()
    s.float()
    assert s.scales.dtype == torch.bfloat16 and torch.equal(s.zeros, zeros)
    assert set(s.state_dict()) == {"data", "scales", "zeros", "bias"}
    assert "kind=int4, group_size=16, symmetric=False" in repr(s)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a compile case on the GPU (8 s under the interpreter)")
def test_compiles_fullgraph():
    torch.manual_seed(3)
    q = QuantLinear.from_linear(torch.nn.Linear(32, 8), "int4", 16).cuda()
    x = torch.randn(2, 32, device="cuda")
    compiled = torch.compile(q, fullgraph=True)
    assert torch.equal(compiled(x), q(x))


def test_bad_input():
    lin = torch.nn.Linear(64, 8)
    with pytest.raises(ValueError, match=r"tigon.quant.quantize_rtn: group_size must be even, > 0 and divide "
                                         r"in_features \(64\) .* got group_size=24"):
        QuantLinear.from_linear(lin, "int4", 24)
    with pytest.raises(ValueError, match="kind must be one of"):
        QuantLinear.from_linear(lin, "int3", 16)
    with pytest.raises(ValueError, match="nf4 is symmetric only"):
        QuantLinear.from_linear(lin, "nf4", 16, symmetric=False)
    with pytest.raises(TypeError, match="tigon.quant.QuantLinear.from_linear: linear must be an nn.Linear"):
        QuantLinear.from_linear(torch.nn.Conv1d(2, 2, 1), "int4", 16)
    with pytest.raises(TypeError, match="tigon.quant.QuantLinear: qw must be a QuantizedWeight"):
        QuantLinear(lin.weight)
    with pytest.raises(ValueError, match=r"bias must be None or a tensor of shape \(8,\)"):
        QuantLinear(quantize_rtn(lin.weight, "int4", 16), torch.zeros(9))
