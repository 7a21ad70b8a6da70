"""tigon.memory.plan: the arithmetic of the byte model (components, linearity in the sequence, LoRA against a full
fine-tune, offload, tiling, longest_seq_len as the inverse of the peak), its predictions against the peaks measured
on an H100 and an H200 (within 10%), the saved bytes of a real patched layer counted on the CPU, and bad input."""

import sys

import pytest
import torch

import tigon
from tigon import ops
from tigon.memory import MemoryPlan, MemoryPlanError, plan

transformers = pytest.importorskip("transformers")
GIB = 2**30
H100_BYTES = int(79.2 * GIB)  # what torch reports as an H100 80GB HBM3's total memory

LLAMA3_8B = dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
LLAMA_1B5 = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=131, tie_word_embeddings=False, max_position_embeddings=256)
# torch.cuda.max_memory_allocated of one step, tigon.patch, bf16, HF gradient checkpointing (non-reentrant) unless
# said, torch's fused AdamW. 8B: PEFT LoRA r 16 (alpha 32) on the seven projections, batch 1 unless said. 1.5B: full
# fine-tune, batch 8 x 2048. docs/memory/plan.md has the table and where each number comes from.
MEASURED = [
    ("8B LoRA, 16K, H100", LLAMA3_8B, dict(seq_len=16384, lora_rank=16), 21.8),
    ("8B LoRA, 32K, H100", LLAMA3_8B, dict(seq_len=32768, lora_rank=16), 28.6),
    ("8B LoRA, 64K, H100", LLAMA3_8B, dict(seq_len=65536, lora_rank=16), 41.8),
    ("8B LoRA, 2 x 4096, H200", LLAMA3_8B, dict(seq_len=4096, batch_size=2, lora_rank=16), 18.90),
    ("1.5B full, 8 x 2048, H100", LLAMA_1B5, dict(seq_len=2048, batch_size=8), 12.13),
    ("1.5B full, 8 x 2048, no checkpointing, H100", LLAMA_1B5,
     dict(seq_len=2048, batch_size=8, checkpointing=False), 23.93),
    # tigon.optim.AdamW(state_bits=8, step_in_backward=True); then the checkpoints offloaded; then the MLP tiled
    ("1.5B full, 8 x 2048, 8-bit moments in the backward, H100", LLAMA_1B5,
     dict(seq_len=2048, batch_size=8, optimizer="adamw_8bit", step_in_backward=True), 8.13),
    ("1.5B full, 8 x 2048, 8-bit in the backward + offload, H100", LLAMA_1B5,
     dict(seq_len=2048, batch_size=8, optimizer="adamw_8bit", step_in_backward=True, offload_checkpoints=True), 7.26),
    ("1.5B full, 8 x 2048, 8-bit in the backward + offload + tile 512, H100", LLAMA_1B5,
     dict(seq_len=2048, batch_size=8, optimizer="adamw_8bit", step_in_backward=True, offload_checkpoints=True,
          tile_tokens=512), 6.91),
    # offload + tile_mlp=True ("auto": the tile read from the H100's free memory at the first step, as the plan
    # reads it from the card's bytes)
    ("8B LoRA, 16K, offload + auto tile, H100", LLAMA3_8B,
     dict(seq_len=16384, lora_rank=16, offload_checkpoints=True, tile_tokens="auto", budget_bytes=H100_BYTES), 18.71),
    ("8B LoRA, 64K, offload + auto tile, H100", LLAMA3_8B,
     dict(seq_len=65536, lora_rank=16, offload_checkpoints=True, tile_tokens="auto", budget_bytes=H100_BYTES), 25.60),
    # 7f7df8b: the long-context benchmark, which records the tile "auto" chose at the first step
    ("8B LoRA, 128K, H100", LLAMA3_8B, dict(seq_len=131072, lora_rank=16), 68.10),
    ("8B LoRA, 32K, offload + tile 36096, H100", LLAMA3_8B,
     dict(seq_len=32768, lora_rank=16, offload_checkpoints=True, tile_tokens=36096), 21.54),
    ("8B LoRA, 128K, offload + tile 36096, H100", LLAMA3_8B,
     dict(seq_len=131072, lora_rank=16, offload_checkpoints=True, tile_tokens=36096), 30.38),
    ("8B LoRA, 256K, offload + tile 29952, H100", LLAMA3_8B,
     dict(seq_len=262144, lora_rank=16, offload_checkpoints=True, tile_tokens=29952), 43.54),
    ("8B LoRA, 4 layers, 256K, offload + tile 39936, H100", dict(LLAMA3_8B, num_hidden_layers=4),
     dict(seq_len=262144, lora_rank=16, offload_checkpoints=True, tile_tokens=39936), 31.93),
    # NF4 QLoRA under a 24 GiB cap
    ("8B QLoRA, 32K, offload + tile 9472, H100 capped at 24 GiB", LLAMA3_8B,
     dict(seq_len=32768, lora_rank=16, quantized_base="nf4", offload_checkpoints=True, tile_tokens=9472), 9.67),
    ("8B QLoRA, 64K, offload + tile 9472, H100 capped at 24 GiB", LLAMA3_8B,
     dict(seq_len=65536, lora_rank=16, quantized_base="nf4", offload_checkpoints=True, tile_tokens=9472), 13.05),
    ("8B QLoRA, 128K, offload + tile 9472, H100 capped at 24 GiB", LLAMA3_8B,
     dict(seq_len=131072, lora_rank=16, quantized_base="nf4", offload_checkpoints=True, tile_tokens=9472), 20.10),
]


