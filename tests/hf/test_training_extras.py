"""Training set-ups beyond the plain forward: gradient checkpointing, TRL's SFTTrainer, the cross_entropy-only
patch (logits kept, loss through tigon.ops.cross_entropy) and the no-GPU fallback to the reference ops.
"""

import copy
import logging

import pytest
import torch

import tigon
from tests.hf._tiny import batch, tiny_model
from tigon.ops import _library, dispatch_counts

# The tiny models live on the CPU: the kernels run there through Triton's interpreter (CI); on a CUDA machine
# without the interpreter the CPU path is the reference ops, and the counts below are checked for that path.
KERNEL = _library.backend_for(torch.device("cpu"))
TINY = dict(num_hidden_layers=1, hidden_size=16, intermediate_size=32, num_attention_heads=2, num_key_value_heads=1,
            head_dim=8, vocab_size=32)


def _close(a, b, name, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _loss_and_grads(model, ids, labels, **kwargs):
    model.zero_grad(set_to_none=True)
    out = model(ids, labels=labels, **kwargs)
    out.loss.backward()
    return out, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _check_grads(grads, grads_ref):
    assert grads.keys() == grads_ref.keys()
    for n, g in grads.items():
        _close(g, grads_ref[n], f"grad {n}", rtol=1e-3, atol=1e-5)


def test_gradient_checkpointing_matches_unpatched_checkpointing():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    for m in (ref, model):
        m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        m.train()
    ids, labels = batch()
    out_ref, grads_ref = _loss_and_grads(ref, ids, labels)
    tigon.patch(model)
    try:
        dispatch_counts.clear()
        out = model(ids, labels=labels)
        forward = dict(dispatch_counts)
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
        assert out.logits is None
        _close(out.loss, out_ref.loss, "loss")
        _check_grads(grads, grads_ref)
        # Backward re-ran each checkpointed layer through the kernels: every MLP and RoPE call once more (a
        # checkpoint that did nothing would leave the counts as the forward left them).
        for op in ("swiglu", "apply_rope"):
            assert dispatch_counts[(op, KERNEL)] == 2 * forward[(op, KERNEL)] == 2 * 2, op
        assert dispatch_counts[("linear_cross_entropy", KERNEL)] == 1
    finally:
        tigon.unpatch(model)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_bf16_autocast_with_fp32_weights(model_type):
    """Trainer's bf16=True: fp32 weights, bf16 matmuls, an fp32 residual stream beside bf16 attention outputs
    (the fused residual add must promote like HF). Against the fp32 run, the patched model's loss and
    gradient errors stay within 2x those of HF under the same autocast, plus a few bf16 ulps."""
    ref = tiny_model(model_type)
    model = copy.deepcopy(ref)
    ref.train(), model.train()
    ids, labels = batch()

    def run(m, amp):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            return _loss_and_grads(m, ids, labels)

    exact, grads_exact = run(ref, False)
    hf, grads_hf = run(ref, True)
    tigon.patch(model)
    try:
        out, grads = run(model, True)
    finally:
        tigon.unpatch(model)
    u = 2.0**-8
    e_k, e_t = (abs(o.loss.item() - exact.loss.item()) for o in (out, hf))
    assert e_k <= 2 * e_t + 4 * u * exact.loss.item(), f"loss err {e_k:.3e} vs HF's {e_t:.3e}"
    assert grads.keys() == grads_exact.keys()
    for n, g in grads_exact.items():
        e_k, e_t = ((x[n] - g).norm().item() for x in (grads, grads_hf))
        assert e_k <= 2 * e_t + 4 * u * g.norm().item(), f"grad {n}: err {e_k:.3e} vs HF's {e_t:.3e}"


def test_cross_entropy_patch_keeps_logits_and_matches_hf_loss():
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    ref.train(), model.train()
    ids, labels = batch()
    n_items = (labels[:, 1:] != -100).sum()
    out_ref, grads_ref = _loss_and_grads(ref, ids, labels)
    loss_n_ref = ref(ids, labels=labels, num_items_in_batch=n_items).loss
    report = tigon.patch(model, cross_entropy=True, fused_linear_cross_entropy=False)
    try:
        assert report.replaced["loss_function (cross_entropy)"] == 1
        assert not any("fused loss" in piece for piece in report.replaced)
        dispatch_counts.clear()
        out, grads = _loss_and_grads(model, ids, labels)
        assert dispatch_counts[("cross_entropy", KERNEL)] == 1
        assert dispatch_counts[("linear_cross_entropy", KERNEL)] == 0
        assert out.logits is not None and out.logits.shape == out_ref.logits.shape
        _close(out.logits, out_ref.logits, "logits")
        _close(out.loss, out_ref.loss, "loss")
        _check_grads(grads, grads_ref)
        # gradient accumulation's sum / num_items_in_batch path of causal_lm_loss
        _close(model(ids, labels=labels, num_items_in_batch=n_items).loss, loss_n_ref, "loss / num_items_in_batch")
    finally:
        tigon.unpatch(model)
    assert "_loss_function" not in model.__dict__


def test_kernels_off_falls_back_to_the_reference_ops(monkeypatch, caplog):
    monkeypatch.setattr(_library, "interpreter_on", lambda: False)  # CPU without TRITON_INTERPRET
    monkeypatch.setattr(_library, "_warned_reference", False)
    ref = tiny_model("llama")
    model = copy.deepcopy(ref)
    ref.train(), model.train()
    ids, labels = batch()
    out_ref, grads_ref = _loss_and_grads(ref, ids, labels)
    tigon.patch(model)
    try:
        dispatch_counts.clear()
        with caplog.at_level(logging.INFO, logger="tigon"):
            out, grads = _loss_and_grads(model, ids, labels)
            model(ids, labels=labels)  # a second call: the warning is one-time
        _close(out.loss, out_ref.loss, "loss")
        _check_grads(grads, grads_ref)
        model.eval(), ref.eval()
        with torch.no_grad():
            _close(model(ids).logits, ref(ids).logits, "eval logits")
        for op in ("rms_norm", "swiglu", "apply_rope", "linear_cross_entropy"):
            assert dispatch_counts[(op, "reference")] > 0, op
            assert dispatch_counts[(op, "triton")] == 0, op
        warnings = [r for r in caplog.records if r.name == "tigon" and "kernels are off" in r.getMessage()]
        assert len(warnings) == 1 and "TRITON_INTERPRET=1" in warnings[0].getMessage()
        assert warnings[0].levelname == "INFO"  # an expected CPU run, not a warning on every start
    finally:
        tigon.unpatch(model)


def test_a_forward_another_library_installed_is_kept_and_reported():
    """TRL's SFTTrainer replaces model.forward on the instance (its own fused LM head computes the loss):
    patching after it must neither claim the fused loss nor, on unpatch, remove the other forward."""
    model = tiny_model("llama")
    hf_forward = model.forward

    def wrapped(*args, **kwargs):
        return hf_forward(*args, **kwargs)

    model.forward = wrapped
    report = tigon.patch(model)
    assert not any("fused loss" in piece for piece in report.replaced)
    assert any(piece == "fused linear cross-entropy" for piece, _ in report.skipped)
    assert model.forward is wrapped
    tigon.unpatch(model)
    assert model.forward is wrapped

    model = tiny_model("llama")  # the other order: tigon first, then the wrapper over tigon's forward
    tigon.patch(model)
    tigon_forward = model.forward
    model.forward = lambda *args, **kwargs: tigon_forward(*args, **kwargs)
    wrapper = model.forward
    tigon.unpatch(model)
    assert model.forward is wrapper
    assert type(model.model.norm).__name__ == "LlamaRMSNorm"


def _word_level_tokenizer(vocab_size):
    """A tokenizer built in memory (no download): SFTTrainer needs one only for the pad and eos ids."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size)}
    return PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t2")),
                                   pad_token="t0", eos_token="t1", unk_token="t2")


def test_trl_sft_trainer_matches_unpatched(tmp_path):
    trl = pytest.importorskip("trl", minversion="1.0")
    datasets = pytest.importorskip("datasets")

    ids, _ = batch(b=6, t=9, seed=3)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})  # pre-tokenized: SFTTrainer skips tokenizing
    tokenizer = _word_level_tokenizer(131)

    def run(patched, out):
        model = tiny_model("llama")
        if patched:
            tigon.patch(model)
        args = trl.SFTConfig(
            output_dir=str(tmp_path / out), max_steps=3, per_device_train_batch_size=2, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, bf16=False, gradient_checkpointing=False, disable_tqdm=True,
        )
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        trainer.train()
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], model

    plain, _ = run(False, "plain")
    dispatch_counts.clear()
    losses, model = run(True, "tigon")
    try:
        # The backbone ran the kernels. The loss itself comes from TRL's own fused LM head (SFTTrainer installs
        # it on model.forward and calls it with fused_lm_head=True), so linear_cross_entropy is not asserted.
        assert dispatch_counts[("rms_norm", KERNEL)] > 0 and dispatch_counts[("swiglu_mlp", KERNEL)] > 0
        assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
        torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-4, atol=1e-5)
    finally:
        tigon.unpatch(model)


@pytest.mark.parametrize("max_grad_norm", [0.05, 0.0])
def test_use_fused_adamw_takes_one_norm_pass_and_logs_hfs_grad_norm(tmp_path, monkeypatch, max_grad_norm):
    """use_fused_adamw(trainer): the Trainer's clip_grad_norm_ (clipping, or its logging-only norm at
    max_grad_norm=0) becomes the optimizer's norm, so each step takes one pass over the gradients, the logged
    grad_norm is the one HF's torch AdamW run logs, and the weights follow HF's clip + AdamW."""
    import accelerate
    from transformers import Trainer, TrainingArguments

    from tigon.hf.trainer import use_fused_adamw

    passes = {"tigon": 0, "accelerate": 0}

    def counted(key, fn):
        def wrapper(*args, **kwargs):
            passes[key] += 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(tigon.optim.AdamW, "_total_norm", counted("tigon", tigon.optim.AdamW._total_norm))
    monkeypatch.setattr(accelerate.Accelerator, "_clip_grad_norm_dtensor_aware",
                        counted("accelerate", accelerate.Accelerator._clip_grad_norm_dtensor_aware))
    # the Trainer's plumbing is under test, not the kernels (tests/test_optim.py): the reference AdamW path
    monkeypatch.setattr(_library, "use_kernels", lambda *args: False)
    ids, labels = batch(vocab=32, b=4, t=6, seed=5)
    data = [{"input_ids": i, "labels": lab} for i, lab in zip(ids, labels)]

    def run(fused):
        model = tiny_model("llama", **TINY)
        args = TrainingArguments(output_dir=str(tmp_path / str(fused)), max_steps=2, per_device_train_batch_size=2,
                                 learning_rate=1e-2, weight_decay=0.1, max_grad_norm=max_grad_norm,
                                 optim="adamw_torch", logging_steps=1, report_to=[], save_strategy="no",
                                 use_cpu=True, seed=0, data_seed=0, dataloader_num_workers=0, disable_tqdm=True)
        trainer = Trainer(model=model, args=args, train_dataset=data)
        if fused:
            use_fused_adamw(trainer)
        passes.update(tigon=0, accelerate=0)
        trainer.train()
        logs = [h for h in trainer.state.log_history if "loss" in h]
        return logs, dict(passes), model

    ref_logs, ref_passes, ref = run(False)
    logs, got_passes, model = run(True)
    assert ref_passes == {"tigon": 0, "accelerate": 2}  # the reference: HF's own pass every step
    assert got_passes == {"tigon": 2, "accelerate": 0}  # one pass a step, the optimizer's
    for got, want in zip(logs, ref_logs):
        assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-5 * want["grad_norm"]
        _close(torch.tensor(got["loss"]), torch.tensor(want["loss"]), "loss")
    for (n, p), q in zip(model.named_parameters(), ref.parameters()):
        _close(p.detach(), q.detach(), n, rtol=1e-4, atol=1e-6)


def test_use_fused_adamw_refuses_what_it_cannot_drive(tmp_path):
    from transformers import Trainer, TrainingArguments

    from tigon.hf.trainer import use_fused_adamw

    with pytest.raises(TypeError, match="use_fused_adamw: trainer must be a transformers Trainer"):
        use_fused_adamw(object())
    model = tiny_model("llama", **TINY)
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = Trainer(model=model, args=args, optimizers=(opt, None))
    with pytest.raises(ValueError, match="already has an optimizer"):
        use_fused_adamw(trainer)


def test_step_in_backward_through_the_trainer_needs_no_clipping_accumulation_or_fp16(tmp_path):
    """fused_adamw(args, step_in_backward=True): the Trainer's settings that need the gradients after the backward
    are refused, naming the TrainingArguments field; without them the optimizer steps in the backward."""
    from transformers import TrainingArguments

    from tigon.hf.trainer import fused_adamw

    def args(**kw):
        return TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True, **kw)

    for kw, what in ((dict(), "max_grad_norm=0"), (dict(max_grad_norm=0.0, gradient_accumulation_steps=2),
                                                   "gradient_accumulation_steps=1")):
        with pytest.raises(ValueError, match=f"fused_adamw: step_in_backward=True needs TrainingArguments with {what}"):
            fused_adamw(args(**kw), step_in_backward=True)
    cls, kwargs = fused_adamw(args(max_grad_norm=0.0), step_in_backward=True, state_bits=8)
    model = tiny_model("llama", **TINY)
    opt = cls(model.parameters(), **kwargs)
    assert opt.step_in_backward and opt.state_bits == 8 and opt.max_grad_norm is None
    model(input_ids=torch.randint(0, 32, (2, 9)), labels=torch.randint(0, 32, (2, 9))).loss.backward()
    assert all(p.grad is None for p in model.parameters()) and len(opt.state) == len(list(model.parameters()))
