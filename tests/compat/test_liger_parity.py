"""tigon.compat.liger has every export of liger-kernel 0.8.5's liger_kernel.transformers, with Liger's signatures
and values: checked against Liger's own modules on the CPU (its Triton kernels through the interpreter) where
they run there, else against the formula (or HF's module) Liger documents."""

import inspect
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tigon.compat import liger

lt = pytest.importorskip("liger_kernel.transformers")

# Liger's Triton kernels and Tigon's: natively on a GPU, through the interpreter on a CPU (tests/conftest.py)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(autouse=True)
def _tensors_on_the_kernels_device():
    with torch.device(DEVICE):  # every factory call of a test makes its tensors there
        yield


# exported by liger_kernel.transformers without being in its __all__
EXTRA_EXPORTS = ["LigerExperts", "LigerVocabParallelCrossEntropy"]
N, V, H = 6, 40, 16
LABELS = torch.tensor([1, -100, 3, 4, -100, 2], device=DEVICE)


def _close(ours, theirs, atol=1e-5):
    ours = ours if isinstance(ours, tuple) else (ours,)
    theirs = theirs if isinstance(theirs, tuple) else (theirs,)
    for a, b in zip(ours, theirs, strict=True):
        torch.testing.assert_close(a.float(), b.float(), atol=atol, rtol=1e-5)


def test_every_liger_export_exists_with_liger_signatures():
    for name in [*lt.__all__, *EXTRA_EXPORTS]:
        ours, theirs = getattr(liger, name), getattr(lt, name)
        if not name.lower().startswith("liger"):
            continue  # the apply functions (Tigon adds strict=) and the Auto class: test_liger_compat.py
        methods = [m for m in ("__init__", "forward") if hasattr(theirs, m)] if inspect.isclass(theirs) else [None]
        for method in methods:
            o, t = (ours, theirs) if method is None else (getattr(ours, method), getattr(theirs, method))
            if name == "LigerKLDIVLoss" and method == "__init__":
                continue  # Liger's (eps, *args, **kwargs) of torch.nn.KLDivLoss
            assert list(inspect.signature(o).parameters) == list(inspect.signature(t).parameters), (name, method)


def test_monkey_patch_path_has_liger_apply_functions():
    from liger_kernel.transformers import monkey_patch as theirs

    from tigon.compat.liger import monkey_patch

    names = [n for n in dir(theirs) if n.startswith("apply_liger_kernel_to_")]
    assert names and all(getattr(monkey_patch, n) is getattr(liger, n) for n in names)
    assert monkey_patch._apply_liger_kernel_to_instance is liger._apply_liger_kernel_to_instance


@pytest.mark.parametrize("beta", [0.0, 0.3, 1.0])
def test_jsd_matches_liger(beta):
    log_q = torch.randn(N, V).log_softmax(-1).requires_grad_()
    log_p = torch.randn(N, V).log_softmax(-1)
    ours, theirs = liger.LigerJSD(beta)(log_q, log_p, LABELS), lt.LigerJSD(beta)(log_q, log_p, LABELS)
    _close(ours, theirs)
    _close(torch.autograd.grad(ours, log_q)[0], torch.autograd.grad(theirs, log_q)[0])


@pytest.mark.parametrize("labels", [None, LABELS])
def test_fused_linear_jsd_runs_tigons_kernel_and_matches_liger(labels):
    x, w = torch.randn(N, H, requires_grad=True), torch.randn(V, H)
    xt, wt = torch.randn(N, H + 4), torch.randn(V, H + 4)
    ours = liger.LigerFusedLinearJSD(0.3, temperature=2.0)(x, w, xt, wt, labels)
    theirs = lt.LigerFusedLinearJSD(0.3, temperature=2.0)(x, w, xt, wt, labels)
    _close(ours, theirs)
    _close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0])


@pytest.mark.parametrize("reduction", ["batchmean", "sum", "mean"])
def test_fused_linear_kl_div_matches_liger(reduction):
    x, w, target = torch.randn(N, H, requires_grad=True), torch.randn(V, H), torch.randn(N, V).softmax(-1)
    ours = liger.LigerFusedLinearKLDivLoss(reduction, temperature=2.0)(x, w, target, LABELS)
    theirs = lt.LigerFusedLinearKLDivLoss(reduction, temperature=2.0)(x, w, target, LABELS)
    _close(ours, theirs)
    _close(torch.autograd.grad(ours, x)[0], torch.autograd.grad(theirs, x)[0])


