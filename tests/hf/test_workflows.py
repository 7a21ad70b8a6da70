"""PEFT, the Trainer callback and the Liger-compatible API on tiny models (kernels through the interpreter)."""

import copy

import pytest
import torch

import tigon
from tests.hf._tiny import batch, tiny_model


def _close(a, b, name, rtol=2e-4, atol=2e-5):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def test_peft_lora_with_lm_head_in_modules_to_save():
    peft = pytest.importorskip("peft")
    base = tiny_model("llama")
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "down_proj"],
                          modules_to_save=["lm_head"], lora_dropout=0.0)
    ref = peft.get_peft_model(base, cfg)
    with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
        for n, p in ref.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    model = copy.deepcopy(ref)
    report = tigon.patch(model)
    assert report.replaced["SwiGLUMLP LlamaMLP"] == 2
    ids, labels = batch()
    model.train(), ref.train()
    out, out_ref = model(input_ids=ids, labels=labels), ref(input_ids=ids, labels=labels)
    assert out.logits is None
    _close(out.loss, out_ref.loss, "loss")
    out.loss.backward(), out_ref.loss.backward()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert any("modules_to_save" in n for n, _ in trainable)
    ref_params = dict(ref.named_parameters())
    for n, p in trainable:
        _close(p.grad, ref_params[n].grad, f"grad {n}", rtol=1e-3, atol=1e-5)


def _train_tiny(tmp_path, out, *, callbacks=(), optimizer=None, optimizer_cls_and_kwargs=None, **args):
    """Three Trainer steps of the tiny Llama on the CPU: (logged losses, trainer). `optimizer(model)` builds the
    optimizer handed to the Trainer (None: the Trainer's own, or `optimizer_cls_and_kwargs`); `args` override the
    TrainingArguments."""
    transformers = pytest.importorskip("transformers")
    ids, labels = batch(b=6, t=7)
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(6)]
    model = tiny_model("llama")
    args = transformers.TrainingArguments(**{
        "output_dir": str(tmp_path / out), "max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-3,
        "logging_steps": 1, "report_to": [], "save_strategy": "no", "use_cpu": True, "seed": 0, "data_seed": 0,
        "dataloader_num_workers": 0, **args})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data, callbacks=list(callbacks),
                                   optimizers=(optimizer(model) if optimizer else None, None),
                                   optimizer_cls_and_kwargs=optimizer_cls_and_kwargs)
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h], trainer


def test_trainer_with_callback_matches_plain_trainer(tmp_path):
    from tigon.hf.trainer import TigonCallback

    callback = TigonCallback()
    losses, trainer = _train_tiny(tmp_path, "tigon", callbacks=[callback])
    plain, _ = _train_tiny(tmp_path, "plain")
    assert callback.report is not None and sum(callback.report.replaced.values()) > 0
    assert type(trainer.model.model.norm).__name__ == "RMSNorm"
    assert len(losses) == 3
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-4, atol=1e-5)


def test_trainer_with_tigon_adamw_and_fused_clipping(tmp_path):
    """The HF Trainer with tigon.optim.AdamW clipping inside its step (the Trainer's own clipping off) trains as the
    Trainer with its AdamW and max_grad_norm; the Trainer's scheduler drives the optimizer's lr."""
    losses, trainer = _train_tiny(
        tmp_path, "tigon", learning_rate=1e-2, max_grad_norm=0.0,
        optimizer=lambda m: tigon.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.0, max_grad_norm=0.5))
    plain, _ = _train_tiny(tmp_path, "plain", learning_rate=1e-2, max_grad_norm=0.5, optim="adamw_torch")
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, tigon.optim.AdamW) and opt.grad_norm.item() > 0.5  # the clipping scaled the last step
    assert len(losses) == 3 and losses[0] == plain[0]
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-4, atol=1e-5)
    assert losses[2] != losses[1]  # the steps moved the weights


def test_trainer_with_fused_adamw_from_its_arguments(tmp_path):
    """`optimizer_cls_and_kwargs=fused_adamw(args)`: the Trainer's own AdamW settings and decay groups on
    tigon.optim.AdamW, its clipping moved into the step; trains as the plain Trainer with the same arguments."""
    transformers = pytest.importorskip("transformers")
    from tigon.hf.trainer import fused_adamw

    settings = dict(learning_rate=1e-2, max_grad_norm=0.5, weight_decay=0.1, adam_beta2=0.99, optim="adamw_torch")
    args = transformers.TrainingArguments(output_dir=str(tmp_path / "x"), report_to=[], use_cpu=True, **settings)
    cls, kwargs = fused_adamw(args)
    assert cls is tigon.optim.AdamW and args.max_grad_norm == 0.0
    assert kwargs == dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, max_grad_norm=0.5)
    with pytest.raises(TypeError, match="fused_adamw: args must be the Trainer's TrainingArguments"):
        fused_adamw(object())

    # the Trainer built from the same settings, with what fused_adamw left in args (max_grad_norm 0)
    losses, trainer = _train_tiny(tmp_path, "tigon", **dict(settings, max_grad_norm=args.max_grad_norm),
                                  optimizer_cls_and_kwargs=(cls, kwargs))
    plain, _ = _train_tiny(tmp_path, "plain", **settings)
    opt = trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer
    assert isinstance(opt, tigon.optim.AdamW) and [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    assert opt.grad_norm.item() > 0.5
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-4, atol=1e-5)


def test_liger_compatible_api():
    from tigon.compat import liger

    model = tiny_model("qwen3")
    report = liger.apply_liger_kernel_to_qwen3(model=model, rope=False)
    assert type(model.model.norm).__name__ == "RMSNorm"
    assert not any("apply_rotary_pos_emb" in k for k in report.replaced)
    with pytest.raises(ValueError, match="cannot both"):
        liger.apply_liger_kernel_to_llama(cross_entropy=True, fused_linear_cross_entropy=True)
    tigon.unpatch(model)
    assert type(model.model.norm).__name__ == "Qwen3RMSNorm"
