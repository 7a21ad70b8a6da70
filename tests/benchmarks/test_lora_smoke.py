"""benchmarks/training/bench_lora.py's QLoRA variants on the CPU: the NF4 swap of the decoder projections (each 4-bit
layer holds its bf16 weight to NF4's error, embeddings and lm_head stay bf16), the tigon-qlora variants built and
stepped in this process (2 tiny layers; tigon-qlora routes every 4-bit LoRA projection through tigon.ops.lora_add,
tigon-qlora-nolora none), liger-qlora built in its own subprocess as the bench runs it (Liger's kernels do not run on a
CPU: no step), and the variant names. The timing needs a GPU (benchmarks/run_gpu.sh qlora)."""


import pytest
import torch

import tigon
from benchmarks.training import bench_lora
from tests.hf._tiny import op_calls

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")
# A CPU smoke test of the bench (its children run Triton's interpreter, which numpy >= 2.4 breaks): on a GPU
# machine the bench itself runs (benchmarks/results/h200.md, the QLoRA table).
pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU smoke of bench_lora: a GPU runs the bench")

@pytest.fixture(scope="module")
def bench():
    return bench_lora


def _smoke_args(bench, variant):
    return bench.parse_args(["--smoke", "--child", variant, "--seq", "16"])


def test_variant_names_and_defaults(bench):
    assert bench.parse_variant("tigon-qlora-nolora") == ("tigon-nolora", True)
    assert bench.parse_variant("liger-qlora") == ("liger", True)
    assert bench.parse_variant("tigon") == ("tigon", False)
    full = bench.parse_args([])
    assert full.variants == "liger,tigon-nolora,tigon"  # the QLoRA rows only when asked for
    assert (full.bs, full.seq, full.steps, full.layers, full.double_quant) == (2, 4096, 6, 32, True)
    smoke = bench.parse_args(["--smoke", "--no-double-quant"])
    assert (smoke.bs, smoke.seq, smoke.steps, smoke.layers, smoke.double_quant) == (1, 64, 1, 2, False)
    with pytest.raises(SystemExit, match="unknown variant 'tigon-qlora-typo'"):
        bench.main(["--smoke", "--variants", "tigon-qlora,tigon-qlora-typo"])


@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "plain-absmax"])
def test_projections_become_nf4_layers_holding_their_weights(bench, double_quant):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**bench.SMOKE, num_hidden_layers=2)).to(torch.bfloat16)
    before = {n: m.weight.detach().clone() for n, m in model.model.layers.named_modules()
              if type(m) is torch.nn.Linear}
    assert bench.quantize_projections(model, double_quant=double_quant, compute_dtype=torch.bfloat16) == 14
    assert model.is_loaded_in_4bit
    layers = dict(model.model.layers.named_modules())
    for name, w in before.items():
        q = layers[name]
        assert type(q) is bnb.nn.Linear4bit and q.compute_dtype == torch.bfloat16
        assert q.weight.quant_type == "nf4" and q.weight.dtype == torch.uint8 and not q.weight.requires_grad
        assert q.weight.bnb_quantized and (q.weight.quant_state.nested == double_quant)
        back = bnb.functional.dequantize_4bit(q.weight.data, q.weight.quant_state).float()
        assert back.shape == w.shape
        # NF4 codes are a block's absmax times 16 levels in [-1, 1], at most ~0.28 absmax apart: an error above
        # 0.15 of the tensor's absmax means the wrong weight (or garbage) was packed; a right one is ~0.1
        err = (back - w.float()).abs().max() / w.float().abs().max()
        assert err <= 0.15, f"{name}: NF4 error {err:.3g} of absmax"
    assert type(model.lm_head) is torch.nn.Linear and model.lm_head.weight.dtype == torch.bfloat16
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16