def test_ce_tvd_vocab_parallel_ce_softmax_sparsemax_relu2_match_liger():
    s, t = torch.randn(N, V), torch.randn(N, V)
    _close(liger.LigerFusedCETVDLoss()(s, t, LABELS), lt.LigerFusedCETVDLoss()(s, t, LABELS))
    logits, target = torch.randn(3, 2, V), torch.tensor([[1, 2], [-100, 4], [5, 6]])
    for formula in ("pytorch", "megatron"):
        kw = dict(label_smoothing=0.1, label_smoothing_formula=formula)
        _close(liger.LigerVocabParallelCrossEntropy(**kw)(logits, target),
               lt.LigerVocabParallelCrossEntropy(**kw)(logits, target))
    x = torch.randn(N, V) * 3
    for name in ("LigerSoftmax", "LigerSparsemax", "LigerReLUSquared"):
        _close(getattr(liger, name)()(x), getattr(lt, name)()(x))


@pytest.mark.parametrize("sparse", [False, True])
def test_multi_token_attention_matches_liger(sparse):
    ours = liger.LigerMultiTokenAttention(2, 2, 3, padding=1, sparse=sparse)
    theirs = lt.LigerMultiTokenAttention(2, 2, 3, padding=1, sparse=sparse)
    theirs.load_state_dict(ours.state_dict())
    scores = torch.randn(1, 2, 5, 5)
    _close(ours(scores), theirs(scores))


def test_llama4_rope_matches_liger():
    q, k = torch.randn(1, 5, 2, 8), torch.randn(1, 5, 2, 8)
    freqs = torch.polar(torch.ones(1, 5, 4), torch.randn(1, 5, 4))
    _close(liger.liger_llama4_text_rotary_pos_emb(q, k, freqs), lt.liger_llama4_text_rotary_pos_emb(q, k, freqs))
    freqs = torch.polar(torch.ones(5, 1, 4), torch.randn(5, 1, 4))
    _close(liger.liger_llama4_vision_rotary_pos_emb(q, k, freqs), lt.liger_llama4_vision_rotary_pos_emb(q, k, freqs))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("token_scaling", [False, True])
def test_flce_options_match_liger(reduction, token_scaling):
    x, w = torch.randn(7, H, requires_grad=True), torch.randn(33, H, requires_grad=True)
    y = torch.tensor([1, -100, 3, 4, -100, 2, 5])
    kw = dict(lse_square_scale=1e-2, label_smoothing=0.1, reduction=reduction, return_z_loss=True,
              use_token_scaling=token_scaling, return_token_accuracy=True, return_predicted_tokens=True)
    ours = liger.LigerFusedLinearCrossEntropyLoss(**kw)(w, x, y)
    theirs = lt.LigerFusedLinearCrossEntropyLoss(**kw)(w, x, y)
    _close((ours.loss, ours.z_loss, ours.token_accuracy), (theirs.loss, theirs.z_loss, theirs.token_accuracy))
    assert torch.equal(ours.predicted_tokens, theirs.predicted_tokens)
    _close(torch.autograd.grad(ours.loss.sum(), (x, w)), torch.autograd.grad(theirs.loss.sum(), (x, w)))
    functional = liger.liger_fused_linear_cross_entropy(x, w, y, **kw)
    _close(functional.loss, ours.loss)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_class_weights_match_torch(reduction):
    x, w, y = torch.randn(7, H), torch.randn(33, H), torch.tensor([1, -100, 3, 4, -100, 2, 5])
    weight = torch.rand(33) + 0.5
    expected = F.cross_entropy(x @ w.T, y, weight=weight, label_smoothing=0.1, reduction=reduction)
    _close(liger.LigerFusedLinearCrossEntropyLoss(ce_weight=weight, label_smoothing=0.1, reduction=reduction)(w, x, y),
           expected)
    _close(liger.LigerCrossEntropyLoss(weight=weight, label_smoothing=0.1, reduction=reduction)(x @ w.T, y), expected)


def test_cross_entropy_return_flags_match_liger():
    z, y = torch.randn(7, 33), torch.tensor([1, -100, 3, 4, -100, 2, 5])
    kw = dict(lse_square_scale=1e-2, return_z_loss=True, return_token_accuracy=True, return_predicted_tokens=True)
    ours, theirs = liger.LigerCrossEntropyLoss(**kw)(z, y), lt.LigerCrossEntropyLoss(**kw)(z, y)
    _close((ours.loss, ours.z_loss, ours.token_accuracy), (theirs.loss, theirs.z_loss, theirs.token_accuracy))
    assert torch.equal(ours.predicted_tokens, theirs.predicted_tokens)


