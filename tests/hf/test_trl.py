"""TRL's fused LM head (1.15+) (what its SFT/DPO/KTO/GRPO trainers call) on Tigon's kernels. The head alone: the same
per-token log-probs, entropies, loss and gradients as TRL's own on a tiny Llama, and dispatch counts that prove Tigon
ran; the softcap fallback. Each trainer on a tiny patched Llama with `use_tigon_losses()` (one step; GRPO two, as
its KL term starts at zero), against the same trainer on the unpatched model and TRL's head (same seed and data):
the same logged losses and metrics, and the same parameter updates (plain SGD: an update is -lr times the summed
gradients, so equal updates are equal gradients)."""

import copy
import gc

import pytest
import torch

import tigon
from tests.hf._tiny import batch, op_calls, tiny_model
from tigon.hf import trl as tigon_trl

trl_utils = pytest.importorskip("trl.trainer.utils", reason="trl is not installed")

# The trainer tests' model: one layer, hidden 32, vocab 64 (the interpreter's time goes by tokens x kernels)
V = 64
TINY = dict(num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=V)


def _trls_own():
    """What TRL's name holds with nothing of Tigon's routed: its own function (a model some earlier test patched and
    left patched, still alive, keeps the router in place)."""
    gc.collect()
    own = getattr(tigon_trl.TigonChunkedLogProb, "fallback", None) or trl_utils._ChunkedLogProbFunction
    return tigon_trl.RoutedChunkedLogProb if tigon_trl._ARMED else own


def _run(model, ids, labels):
    out = model(input_ids=ids, labels=labels, fused_lm_head=True)
    loss = out.loss + 0.1 * out.entropy[out.label_mask].mean()
    params = [p for p in model.parameters() if p.requires_grad]
    return out, torch.autograd.grad(loss, params)


def test_fused_head_matches_trl():
    outputs = ("log_probs", "entropy", "mean_logits", "is_top1", "log_sum_sq_probs")
    base = tiny_model("llama", num_hidden_layers=1)
    ids, labels = batch()
    theirs, mine = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(mine)
    trl_utils.add_fused_lm_head(theirs, temperature=0.9, outputs=outputs)
    trl_utils.add_fused_lm_head(mine, temperature=0.9, outputs=outputs)
    ref, ref_grads = _run(theirs, ids, labels)
    restore = tigon_trl.use_tigon_losses()
    try:
        assert tigon_trl.use_tigon_losses()() is None  # a second call is a no-op and so is its undo
        assert trl_utils._ChunkedLogProbFunction is tigon_trl.RoutedChunkedLogProb
        before = op_calls("fused_linear_logprobs")
        got, grads = _run(mine, ids, labels)
        assert op_calls("fused_linear_logprobs") == before + 1
    finally:
        restore()
        tigon.unpatch(mine)
    own = _trls_own()  # first: its collection may be what gives TRL its name back
    assert trl_utils._ChunkedLogProbFunction is own
    m = ref.label_mask
    torch.testing.assert_close(got.loss, ref.loss, rtol=1e-5, atol=1e-5)
    for k in ("log_probs", "entropy", "mean_logits", "log_sum_sq_probs"):
        torch.testing.assert_close(getattr(got, k)[m], getattr(ref, k)[m], rtol=1e-5, atol=1e-5)
    assert torch.equal(got.is_top1[m], ref.is_top1[m])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)


def test_softcap_falls_back_to_trl(monkeypatch):
    calls = []

    class Spy:
        @staticmethod
        def apply(*args):
            calls.append(args)
            return (torch.zeros(1),) + (None,) * 4

    monkeypatch.setattr(tigon_trl.TigonChunkedLogProb, "fallback", Spy)
    out = tigon_trl.TigonChunkedLogProb.apply(torch.zeros(1, 4), torch.zeros(3, 4), None, torch.zeros(1).long(), 1.0,
                                              8, 5.0)
    assert calls and out[0].shape == (1,)


def test_bad_outputs_and_old_trl(monkeypatch):
    with pytest.raises(ValueError, match="unknown outputs"):
        tigon_trl.TigonChunkedLogProb.apply(torch.zeros(1, 4), torch.zeros(3, 4), None, torch.zeros(1).long(), 1.0,
                                            8, outputs=("log_probs", "logits"))
    with monkeypatch.context() as m:  # TRL 1.14: a _ChunkedLogProbFunction, but no fused head that calls it
        m.delattr(trl_utils, "add_fused_lm_head")
        with pytest.raises(ImportError, match="TRL >= 1.15"):
            tigon_trl.use_tigon_losses()
    monkeypatch.delattr(trl_utils, "_ChunkedLogProbFunction")
    with pytest.raises(ImportError, match="TRL >= 1.15"):
        tigon_trl.use_tigon_losses()