def config(**fields):
    return transformers.LlamaConfig(**fields)


def test_components_sum_to_the_peak():
    p = plan(config(**LLAMA3_8B), seq_len=8192, lora_rank=16, offload_checkpoints=4)
    card = {k: v for k, v in p.components().items() if k not in ("overhead", "checkpoints_host")}
    assert p.peak_allocated == sum(card.values()) and p.peak == p.peak_allocated + p.overhead
    assert p.checkpoints_host > 0 and all(v >= 0 for v in p.components().values())
    assert isinstance(p, MemoryPlan) and p.fits(p.peak) and not p.fits(p.peak - 1)
    assert p.layer_saved_per_token == pytest.approx(sum(b for _, b in p.layer_saved_parts))


def test_peak_is_linear_in_the_sequence():
    """Past one chunk of the loss, every component at the peak moment is a * tokens + b: equal steps in seq_len
    give equal steps in bytes, and the slope is the checkpoints plus the recomputed layer's bytes."""
    c = config(**LLAMA3_8B)
    peaks = [plan(c, seq_len=s, lora_rank=16) for s in (16384, 32768, 49152)]
    assert len({p.moment for p in peaks}) == 1
    a, b, d = (p.peak_allocated for p in peaks)
    assert b - a == d - b
    h, i = 4096, 14336
    # 32 checkpoints of 2H bytes, what one layer keeps, the output's and the product's gradients
    slope = 32 * 2 * h + peaks[0].layer_saved_per_token + 2 * h + 2 * i
    assert (b - a) / 16384 == pytest.approx(slope + 24 + 2 * 128 * 2)  # + ids/labels/positions, RoPE's cos/sin


def test_lora_keeps_adapter_gradients_and_state_only():
    c = config(**LLAMA_1B5)
    full, lora = plan(c, seq_len=2048), plan(c, seq_len=2048, lora_rank=8)
    params = full.weights // 2  # bf16
    r_params = 16 * 8 * (2 * (2048 + 2048) + 2 * (2048 + 512) + 3 * (2048 + 8192))
    assert lora.weights == full.weights + 4 * r_params  # fp32 adapters beside the bf16 base
    assert full.optimizer_state == 2 * 2 * params and lora.optimizer_state == 2 * 4 * r_params
    end = plan(c, seq_len=16)  # short: the peak comes at the end of the backward, with every gradient made
    assert end.moment == "embedding backward" and end.gradients == full.weights
    parts_full, parts_lora = dict(full.layer_saved_parts), dict(lora.layer_saved_parts)
    assert parts_full["lora"] == 0 and parts_lora["lora"] == 2 * 8 * 7  # x A^T: r bf16 values a projection
    assert {k: v for k, v in parts_lora.items() if k != "lora"} == {k: v for k, v in parts_full.items() if k != "lora"}


