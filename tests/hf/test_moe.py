"""tigon.patch(model, moe_experts=True): the routed experts run the "tigon" experts implementation (tigon.hf.moe).

Bound (the op contract's): against the model in fp64 with HF's "eager" experts (a loop over experts, the spec),
err(patched in dtype) <= 2 * err(HF "grouped_mm" in dtype) + atol, for the loss and every parameter's gradient.
Both sides run the same grouped GEMMs; only the glue (permute, SwiGLU, combine) differs.
"""

import copy

import pytest
import torch

import tigon
from tests._grid import UNIT_ROUNDOFF
from tests.hf._tiny import batch, op_calls, tiny_model
from tigon.hf import moe

ONLY_EXPERTS = dict(rms_norm=False, rope=False, swiglu=False, fused_linear_cross_entropy=False, attention=False,
                    lora=False, moe_experts=True)
OPS = ("moe_permute", "moe_combine", "swiglu")
MOE_LAYERS = {"qwen3_moe": 1, "mixtral": 1}  # the tiny qwen3_moe's layer 1 is dense (mlp_only_layers); mixtral
# runs one layer here


def _loss_and_grads(model, ids, labels):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


SLACK_ULPS = {torch.float32: 64, torch.bfloat16: 4}


def _rel(a, ref):
    return ((a.double() - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def _check(name, got, hf, ref, dtype):
    assert torch.isfinite(got).all(), f"{name}: non-finite"
    e, e_hf = _rel(got, ref), _rel(hf, ref)
    slack = SLACK_ULPS[dtype] * UNIT_ROUNDOFF[dtype]
    assert e <= 2 * e_hf + slack, f"{name}: rel err {e:.3e} > 2 * HF's {e_hf:.3e} + {slack:.3e}"


@pytest.mark.parametrize("model_type,dtype", [("qwen3_moe", torch.float32), ("qwen3_moe", torch.bfloat16),
                                              ("mixtral", torch.float32)])
def test_patched_experts_match_hf(model_type, dtype):
    ids, labels = batch()
    size = dict(num_hidden_layers=1) if model_type == "mixtral" else {}
    spec = tiny_model(model_type, **size).to(torch.float64)
    spec.set_experts_implementation("eager")
    ref_loss, ref_grads = _loss_and_grads(spec, ids, labels)
    model = tiny_model(model_type, **size).to(dtype)
    assert model.get_experts_implementation()[""] == "grouped_mm"
    hf_loss, hf_grads = _loss_and_grads(model, ids, labels)

    before = op_calls(*OPS)
    report = tigon.patch(model, **ONLY_EXPERTS)
    assert model.get_experts_implementation()[""] == moe.NAME
    assert sum(n for piece, n in report.replaced.items() if piece.startswith("routed experts")) == \
        MOE_LAYERS[model_type]
    loss, grads = _loss_and_grads(model, ids, labels)
    # one permute, one SwiGLU and one combine per MoE layer: the Tigon ops ran
    assert op_calls(*OPS) - before == 3 * MOE_LAYERS[model_type]

    _check("loss", loss, hf_loss, ref_loss, dtype)
    assert grads.keys() == hf_grads.keys() == ref_grads.keys()
    for n in grads:
        _check(n, grads[n], hf_grads[n], ref_grads[n], dtype)

    tigon.unpatch(model)
    assert model.get_experts_implementation()[""] == "grouped_mm"
    before = op_calls(*OPS)
    again, _ = _loss_and_grads(model, ids, labels)
    assert op_calls(*OPS) == before and torch.equal(again, hf_loss)


def _routing_with_empty_experts_and_sentinels(T, K, E, seed):
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E - 2, generator=g)[:K] for _ in range(T)])  # experts E-2, E-1 get nothing
    idx[1, 0] = idx[4, 1] = E  # expert parallelism's sentinel (not routed on this rank), weight 0
    w = torch.rand(T, K, generator=g)
    w[1, 0] = w[4, 1] = 0.0
    return idx, w


