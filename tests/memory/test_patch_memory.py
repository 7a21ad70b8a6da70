"""tigon.patch's memory options: offload_checkpoints and tile_mlp install, report, refuse bad values before
anything changes, and unpatch removes them."""

import pytest
import torch

import tigon
from tigon.memory import checkpoint_offload_installed, tiled_mlp_installed, tiled_mlp_tile_tokens

from ..hf._tiny import tiny_model


def _grads(model, ids):
    model.zero_grad(set_to_none=True)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _checkpointed():
    model = tiny_model("llama", num_hidden_layers=2)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model.train()


def test_offload_is_bitwise_the_patched_step_and_unpatch_removes_it():
    ids = torch.randint(0, 131, (1, 19), generator=torch.Generator().manual_seed(0))
    model = _checkpointed()
    tigon.patch(model)
    loss, grads = _grads(model, ids)
    tigon.unpatch(model)
    report = tigon.patch(model, offload_checkpoints=True)
    assert report.replaced["checkpoint in host memory (1 kept on the card)"] == 2
    assert checkpoint_offload_installed(model)
    loss_o, grads_o = _grads(model, ids)
    assert torch.equal(loss, loss_o)
    assert grads.keys() == grads_o.keys() and all(torch.equal(grads[n], grads_o[n]) for n in grads)
    tigon.unpatch(model)
    assert not checkpoint_offload_installed(model)


def test_tiled_mlp_matches_the_untiled_patched_step():
    ids = torch.randint(0, 131, (1, 37), generator=torch.Generator().manual_seed(1))
    model = _checkpointed()
    tigon.patch(model)
    loss, grads = _grads(model, ids)
    tigon.unpatch(model)
    report = tigon.patch(model, tile_mlp=16, offload_checkpoints=2)
    assert report.replaced["tiled MLP (16 tokens a tile)"] == 2 and tiled_mlp_installed(model)
    assert tiled_mlp_tile_tokens(model) is None  # no step yet
    loss_t, grads_t = _grads(model, ids)
    assert tiled_mlp_tile_tokens(model) == 16
    # fp32, rows computed alone: the tiles change only which rows a GEMM sees (a few ulps of a K=96 reduction),
    # and the weight gradients sum 3 tile partials instead of one 45-row reduction
    torch.testing.assert_close(loss_t, loss, rtol=1e-6, atol=0)
    for n in grads:
        scale = grads[n].abs().max().item()
        assert (grads_t[n] - grads[n]).abs().max().item() <= 64 * torch.finfo(torch.float32).eps * max(scale, 1e-3), n
    tigon.unpatch(model)
    assert not tiled_mlp_installed(model) and not checkpoint_offload_installed(model)


@pytest.mark.parametrize("kw, error, words", [
    (dict(offload_checkpoints=-1), ValueError, "offload_checkpoints"),
    (dict(offload_checkpoints="yes"), TypeError, "offload_checkpoints"),
    (dict(tile_mlp=0), ValueError, "tile_mlp"),
    (dict(tile_mlp=2.5), TypeError, "tile_mlp"),
])
def test_bad_values_change_nothing(kw, error, words):
    model = _checkpointed()
    before = {n: type(m) for n, m in model.named_modules()}
    with pytest.raises(error, match=words):
        tigon.patch(model, **kw)
    assert {n: type(m) for n, m in model.named_modules()} == before
    assert not checkpoint_offload_installed(model) and not tiled_mlp_installed(model)


def test_memory_options_need_an_instance():
    for kw in (dict(offload_checkpoints=True), dict(tile_mlp=True)):
        with pytest.raises(ValueError, match="model instance"):
            tigon.patch(model_type="llama", **kw)


def test_the_report_carries_the_memory_plan():
    model, plain = _checkpointed(), _checkpointed()
    try:
        report = tigon.patch(model, offload_checkpoints=True)
        assert report.memory_plan.endswith("for LoRA)") and "GiB at 4096 tokens a row" in report.memory_plan
        assert "memory plan: " in str(report)
        assert not tigon.patch(plain).memory_plan
    finally:
        tigon.unpatch(model)
        tigon.unpatch(plain)
