"""RoPE in the Hugging Face layout: tigon vs eager (HF apply_rotary_pos_emb) vs torch.compile vs Liger.

q [4, 32, 4096, 128] and k [4, 8, 4096, 128] are the transposed views HF hands over
(q_proj(x).view(B, T, H, D).transpose(1, 2): physically [B, T, H, D]); cos/sin [4, 4096, 128] bf16 from
real angles with theta 500000, as LlamaRotaryEmbedding builds them.

Byte model: fwd reads q, k, cos, sin and writes q, k: 2 * (q + k) + cos + sin bytes; the backward is the
same map transposed (reads dq, dk, cos, sin, writes dq, dk), so fwd+bwd is twice that.
"""

import torch

from benchmarks.tools import harness as H
from benchmarks.tools.harness import Call

SHAPE = dict(B=4, T=4096, NH=32, NKV=8, D=128)
QUICK_SHAPE = dict(B=1, T=16, NH=4, NKV=2, D=32)
THETA = 500000.0
BF16 = torch.bfloat16


def cos_sin(ctx, B, T, D, dtype=BF16):
    inv_freq = 1.0 / (THETA ** (torch.arange(0, D, 2, device=ctx.device, dtype=torch.float32) / D))
    pos = torch.arange(T, device=ctx.device, dtype=torch.float32)
    emb = torch.cat([torch.outer(pos, inv_freq)] * 2, dim=-1)
    return (emb.cos()[None].expand(B, T, D).contiguous().to(dtype),
            emb.sin()[None].expand(B, T, D).contiguous().to(dtype))


def run_rope(ctx):
    from tigon import ops
    from tigon.ops import reference as ref

    s = QUICK_SHAPE if ctx.quick else SHAPE
    B, T, NH, NKV, D = s["B"], s["T"], s["NH"], s["NKV"], s["D"]
    g = torch.Generator(device=ctx.device).manual_seed(3)
    qb = H.randn((B, T, NH, D), ctx, requires_grad=True, gen=g)  # physical layout of HF's q
    kb = H.randn((B, T, NKV, D), ctx, requires_grad=True, gen=g)
    q0, k0 = qb.detach().clone(), kb.detach().clone()
    cos, sin = cos_sin(ctx, B, T, D)
    dq, dk = H.randn((B, T, NH, D), ctx, gen=g), H.randn((B, T, NKV, D), ctx, gen=g)
    dq_buf, dk_buf = dq.clone(), dk.clone()
    # Liger rotates q, k (and dq, dk in backward) in place: all four are restored before every call.
    restore = [(qb, q0), (kb, k0), (dq_buf, dq), (dk_buf, dk)]
    gos = (dq_buf.transpose(1, 2), dk_buf.transpose(1, 2))
    inputs = (qb, kb)

    qr, kr = q0.double().transpose(1, 2).requires_grad_(), k0.double().transpose(1, 2).requires_grad_()
    qo, ko = ref.apply_rope(qr, kr, cos.double(), sin.double())
    gq, gk = torch.autograd.grad((qo, ko), (qr, kr), (dq.double().transpose(1, 2), dk.double().transpose(1, 2)))
    refs = [qo.detach(), ko.detach(), gq.transpose(1, 2), gk.transpose(1, 2)]
    del qr, kr, qo, ko, gq, gk

    def check(outs, grads):
        return H.errors(("q", "k", "dq", "dk"), [*outs[:2], *grads[:2]], refs)

    def hf(fn):
        return lambda: fn(qb.transpose(1, 2), kb.transpose(1, 2), cos, sin)

    def tigon():
        return Call(hf(ops.apply_rope), inputs, gos, restore)

    def eager():
        return Call(hf(ref.eager_apply_rope), inputs, gos, restore)

    def compiled():
        return Call(hf(H.compiled(ctx, ref.eager_apply_rope, dynamic=False)), inputs, gos, restore)

    def liger():
        H.need_cuda(ctx, "liger")
        return Call(hf(H.import_first("liger_kernel.transformers:liger_rotary_pos_emb",
                                      "liger_kernel.transformers.rope:liger_rotary_pos_emb")), inputs, gos, restore)

    nqk = (B * T * NH * D + B * T * NKV * D) * 2
    ncs = 2 * B * T * D * 2
    H.measure(ctx, "apply_rope", f"q [{B}, {NH}, {T}, {D}], k [{B}, {NKV}, {T}, {D}] (HF transposed views), "
              f"cos/sin [{B}, {T}, {D}] bf16",
              [("tigon", tigon), ("eager", eager), ("torch.compile", compiled), ("liger", liger)],
              bytes_fwd=2 * nqk + ncs, bytes_fb=2 * (2 * nqk + ncs), check=check,
              extra={"model": "fwd 2 (q + k) + cos + sin bytes, fwd+bwd twice that"})


SECTIONS = {"rope": run_rope}

def main(argv=None) -> int:
    return H.standalone(SECTIONS, argv)


if __name__ == "__main__":
    raise SystemExit(main())