@pytest.fixture(scope="module")
def tokenizer():
    """A whitespace word-level tokenizer built in memory (no download): t0 pad, t1 eos, t2 unk."""
    tokenizers = pytest.importorskip("tokenizers")
    from transformers import PreTrainedTokenizerFast

    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({f"t{i}": i for i in range(V)}, unk_token="t2"))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="t0", eos_token="t1", unk_token="t2")


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory):
    """The initial policy on disk: every run loads it, and GRPOTrainer builds its reference model from its path."""
    path = tmp_path_factory.mktemp("policy")
    tiny_model("llama", **TINY).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def datasets():
    return pytest.importorskip("datasets")


def _text(g, n):
    return " ".join(f"t{i}" for i in torch.randint(3, V, (n,), generator=g).tolist())


def _train(name, policy_dir, tokenizer, out, on_tigon, data, trainer_kwargs=None, explicit=True, **config):
    trl = pytest.importorskip("trl", minversion="1.15")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(policy_dir, attn_implementation="eager")
    start = [p.detach().clone() for p in model.parameters()]
    if on_tigon:
        tigon.patch(model)
    restore = tigon_trl.use_tigon_losses() if on_tigon and explicit else (lambda: None)
    try:
        kw = dict(output_dir=str(policy_dir.parent / f"{name}-{out}"), max_steps=1, per_device_train_batch_size=2,
                  optim="sgd", learning_rate=0.1, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
                  seed=0, data_seed=0, dataloader_num_workers=0, bf16=False, disable_tqdm=True)
        cfg = getattr(trl, f"{name}Config")(**{**kw, **config})
        trainer = getattr(trl, f"{name}Trainer")(model=model, args=cfg, train_dataset=data,
                                                 processing_class=tokenizer, **(trainer_kwargs or {}))
        trainer.train()
    finally:
        restore()
        if on_tigon:
            tigon.unpatch(model)
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert len(logs) == cfg.max_steps
    return logs, [p.detach() - p0 for p, p0 in zip(model.parameters(), start)]


def _compare(run, metrics=("loss",)):
    plain, plain_updates = run(False, "trl")
    before = op_calls("fused_linear_logprobs")
    logs, updates = run(True, "tigon")
    assert op_calls("fused_linear_logprobs") > before  # Tigon computed the loss
    for key in metrics:
        got, ref = (torch.tensor([h[key] for h in hs]) for hs in (logs, plain))
        assert torch.isfinite(got).all(), key
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=key)
    for u, r in zip(updates, plain_updates):  # the same gradients: the same SGD updates
        assert r.abs().max() > 0
        torch.testing.assert_close(u, r, rtol=1e-4, atol=1e-4 * r.abs().max().item())


def test_patch_alone_runs_tigons_loss_in_trl(policy_dir, tokenizer, datasets):
    """tigon.patch(model) and nothing else: SFTTrainer's loss runs Tigon's head for the patched model (its numbers
    are test_sft_trainer_on_tigon_losses'), and TRL's own for an unpatched one in the same process; unpatch gives
    TRL its function back."""
    ids, _ = batch(vocab=V, b=2, t=7, seed=3)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    trl_function = _trls_own()
    before = op_calls("fused_linear_logprobs")
    _train("SFT", policy_dir, tokenizer, "patch-alone", True, data, explicit=False)
    assert op_calls("fused_linear_logprobs") > before
    assert trl_utils._ChunkedLogProbFunction is trl_function  # unpatched: TRL's again
    patched = tiny_model("llama", **TINY)
    tigon.patch(patched)
    try:
        assert trl_utils._ChunkedLogProbFunction is tigon_trl.RoutedChunkedLogProb
        before = op_calls("fused_linear_logprobs")
        _train("SFT", policy_dir, tokenizer, "beside-a-patched-one", False, data)
        assert op_calls("fused_linear_logprobs") == before
    finally:
        tigon.unpatch(patched)
    assert trl_utils._ChunkedLogProbFunction is trl_function


