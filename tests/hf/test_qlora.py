"""QLoRA: PEFT LoRA adapters on a frozen NF4 4-bit base (bitsandbytes), patched vs unpatched.

The base is a tiny random Llama saved to disk and loaded back through `BitsAndBytesConfig(load_in_4bit=True)`,
the way a QLoRA script loads a checkpoint; bitsandbytes >= 0.48 has a CPU backend, so this runs on the CPU
(fp32 compute, kernels through the interpreter) and on a GPU (bf16 compute). One model serves every run:
unpatched first, then patched, then unpatched again (an instance patch swaps RoPE module-wide, so a second
"unpatched" model would not be unpatched while the first is patched).
"""

import pytest
import torch

import tigon
from tests.hf._tiny import batch, op_calls, tiny_model
from tigon.hf import lora as tigon_lora
from tigon.ops import dispatch_counts

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
STEPS = 3


def _compute_dtype(device):
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def _require_nf4(device):
    """Skip, with the reason, when this bitsandbytes build cannot quantize and dequantize NF4 on `device`."""
    w = torch.randn(96, 128, device=device, dtype=_compute_dtype(device))
    try:
        packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4")
        back = bnb.functional.dequantize_4bit(packed, state)
    except Exception as e:  # a build without this device's backend raises from its native library
        pytest.skip(f"bitsandbytes {bnb.__version__} cannot run NF4 on {device.type}: {type(e).__name__}: {e}")
    # NF4's largest step is ~0.28 of a block's absmax; a broken backend returns zeros or garbage.
    assert (back.float() - w.float()).abs().max() <= 0.3 * w.abs().max()


def _qlora_model(tmp_path, device, *, checkpointing=False, patch_first=False, **quant):
    """The QLoRA recipe: a 4-bit NF4 base, prepare_model_for_kbit_training, LoRA on every projection (patch_first:
    tigon.patch before get_peft_model, the order of the 8B LoRA benchmark)."""
    _require_nf4(device)
    dtype = _compute_dtype(device)
    path = tmp_path / "base"
    # Every weight's rows a multiple of 64 (bnb's block): bitsandbytes 0.50.2's CPU NF4 dequantize kernel walks
    # the blocks row by row and reads garbage when a row ends mid-block ([64, 96] gets 87% of absmax wrong).
    tiny_model("llama", intermediate_size=128).to(dtype).save_pretrained(path)
    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=dtype, **quant)
    device_map = {"": device.index or 0} if device.type == "cuda" else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config,
                                                              device_map=device_map, dtype=dtype)
    model = peft.prepare_model_for_kbit_training(
        model, use_gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False})
    if patch_first:
        tigon.patch(model)
    torch.manual_seed(0)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS,
                                                       lora_dropout=0.0))
    with torch.no_grad():  # LoRA B starts at zero: make the adapters matter from the first step
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    model.train()
    return model


def _four_bit_layers(model):
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _train(model, ids, labels, start):
    """STEPS AdamW steps from the adapter weights `start`: (losses, the first step's LoRA grads, final weights)."""
    trainable = {n: p for n, p in model.named_parameters() if p.requires_grad}
    with torch.no_grad():
        for n, p in trainable.items():
            p.copy_(start[n])
    opt = torch.optim.AdamW(trainable.values(), lr=1e-3)
    losses, first_grads = [], None
    for _ in range(STEPS):
        opt.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=labels)
        out.loss.backward()
        for m in _four_bit_layers(model):
            assert m.weight.grad is None, "the frozen 4-bit base got a gradient"
        if first_grads is None:
            first_grads = {n: p.grad.clone() for n, p in trainable.items()}
        losses.append(out.loss.detach().float())
        opt.step()
    final = {n: p.detach().clone() for n, p in trainable.items()}
    return torch.stack(losses), first_grads, final, out


