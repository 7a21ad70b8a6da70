"""DPO (every liger-kernel 0.8.5 loss type, RPO's NLL), ORPO, CPO, SimPO and KTO on the fused linear head: against
the fp64 formulas of tigon.ops.reference (loss, metrics, every gradient), against liger-kernel's own chunked losses,
and bad input."""

import pytest
import torch

from tests.ops._loss_helpers import as64, check, grads_of, head, lengths
from tigon import ops
from tigon.ops import FusedLinearLossConfig, reference

CFG = FusedLinearLossConfig(chunk_rows=7)  # 20 rows in 3 chunks, one ragged: sequences straddle chunks
TWO_PASS = FusedLinearLossConfig(chunk_rows=7, one_pass_bytes=0)  # the same chunks, the pairwise two-pass walk
B, T, H, V = 4, 5, 24, 67


def one_pair_a_chunk(dtype):
    """The pairwise one-pass walk with one pair per chunk (2 chunks): each chunk's coefficients alone."""
    return FusedLinearLossConfig(one_pass_bytes=2 * T * V * torch.empty((), dtype=dtype).element_size())

CASES = [
    dict(kind="dpo"),
    dict(kind="dpo", loss_type="hinge", compute_nll_loss=True, alpha=0.5, ref="head"),
    dict(kind="dpo", loss_type="discopop", average_log_prob=True, ref="logps"),
    dict(kind="dpo", loss_type="robust", label_smoothing=0.1, ref="logps"),
    dict(kind="dpo", loss_type="exo_pair", label_smoothing=1e-3, ref="head"),
    dict(kind="dpo", loss_type="nca_pair", ref="logps"),
    dict(kind="dpo", loss_type="bco_pair", ref="logps"),
    dict(kind="dpo", loss_type="sppo_hard", ref="logps"),
    dict(kind="dpo", loss_type="apo_zero", ref="logps"),
    dict(kind="dpo", loss_type="apo_down", ref="logps"),
    dict(kind="orpo", compute_nll_loss=True, average_log_prob=True, nll="other"),
    dict(kind="cpo", compute_nll_loss=True, label_smoothing=0.1),
    dict(kind="simpo", average_log_prob=True, gamma=0.3),
]


def _kw(case, dtype, ins64=False):
    kw = dict(case)
    ref = kw.pop("ref", None)
    nll = kw.pop("nll", None)
    g = torch.Generator().manual_seed(1)
    dt = torch.float64 if ins64 else dtype
    if ref == "head":
        kw["ref_hidden"] = torch.randn(B, T, 16, generator=g).to(dt)
        kw["ref_weight"] = (torch.randn(V, 16, generator=g) * 0.5).to(dt)
    elif ref == "logps":
        kw["ref_logps"] = (torch.randn(B, generator=g) - 8).to(dt)
    if nll == "other":
        kw["nll_target"] = torch.randint(0, V, (B, T), generator=g)
    return kw


# bf16 for two DPO variants and the other methods (the loss formula is the same fp32 math in both dtypes)
PAIRS = [(c, torch.float32) for c in CASES] + [(c, torch.bfloat16) for c in CASES if c.get("loss_type") in (None,
                                                                                                        "hinge")]


# The two-pass walk shares _pref_loss with the one-pass one: its cases cover what differs in the walk (the second
# target of the NLL, a reference head, averaging, bf16).
TWO_PASS_CASES = [(CASES[1], torch.float32), (CASES[10], torch.float32), (CASES[12], torch.float32),
                  (CASES[0], torch.bfloat16)]  # hinge + NLL + ref head, ORPO's nll_target, SimPO's means, bf16
WALKS = [(c, d, "one-pass") for c, d in PAIRS] + [(c, d, "two-pass") for c, d in TWO_PASS_CASES]


@pytest.mark.parametrize("case,dtype,walk", WALKS, ids=lambda v: str(v).split(".")[-1] if isinstance(v, torch.dtype)
                         else v if isinstance(v, str) else f"{v['kind']}-{v.get('loss_type', '')}")
def test_preference_vs_fp64(case, dtype, walk):
    h, w, b, t = head(B, T, H, V, dtype)
    cfg = TWO_PASS if walk == "two-pass" else one_pair_a_chunk(dtype)
    loss, aux = ops.fused_linear_preference(h, w, t, b, config=cfg, **_kw(case, dtype))
    got = grads_of(loss, [h, w, b])
    h64, w64, b64 = as64([h, w, b])
    kw64 = _kw(case, dtype, ins64=True)
    for k in ("ref_hidden", "ref_weight", "ref_logps"):  # the reference sees the same (dtype-rounded) values
        if k in kw64:
            kw64[k] = kw64[k].to(dtype).double()
    ref, ref_aux = reference.fused_linear_preference(h64, w64, t, b64, **kw64)
    want = grads_of(ref, [h64, w64, b64])
    k = lengths(H, V, B * T) * T  # sequence sums of T log-probs, each of magnitude |lse|
    check("loss", loss, ref, dtype, k=k, mag=10.0)
    assert len(aux) == len(ref_aux)
    for i, (a, r) in enumerate(zip(aux, ref_aux)):
        check(f"aux{i}", a, r, dtype, k=k, mag=10.0)
    for n, g, r in zip(("dh", "dW", "db"), got, want):
        assert g.dtype == dtype
        check(n, g, r, dtype, k=k)


