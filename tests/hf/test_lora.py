"""PEFT LoRA on all seven projections of a tiny Llama: patched (either order of patch and get_peft_model) vs PEFT.

fp32 models, so patched and unpatched differ only by the fused kernels' rounding order: loss and every LoRA gradient
agree to 1e-4 of their scale. tigon.ops.dispatch_counts proves the op ran on every projection.
"""

import gc

import pytest
import torch

import tigon
from tests.hf._tiny import batch as _batch
from tests.hf._tiny import op_calls, tiny_model
from tigon.hf import lora as tigon_lora
from tigon.ops import reference

peft = pytest.importorskip("peft")

def batch():
    return _batch(b=1, t=6, ignore_tail=1)  # one short row: the interpreter's cost grows with the rows


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _peft_model(*, patch_first=False, dropout=0.0, second=False, **patch_kw):
    """A 1-layer tiny Llama with LoRA r=4 on all projections (B random, so the adapters matter); patched before or
    after get_peft_model, or not at all (patch_first None)."""
    model = tiny_model("llama", num_hidden_layers=1)
    report = tigon.patch(model, **patch_kw) if patch_first else None
    torch.manual_seed(0)
    cfg = dict(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=dropout)
    model = peft.get_peft_model(model, peft.LoraConfig(**cfg))
    if second:
        model.add_adapter("second", peft.LoraConfig(**{**cfg, "r": 2, "lora_alpha": 6, "use_rslora": True}))
        model.base_model.set_adapter(["default", "second"])
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    if patch_first is False:
        report = tigon.patch(model, **patch_kw)
    return model, report


def _step(model):
    ids, labels = batch()
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def _assert_close(got, want):
    (loss, grads), (loss_ref, grads_ref) = got, want
    assert abs(loss.item() - loss_ref.item()) <= 1e-5 * abs(loss_ref.item())
    assert grads.keys() == grads_ref.keys() and any("lora_A" in n for n in grads)
    for n, g in grads.items():
        scale = grads_ref[n].abs().max().item()
        assert (g - grads_ref[n]).abs().max().item() <= 1e-4 * scale + 1e-7, n


@pytest.fixture(scope="module")
def peft_ref():
    model, _ = _peft_model(patch_first=None)
    return _step(model)


@pytest.mark.parametrize("patch_first", [True, False])
def test_patched_matches_peft_either_order(peft_ref, patch_first):
    """patch first runs benchmarks/bench_lora.py's order: patch, gradient checkpointing, get_peft_model (each
    projection then runs twice a step: the forward and checkpointing's recompute)."""
    model, report = _peft_model(patch_first=patch_first)
    if patch_first:
        model.base_model.model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
        model.train()
    piece = "lora: nn.Linear layers ready for PEFT adapters added later" if patch_first else \
        "lora: projections (PEFT lora.Linear -> ops.lora_linear; its bitsandbytes layers -> ops.lora_add)"
    assert report.replaced[piece] == (8 if patch_first else 7)  # 7 projections (+ lm_head when marked before PEFT)
    calls = op_calls("lora_linear"), op_calls("swiglu"), op_calls("linear_cross_entropy")
    got = _step(model)
    assert op_calls("lora_linear") - calls[0] == (14 if patch_first else 7)  # every projection of the layer
    assert op_calls("swiglu") > calls[1] and op_calls("linear_cross_entropy") > calls[2]  # fused GLU and loss stay on
    _assert_close(got, peft_ref)
    tigon.unpatch(model)
    # unpatch keeps the adapters: every projection is still PEFT's LoRA layer, and the model computes PEFT's step
    lora_layers = [n for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.layer.Linear)]
    assert len(lora_layers) == 7, lora_layers
    before = op_calls("lora_linear")
    _assert_close(_step(model), peft_ref)
    assert op_calls("lora_linear") == before


def test_unpatched_peft_model_beside_a_patched_one_keeps_peft(peft_ref):
    patched, _ = _peft_model(patch_first=True)
    plain, _ = _peft_model(patch_first=None)
    before = op_calls("lora_linear")
    _assert_close(_step(plain), peft_ref)
    assert op_calls("lora_linear") == before
    tigon.unpatch(patched)