def _check_close(a, b, name, device):
    if device.type == "cuda":  # bf16 4-bit matmuls: rounding differs between the two orders of the fused ops
        err = (a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-12)
        assert err <= 3e-2, f"{name}: relative error {err:.3g}"
    else:
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-5, msg=lambda m: f"{name}: {m}")


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_qlora_patched_matches_unpatched(tmp_path, device, checkpointing):
    model = _qlora_model(tmp_path, device, checkpointing=checkpointing)
    hf = model.get_base_model()
    four_bit = _four_bit_layers(model)
    assert len(four_bit) == 2 * len(LORA_TARGETS)  # two layers, every projection quantized
    assert all(not m.weight.requires_grad and m.weight.dtype == torch.uint8 for m in four_bit)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    start = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    ids, labels = (t.to(device) for t in batch())

    losses_ref, grads_ref, final_ref, out_ref = _train(model, ids, labels, start)
    assert out_ref.logits is not None

    report = tigon.patch(model)
    try:
        assert report.replaced["SwiGLUMLP LlamaMLP"] == 2
        assert report.replaced["LlamaForCausalLM.forward (fused loss)"] == 1
        assert not [s for s in report.skipped if s[0] == "fused linear cross-entropy"]
        assert type(hf.model.layers[0].mlp).__name__ == "SwiGLUMLP"
        assert type(hf.model.layers[0].mlp.gate_proj).__name__ == "Linear4bit"  # PEFT's, around bnb's
        before = dispatch_counts[("linear_cross_entropy", "triton")]
        swiglu_before = dispatch_counts[("swiglu", "triton")]
        adds = op_calls("lora_add")
        losses, grads, final, out = _train(model, ids, labels, start)
        assert out.logits is None  # the loss came from the fused lm_head, not from full logits
        # every 4-bit LoRA projection ran tigon.ops.lora_add, twice a step under checkpointing (the recompute)
        assert op_calls("lora_add") - adds == len(four_bit) * STEPS * (2 if checkpointing else 1)
        assert dispatch_counts[("linear_cross_entropy", "triton")] == before + STEPS
        assert dispatch_counts[("swiglu", "triton")] >= swiglu_before + 2 * STEPS
    finally:
        tigon.unpatch(model)

    assert torch.isfinite(losses).all()
    _check_close(losses, losses_ref, "losses", device)
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        _check_close(g, grads_ref[n], f"grad {n}", device)
    for n, w in final.items():
        _check_close(w, final_ref[n], f"weight after {STEPS} steps {n}", device)
    assert losses[-1] < losses[0]

    assert type(hf.model.layers[0].mlp).__name__ == "LlamaMLP"
    assert type(hf.model.norm).__name__ == "LlamaRMSNorm"
    assert "forward" not in hf.__dict__
    assert not any(tigon_lora.MARK in m.__dict__ for m in model.modules())
    adds = op_calls("lora_add")
    losses_again, grads_again, _, out_again = _train(model, ids, labels, start)
    assert out_again.logits is not None and op_calls("lora_add") == adds
    _check_close(losses_again, losses_ref, "losses after unpatch", device)
    for n, g in grads_again.items():
        _check_close(g, grads_ref[n], f"grad after unpatch {n}", device)


def test_qlora_quantized_lm_head_keeps_the_hf_loss(tmp_path, device):
    """With lm_head quantized too (skip list without it) the fused loss cannot read its packed uint8 weight:
    patch() leaves the loss to Hugging Face, says why, and the norms and MLPs are still Tigon's."""
    model = _qlora_model(tmp_path, device, llm_int8_skip_modules=["none"])
    hf = model.get_base_model()
    assert isinstance(hf.lm_head, bnb.nn.Linear4bit)
    ids, labels = (t.to(device) for t in batch())
    ref = model(input_ids=ids, labels=labels).loss.detach()
    report = tigon.patch(model)
    try:
        assert report.replaced["SwiGLUMLP LlamaMLP"] == 2
        assert any(piece == "fused linear cross-entropy" and "quantized" in why for piece, why in report.skipped)
        out = model(input_ids=ids, labels=labels)
        assert out.logits is not None
        _check_close(out.loss.detach(), ref, "loss", device)
        out.loss.backward()
        assert all(m.weight.grad is None for m in _four_bit_layers(model))
    finally:
        tigon.unpatch(model)


def _loss_and_lora_grads(model, ids, labels):
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.requires_grad}


def test_qlora_on_a_class_level_patch(tmp_path, device):
    """patch(model_type=...) before from_pretrained: bitsandbytes quantizes the projections inside Tigon's MLP."""
    ids, labels = (t.to(device) for t in batch())
    out_ref, grads_ref = _loss_and_lora_grads(_qlora_model(tmp_path, device), ids, labels)
    tigon.patch(model_type="llama")
    try:
        model = _qlora_model(tmp_path, device)
        hf = model.get_base_model()
        assert type(hf.model.layers[0].mlp).__name__ == "SwiGLUMLP"
        assert isinstance(hf.model.layers[0].mlp.down_proj.base_layer, bnb.nn.Linear4bit)
        out, grads = _loss_and_lora_grads(model, ids, labels)
        assert out.logits is None
    finally:
        tigon.unpatch()
    _check_close(out.loss.detach(), out_ref.loss.detach(), "loss", device)
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        _check_close(g, grads_ref[n], f"grad {n}", device)


