"""The "tigon" experts implementation of transformers' routed experts (`@use_experts_implementation` classes:
Qwen3-MoE, Mixtral, ...): the same grouped GEMMs as HF's "grouped_mm" (torch's grouped_mm, or HF's per-expert
fallback where that is unavailable), with the elementwise glue around them fused:

    HF grouped_mm                                      tigon
    hidden[perm // K] (+ masked_fill_)                 ops.moe_permute: one pass, deterministic backward
    grouped_mm up, masked_fill                         grouped_mm up
    chunk + silu(gate) * up                            swiglu_packed on the [S, 2I] buffer (backward in place)
    grouped_mm down, masked_fill                       grouped_mm down
    * weight, inverse-permute gather, view.sum(1)      ops.moe_combine: [S, H] read once, [T, H] written once

Rows past the last offset (expert parallelism's sentinel experts, sorted to the tail, which the grouped GEMMs leave
unwritten) are handled inside permute and combine (n_rows), so no masked_fill pass is left. Experts with a
bias, without a gate, interleaved gate/up, another activation or their own _apply_gate keep HF's gate and bias
code between the same permute and combine. `register()` adds the implementation to transformers'
ExpertsInterface; tigon.patch(model, moe_experts=True) switches a model to it (hf/patching.py).
"""

import torch

from .. import ops
from ..ops.swiglu import swiglu_packed

NAME = "tigon"


def _hf_moe():
    from transformers.integrations import moe

    return moe


def _fused_gate(experts) -> bool:
    """Whether silu(gate) * up on the concatenated [S, 2I] buffer is exactly what this module's gate computes."""
    from transformers.activations import SiLUActivation

    hf = _hf_moe()
    return (experts.has_gate and experts.is_concatenated
            and getattr(type(experts), "_apply_gate", None) is hf._default_apply_gate
            and isinstance(getattr(experts, "act_fn", None), (SiLUActivation, torch.nn.SiLU)))


def _routing(top_k_index, num_experts):
    """(pos [T, K], offsets [E] int32, n_rows [1]) of a stable sort of the (token, expert) pairs by expert."""
    T, K = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    expert_ids_g, perm = torch.sort(expert_ids, stable=True)  # stable: the same order run to run
    pos = torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel(), device=perm.device))
    # histc as HF's (no host sync, CUDA-graph safe); ids >= num_experts (sentinels) fall outside its range
    device = top_k_index.device
    counts = torch.histc(expert_ids_g.float() if device.type in ("cpu", "mps") else expert_ids_g.int(),
                         bins=num_experts, min=0, max=num_experts - 1)
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)
    return pos.view(T, K), offsets, offsets[-1:], expert_ids_g


def tigon_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """The experts' forward: hidden_states [T, H], top_k_index [T, K] (ids >= num_experts: not routed here),
    top_k_weights [T, K] -> [T, H] in hidden_states.dtype."""
    hf = _hf_moe()
    pos, offsets, n_rows, expert_ids_g = _routing(top_k_index, self.num_experts)
    first = self.gate_up_proj if self.has_gate else self.up_proj
    x_g = ops.moe_permute(hidden_states.to(first.dtype), pos, n_rows)  # [S, H]
    bias_ids = expert_ids_g.clamp(max=self.num_experts - 1) if self.has_bias else None
    bias = (self.gate_up_proj_bias if self.has_gate else self.up_proj_bias)[bias_ids] if self.has_bias else None
    proj = hf._grouped_linear(x_g, first, offsets, bias=bias, is_transposed=self.is_transposed)
    if self.has_gate and _fused_gate(self):
        # proj is the GEMM's fresh output, read by nobody else: its gradient may overwrite it
        proj = swiglu_packed(proj, inplace_backward=True)
    elif self.has_gate:
        proj = self._apply_gate(proj)
    else:
        proj = self.act_fn(proj)
    bias = self.down_proj_bias[bias_ids] if self.has_bias else None
    y = hf._grouped_linear(proj, self.down_proj, offsets, bias=bias, is_transposed=self.is_transposed)
    return ops.moe_combine(y, top_k_weights, pos, n_rows).to(hidden_states.dtype)


def register() -> None:
    """Add "tigon" to transformers' ExpertsInterface (all instances; idempotent)."""
    hf = _hf_moe()
    if hf.ExpertsInterface._global_mapping.get(NAME) is not tigon_experts_forward:
        hf.ExpertsInterface.register(NAME, tigon_experts_forward)


def experts_modules(model):
    """The routed-experts modules of `model` whose forward dispatches on the experts implementation."""
    return [m for m in model.modules()
            if hasattr(m, "is_concatenated") and hasattr(m, "has_gate") and hasattr(type(m), "_apply_gate")]
