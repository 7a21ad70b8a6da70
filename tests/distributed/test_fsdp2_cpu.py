"""FSDP2 (torch.distributed.fsdp.fully_shard) on a patched model, checked on CPU: two processes, gloo.

Each rank shards the tiny Llama (every decoder layer, the lm_head and the root), computes the fused
linear-cross-entropy loss on its half of the batch with the lm_head weight sharded in two, and runs
backward. The summed loss, every gathered gradient, and the parameters after one AdamW step must equal a
single-process run of the same patched model on the full batch; tigon.optim.AdamW clipping inside its step (the
shards' squares all-reduced) must step as torch's AdamW after clip_grad_norm_ on the whole model. The fused
loss runs inside the lm_head module's call (causal_lm.lm_head_loss), so FSDP2's pre-forward hook has
all-gathered the weight when the kernel reads it. Reading `lm_head.weight` outside the call hands the op a
DTensor shard (torch 2.13: "tigon.linear_cross_entropy_fwd.default got mixed torch.Tensor and DTensor"), which
this test catches.
"""

from pathlib import Path

import pytest
import torch

import tigon
from tests.distributed._ranks import SKIPS, launch, wait
from tests.hf._tiny import batch, tiny_model

WORLD = 2
WORKER = Path(__file__).with_name("_fsdp2_worker.py")

pytestmark = SKIPS


def _close(a, b, name, rtol=1e-4, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _reference(ids, labels, clip=None):
    """The same patched model on the full batch in one process: loss, gradients, params after AdamW (after
    clip_grad_norm_ to `clip`), and the norm clip_grad_norm_ returned."""
    model = tiny_model("llama", num_hidden_layers=1)  # one layer: FSDP2 still wraps a decoder layer apart
    tigon.patch(model)
    model.train()
    loss = model(ids, labels=labels).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip) if clip else None
    torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6).step()
    with torch.no_grad():
        loss2 = model(ids, labels=labels).loss
    return loss.detach(), grads, loss2, dict(model.named_parameters()), norm


@pytest.mark.parametrize("optim", ["torch", "tigon"])
def test_fsdp2_sharded_lm_head_fused_loss_matches_single_process(tmp_path, optim):
    # the ranks run while this process computes the reference
    procs = launch(WORKER, tmp_path, WORLD, TIGON_FSDP2_OPTIM=optim)
    ids, labels = batch(131, b=2 * WORLD, t=7)  # row 0 has ignored tokens: the halves weigh differently
    from tests.distributed._fsdp2_worker import CLIP

    loss, grads, loss2, params, norm = _reference(ids, labels, CLIP if optim == "tigon" else None)
    wait(procs, tmp_path, "FSDP2")
    got = torch.load(tmp_path / "fsdp2.pt")
    if optim == "tigon":  # one launch of the norm and one of the update on each rank's shards
        assert got["optim_counts"] == {"grad_norm/triton": 1, "adamw/triton": 1}, got["optim_counts"]
        assert norm > CLIP
        _close(got["grad_norm"], norm, "the norm over the shards, all-reduced")

    # every rank ran the fused path through the Triton kernels (interpreter), lm_head included
    assert got["counts"].get("linear_cross_entropy/triton") == 1, got["counts"]
    # the MLP ran as one node (ops.swiglu_mlp) on the weights FSDP2 gathered for the layer
    assert got["counts"].get("rms_norm/triton", 0) > 0 and got["counts"].get("swiglu_mlp/triton", 0) > 0
    _close(got["loss"], loss, "summed loss over ranks")
    assert got["grads"].keys() == grads.keys()
    for name, g in grads.items():
        _close(got["grads"][name], g, f"grad {name}")
    # Adam turns a near-zero gradient into a full-size step: atol is a tenth of lr, as in test_patch.py
    _close(got["loss2"], loss2, "loss after one AdamW step")
    for name, p in params.items():
        _close(got["params"][name], p.detach(), f"param {name} after one AdamW step", atol=1e-4)