@pytest.mark.parametrize("dtype,walk", [(torch.float32, "one-pass"), (torch.bfloat16, "one-pass"),
                                        (torch.float32, "two-pass")])
def test_kto_vs_fp64(dtype, walk):
    h, w, b, t = head(B, T, H, V, dtype)
    lab = torch.tensor([True, False, False, True])
    g = torch.Generator().manual_seed(2)
    rh, rw = torch.randn(B, T, 16, generator=g).to(dtype), (torch.randn(V, 16, generator=g) * 0.5).to(dtype)
    kl = torch.tensor(0.2) if dtype == torch.float32 else torch.tensor([0.2, -0.1, 0.3, 0.0])  # [] and [B]
    cfg = TWO_PASS if walk == "two-pass" else one_pair_a_chunk(dtype)  # one-pass: 2 sequences a chunk
    loss, aux = ops.fused_linear_kto(h, w, t, lab, b, ref_hidden=rh, ref_weight=rw, kl=kl, beta=0.3, config=cfg)
    got = grads_of(loss, [h, w, b])
    h64, w64, b64 = as64([h, w, b])
    ref, ref_aux = reference.fused_linear_kto(h64, w64, t, lab, b64, ref_hidden=rh.double(), ref_weight=rw.double(),
                                              kl=kl.double(), beta=0.3)
    want = grads_of(ref, [h64, w64, b64])
    k = lengths(H, V, B * T) * T
    check("loss", loss, ref, dtype, k=k, mag=1.0)
    for i, (a, r) in enumerate(zip(aux, ref_aux)):
        check(f"aux{i}", a, r, dtype, k=k, mag=50.0)
    for n, gg, r in zip(("dh", "dW", "db"), got, want):
        check(n, gg, r, dtype, k=k)


def test_reference_inputs_get_no_gradient_and_grad_output_scales():
    h, w, b, t = head(B, T, H, V, torch.float32)
    rh = torch.randn(B, T, 16, requires_grad=True)
    rw = torch.randn(V, 16, requires_grad=True)
    loss, _ = ops.fused_linear_dpo(h, w, t, b, ref_hidden=rh, ref_weight=rw, config=CFG)
    (3.0 * loss).backward()
    assert rh.grad is None and rw.grad is None
    g3 = h.grad.clone()
    h.grad = None
    loss, _ = ops.fused_linear_dpo(h, w, t, b, ref_hidden=rh, ref_weight=rw, config=CFG)
    loss.backward()
    torch.testing.assert_close(g3, 3.0 * h.grad)


def test_no_grad_and_default_chunking():
    h, w, b, t = head(B, T, H, V, torch.float32)
    with torch.no_grad():
        a, _ = ops.fused_linear_simpo(h, w, t, b)
    c, _ = ops.fused_linear_simpo(h, w, t, b, config=CFG)
    torch.testing.assert_close(a, c.detach(), rtol=1e-5, atol=1e-6)


liger_cl = pytest.importorskip("liger_kernel.chunked_loss", reason="liger-kernel is not installed")


@pytest.mark.parametrize("name,case", [
    ("DPO", dict(kind="dpo", ref="head")), ("DPO", dict(kind="dpo", loss_type="apo_zero", compute_nll_loss=True)),
    ("ORPO", dict(kind="orpo", average_log_prob=True, compute_nll_loss=True)),
    ("CPO", dict(kind="cpo", compute_nll_loss=True)), ("SimPO", dict(kind="simpo", average_log_prob=True)),
])
def test_matches_liger(name, case):
    h, w, b, t = head(B, T, H, V, torch.float32)
    kw = _kw(case, torch.float32)
    kind = kw.pop("kind")
    args = {"DPO": dict(loss_type=kw.get("loss_type", "sigmoid"), compute_nll_loss=kw.get("compute_nll_loss", False),
                        use_ref_model="ref_hidden" in kw),
            "ORPO": dict(), "CPO": dict(), "SimPO": dict(compute_nll_loss=False)}[name]
    lg = getattr(liger_cl, f"LigerFusedLinear{name}Loss")(compiled=False, **args)
    extra = dict(ref_input=kw["ref_hidden"], ref_weight=kw["ref_weight"]) if "ref_hidden" in kw else {}
    l_loss, l_aux = lg(w, h, t, b, **extra)
    l_grads = grads_of(l_loss, [h, w, b])
    if name == "SimPO":
        kw["compute_nll_loss"] = False
    loss, aux = ops.fused_linear_preference(h, w, t, b, kind=kind, config=CFG, **kw)
    grads = grads_of(loss, [h, w, b])
    torch.testing.assert_close(loss, l_loss, rtol=1e-5, atol=1e-6)
    assert len(aux) == len(l_aux)
    for a, la in zip(aux, l_aux):
        torch.testing.assert_close(a, la.float(), rtol=1e-5, atol=1e-5)
    for g, lg_ in zip(grads, l_grads):
        torch.testing.assert_close(g, lg_, rtol=1e-4, atol=1e-6)


