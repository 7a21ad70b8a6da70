"""`skip_logits`, the forward argument Liger-Kernel 0.8.5's patched forwards take and transformers' Trainer passes
for a loss-only evaluation (`prediction_loss_only` with `use_liger_kernel`): True gives the fused loss and
logits None, in eval too; None (the default) skips the logits in training with labels; False builds them.
"""

import copy

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import tigon
from tests.hf._tiny import batch, tiny_model
from tigon.ops import _library, dispatch_counts

KERNEL = _library.backend_for(torch.device("cpu"))


class _LogitsGemms(TorchFunctionMode):
    """Counts F.linear calls on the lm_head weight: the [tokens, vocab] logits GEMM of HF's forward."""

    def __init__(self, weight):
        super().__init__()
        self.weight, self.calls = weight, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear and (args[1] if len(args) > 1 else kwargs.get("weight")) is self.weight:
            self.calls += 1
        return func(*args, **kwargs)


def _models():
    ref = tiny_model("llama", num_hidden_layers=1)
    model = copy.deepcopy(ref)
    tigon.patch(model)
    return ref, model


def _close(a, b, name):
    torch.testing.assert_close(a, b, rtol=2e-4, atol=2e-5, msg=lambda m: f"{name}: {m}")


def test_eval_skip_logits_gives_hf_loss_and_no_logits():
    ref, model = _models()
    ref.eval(), model.eval()
    ids, labels = batch()
    outputs = []
    model.lm_head.register_forward_hook(lambda module, args, out: outputs.append(out))
    dispatch_counts.clear()
    with torch.no_grad(), _LogitsGemms(model.lm_head.weight) as gemms:
        out = model(input_ids=ids, labels=labels, skip_logits=True)
    with torch.no_grad():
        out_ref = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    _close(out.loss, out_ref.loss, "loss")
    # The loss ran inside lm_head's call (its hook saw the scalar loss, not [b, t, vocab] logits), through the
    # fused op once, and HF's logits GEMM never ran.
    assert len(outputs) == 1 and outputs[0].dim() == 0
    assert dispatch_counts[("linear_cross_entropy", KERNEL)] == 1
    assert dispatch_counts[("cross_entropy", KERNEL)] == 0
    assert gemms.calls == 0


def test_defaults_and_skip_logits_false_follow_liger():
    ref, model = _models()
    ids, labels = batch()
    model.eval()
    with torch.no_grad(), _LogitsGemms(model.lm_head.weight) as gemms:
        evaluated = model(input_ids=ids, labels=labels)  # eval, labels, no skip_logits: logits as HF
    assert evaluated.logits is not None and gemms.calls == 1
    model.train(), ref.train()
    out_ref = ref(input_ids=ids, labels=labels)
    assert model(input_ids=ids, labels=labels).logits is None  # training with labels: skipped by default
    forced = model(input_ids=ids, labels=labels, skip_logits=False)
    _close(forced.logits, out_ref.logits, "logits")
    _close(forced.loss, out_ref.loss, "loss")
    with pytest.raises(ValueError, match="skip_logits=True .* needs labels or shift_labels"):
        model(input_ids=ids, skip_logits=True)


def test_skip_logits_with_shift_labels_only():
    """As in Liger, skip_logits=True with shift_labels (already shifted, no labels) computes the loss from them."""
    ref, model = _models()
    ref.eval(), model.eval()
    ids, labels = batch()
    shift = F.pad(labels, (0, 1), value=-100)[..., 1:]
    with torch.no_grad():
        out = model(input_ids=ids, shift_labels=shift, skip_logits=True)
        out_ref = ref(input_ids=ids, labels=labels)
    assert out.logits is None
    _close(out.loss, out_ref.loss, "loss")


def test_trainer_prediction_loss_only_evaluation(tmp_path):
    """transformers' Trainer evaluates with skip_logits=True under prediction_loss_only and use_liger_kernel
    (set after construction here: the Trainer would otherwise import liger_kernel to patch the model)."""
    transformers = pytest.importorskip("transformers")
    ids, labels = batch(b=4, t=7)
    data = [{"input_ids": ids[i], "labels": labels[i]} for i in range(4)]

    def evaluate(model, out):
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), per_device_eval_batch_size=2, report_to=[], use_cpu=True,
            prediction_loss_only=True, dataloader_num_workers=0,
        )
        trainer = transformers.Trainer(model=model, args=args, eval_dataset=data)
        trainer.args.use_liger_kernel = True
        return trainer.evaluate()["eval_loss"]

    ref, model = _models()
    seen = []
    model.lm_head.register_forward_hook(lambda module, args, out: seen.append(out.dim()))
    with _LogitsGemms(model.lm_head.weight) as gemms:
        loss = evaluate(model, "tigon")
    assert seen == [0, 0] and gemms.calls == 0  # two batches, each a scalar loss from inside lm_head
    assert loss == pytest.approx(evaluate(ref, "hf"), rel=2e-4)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured by the CUDA allocator")
def test_eval_skip_logits_peak_memory_gpu():
    """8192 tokens x a 65536 vocab: HF's eval builds 1 GiB of bf16 logits (and an fp32 copy in its loss); the
    fused loss needs one 128 MiB chunk (ops.linear_cross_entropy.CHUNK_BYTES), so under a quarter of the logits."""
    model = tiny_model("llama", num_hidden_layers=1, vocab_size=65536, attn_implementation="sdpa")
    model = model.to("cuda", torch.bfloat16).eval()
    tigon.patch(model)
    ids = torch.randint(0, 65536, (4, 2048), device="cuda")
    logits_bytes = ids.numel() * 65536 * 2

    def peak_extra(**kw):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        with torch.no_grad():
            out = model(input_ids=ids, labels=ids, use_cache=False, **kw)
        torch.cuda.synchronize()
        return out, torch.cuda.max_memory_allocated() - base

    out, fused = peak_extra(skip_logits=True)
    assert out.logits is None
    out_hf, full = peak_extra(skip_logits=False)
    assert full >= logits_bytes, full
    assert fused < logits_bytes / 4, (fused, logits_bytes)
    torch.testing.assert_close(out.loss, out_hf.loss, rtol=2e-2, atol=0)