def test_qlora_quantized_lm_head_on_a_class_level_patch(tmp_path, device):
    """A 4-bit lm_head is an nn.Linear subclass holding packed integers: the class-level fused forward must
    leave the loss to HF's logits path (causal_lm._resolve_linear) instead of reading the uint8 weight."""
    ids, labels = (t.to(device) for t in batch())
    tigon.patch(model_type="llama")
    try:
        model = _qlora_model(tmp_path, device, llm_int8_skip_modules=["none"])
        out = model(input_ids=ids, labels=labels)
    finally:
        tigon.unpatch()
    assert out.logits is not None
    ref = _qlora_model(tmp_path, device, llm_int8_skip_modules=["none"])
    _check_close(out.loss.detach(), ref(input_ids=ids, labels=labels).loss.detach(), "loss", device)


def test_qlora_patch_before_peft_runs_lora_add_and_unpatch_restores_peft(tmp_path, device):
    """tigon.patch on the 4-bit model before get_peft_model: the bitsandbytes layers carry the marks PEFT's
    Linear4bit finds (its module is imported by get_peft_model, after the patch: installed at the first forward).
    Loss and LoRA grads equal PEFT's; unpatch puts PEFT's forward back on its class once no marked model is left."""
    import gc

    from peft.tuners.lora import bnb as peft_bnb

    ids, labels = (t.to(device) for t in batch())
    ref = _qlora_model(tmp_path, device)
    start = {n: p.detach().clone() for n, p in ref.named_parameters() if p.requires_grad}
    out_ref, grads_ref = _loss_and_lora_grads(ref, ids, labels)
    peft_forward = tigon_lora._PEFT_FORWARD.get(peft_bnb.Linear4bit, peft_bnb.Linear4bit.forward)
    model = _qlora_model(tmp_path, device, patch_first=True)
    with torch.no_grad():  # the adapters are drawn in module order, which Tigon's MLP changes: copy them by name
        for n, p in model.named_parameters():
            if p.requires_grad:
                p.copy_(start[n])
    try:
        adds = op_calls("lora_add")
        out, grads = _loss_and_lora_grads(model, ids, labels)
        assert op_calls("lora_add") - adds == len(_four_bit_layers(model))
        assert getattr(peft_bnb.Linear4bit.forward, "__tigon__", False)
    finally:
        gc.collect()  # models of earlier tests in this process (garbage, not yet collected) may still hold marks
        tigon.unpatch(model)
    _check_close(out.loss.detach(), out_ref.loss.detach(), "loss", device)
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        _check_close(g, grads_ref[n], f"grad {n}", device)
    if tigon_lora._LIVE:  # a model another test keeps alive still holds marks: PEFT's layers keep Tigon's forward
        assert getattr(peft_bnb.Linear4bit.forward, "__tigon__", False)
    else:
        assert peft_bnb.Linear4bit.forward is peft_forward
    adds = op_calls("lora_add")
    with torch.no_grad():
        assert torch.isfinite(model(input_ids=ids, labels=labels).loss)
    assert op_calls("lora_add") == adds  # the attention's 4-bit LoRA layers are PEFT's again


def test_lora_8bit_layer_runs_lora_add(device):
    """PEFT's Linear8bitLt shares Linear4bit's forward (without the clone): one layer around bitsandbytes'
    int8 Linear8bitLt, armed as patch() arms a model, against PEFT's own forward on the same layer."""
    from peft.tuners.lora import bnb as peft_bnb

    torch.manual_seed(0)
    base = bnb.nn.Linear8bitLt(128, 64, bias=True, has_fp16_weights=False).to(device)
    layer = peft_bnb.Linear8bitLt(base, "default", config=peft.LoraConfig(r=4, lora_alpha=8), r=4, lora_alpha=8)
    with torch.no_grad():
        layer.lora_B["default"].weight.normal_(0.0, 0.1)
    x = torch.randn(2, 3, 128, device=device)

    def run():
        xs = x.clone().requires_grad_()
        y = layer(xs)
        y.square().sum().backward()
        ab = [layer.lora_A["default"].weight, layer.lora_B["default"].weight]
        grads = [xs.grad] + [p.grad.clone() for p in ab]
        layer.zero_grad(set_to_none=True)
        return [y.detach()] + grads

    want = run()
    holder, undo = torch.nn.ModuleDict({"layer": layer}), []
    tigon_lora.arm(holder, undo)
    try:
        adds = op_calls("lora_add")
        got = run()
        assert op_calls("lora_add") == adds + 1
    finally:
        for m, name, _ in undo:
            del m.__dict__[name]
        tigon_lora.release(holder)
    for name, g, w in zip(["out", "dx", "dA", "dB"], got, want):
        _check_close(g, w, name, device)