def test_a_model_patched_before_trl_is_imported_routes_at_its_first_forward(monkeypatch):
    import sys

    model = tiny_model("llama", **TINY)
    utils = sys.modules[tigon_trl._UTILS]
    trl_function = utils._ChunkedLogProbFunction
    monkeypatch.delitem(sys.modules, tigon_trl._UTILS)  # as if TRL's trainers were imported after the patch
    undo = []
    assert tigon_trl.arm(model, undo) and undo == [(model, tigon_trl.MARK, None)]
    assert utils._ChunkedLogProbFunction is trl_function and model in tigon_trl._PENDING
    ids, _ = batch(vocab=V, b=1, t=3)
    with torch.no_grad():
        model(ids)  # TRL still not imported: nothing routed yet
        assert utils._ChunkedLogProbFunction is trl_function
        monkeypatch.setitem(sys.modules, tigon_trl._UTILS, utils)
        model(ids)
    try:
        assert utils._ChunkedLogProbFunction is tigon_trl.RoutedChunkedLogProb and model not in tigon_trl._PENDING
    finally:
        tigon_trl.release(model)
    assert utils._ChunkedLogProbFunction is trl_function and tigon_trl.MARK not in model.__dict__


def test_a_model_dropped_without_unpatch_gives_trl_its_function_back_once_collected():
    """A patched model nobody unpatches (kept alive by a reference cycle until the collector runs) must not keep TRL's
    name routed: the unpatch of another model leaves it routed while the dropped one may still run, and collecting
    the dropped one gives TRL its own function back."""
    trl_function = _trls_own()
    dropped, kept = tiny_model("llama", **TINY), tiny_model("llama", **TINY)
    tigon.patch(dropped)
    tigon.patch(kept)
    dropped.__dict__["_cycle"] = [dropped]
    gc.disable()  # the collector would take the dropped model at any allocation from here
    try:
        del dropped
        tigon.unpatch(kept)
        assert trl_utils._ChunkedLogProbFunction is tigon_trl.RoutedChunkedLogProb
    finally:
        gc.enable()
    gc.collect()
    assert trl_utils._ChunkedLogProbFunction is trl_function


def test_a_copys_first_forward_after_trl_is_imported_leaves_trls_name(monkeypatch):
    """A deep copy of a model patched before TRL was imported carries its one-shot hook, bound to the copy: the copy
    is not armed, so its first forward routes nothing (no armed model would be left to give TRL its name back)."""
    import sys

    model = tiny_model("llama", **TINY)
    utils = sys.modules[tigon_trl._UTILS]
    trl_function = _trls_own()
    monkeypatch.delitem(sys.modules, tigon_trl._UTILS)
    undo = []
    assert tigon_trl.arm(model, undo)
    twin = copy.deepcopy(model)
    tigon_trl.release(model)
    monkeypatch.setitem(sys.modules, tigon_trl._UTILS, utils)
    with torch.no_grad():
        twin(batch(vocab=V, b=1, t=3)[0])
    assert utils._ChunkedLogProbFunction is trl_function and twin not in tigon_trl._ARMED


def test_a_quantized_head_is_not_armed():
    model = tiny_model("llama", **TINY)
    model.lm_head.weight = torch.nn.Parameter(torch.zeros(V * 16, 1, dtype=torch.uint8), requires_grad=False)
    undo = []
    assert not tigon_trl.arm(model, undo) and not undo


def _ref_model():
    """A reference policy other than the initial one, so DPO's and KTO's log-ratios are not zero."""
    return dict(ref_model=tiny_model("llama", seed=1, **TINY))


def _reward(completion_ids, **kwargs):
    """A reward with no ties between completions: their mean token id."""
    return [sum(c) / max(len(c), 1) for c in completion_ids]


def test_sft_trainer_on_tigon_losses(policy_dir, tokenizer, datasets):
    ids, _ = batch(vocab=V, b=2, t=7, seed=3)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    _compare(lambda on, out: _train("SFT", policy_dir, tokenizer, out, on, data))


def test_dpo_trainer_on_tigon_losses(policy_dir, tokenizer, datasets):
    g = torch.Generator().manual_seed(4)
    rows = [{"prompt": _text(g, 2) + " ", "chosen": _text(g, 2), "rejected": _text(g, 3)} for _ in range(2)]
    data = datasets.Dataset.from_list(rows)
    _compare(lambda on, out: _train("DPO", policy_dir, tokenizer, out, on, data, _ref_model()),
             metrics=("loss", "rewards/margins"))


def test_kto_trainer_on_tigon_losses(policy_dir, tokenizer, datasets):
    # one desirable and one undesirable example; the KL estimate from the batch's mismatched pairs
    g = torch.Generator().manual_seed(5)
    rows = [{"prompt": _text(g, 2) + " ", "completion": _text(g, 3), "label": i == 0} for i in range(2)]
    data = datasets.Dataset.from_list(rows)
    _compare(lambda on, out: _train("KTO", policy_dir, tokenizer, out, on, data, _ref_model()),
             metrics=("loss", "kl", "logps/chosen", "logps/rejected"))