def test_experts_forward_with_empty_experts_and_sentinels():
    model = tiny_model("qwen3_moe", num_experts=6)
    experts = moe.experts_modules(model)[0]
    T, K, H = 9, 2, model.config.hidden_size
    idx, w = _routing_with_empty_experts_and_sentinels(T, K, 6, seed=3)
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(4))
    go = torch.randn(T, H, generator=torch.Generator().manual_seed(5))

    def run(fn, dtype):
        xk, wk = x.to(dtype).requires_grad_(), w.to(dtype).requires_grad_()
        out = fn(experts, xk, idx, wk)
        params = [experts.gate_up_proj, experts.down_proj]
        grads = torch.autograd.grad(out, [xk, wk, *params], go.to(dtype))
        return [out.detach(), *grads]

    from transformers.integrations.moe import grouped_mm_experts_forward

    def spec(self, x, idx, w):  # fp64, one token and expert at a time, sentinels skipped
        rows = []
        for t in range(x.shape[0]):
            row = torch.zeros_like(x[t])
            for k in range(idx.shape[1]):
                e = int(idx[t, k])
                if e < self.num_experts:
                    gate, up = (self.gate_up_proj[e] @ x[t]).chunk(2)
                    row = row + w[t, k] * (self.down_proj[e] @ (torch.nn.functional.silu(gate) * up))
            rows.append(row)
        return torch.stack(rows)

    ref = run(grouped_mm_experts_forward, torch.float32)  # the per-expert GEMMs are the same in both
    experts.double()
    exact = run(spec, torch.float64)
    experts.float()
    before = op_calls("moe_permute", "moe_combine")
    got = run(moe.tigon_experts_forward, torch.float32)
    assert op_calls("moe_permute", "moe_combine") == before + 2
    for name, a, b, e in zip(("out", "dx", "dw", "dgate_up", "ddown"), got, ref, exact):
        _check(name, a, b, e, torch.float32)
    assert (got[2][1, 0] == 0) and (got[2][4, 1] == 0)  # a sentinel's weight gets no gradient


def test_default_auto_class_patch_skips_and_idempotent():
    model = tiny_model("qwen3_moe")
    tigon.patch(model, attention=False)  # moe_experts="auto": on for a model with routed experts
    assert model.get_experts_implementation()[""] == moe.NAME
    tigon.unpatch(model)
    assert model.get_experts_implementation()[""] == "grouped_mm"
    tigon.patch(model, attention=False, moe_experts=False)
    assert model.get_experts_implementation()[""] == "grouped_mm"
    tigon.unpatch(model)
    report = tigon.patch(model_type="qwen3_moe", moe_experts=True, rms_norm=False, swiglu=False, rope=False,
                         fused_linear_cross_entropy=False)
    assert any(piece == "moe experts" for piece, _ in report.skipped)
    tigon.unpatch(model_type="qwen3_moe")
    with pytest.raises(TypeError, match="moe_experts"):
        tigon.patch(model, moe_experts="yes")
    model.set_experts_implementation("eager")
    tigon.patch(model, **ONLY_EXPERTS)
    tigon.patch(model, **ONLY_EXPERTS)  # twice: one undo record, the first "before" kept
    clone = copy.deepcopy(model)
    assert clone.get_experts_implementation()[""] == moe.NAME
    tigon.unpatch(model)
    assert model.get_experts_implementation()[""] == "eager"
    assert clone.get_experts_implementation()[""] == moe.NAME  # the copy keeps its own patch
    tigon.unpatch(clone)
    assert clone.get_experts_implementation()[""] == "eager"


def test_dense_model_skips():
    report = tigon.patch(tiny_model("llama"), **ONLY_EXPERTS)
    assert any(piece == "moe experts" and "no routed experts" in why for piece, why in report.skipped)
    quiet = tigon.patch(tiny_model("llama"), **{**ONLY_EXPERTS, "moe_experts": "auto"})
    assert not any(piece == "moe experts" for piece, _ in quiet.skipped)  # "auto" says nothing about a dense model