def test_offload_moves_checkpoints_from_card_to_host():
    c = config(**LLAMA3_8B)
    layer = 2 * 4096 * 65536
    kept = plan(c, seq_len=65536, lora_rank=16)
    host = plan(c, seq_len=65536, lora_rank=16, offload_checkpoints=True)
    some = plan(c, seq_len=65536, lora_rank=16, offload_checkpoints=6)
    assert (kept.checkpoints_on_card, kept.checkpoints_host) == (32 * layer, 0)
    # the one in use and the one prefetched below it, and the frozen embedding's output, a leaf that requires grad
    # under LoRA, held through the backward
    assert (host.checkpoints_on_card, host.checkpoints_host) == (3 * layer, 32 * layer)
    assert (some.checkpoints_on_card, some.checkpoints_host) == (7 * layer, 26 * layer)
    assert kept.peak_allocated - host.peak_allocated == 29 * layer
    full = plan(c, seq_len=8192, offload_checkpoints=True)  # the embedding trains: its output is no leaf
    assert full._job.input_leaf is False and host._job.input_leaf is True
    assert plan(c, seq_len=65536, lora_rank=16, offload_checkpoints=32) == kept


def test_tiling_bounds_the_mlp_part():
    c = config(**LLAMA3_8B)
    kw = dict(lora_rank=16, offload_checkpoints=True, tile_tokens=4096)
    short, long = plan(c, seq_len=65536, **kw), plan(c, seq_len=131072, **kw)
    mlp_bytes = [dict(p.layer_saved_parts)["mlp"] * p.seq_len for p in (short, long)]
    assert mlp_bytes[0] == mlp_bytes[1] == 3 * 2 * 14336 * 4096  # gate, up, product of one tile
    untiled = plan(c, seq_len=65536, lora_rank=16, offload_checkpoints=True)
    assert dict(untiled.layer_saved_parts)["mlp"] == 3 * 2 * 14336
    assert short.layer_working_set < untiled.layer_working_set / 2
    # a sequence no longer than a tile runs untiled, as install_tiled_mlp does
    assert plan(c, seq_len=4096, **kw) == plan(c, seq_len=4096, lora_rank=16, offload_checkpoints=True)


@pytest.mark.parametrize("attention", ["flash", "eager"])
def test_longest_seq_len_inverts_the_peak(attention):
    c = config(**LLAMA_1B5)
    p = plan(c, seq_len=1024, batch_size=2, attention=attention)
    for budget in (20 * GIB, 40 * GIB):
        s = p.longest_seq_len(budget)
        assert s > 0 and plan(c, seq_len=s, batch_size=2, attention=attention).fits(budget)
        assert not plan(c, seq_len=s + 1, batch_size=2, attention=attention).fits(budget)
    if attention == "eager":  # quadratic: twice the budget buys much less than twice the tokens
        assert p.longest_seq_len(40 * GIB) < 2 * p.longest_seq_len(20 * GIB)
    assert p.longest_seq_len(p.weights + 1) == 0  # the weights fit, no token does


@pytest.mark.parametrize("name,fields,kwargs,measured_gib", MEASURED, ids=[m[0] for m in MEASURED])
def test_prediction_within_10_percent_of_the_measured_peak(name, fields, kwargs, measured_gib):
    predicted = plan(config(**fields), **kwargs).peak_allocated / GIB
    assert abs(predicted / measured_gib - 1) <= 0.10, (name, predicted, measured_gib)


def test_auto_tile_is_the_tiling_rule_over_the_memory_free_at_the_first_step():
    from tigon.memory.plan import CONTEXT_BYTES
    from tigon.memory.tiling import CPU_AUTO_TILE_TOKENS, auto_tile_tokens

    c = config(**LLAMA3_8B)
    assert plan(c, seq_len=8192, tile_tokens="auto").tile_tokens == CPU_AUTO_TILE_TOKENS  # no card, no budget
    assert plan(c, seq_len=8192).tile_tokens is None
    fixed = plan(c, seq_len=65536, lora_rank=16, tile_tokens=8192)
    auto = plan(c, seq_len=65536, lora_rank=16, tile_tokens="auto", budget_bytes=H100_BYTES)
    free = H100_BYTES - CONTEXT_BYTES - fixed.weights
    assert auto.tile_tokens == auto_tile_tokens(14336, 2, free) and auto.tile_tokens % 256 == 0
    assert auto.tile_tokens > 8192 and auto.layer_working_set > fixed.layer_working_set  # a longer tile, more bytes
    # a batch of rows shares the tile's budget, as install_tiled_mlp's rule does
    assert plan(c, seq_len=65536, batch_size=2, lora_rank=16, tile_tokens="auto",
                budget_bytes=H100_BYTES).tile_tokens == auto_tile_tokens(14336, 2, free, rows_per_token=2)


