"""bf16 training convergence on the GPU: a patched model follows the unpatched one step by step.

Mini Llama / Qwen3 / Gemma2 (hidden 256, 4 layers) with the real vocabularies (32000 / 151936 / 256000: the
lm_head is where the fused loss matters), 30 AdamW steps (lr 3e-4) from the same init on two fixed batches of
random tokens (memorized, so the loss falls), in two precisions: bf16 weights, and fp32 weights under bf16
autocast (Trainer's bf16=True). The unpatched run goes first (an instance patch swaps RoPE module-wide).
Peak memory stays near 2 GiB (Gemma2: 2 x 65.5M embedding/head + Adam state, and the unpatched run's
[1024, 256000] fp32 logits).

Tolerances, from bf16's unit roundoff u = 2^-8 = 3.9e-3, and measured on a CPU proxy (the same runs with the
kernels off, so the patched model runs tigon's fp32-math reference ops, which round like the kernels: fp32
math, one cast per op; SEQ 128):
- loss, per step: |loss - loss_ref| <= 2e-2 * loss_ref (~5u). Both losses are fp32 reductions of activations
  rounded to bf16 at different places (a fused op rounds once, eager HF after each elementwise step), and the
  runs drift apart as their weights differ by a few ulps more each step. Measured: <= 3.3e-3 (Llama),
  2.4e-3 (Llama, autocast), 4.8e-4 (Qwen3), 7.6e-4 (Gemma2), 4.8e-3 (Gemma2, autocast). A wrong gradient
  term moves the loss by far more within a few steps. At lr 1e-3 the two-batch memorization turns chaotic
  after ~20 steps (5% loss gaps, 10% weight gaps on the proxy), hence 3e-4.
- parameters after 30 steps: ||p - p_ref|| / ||p_ref|| per tensor <= 3e-2. An Adam step moves every weight by
  about lr whatever its gradient's size, so where the gradient is near zero (its sign is rounding noise) two
  runs step apart: up to 2 * 30 * lr = 0.018 per weight against an init std of 0.02. The rest of the gradient
  agrees between runs; measured <= 9e-3 (Llama), 7.1e-3 (Llama, autocast), 7.8e-3 (Qwen3). Gemma2's norm
  weights start at 0 (it scales by 1 + w), so p_ref is the 30 updates alone and the ratio is the share of
  noisy update signs: PARAM_RTOL_ZERO_INIT = 1.5e-1 (measured <= 4.6e-2, 5.5e-2 autocast); a wrong norm
  gradient gives O(1).
- the loss falls: the last step's loss is below 0.9x the first's (measured 0.65x Llama, 0.63x Qwen3,
  0.72x Gemma2), so the test sees training, not noise.
"""

import copy

import pytest
import torch

import tigon
from tests.hf._tiny import tiny_config
from tigon.ops import dispatch_counts

pytestmark = pytest.mark.gpu

STEPS, LR, BATCH, SEQ, N_BATCHES = 30, 3e-4, 4, 256, 2
LOSS_RTOL = 2e-2
PARAM_RTOL = 3e-2
PARAM_RTOL_ZERO_INIT = 1.5e-1
MINI = dict(hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, max_position_embeddings=SEQ, initializer_range=0.02)
CONFIGS = {
    "llama": dict(vocab_size=32000),
    "qwen3": dict(vocab_size=151936),
    # Gemma2's logit softcap (30) runs inside the fused loss; tied embeddings give the head's gradient two
    # sources; sliding_window < SEQ makes the alternating sliding-window layers differ from the global ones.
    "gemma2": dict(vocab_size=256000, tie_word_embeddings=True, final_logit_softcapping=30.0,
                   attn_logit_softcapping=50.0, sliding_window=128, query_pre_attn_scalar=64),
}


def build(model_type, device, dtype=torch.bfloat16, **overrides):
    """The mini model with HF's own init (std 0.02), in `dtype` on `device`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = tiny_config(model_type, **{**MINI, **CONFIGS[model_type], **overrides})
    return AutoModelForCausalLM.from_config(config).to(device=device, dtype=dtype)


def batches(vocab, device, n=N_BATCHES, b=BATCH, t=SEQ):
    g = torch.Generator(device="cpu").manual_seed(1)
    out = []
    for _ in range(n):
        ids = torch.randint(0, vocab, (b, t), generator=g)
        labels = ids.clone()
        labels[0, -t // 4:] = -100  # some ignored labels, as padding would give
        out.append((ids.to(device), labels.to(device)))
    return out


def train(model, data, steps=STEPS, lr=LR, amp=False):
    """AdamW; returns the per-step losses (fp32, on the CPU) without syncing inside the loop. amp=True: fp32
    weights under bf16 autocast (Trainer's bf16=True), else the weights themselves are bf16."""
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    losses = []
    device_type = next(model.parameters()).device.type
    for step in range(steps):
        ids, labels = data[step % len(data)]
        opt.zero_grad(set_to_none=True)
        with torch.autocast(device_type, dtype=torch.bfloat16, enabled=amp):
            loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        opt.step()
        losses.append(loss.detach().float())
    return torch.stack(losses).cpu()


def compare(model_type, device, amp=False, lr=LR, **overrides):
    """Trains the unpatched model, then a patched copy of the same init; returns both loss curves and the
    per-parameter relative L2 distance, after checking the patched run used the fused loss."""
    ref = build(model_type, device, dtype=torch.float32 if amp else torch.bfloat16, **overrides)
    model = copy.deepcopy(ref)
    init = {n: p.detach().clone() for n, p in ref.named_parameters()}
    data = batches(ref.config.vocab_size, device)
    losses_ref = train(ref, data, lr=lr, amp=amp)
    tigon.patch(model)
    try:
        dispatch_counts.clear()
        losses = train(model, data, lr=lr, amp=amp)
        assert dispatch_counts[("linear_cross_entropy", "triton")] == STEPS or device.type != "cuda"
    finally:
        tigon.unpatch(model)
    ref_params = dict(ref.named_parameters())
    rel = {}
    for n, p in model.named_parameters():
        p_ref = ref_params[n].float()
        rel[n] = ((p.float() - p_ref).norm() / p_ref.norm().clamp_min(1e-12)).item(), bool(init[n].abs().max() == 0)
    return losses, losses_ref, rel


@pytest.mark.parametrize("amp", [False, True], ids=["bf16_weights", "autocast"])
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_bf16_training_follows_unpatched(model_type, amp):
    losses, losses_ref, rel = compare(model_type, torch.device("cuda"), amp=amp)
    assert torch.isfinite(losses).all() and torch.isfinite(losses_ref).all()
    assert losses_ref[-1] < 0.9 * losses_ref[0], f"the reference did not train: {losses_ref.tolist()}"
    diff = (losses - losses_ref).abs()
    bad = (diff > LOSS_RTOL * losses_ref).nonzero().flatten().tolist()
    assert not bad, f"{model_type}: loss differs at steps {bad}: {losses.tolist()} vs {losses_ref.tolist()}"
    for n, (r, zero_init) in rel.items():
        tol = PARAM_RTOL_ZERO_INIT if zero_init else PARAM_RTOL
        assert r <= tol, f"{model_type}: {n} relative L2 {r:.3e} > {tol:g} after {STEPS} steps"