@pytest.mark.parametrize("variant", ["tigon-qlora-nolora", "tigon-qlora"])
def test_tigon_qlora_variant_builds_and_trains_one_step(bench, variant):
    from peft.tuners.lora import bnb as peft_bnb

    a = _smoke_args(bench, variant)
    model, opt, ids, report, four_bit = bench.build(variant, a, torch.device("cpu"))
    try:
        assert four_bit == 14 and report is not None
        wrapped = [m for m in model.modules() if type(m) is peft_bnb.Linear4bit]
        assert len(wrapped) == 14 and all(type(m.base_layer) is bnb.nn.Linear4bit for m in wrapped)
        lora_b = {n: p.detach().clone() for n, p in model.named_parameters() if "lora_B" in n}
        assert len(lora_b) == 14 and all(not p.any() for p in lora_b.values())  # PEFT's zero init
        adds = op_calls("lora_add")
        loss = bench.step(model, opt, ids)
        assert torch.isfinite(loss)
        # tigon-qlora: every 4-bit LoRA projection ran lora_add, twice under checkpointing (forward, recompute)
        assert op_calls("lora_add") - adds == (14 * 2 if variant == "tigon-qlora" else 0)
        after = {n: p.detach() for n, p in model.named_parameters() if "lora_B" in n}
        assert all(after[n].any() for n in lora_b)  # the step reached every adapter
        assert all(m.weight.grad is None for m in wrapped)  # the frozen 4-bit base got no gradient
    finally:
        tigon.unpatch(model)


def test_liger_qlora_builds_in_its_own_process(bench):
    pytest.importorskip("liger_kernel")
    (row,) = bench.main(["--smoke", "--variants", "liger-qlora", "--seq", "16", "--timeout", "240"])
    assert "error" not in row, row.get("error")
    assert row["four_bit_layers"] == 14 and row["base"] == "nf4 dq"
    assert row["skipped"].startswith("built; no step")


def test_tigon_variant_under_autocast_runs_every_projection_through_the_op(bench):
    """--autocast (the Trainer's bf16=True): the forward under bf16 autocast still takes lora_linear for every LoRA
    projection, twice under checkpointing, and the fp32 adapters are what the step updates."""
    a = bench.parse_args(["--smoke", "--child", "tigon", "--seq", "16", "--autocast"])
    assert a.autocast and not bench.parse_args(["--smoke"]).autocast
    model, opt, ids, report, _ = bench.build("tigon", a, torch.device("cpu"))
    try:
        lora_b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
        assert len(lora_b) == 14 and all(p.dtype == torch.float32 for p in lora_b.values())
        calls = op_calls("lora_linear")
        loss = bench.step(model, opt, ids, autocast=True)
        assert torch.isfinite(loss)
        assert op_calls("lora_linear") - calls == 14 * 2
        assert all(p.detach().any() for p in lora_b.values())
    finally:
        tigon.unpatch(model)


@pytest.mark.parametrize("kept,calls", [(-1, 14), (1, 14 + 7)], ids=["all", "one"])
def test_tigon_kept_variant_skips_the_recompute(bench, kept, calls):
    """tigon-kept: the layers keep_activations chose (all by default) run once a step, so their LoRA projections
    call lora_linear once; the others still recompute. The loss equals the tigon variant's."""
    a = bench.parse_args(["--smoke", "--child", "tigon-kept", "--seq", "16", "--keep-activations", str(kept)])
    model, opt, ids, report, _ = bench.build("tigon-kept", a, torch.device("cpu"))
    ref_args = bench.parse_args(["--smoke", "--child", "tigon", "--seq", "16"])
    ref, ref_opt, ref_ids, _, _ = bench.build("tigon", ref_args, torch.device("cpu"))
    try:
        assert "without the recompute" in report
        before = op_calls("lora_linear")
        loss = bench.step(model, opt, ids)
        assert op_calls("lora_linear") - before == calls
        assert torch.equal(loss, bench.step(ref, ref_opt, ref_ids))
    finally:
        tigon.unpatch(model)
        tigon.unpatch(ref)