def test_the_10_percent_check_rejects_a_plan_without_the_checkpoints():
    """Negative control: the same 64K job planned with its checkpoints off the card misses the measurement."""
    predicted = plan(config(**LLAMA3_8B), seq_len=65536, lora_rank=16, offload_checkpoints=True).peak_allocated
    assert abs(predicted / GIB / 41.8 - 1) > 0.10


def _tiny_model(lora: bool):
    if lora:  # imported before tigon.patch, which then installs the PEFT layers' forward at once
        peft = pytest.importorskip("peft")
    cfg = config(**TINY)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = transformers.LlamaForCausalLM(cfg).to(device=device, dtype=torch.bfloat16)
    tigon.patch(model)
    if lora:
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=[
            "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]))
    return model


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_saved_bytes_of_a_patched_layer_match_the_plan(lora):
    """One decoder layer of a patched tiny Llama, forward and backward under a saved-tensor hook (as checkpointing's
    recompute runs it): the bytes autograd keeps, its input, the shared RoPE tables and the parameters left out,
    are the plan's per-token formula times the tokens."""
    model = _tiny_model(lora)
    inner = model.get_base_model().model if lora else model.model
    T, device = 48, inner.embed_tokens.weight.device
    x = torch.randn(1, T, TINY["hidden_size"], device=device, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(T, device=device)[None]
    cos, sin = inner.rotary_emb(x, positions)
    skip = {t.untyped_storage().data_ptr() for t in (*model.parameters(), *model.buffers(), x, cos, sin)}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in skip:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    before = sum(n for (op, path), n in ops.dispatch_counts.items() if path == "triton")
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            out = inner.layers[0](x, attention_mask=None, position_ids=positions, position_embeddings=(cos, sin))
        out = out[0] if isinstance(out, tuple) else out
        out.float().square().sum().backward()
    finally:
        tigon.unpatch(model)
    assert torch.isfinite(x.grad).all()
    ran = {op for (op, path), n in ops.dispatch_counts.items() if path == "triton"}
    assert sum(n for (op, path), n in ops.dispatch_counts.items() if path == "triton") > before
    assert {"add_rms_norm", "apply_rope", "swiglu"} <= ran and (not lora or "lora_linear" in ran)
    predicted = plan(model, seq_len=T).layer_saved_per_token
    # exact on the CPU; a GPU backend may pad the fp32 lse to whole tiles of queries
    assert sum(saved.values()) / T == pytest.approx(predicted, rel=0 if device.type == "cpu" else 0.03)


def test_a_model_and_its_config_give_the_same_plan():
    pytest.importorskip("peft")
    import peft

    cfg = config(**TINY)
    with torch.device("meta"):  # no memory: a big model can be planned the same way
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    assert plan(model, seq_len=64) == plan(cfg, seq_len=64)
    assert plan(model, seq_len=64, lora_rank=4) == plan(cfg, seq_len=64, lora_rank=4)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    assert plan(wrapped, seq_len=64) == plan(cfg, seq_len=64, lora_rank=4, lora_targets=["q_proj", "v_proj"])
    with pytest.raises(ValueError, match="lora_rank and lora_targets"):
        plan(wrapped, seq_len=64, lora_rank=8)


def test_nf4_base_weighs_about_a_quarter():
    c = config(**LLAMA3_8B)
    bf16, nf4 = plan(c, seq_len=8192, lora_rank=16), plan(c, seq_len=8192, lora_rank=16, quantized_base="nf4")
    embeddings = 2 * 2 * 128256 * 4096  # the embedding and LM head stay bf16
    assert (nf4.weights - embeddings) / (bf16.weights - embeddings) == pytest.approx(0.5625 / 2, rel=0.05)


def test_budget_too_small_names_the_largest_component_before_any_step():
    c = config(**LLAMA3_8B)
    with pytest.raises(MemoryPlanError, match=r"largest component is checkpoints_on_card .* seq_len <= \d+ fits"):
        plan(c, seq_len=262144, lora_rank=16, budget_bytes=80 * GIB)
    with pytest.raises(MemoryPlanError, match=r"over budget_bytes \(80.00 GiB\)"):
        plan(c, seq_len=262144, lora_rank=16, budget_bytes=80 * GIB)
    with pytest.raises(ValueError, match="budget_bytes .* smaller than the weights alone"):
        plan(c, seq_len=1024, lora_rank=16, budget_bytes=8 * GIB)
    assert plan(c, seq_len=262144, lora_rank=16, offload_checkpoints=True, tile_tokens=8192,
                budget_bytes=80 * GIB).fits(80 * GIB)


@pytest.mark.parametrize("kwargs,error,words", [
    (dict(seq_len=0), ValueError, "seq_len must be >= 1"),
    (dict(seq_len=-3), ValueError, "seq_len must be >= 1"),
    (dict(seq_len=2.5), TypeError, "seq_len must be an int"),
    (dict(seq_len=8, batch_size=0), ValueError, "batch_size must be >= 1"),
    (dict(seq_len=8, optimizer="adam"), ValueError, "optimizer must be one of"),
    (dict(seq_len=8, attention="xformers"), ValueError, "attention must be one of"),
    (dict(seq_len=8, loss="chunked"), ValueError, "loss must be one of"),
    (dict(seq_len=8, quantized_base="int4"), ValueError, "quantized_base must be one of"),
    (dict(seq_len=8, quantized_base="nf4"), ValueError, "quantized_base='nf4' needs lora_rank"),
    (dict(seq_len=8, lora_rank=16, lora_targets=["qkv"]), ValueError, "lora_targets must be .all. or names from"),
    (dict(seq_len=8, checkpointing=False, offload_checkpoints=True), ValueError, "offload_checkpoints needs"),
    (dict(seq_len=8, offload_checkpoints=40), ValueError, r"offload_checkpoints must be in \[0, 16\]"),
    (dict(seq_len=8, tile_tokens=0), ValueError, "tile_tokens must be >= 1"),
    (dict(seq_len=8, tile_tokens="whole"), ValueError, "tile_tokens must be an int >= 1, 'auto' or None"),
    (dict(seq_len=8, dtype=torch.int8), TypeError, "dtype must be"),
    (dict(seq_len=8, budget_bytes=-1), ValueError, "budget_bytes must be > 0"),
])
def test_bad_input_names_the_argument(kwargs, error, words):
    with pytest.raises(error, match=r"^tigon\.memory\.plan: .*" + words):
        plan(config(**LLAMA_1B5), **kwargs)


def test_bad_model_or_config():
    with pytest.raises(TypeError, match="model_or_config must be a transformers config or a model"):
        plan("meta-llama/Llama-3-8B", seq_len=8)
    with pytest.raises(ValueError, match="missing hidden_size"):
        plan(transformers.PretrainedConfig(), seq_len=8)
    with pytest.raises(ValueError, match="mixture-of-experts"):
        plan(transformers.MixtralConfig(num_hidden_layers=2), seq_len=8)


@pytest.mark.parametrize("with_tabulate", [True, False])
def test_the_table_names_every_component(monkeypatch, with_tabulate):
    if not with_tabulate:
        monkeypatch.setitem(sys.modules, "tabulate", None)  # import fails: the plain layout
    text = str(plan(config(**LLAMA3_8B), seq_len=32768, lora_rank=16, offload_checkpoints=True))
    for name in ("weights", "gradients", "optimizer_state", "checkpoints_on_card", "checkpoints_host",
                 "layer_working_set", "loss_chunk", "attention_workspace", "overhead", "peak (card)"):
        assert name in text
    assert "GiB" in text and "1 x 32768 tokens" in text


def test_stepping_in_the_backward_holds_one_gradient_at_a_time():
    """Stepped in the backward, the gradients at every moment are the one being made (and a tied head's share):
    the 1.5B full fine-tune's gradient component falls from every parameter's to one down projection's, and the
    optimizer step is no longer a peak moment."""
    c = config(**LLAMA_1B5)
    base = plan(c, seq_len=2048, batch_size=8)
    lean = plan(c, seq_len=2048, batch_size=8, step_in_backward=True)
    down = 2048 * 8192 * 2
    assert lean.gradients == down and base.gradients > 60 * down
    assert lean.peak_allocated < base.peak_allocated and lean.moment != "optimizer step"
    tied = plan(config(**dict(LLAMA_1B5, tie_word_embeddings=True)), seq_len=2048, batch_size=8,
                step_in_backward=True)
    assert tied.gradients == down + (128256 + 1) * 2048 * 2  # the head (and final norm) waits for the embedding
    with pytest.raises(TypeError, match="step_in_backward must be True or False"):
        plan(c, seq_len=2048, step_in_backward="yes")