def test_grpo_trainer_on_tigon_losses(policy_dir, tokenizer, datasets):
    # one prompt per step, two sampled completions of 4 tokens at temperature 0.8; a KL term to the reference model
    # TRL builds from policy_dir (zero at step 1, not at step 2) and an entropy bonus: both through the head's grads
    data = datasets.Dataset.from_list([{"prompt": "t5 t9"}, {"prompt": "t17 t3"}])
    _compare(lambda on, out: _train("GRPO", policy_dir, tokenizer, out, on, data, dict(reward_funcs=_reward),
                                    max_steps=2, num_generations=2, max_completion_length=4, temperature=0.8,
                                    beta=0.1, entropy_coef=0.01),
             metrics=("loss", "kl", "entropy", "reward", "grad_norm"))


def test_sft_trainer_use_kernels_runs_tigons_norms(policy_dir, tokenizer, datasets):
    """TRL's use_kernels (model_init_kwargs, when the trainer loads the model from a path) with Tigon's kernel
    config: the norms run Tigon's op through transformers' kernelize, and the step equals TRL's without kernels."""
    trl = pytest.importorskip("trl", minversion="1.15")
    from transformers.utils import is_kernels_available

    if not is_kernels_available():
        pytest.skip("the `kernels` package in transformers' supported range is not installed")
    from tigon.hf import kernels as tigon_kernels

    ids, _ = batch(vocab=V, b=2, t=7, seed=3)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})

    def run(init_kwargs, out):
        cfg = trl.SFTConfig(output_dir=str(policy_dir.parent / f"SFT-kernels-{out}"), max_steps=1,
                            per_device_train_batch_size=2, optim="sgd", learning_rate=0.1, logging_steps=1,
                            report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
                            dataloader_num_workers=0, bf16=False, disable_tqdm=True,
                            model_init_kwargs={"attn_implementation": "eager", **init_kwargs})
        trainer = trl.SFTTrainer(model=str(policy_dir), args=cfg, train_dataset=data, processing_class=tokenizer)
        before = op_calls("rms_norm")
        try:
            trainer.train()
        finally:  # kernelize set the layer on transformers' module-level apply_rotary_pos_emb: give it back
            for m in trainer.model.modules():
                for fn in m.__dict__.get("_kernel_funcs", {}).values():
                    fn.__dict__.pop("forward", None)
        return [h["loss"] for h in trainer.state.log_history if "loss" in h], op_calls("rms_norm") - before

    plain, plain_norms = run({}, "plain")
    got, norms = run({"use_kernels": True, "kernel_config": tigon_kernels.kernel_config("cpu")}, "tigon")
    assert plain_norms == 0 and norms >= 3  # one layer's two norms and the final one, forward (and recompute)
    torch.testing.assert_close(torch.tensor(got), torch.tensor(plain), rtol=1e-5, atol=1e-6)


def test_sft_trainer_with_tigon_adamw(policy_dir, tokenizer, datasets):
    """TRL's trainers take the Trainer's optimizer_cls_and_kwargs: tigon.optim.AdamW clipping inside its step (TRL's
    clipping off) updates the weights as TRL with torch's AdamW and max_grad_norm."""
    ids, _ = batch(vocab=V, b=2, t=7, seed=3)
    data = datasets.Dataset.from_dict({"input_ids": ids.tolist()})
    opt = dict(optim="adamw_torch", learning_rate=1e-2, weight_decay=0.0)
    _, plain = _train("SFT", policy_dir, tokenizer, "adamw-torch", True, data, max_grad_norm=0.5, **opt)
    trl = pytest.importorskip("trl", minversion="1.15")
    from tigon.hf.trainer import fused_adamw

    config = trl.SFTConfig(output_dir=str(policy_dir.parent / "SFT-adamw-args"), report_to=[], use_cpu=True,
                           max_grad_norm=0.5, **opt)  # an SFTConfig is the Trainer's arguments
    fused = fused_adamw(config, weight_decay=0.0)
    assert config.max_grad_norm == 0.0 and fused[1]["max_grad_norm"] == 0.5 and fused[1]["lr"] == 1e-2
    before = op_calls("adamw")
    _, got = _train("SFT", policy_dir, tokenizer, "adamw-tigon", True, data,
                    trainer_kwargs=dict(optimizer_cls_and_kwargs=fused), max_grad_norm=0.0, **opt)
    assert op_calls("adamw") > before  # tigon's step ran
    for u, r in zip(got, plain):
        assert r.abs().max() > 0
        torch.testing.assert_close(u, r, rtol=1e-4, atol=1e-4 * r.abs().max().item())
