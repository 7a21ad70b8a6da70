"""Tiny random-init models of each family, small enough for the Triton interpreter."""

import contextlib

import torch

from tigon import ops

COMMON = dict(
    vocab_size=131, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
    attn_implementation="eager",
)
EXTRA = {
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=48, decoder_sparse_step=1),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[1]),
    "olmoe": dict(num_experts=4, num_experts_per_tok=2),
    "gemma2": dict(final_logit_softcapping=5.0, sliding_window=16),
    "gemma3_text": dict(final_logit_softcapping=5.0, sliding_window=16),
    "phi3": dict(pad_token_id=0),
    "glm": dict(partial_rotary_factor=0.5, pad_token_id=0),
    "glm4": dict(partial_rotary_factor=0.5, pad_token_id=0),
    "hunyuan_v1_dense": dict(),
    "smollm3": dict(pad_token_id=0),
    "seed_oss": dict(residual_dropout=0.0, attention_dropout=0.0),  # 0.1 by default: random in training
    # the rows added for liger-kernel 0.8.5's coverage (their HF checks: tests/hf/test_registry_families.py)
    "qwen3_next": dict(layer_types=["linear_attention", "full_attention"], num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=16, shared_expert_intermediate_size=24, linear_num_value_heads=2,
                       linear_num_key_heads=1, linear_key_head_dim=8, linear_value_head_dim=8),
    "deepseek_v2": dict(q_lora_rank=None, num_key_value_heads=4, head_dim=8, kv_lora_rank=16, qk_rope_head_dim=8,
                        qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4, n_shared_experts=1,
                        first_k_dense_replace=0, num_experts_per_tok=2, moe_intermediate_size=16),
    "deepseek_v3": dict(q_lora_rank=16, n_group=1, topk_group=1, num_key_value_heads=4, head_dim=8, kv_lora_rank=16,
                        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, n_routed_experts=4,
                        n_shared_experts=1, first_k_dense_replace=0, num_experts_per_tok=2, moe_intermediate_size=16),
    "falcon_h1": dict(mamba_d_ssm=32, mamba_n_heads=2, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=8,
                      mamba_chunk_size=4),
    "nemotron": dict(partial_rotary_factor=0.5),
    # Gemma-4's per-layer inputs default to a 262144 x 256 table per layer, its full-attention heads to 512 wide
    "gemma4_text": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=131, global_head_dim=16,
                        sliding_window=16, final_logit_softcapping=5.0),
}


def tiny_config(model_type, **overrides):
    from transformers import AutoConfig

    kwargs = {**COMMON, **EXTRA.get(model_type, {}), **overrides}
    attn = kwargs.pop("attn_implementation")
    config = AutoConfig.for_model(model_type, **kwargs)
    config._attn_implementation = attn
    return config


def tiny_model(model_type, seed=0, **overrides):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(model_type, **overrides))
    # A larger init than HF's 0.02 so the softmax is far from uniform and the test sees the weights.
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.2)
    return model.float()


def batch(vocab=131, b=2, t=7, seed=1, ignore_tail=2):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (b, t), generator=g)
    labels = ids.clone()
    labels[0, -ignore_tail:] = -100
    return ids, labels


def prompt_ids(b, t, seed=1, vocab=131):
    """A [b, t] random prompt from a fixed CPU generator."""
    return torch.randint(0, vocab, (b, t), generator=torch.Generator().manual_seed(seed))


def greedy_with_scores(model, ids, cache, new, **kw):
    """model.generate, greedy, exactly `new` tokens over `cache`: (sequences, scores [b, new, vocab])."""
    out = model.generate(ids, max_new_tokens=new, min_new_tokens=new, do_sample=False, past_key_values=cache,
                         output_scores=True, return_dict_in_generate=True, pad_token_id=0, **kw)
    return out.sequences, torch.stack(out.scores, 1)


def op_calls(*op_names):
    """Eager calls of Tigon's ops `op_names` so far, on either path (ops.dispatch_counts): the Triton kernels
    (CUDA, or CPU under TRITON_INTERPRET=1) or the PyTorch reference (CPU tensors on a CUDA machine, where
    tests/conftest.py leaves the interpreter off). For tests that prove a patched model routes through Tigon's op;
    that the kernel equals the reference is tests/ops' job."""
    return sum(ops.dispatch_counts[(op, path)] for op in op_names for path in ("triton", "reference"))


@contextlib.contextmanager
def kernel_funcs_set_aside(model):
    """`model` without kernels' `_kernel_funcs` for the block (a pickle of it), then with them again. With the
    `kernels` package installed, transformers 5.17's attention modules hold apply_rotary_pos_emb there as an
    instance of a class local to kernels (`_create_func_module`), which pickle cannot name: Hugging Face's own
    model does not torch.save, patched or not. A copy made in the block has none (only kernelize reads them)."""
    held = [(m, m.__dict__.pop("_kernel_funcs")) for m in model.modules() if "_kernel_funcs" in m.__dict__]
    try:
        yield model
    finally:
        for m, funcs in held:
            m.__dict__["_kernel_funcs"] = funcs