def test_kl_div_and_tvd_follow_their_formulas():
    y_pred, p = torch.randn(N, V).log_softmax(-1), torch.randn(N, V).softmax(-1)
    for reduction in ("batchmean", "sum", "mean", "none"):
        _close(liger.LigerKLDIVLoss(reduction=reduction)(y_pred, p), F.kl_div(y_pred, p, reduction=reduction))
    _close(liger.LigerKLDIVLoss(reduction="batchmean", log_target=True)(y_pred, p.log()),
           F.kl_div(y_pred, p.log(), reduction="batchmean", log_target=True))
    q = torch.randn(N, V).softmax(-1)
    keep = LABELS != -100
    _close(liger.LigerTVDLoss()(p, q, LABELS), 0.5 * (p - q)[keep].abs().sum() / keep.sum())
    _close(liger.LigerTVDLoss(reduction="none")(p, q, LABELS), 0.5 * (p - q).abs() * keep[:, None])


def test_norm_layers_follow_their_formulas():
    x = torch.randn(N, V)
    rms = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + 1e-6)
    dyt = liger.LigerDyT(V)
    with torch.no_grad():
        dyt.gamma.uniform_(), dyt.beta.uniform_()
    _close(dyt(x), dyt.gamma * torch.tanh(0.5 * x) + dyt.beta)
    assert liger.LigerDyT(V, beta=False).beta is None
    norm = lambda u: u * torch.rsqrt(u.square().mean(-1, keepdim=True) + 1e-6)  # noqa: E731
    _close(liger.LigerPolyNorm()(x), (norm(x ** 3) + norm(x ** 2) + norm(x)) / 3 + 1)
    scale, shift = torch.randn(N, 1), torch.randn(V)
    _close(liger.LigerModulatedRMSNorm(V)(x, scale, shift), (1 + scale) * rms + shift)
    _close(liger.LigerRMSNormForMuseGlimmer(V, with_scale=False)(x), rms)
    assert liger.LigerRMSNormForMuseGlimmer(V, with_scale=False).weight is None
    _close(liger.LigerRMSNormForMuseGlimmerTextCentered(V)(x), rms)  # (1 + 0) * rms


def test_mlp_variants_follow_their_formulas():
    config = SimpleNamespace(hidden_size=H, intermediate_size=24, hidden_act="silu", mlp_multipliers=(0.5, 2.0),
                             mlp_bias=False)
    x = torch.randn(N, H)
    for cls in (liger.LigerMLP, liger.LigerSwiGLUMLPForMuseGlimmer):
        m = cls(config)
        _close(m(x), m.down_proj(F.silu(m.gate_proj(x)) * m.up_proj(x)))
    for cls in (liger.LigerFalconH1MLP, liger.LigerFalconH1SwiGLUMLP):
        m = cls(config)
        _close(m(x), m.down_proj(F.silu(m.gate_proj(x) * 0.5) * m.up_proj(x)) * 2.0)
    with pytest.raises(ValueError, match="LigerFalconH1MLP: config.mlp_bias=True"):
        liger.LigerFalconH1MLP(SimpleNamespace(**{**vars(config), "mlp_bias": True}))
    with pytest.raises(ValueError, match="hidden_act"):
        liger.LigerMLP(SimpleNamespace(**{**vars(config), "hidden_act": "gelu"}))


def test_experts_match_hf_mixtral_experts():
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=H, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2)
    hf, ours = MixtralExperts(config), liger.LigerExperts(config)
    torch.nn.init.normal_(hf.gate_up_proj, std=0.2), torch.nn.init.normal_(hf.down_proj, std=0.2)
    ours.load_state_dict(hf.state_dict())
    index = torch.tensor([[0, 1], [2, 0], [3, 1], [1, 0], [2, 3], [0, 3]])
    x, weights = torch.randn(N, H), torch.rand(N, 2)
    _close(ours(x, index, weights), hf(x, index, weights))


def test_mhc_is_a_documented_error():
    with pytest.raises(NotImplementedError, match="LigerMHC: Tigon has no"):
        liger.LigerMHC(torch.nn.Linear(8, 8), hc=2, c=8)
