"""tigon.compat.liger_chunked_loss: liger-kernel 0.8.5's chunked-loss class names with its exact constructor and
forward signatures (checked against liger's classes when installed, else against the recorded 0.8.5 parameter
names), and one DPO forward through the compat class against the functional."""

import inspect

import pytest
import torch

from tigon import ops
from tigon.compat import liger_chunked_loss as compat

NAMES = ["DPO", "ORPO", "CPO", "SimPO", "KTO", "GRPO", "JSD"]
FORWARD_0_8_5 = {
    "DPO": ["lin_weight", "_input", "target", "bias", "ref_input", "ref_weight", "ref_bias"],
    "ORPO": ["lin_weight", "_input", "target", "bias", "nll_target"],
    "CPO": ["lin_weight", "_input", "target", "bias"],
    "SimPO": ["lin_weight", "_input", "target", "bias"],
    "KTO": ["_input", "lin_weight", "target", "bias", "preference_labels", "ref_input", "ref_weight", "ref_bias",
            "kl"],
    "GRPO": ["_input", "lin_weight", "selected_token_ids", "attention_mask", "advantages", "bias",
             "ref_per_token_logps", "old_per_token_logps", "ref_input", "ref_weight", "ref_bias", "vllm_is_ratio",
             "num_items_in_batch"],
    "JSD": ["student_input", "student_weight", "teacher_input", "teacher_weight", "true_labels", "student_bias",
            "teacher_bias"],
}


def _params(fn):
    return [(p.name, p.default) for p in inspect.signature(fn).parameters.values() if p.name != "self"]


@pytest.mark.parametrize("name", NAMES)
def test_forward_names(name):
    cls = getattr(compat, f"LigerFusedLinear{name}Loss")
    assert [p for p, _ in _params(cls.forward)] == FORWARD_0_8_5[name]


@pytest.mark.parametrize("name", NAMES)
def test_signatures_match_liger(name):
    liger = pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed")
    ours, theirs = getattr(compat, f"LigerFusedLinear{name}Loss"), getattr(liger, f"LigerFusedLinear{name}Loss")
    assert _params(ours.__init__) == _params(theirs.__init__)
    assert _params(ours.forward) == _params(theirs.forward)


def test_dpo_compat_forward():
    torch.manual_seed(0)
    h, w = torch.randn(2, 3, 8, requires_grad=True), torch.randn(11, 8)
    t = torch.randint(0, 11, (2, 3))
    loss, aux = compat.LigerFusedLinearDPOLoss(use_ref_model=False)(w, h, t)
    loss2, aux2 = ops.fused_linear_dpo(h, w, t)
    torch.testing.assert_close(loss, loss2)
    assert len(aux) == 7
    with pytest.raises(ValueError, match="Unsupported loss_type"):
        compat.LigerFusedLinearDPOLoss(loss_type="ipo")
