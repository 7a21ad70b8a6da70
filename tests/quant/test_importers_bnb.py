"""bitsandbytes Linear4bit (installed, CPU backend): the NF4 import against bitsandbytes' own dequantize (bit for bit)
and its module forward, plain and double-quantized absmax; FP4 and row-straddling blocks refused."""

import pytest
import torch

from tests._grid import assert_tol, matmul_tol
from tigon.ops.quantized_weight import dequantize, linear_reference
from tigon.quant import format_of, import_bnb4

bnb = pytest.importorskip("bitsandbytes")


def _linear4bit(n, k, *, quant_type="nf4", nested=False, blocksize=64, seed=0):
    torch.manual_seed(seed)
    dense = torch.nn.Linear(k, n)
    m = bnb.nn.Linear4bit(k, n, bias=True, quant_type=quant_type, compress_statistics=nested,
                          compute_dtype=torch.float32)
    m.weight = bnb.nn.Params4bit(dense.weight.data.clone(), requires_grad=False, quant_type=quant_type,
                                 compress_statistics=nested, blocksize=blocksize)
    m.bias = torch.nn.Parameter(dense.bias.data.clone(), requires_grad=False)
    m.weight._quantize("cpu")
    return m


@pytest.mark.parametrize("nested", [False, True])
def test_nf4_matches_bitsandbytes(nested):
    m = _linear4bit(24, 192, nested=nested)
    assert m.weight.quant_state.nested == nested
    packed, absmax = m.weight.data.clone(), m.weight.quant_state.absmax.clone()
    assert format_of(m) == "bnb4"
    qw = import_bnb4(m)
    assert (qw.kind, qw.group_size, qw.shape, qw.dtype) == ("nf4", 64, (24, 192), torch.float32)
    w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
    assert torch.equal(dequantize(qw), w.float())  # bitsandbytes' own dequantize, bit for bit
    assert torch.equal(m.weight.data, packed) and torch.equal(m.weight.quant_state.absmax, absmax)
    x = torch.randn(3, 192)
    ref = x.double() @ w.double().T + m.bias.double()
    assert_tol("import forward", linear_reference(x, qw, m.bias), ref, matmul_tol(x, w.T))
    assert_tol("module forward", m(x), ref, matmul_tol(x, w.T))


def test_refusals():
    with pytest.raises(ValueError, match=r"tigon.quant.import_bnb4: only the NF4 code book .* 'fp4'"):
        import_bnb4(_linear4bit(8, 64, quant_type="fp4"))
    with pytest.raises(ValueError, match="blocksize 64 must divide in_features 96"):
        import_bnb4(_linear4bit(8, 96))
    with pytest.raises(ValueError, match="no quant_state"):
        import_bnb4(torch.nn.Linear(4, 4))
