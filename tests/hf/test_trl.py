"""TRL 1.16's fused LM head (what SFT/DPO/KTO/GRPO trainers call) on Tigon's kernels: the same per-token log-probs,
entropies, loss and gradients as TRL's own path on a tiny patched Llama, and dispatch counts that prove Tigon ran;
SFTTrainer and DPOTrainer (with a reference model) for two steps each, with the same logged losses and weights as
on TRL's head; and the softcap fallback."""

import copy

import pytest
import torch

import tigon
from tests.hf._tiny import batch, op_calls, tiny_model
from tigon.hf import trl as tigon_trl

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")


def _run(model, ids, labels, temperature=1.0):
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    loss = out.loss + 0.1 * out.entropy[out.label_mask].mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(loss, params)


@pytest.mark.parametrize("outputs", [("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")])
def test_fused_head_matches_trl(outputs):
    base = tiny_model("llama", num_hidden_layers=1)
    ids, labels = batch()
    theirs, mine = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(theirs)
    tigon.patch(mine)
    trl_utils.add_fused_lm_head(theirs, temperature=0.9, outputs=outputs)
    trl_utils.add_fused_lm_head(mine, temperature=0.9, outputs=outputs)
    ref, ref_grads = _run(theirs, ids, labels)
    restore = tigon_trl.use_tigon_losses()
    try:
        before = op_calls("fused_linear_logprobs")
        got, grads = _run(mine, ids, labels)
        assert op_calls("fused_linear_logprobs") == before + 1
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


def _tokenizer(vocab_size=131):
    """A whitespace word-level tokenizer built in memory (no download): t0 pad, t1 eos, t2 unk."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(vocab_size)}, unk_token="t2"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


def _train(trainer_name, tmp_path, out, tigon_head, data, with_ref=False, **config):
    trl = pytest.importorskip("trl", minversion="1.16")
    model = tiny_model("llama", num_hidden_layers=1)  # one layer: the interpreter's time is in the layers
    tigon.patch(model)
    restore = tigon_trl.use_tigon_losses() if tigon_head else (lambda: None)
    try:
        kw = dict(output_dir=str(tmp_path / out), max_steps=2, per_device_train_batch_size=2, learning_rate=1e-3,
                  logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                  dataloader_num_workers=0, bf16=False, disable_tqdm=True, **config)
        cfg = getattr(trl, f"{trainer_name}Config")(**kw)
        # a reference policy other than the initial one, so the DPO log-ratios are not zero
        extra = dict(ref_model=tiny_model("llama", seed=1, num_hidden_layers=1)) if with_ref else {}
        trainer = getattr(trl, f"{trainer_name}Trainer")(model=model, args=cfg, train_dataset=data,
                                                         processing_class=_tokenizer(), **extra)
        trainer.train()
    finally:
        restore()
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    return losses, [p.detach().clone() for p in model.parameters()]


def _compare(run):
    plain, plain_params = run(False, "trl")
    before = op_calls("fused_linear_logprobs")
    losses, params = run(True, "tigon")
    assert op_calls("fused_linear_logprobs") > before  # Tigon computed the loss
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(plain), rtol=1e-4, atol=1e-5)
    for p, q in zip(params, plain_params):  # the same gradients: the same weights after two Adam steps
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5)


def test_sft_trainer_on_tigon_losses(tmp_path):
    datasets = pytest.importorskip("datasets")
    ids, _ = batch(b=4, t=9, seed=3)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    _compare(lambda tigon_head, out: _train("SFT", tmp_path, out, tigon_head, data))


def test_dpo_trainer_on_tigon_losses(tmp_path):
    datasets = pytest.importorskip("datasets")
    g = torch.Generator().manual_seed(4)

    def text(n):
        return " ".join(f"t{i}" for i in torch.randint(3, 131, (n,), generator=g).tolist())

    rows = [{"prompt": text(4) + " ", "chosen": text(3), "rejected": text(5)} for _ in range(4)]
    data = datasets.Dataset.from_list(rows)
    _compare(lambda tigon_head, out: _train("DPO", tmp_path, out, tigon_head, data, with_ref=True))
