"""GRPO (grpo/bnpo/dr_grpo/dapo, token and sequence ratios, reference head or log-probs, entropy bonus) and the
per-token log-prob + entropy op on the fused linear head: vs the fp64 formulas, vs liger-kernel, bad input."""

import pytest
import torch

from tests.ops._loss_helpers import as64, check, grads_of, head, lengths
from tigon import ops
from tigon.ops import FusedLinearLossConfig, reference

CFG = FusedLinearLossConfig(chunk_rows=7)
B, T, H, V = 4, 5, 24, 67


def _rl_inputs(dtype):
    h, w, b, t = head(B, T, H, V, dtype)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.rand(B, T, generator=g) > 0.25).long()
    adv = torch.randn(B, generator=g)
    old = torch.randn(B, T, generator=g) * 0.2 - 4.5
    return h, w, b, ids, mask, adv, old


CASES = [
    dict(loss_type="dapo"),
    dict(loss_type="grpo", old=True, temperature=0.7, ref="head", beta=0.1),
    dict(loss_type="dr_grpo", max_completion_length=T, importance_sampling_level="sequence", old=True, ref="logps",
         entropy_coef=0.01, delta=1.5),
    dict(loss_type="bnpo", old=True),
    dict(loss_type="dapo", num_items_in_batch=13, old=True, ref="logps"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c["loss_type"])
def test_grpo_vs_fp64(case, dtype):
    h, w, b, ids, mask, adv, old = _rl_inputs(dtype)
    kw = {k: v for k, v in case.items() if k not in ("old", "ref")}
    g = torch.Generator().manual_seed(4)
    if case.get("old"):
        kw["old_per_token_logps"] = old
    if case.get("ref") == "head":
        kw["ref_hidden"] = torch.randn(B, T, 16, generator=g).to(dtype)
        kw["ref_weight"] = (torch.randn(V, 16, generator=g) * 0.5).to(dtype)
    elif case.get("ref") == "logps":
        kw["ref_per_token_logps"] = old + 0.1
    loss, metrics = ops.fused_linear_grpo(h, w, ids, mask, adv, b, config=CFG, **kw)
    got = grads_of(loss, [h, w, b])
    h64, w64, b64 = as64([h, w, b])
    kw64 = {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}
    ref, ref_metrics = reference.fused_linear_grpo(h64, w64, ids, mask, adv.double(), b64, **kw64)
    want = grads_of(ref, [h64, w64, b64])
    # the ratio exp(logp - old) and k3's exp(ref - logp) amplify logp's error by up to their size (~e^5 here)
    k = lengths(H, V, B * T) * 150
    check("loss", loss, ref, dtype, k=k, mag=1.0)
    assert len(metrics) == len(ref_metrics)
    for i, (m, r) in enumerate(zip(metrics, ref_metrics)):
        check(f"metric{i}", m, r, dtype, k=k, mag=1.0)
    for n, gg, r in zip(("dh", "dW", "db"), got, want):
        assert gg.dtype == dtype
        check(n, gg, r, dtype, k=k)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_and_entropy(dtype):
    h, w, b, t = head(B, T, H, V, dtype)
    lp, ent, lsq, mean, top1 = ops.fused_linear_logprobs(h, w, t, b, temperature=0.8, logit_scale=1.25, config=CFG)
    g = torch.Generator().manual_seed(5)
    go_lp, go_ent = torch.randn(B, T, generator=g), torch.randn(B, T, generator=g)
    got = grads_of((lp * go_lp).sum() + (ent * go_ent).sum(), [h, w, b])
    h64, w64, b64 = as64([h, w, b])
    rlp, rent = reference.fused_linear_logprobs(h64, w64, t, b64, temperature=0.8, logit_scale=1.25)
    want = grads_of((rlp * go_lp.double()).sum() + (rent * go_ent.double()).sum(), [h64, w64, b64])
    k = lengths(H, V, B * T)
    check("log_probs", lp, rlp, dtype, k=k, mag=10.0)
    check("entropy", ent, rent, dtype, k=k, mag=10.0)
    for n, gg, r in zip(("dh", "dW", "db"), got, want):
        check(n, gg, r, dtype, k=k * 4)
    x = (h64 @ w64.T + b64).detach() * (1.25 / 0.8)
    valid = t != -100
    check("mean_logits", mean, x.mean(-1), dtype, k=k)
    p = torch.softmax(x, -1)
    check("log_sum_sq_probs", lsq, torch.log((p * p).sum(-1)), dtype, k=k, mag=10.0)
    if dtype == torch.float32:
        assert torch.equal(top1[valid], (x.argmax(-1) == t)[valid])


liger_cl = pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed")


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_grpo_matches_liger(loss_type):
    h, w, b, ids, mask, adv, old = _rl_inputs(torch.float32)
    ref = old + 0.1
    kw = dict(beta=0.05, loss_type=loss_type, max_completion_length=T, temperature=0.9)
    lg = liger_cl.LigerFusedLinearGRPOLoss(compiled=False, chunk_size=2, **kw)
    l_loss, l_metrics = lg(h, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old)
    loss, metrics = ops.fused_linear_grpo(h, w, ids, mask, adv, b, ref_per_token_logps=ref, old_per_token_logps=old,
                                          config=CFG, **kw)
    torch.testing.assert_close(loss, l_loss, rtol=1e-5, atol=1e-6)
    for m, lm in zip(metrics, l_metrics):
        torch.testing.assert_close(m, lm, rtol=1e-5, atol=1e-6)
    for g, lgr in zip(grads_of(loss, [h, w, b]), grads_of(l_loss, [h, w, b])):
        torch.testing.assert_close(g, lgr, rtol=1e-4, atol=1e-6)


def test_bad_input():
    h, w, b, ids, mask, adv, old = _rl_inputs(torch.float32)
    with pytest.raises(ValueError, match="fused_linear_grpo: loss_type must be one of"):
        ops.fused_linear_grpo(h, w, ids, mask, adv, loss_type="ppo")
    with pytest.raises(ValueError, match="fused_linear_grpo: max_completion_length must be an int >= 1"):
        ops.fused_linear_grpo(h, w, ids, mask, adv, loss_type="dr_grpo")
    with pytest.raises(ValueError, match="fused_linear_grpo: advantages must have shape"):
        ops.fused_linear_grpo(h, w, ids, mask, adv[:2])
    with pytest.raises(ValueError, match="fused_linear_grpo: temperature must be"):
        ops.fused_linear_grpo(h, w, ids, mask, adv, temperature=0.0)
    with pytest.raises(ValueError, match=r"fused_linear_grpo: selected_token_ids must be in \[0, 67\); got -1"):
        ops.fused_linear_grpo(h, w, torch.full_like(ids, -1), mask, adv)
    with pytest.raises(ValueError, match="fused_linear_logprobs: target must have shape"):
        ops.fused_linear_logprobs(h, w, ids[:, :2])
    with pytest.raises(TypeError, match="fused_linear_logprobs: target must be an integer tensor"):
        ops.fused_linear_logprobs(h, w, ids.float())


def test_strided_views():
    """A strided target and a transposed hidden view read as their values (the ops make the ids contiguous)."""
    g = torch.Generator().manual_seed(7)
    h = torch.randn(H, 10, generator=g).t().requires_grad_()  # non-contiguous [10, H]
    w = torch.randn(V, H, generator=g) * 0.3
    t = torch.randint(0, V, (20,), generator=g)[::2]
    assert not t.is_contiguous() and not h.is_contiguous()
    lp, ent = ops.fused_linear_logprobs(h, w, t, config=CFG)[:2]
    rlp, rent = reference.fused_linear_logprobs(h.detach().double(), w.double(), t)
    torch.testing.assert_close(lp.double(), rlp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent.double(), rent, rtol=1e-5, atol=1e-5)