def test_kto_matches_liger():
    h, w, b, t = head(B, T, H, V, torch.float32)
    lab = torch.tensor([True, False, False, True])
    lg = liger_cl.LigerFusedLinearKTOLoss(compiled=False, beta=0.2)
    l_loss, l_aux = lg(h, w, t, b, preference_labels=lab, kl=torch.tensor(0.1))
    loss, aux = ops.fused_linear_kto(h, w, t, lab, b, beta=0.2, kl=torch.tensor(0.1), config=CFG)
    torch.testing.assert_close(loss, l_loss, rtol=1e-5, atol=1e-6)
    for a, la in zip(aux, l_aux):
        torch.testing.assert_close(a, la, rtol=1e-5, atol=1e-4)
    for g, lg_ in zip(grads_of(loss, [h, w, b]), grads_of(l_loss, [h, w, b])):
        torch.testing.assert_close(g, lg_, rtol=1e-4, atol=1e-6)


def test_bad_input():
    h, w, b, t = head(B, T, H, V, torch.float32)
    with pytest.raises(ValueError, match="fused_linear_dpo: hidden must have 3 dimensions"):
        ops.fused_linear_dpo(h.reshape(-1, H), w, t)
    with pytest.raises(ValueError, match="fused_linear_dpo: loss_type must be one of"):
        ops.fused_linear_dpo(h, w, t, loss_type="ipo")
    with pytest.raises(ValueError, match="fused_linear_dpo: hidden's batch must be 2"):
        ops.fused_linear_dpo(h[:3], w, t[:3])
    with pytest.raises(ValueError, match="fused_linear_dpo: target must have shape"):
        ops.fused_linear_dpo(h, w, t[:, :2])
    with pytest.raises(ValueError, match="label_smoothing must be > 0 for loss_type='exo_pair'"):
        ops.fused_linear_dpo(h, w, t, loss_type="exo_pair")
    with pytest.raises(ValueError, match="fused_linear_dpo: ref_logps must have shape"):
        ops.fused_linear_dpo(h, w, t, ref_logps=torch.zeros(3))
    with pytest.raises(TypeError, match="fused_linear_dpo: beta must be a Python number"):
        ops.fused_linear_dpo(h, w, t, beta=torch.tensor(0.1))
    with pytest.raises(TypeError, match="fused_linear_dpo: config must be a FusedLinearLossConfig"):
        ops.fused_linear_dpo(h, w, t, config=7)
    with pytest.raises(ValueError, match="fused_linear_kto: preference_labels must be a tensor of shape"):
        ops.fused_linear_kto(h, w, t, torch.ones(3, dtype=torch.bool))
    bad = t.clone()
    bad[0, 1] = V
    with pytest.raises(ValueError, match=r"fused_linear_dpo: target must be in \[0, 67\) or ignore_index"):
        ops.fused_linear_dpo(h, w, bad)
    with pytest.raises(ValueError, match=r"fused_linear_kto: target must be in \[0, 67\)"):
        ops.fused_linear_kto(h, w, bad, torch.ones(B, dtype=torch.bool))
    with pytest.raises(ValueError, match="FusedLinearLossConfig: chunk_rows must be an int >= 0"):
        FusedLinearLossConfig(chunk_rows=-1)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the compiled row kernels)")
@pytest.mark.parametrize("kind", ["dpo", "orpo"])
def test_both_walks_on_cuda_vs_fp64(kind):
    """The one-pass (a pair a chunk) and two-pass walks on CUDA tensors, bf16, against the fp64 formula."""
    Bc, Tc, Hc, Vc = 4, 257, 64, 4099
    h, w, b, t = (x.cuda().detach().requires_grad_(x.requires_grad) if x.is_floating_point() else x.cuda()
                  for x in head(Bc, Tc, Hc, Vc, torch.bfloat16))
    kw = dict(kind=kind, compute_nll_loss=kind == "orpo", average_log_prob=kind == "orpo")
    h64, w64, b64 = as64([h, w, b])
    ref, ref_aux = reference.fused_linear_preference(h64, w64, t, b64, **kw)
    want = grads_of(ref, [h64, w64, b64])
    k = lengths(Hc, Vc, Bc * Tc) * Tc
    one = FusedLinearLossConfig(one_pass_bytes=2 * Tc * Vc * 2)
    for cfg in (one, FusedLinearLossConfig(one_pass_bytes=0)):
        loss, aux = ops.fused_linear_preference(h, w, t, b, config=cfg, **kw)
        check("loss", loss, ref, torch.bfloat16, k=k, mag=10.0)
        for i, (a, r) in enumerate(zip(aux, ref_aux)):
            check(f"aux{i}", a, r, torch.bfloat16, k=k, mag=10.0)
        for n, g, r in zip(("dh", "dW", "db"), grads_of(loss, [h, w, b]), want):
            check(n, g, r, torch.bfloat16, k=k)
