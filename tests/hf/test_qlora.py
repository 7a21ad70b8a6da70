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
from tests.hf._tiny import batch, tiny_model
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


def _qlora_model(tmp_path, device, *, checkpointing=False, **quant):
    """The QLoRA recipe: a 4-bit NF4 base, prepare_model_for_kbit_training, LoRA on every projection."""
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
        losses, grads, final, out = _train(model, ids, labels, start)
        assert out.logits is None  # the loss came from the fused lm_head, not from full logits
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
    losses_again, grads_again, _, out_again = _train(model, ids, labels, start)
    assert out_again.logits is not None
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
