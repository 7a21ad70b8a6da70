"""bitsandbytes Linear4bit (installed, CPU backend): the NF4 and FP4 imports against bitsandbytes' own dequantize (bit
for bit) and its module forward, plain and double-quantized absmax; the FP4 table against bitsandbytes' dequantization
of every code; unknown code books and row-straddling blocks refused."""

import importlib

import pytest
import torch

from tests._grid import assert_tol, matmul_tol
from tests.ops.test_quant_linear import _on
from tigon import ops
from tigon.ops.quantized_weight import FP4, TABLES, dequantize, linear_reference
from tigon.quant import format_of, import_bnb4

bnb = pytest.importorskip("bitsandbytes")
ql = importlib.import_module("tigon.ops.quant_linear")  # the module: tigon.ops.quant_linear is the function


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


def _matches_bitsandbytes(m, kind, block, n, k, device):
    """The import of m against bitsandbytes: its dequantize bit for bit, its forward and tigon's kernels (on the
    suite's device) within the fp32 matmul model, m left untouched."""
    packed, absmax = m.weight.data.clone(), m.weight.quant_state.absmax.clone()
    assert format_of(m) == "bnb4"
    qw = import_bnb4(m)
    assert (qw.kind, qw.group_size, qw.shape, qw.dtype) == (kind, block, (n, k), torch.float32)
    w = bnb.functional.dequantize_4bit(m.weight.data, m.weight.quant_state)
    assert torch.equal(dequantize(qw), w.float())  # bitsandbytes' own dequantize, bit for bit
    assert torch.equal(m.weight.data, packed) and torch.equal(m.weight.quant_state.absmax, absmax)
    x = torch.randn(3, k)
    ref = x.double() @ w.double().T + m.bias.double()
    tol = matmul_tol(x, w.T)
    assert_tol("import forward", linear_reference(x, qw, m.bias), ref, tol)
    assert_tol("module forward", m(x), ref, tol)
    before = ops.dispatch_counts[("quant_linear", "triton")]
    qw, x, bias = _on(qw, device), x.to(device), m.bias.to(device)
    for rows in (1, 3):  # the GEMV and the tensor-core kernel, through the table path (fp32 x: no rounding of W)
        assert_tol(f"quant_linear {rows}", ops.quant_linear(x[:rows], qw, bias=bias).cpu(), ref[:rows], tol[:rows])
    assert ops.dispatch_counts[("quant_linear", "triton")] == before + 2  # the kernels ran, not the reference


@pytest.mark.parametrize("nested", [False, True])
def test_nf4_matches_bitsandbytes(device, nested):
    m = _linear4bit(24, 192, nested=nested)
    assert m.weight.quant_state.nested == nested
    _matches_bitsandbytes(m, "nf4", 64, 24, 192, device)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("n, k, blocksize", [(24, 192, 64), (13, 320, 64), (7, 96, 32), (5, 384, 128)])
def test_fp4_matches_bitsandbytes(device, nested, n, k, blocksize):
    # odd N; 65 absmax blocks for 13 x 320 (double quant: a partial block of the second-level absmax)
    m = _linear4bit(n, k, quant_type="fp4", nested=nested, blocksize=blocksize, seed=n)
    state = m.weight.quant_state
    assert (state.quant_type, state.nested, state.blocksize) == ("fp4", nested, blocksize)
    _matches_bitsandbytes(m, "fp4", blocksize, n, k, device)


def test_fp4_table_is_bitsandbytes_dequantization_of_every_code():
    code = bnb.functional.get_4bit_type("fp4", device="cpu")
    assert torch.equal(torch.tensor(FP4), code) and TABLES["fp4"] is FP4
    # every byte, absmax 1: bitsandbytes' dequantize_4bit of a code is its table value (first code in the high nibble)
    _, state = bnb.functional.quantize_4bit(torch.randn(8, 64), quant_type="fp4", blocksize=64)
    state.absmax, state.shape, state.dtype = torch.ones(8), torch.Size((8, 64)), torch.float32
    out = bnb.functional.dequantize_4bit(torch.arange(256, dtype=torch.uint8).reshape(-1, 1), state).reshape(256, 2)
    b = torch.arange(256)
    table = torch.tensor(FP4)
    assert torch.equal(out[:, 0], table[b >> 4]) and torch.equal(out[:, 1], table[b & 15])
    # the kernels' T: each byte's (low, high) nibble values
    assert torch.equal(ql._pairs("fp4", torch.device("cpu")), torch.stack((out[:, 1], out[:, 0]), dim=1))


def test_refusals():
    m = _linear4bit(8, 64, quant_type="fp4")
    m.weight.quant_state.quant_type = "af4"
    with pytest.raises(ValueError, match=r"tigon.quant.import_bnb4: quant_type must be 'nf4' or 'fp4' .* 'af4'"):
        import_bnb4(m)
    m = _linear4bit(8, 64, quant_type="fp4")
    m.weight.quant_state.code = bnb.functional.get_4bit_type("nf4", device="cpu")  # another table under fp4's name
    with pytest.raises(ValueError, match=r"import_bnb4: the state's fp4 code book differs from bitsandbytes' FP4"):
        import_bnb4(m)
    with pytest.raises(ValueError, match="blocksize 64 must divide in_features 96"):
        import_bnb4(_linear4bit(8, 96, quant_type="fp4"))
    with pytest.raises(ValueError, match="blocksize 64 must divide in_features 96"):
        import_bnb4(_linear4bit(8, 96))
    with pytest.raises(ValueError, match="no quant_state"):
        import_bnb4(torch.nn.Linear(4, 4))