def test_two_adapters_match_peft():
    ref = _step(_peft_model(patch_first=None, second=True)[0])
    model, _ = _peft_model(second=True)
    before = op_calls("lora_linear")
    got = _step(model)
    assert op_calls("lora_linear") - before == 7
    assert any("second" in n for n in got[1])
    _assert_close(got, ref)
    tigon.unpatch(model)


def test_merged_and_disabled_adapters_take_peft_path_unpatch_restores():
    from peft.tuners.lora.layer import Linear

    peft_forward = tigon_lora._PEFT_FORWARD.get(Linear, Linear.forward)
    ids, _ = batch()
    model, _ = _peft_model()
    with torch.no_grad():
        want = model(input_ids=ids).logits
        model.base_model.merge_adapter()
        before = op_calls("lora_linear")
        merged = model(input_ids=ids).logits
        assert op_calls("lora_linear") == before
        torch.testing.assert_close(merged, want, rtol=1e-4, atol=1e-4)
        model.base_model.unmerge_adapter()
        with model.disable_adapter():
            model(input_ids=ids)
        assert op_calls("lora_linear") == before
    gc.collect()  # models of earlier tests in this process (garbage, not yet collected) still hold marks
    tigon.unpatch(model)
    if tigon_lora._LIVE:  # a model another test keeps alive still holds marks: PEFT's layers keep Tigon's forward
        assert getattr(Linear.forward, "__tigon__", False)
    else:
        assert Linear.forward is peft_forward and not getattr(Linear.forward, "__tigon__", False)
    assert not any(tigon_lora.MARK in m.__dict__ for m in model.modules())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, want, rtol=1e-4, atol=1e-4)
    assert op_calls("lora_linear") == before


def test_lora_false_leaves_projections_to_peft(peft_ref):
    model, report = _peft_model(lora=False)
    assert not any(piece.startswith("lora") for piece in report.replaced)
    before = op_calls("lora_linear")
    _assert_close(_step(model), peft_ref)
    assert op_calls("lora_linear") == before
    tigon.unpatch(model)


def test_dropout_eval_equals_peft_and_train_replays_mask():
    """Dropout masks differ between implementations, so p > 0 is checked without comparing masks: in eval mode
    (dropout off) the patched model equals PEFT's; in training one projection's output and gradients equal the
    fp32 reference run with the mask the op drew (reseeded, the same draw)."""
    ids, labels = batch()
    ref, _ = _peft_model(patch_first=None, dropout=0.1)
    model, _ = _peft_model(dropout=0.1)
    ref.eval()
    model.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, ref(input_ids=ids).logits, rtol=1e-4, atol=1e-4)
    model.train()
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 5, layer.in_features, generator=torch.Generator().manual_seed(4), requires_grad=True)
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    before = op_calls("lora_linear")
    torch.manual_seed(11)
    y = layer(x)
    assert op_calls("lora_linear") == before + 1
    torch.manual_seed(11)
    mask = torch.native_dropout(x.detach().reshape(-1, x.shape[-1]), 0.1, True)[1].view(x.shape)
    leaves = [t.detach().clone().requires_grad_() for t in (x, a, b)]
    y_ref = reference.lora_linear(leaves[0], layer.base_layer.weight, None, [leaves[1]], [leaves[2]],
                                  [layer.scaling["default"]], [0.1], [mask])
    g = torch.randn(y.shape, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(y, (x, a, b), g)
    y_ref.backward(g)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)
    for got, leaf in zip(grads, leaves):
        torch.testing.assert_close(got, leaf.grad, rtol=1e-5, atol=1e-5)
    tigon.unpatch(model)


def test_a_copied_first_forward_hook_removes_itself_without_its_handle():
    """A deep copy of a model patched before PEFT was imported carries the one-shot install hook but not its handle
    (the handles are kept by module, weakly): its first forward installs and takes the hook off, with no error."""
    import functools

    pytest.importorskip("peft.tuners.lora.layer")
    copy = torch.nn.Linear(4, 3)
    copy.register_forward_pre_hook(functools.partial(tigon_lora._install_at_first_forward, qlora=False),
                                   with_kwargs=True)
    assert copy not in tigon_lora._PENDING
    copy(torch.randn(2, 4))
    assert not copy._forward_pre_hooks and not copy._forward_pre_hooks_with_kwargs
    copy(torch.randn(2, 4))  # and stays off
