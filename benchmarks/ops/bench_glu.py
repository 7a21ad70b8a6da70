"""SwiGLU silu(gate) * up and GeGLU gelu_tanh(gate) * up at [16384, 14336] bf16 (Llama-3-8B's MLP):
tigon (and tigon with inplace_backward=True) vs eager vs torch.compile vs Liger (LigerSiLUMulFunction,
LigerGELUMulFunction). Errors are against an fp32 reference.

gate and up are results of an op (a clone of a leaf), as the projections' outputs are in a model: tigon
honours inplace_backward only for such tensors (on leaves it silently takes the out-of-place path).
Liger's backward, and tigon's with inplace_backward, write dgate and dup over gate and up: both are
restored before every call.

Byte model, n = rows * I * 2 bytes: fwd reads gate, up and writes y (3n); fwd+bwd adds reading dy, gate,
up and writing dgate, dup (8n).
"""

import torch

from benchmarks.tools import harness as H
from benchmarks.tools.harness import Call

SHAPE = (16384, 14336)
QUICK_SHAPE = (16, 384)
BF16 = torch.bfloat16


def _run(ctx, op, liger_name):
    from tigon import ops
    from tigon.ops import reference as ref

    rows, inter = QUICK_SHAPE if ctx.quick else SHAPE
    g = torch.Generator(device=ctx.device).manual_seed(4)
    a_leaf = H.randn((rows, inter), ctx, requires_grad=True, gen=g)
    b_leaf = H.randn((rows, inter), ctx, requires_grad=True, gen=g)
    a, b = a_leaf.clone(), b_leaf.clone()  # non-leaf, like an up/gate projection's output
    a0, b0 = a.detach().clone(), b.detach().clone()
    dy = H.randn((rows, inter), ctx, gen=g)
    restore = [(a, a0), (b, b0)]
    ar, br = a0.float().requires_grad_(), b0.float().requires_grad_()
    yr = getattr(ref, op)(ar, br)
    refs = [yr.detach(), *torch.autograd.grad(yr, (ar, br), dy.float())]
    del ar, br, yr

    def check(outs, grads):
        return H.errors(("y", "dgate", "dup"), [outs[0], *grads[:2]], refs)

    tig, eag = getattr(ops, op), getattr(ref, f"eager_{op}")

    def tigon():
        return Call(lambda: tig(a, b), (a, b), (dy,), restore)

    def tigon_inplace():
        f = H.with_kwargs(tig, f"tigon {op}", inplace_backward=True)
        return Call(lambda: f(a, b), (a, b), (dy,), restore)

    def eager():
        return Call(lambda: eag(a, b), (a, b), (dy,), restore)

    def compiled():
        f = H.compiled(ctx, eag, dynamic=False)
        return Call(lambda: f(a, b), (a, b), (dy,), restore)

    def liger():
        H.need_cuda(ctx, "liger")
        fn = H.import_first(f"liger_kernel.ops:{liger_name}", f"liger_kernel.ops.{op}:{liger_name}")
        return Call(lambda: fn.apply(a, b), (a, b), (dy,), restore)

    n = rows * inter * 2
    act = "silu" if op == "swiglu" else "gelu_tanh"
    H.measure(ctx, op, f"gate, up [{rows}, {inter}] bf16 ({act}(gate) * up)",
              [("tigon", tigon), ("tigon inplace_backward", tigon_inplace), ("eager", eager),
               ("torch.compile", compiled), ("liger", liger)],
              bytes_fwd=3 * n, bytes_fb=8 * n, check=check,
              extra={"model": "fwd 3n, fwd+bwd 8n bytes (n = gate bytes)"})


def run_swiglu(ctx):
    _run(ctx, "swiglu", "LigerSiLUMulFunction")


def run_geglu(ctx):
    _run(ctx, "geglu", "LigerGELUMulFunction")


SECTIONS = {"swiglu": run_swiglu, "geglu": run_geglu}

def main(argv=None) -> int:
    return H.standalone(SECTIONS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
