"""Quantized models on the fused decode step: QuantLinear projections (tigon.quantize, or a checkpoint adopted by
tigon.patch: bitsandbytes NF4, with or without PEFT LoRA adapters; GPTQ, AWQ, compressed-tensors and FP8 stand-ins)
decode through `_quantized_step`.

The reference of each case is the same model run by Hugging Face's own module forwards with its QuantLinear
modules (no patch; `tigon.quant.adopt` for the NF4 checkpoint) or, for the stand-ins (tests/quant/_formats.py,
whose forward is the product of the weight their tensors encode), with the checkpoint's modules: fp32 greedy
tokens must be equal. The fused step is proven to run by the quant_linear launches it makes (4 a layer and step
where q|k|v and gate|up stack, 7 for the module forwards). The code-MMA kernel (int4, 16-bit x) decodes a bf16
model to the tokens of the other kernels. Most quantize / NF4 cases run the reference ops (the
model plumbing is under test; the kernels are tests/ops' job), the stand-in checkpoints the interpreted kernels.
bitsandbytes' own CPU forward is not the reference: it differs from the product of its own dequantized weight by
~2% (tests/quant/test_importers_bnb.py checks the import). A projection adopt leaves alone (bitsandbytes 8-bit,
a GPTQ group size that does not divide K) keeps its layer on the module forwards, named in the patch report.
"""

import copy
import importlib
import logging

import pytest
import torch

import tigon
from tests.decode.test_prefill_graph import graphs  # noqa: F401 (a fixture: CPU stand-ins for the CUDA graphs)
from tests.hf._tiny import batch, op_calls, prompt_ids, tiny_model
from tests.ops.test_quant_code_mma import launches  # noqa: F401 (a fixture: the code-MMA kernel's launches)
from tigon import ops
from tigon.memory import RollingKVCache
from tigon.ops import _library
from tigon.quant import QuantLinear, adopt, quantize, release
from tigon.quant.stack import STACK, concat

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
LAYERS = 2


@pytest.fixture
def reference_path(monkeypatch):
    """Every op on its PyTorch reference, each call still counted in ops.dispatch_counts."""
    monkeypatch.setattr(_library, "use_kernels", lambda op, x: _library.record(op, "reference") or False)


def _tiny(model_type, **overrides):
    """A tiny random-init model on SDPA that generates every token asked for (no eos)."""
    model = tiny_model(model_type, attn_implementation="sdpa", **overrides).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _quantized(model_type, fmt, **overrides):
    return quantize(_tiny(model_type, **overrides), fmt, group_size=32)


def _greedy(model, ids, new, **kw):
    with torch.no_grad():
        return model.generate(ids, max_new_tokens=new, do_sample=False, **kw)


def _launches(per_layer, steps, prefill_per_layer=None):
    """quant_linear calls of a tigon.generate: `per_layer` a layer in the fused prefill (`prefill_per_layer` where
    it differs) and in each decode step (the same launches: stacked where the layouts stack)."""
    return LAYERS * (per_layer if prefill_per_layer is None else prefill_per_layer) + steps * LAYERS * per_layer


@pytest.mark.parametrize("model_type,fmt", [("llama", "int4"), ("llama", "fp8"), ("qwen2", "int4")],
                         ids=["int4", "fp8", "int4-qkv-bias"])
def test_generate_runs_the_fused_quantized_step(model_type, fmt, reference_path):
    ref = _quantized(model_type, fmt)
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    ids = prompt_ids(2, 6)
    want = _greedy(ref, ids, 4)
    before = op_calls("quant_linear")
    got = tigon.generate(patched, ids, max_new_tokens=4, cuda_graph=False)
    # the fused prefill and each of 3 decode steps: 4 launches a layer (q|k|v and gate|up stacked)
    assert op_calls("quant_linear") - before == _launches(4, 3)
    assert torch.equal(got, want)
    # HF's own generate over a RollingKVCache on the patched model: the same step
    before = op_calls("quant_linear")
    got = _greedy(patched, ids, 4, past_key_values=RollingKVCache(patched.config, batch_size=2, capacity=16))
    assert op_calls("quant_linear") - before == _launches(4, 3)
    assert torch.equal(got, want)


def test_sampling_and_stats_run_the_fused_quantized_step(reference_path):
    """Sampling (temperature, top-k, top-p, a seeded generator) and return_stats on a quantized model: the same fused
    step's launches, draws that repeat with the seed, top_k=1 equal to greedy, and the stats of every step."""
    patched = _quantized("llama", "int4")
    tigon.patch(patched)
    ids = prompt_ids(2, 6)
    kw = dict(max_new_tokens=4, cuda_graph=False, do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    before = op_calls("quant_linear")
    a, stats = tigon.generate(patched, ids, generator=torch.Generator().manual_seed(7), return_stats=True, **kw)
    assert op_calls("quant_linear") - before == _launches(4, 3)
    assert torch.equal(a, tigon.generate(patched, ids, generator=torch.Generator().manual_seed(7), **kw))
    assert not torch.equal(a, tigon.generate(patched, ids, generator=torch.Generator().manual_seed(8), **kw))
    assert stats["new_tokens"] == 4 and len(stats["step_s"]) == 3 and all(t > 0 for t in stats["step_s"])
    assert stats["ttft_s"] > 0 and stats["decode_tokens_per_s"] > 0
    greedy = tigon.generate(patched, ids, max_new_tokens=4, cuda_graph=False)
    one = tigon.generate(patched, ids, max_new_tokens=4, cuda_graph=False, do_sample=True, top_k=1, temperature=3.0,
                         generator=torch.Generator().manual_seed(0))
    assert torch.equal(one, greedy)


def test_layouts_that_do_not_stack_launch_apart(reference_path):
    """q_proj and gate_proj with an act-order permutation of their own: q, k, v launch one by one, gate and up
    too (their GLU after); the tokens stay the module forwards'."""
    ref = _quantized("llama", "int4")
    for layer in ref.model.layers:
        for m in (layer.self_attn.q_proj, layer.mlp.gate_proj):
            m.perm = torch.randperm(m.in_features, generator=torch.Generator().manual_seed(3))
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    ids = prompt_ids(1, 5)
    before, glu = op_calls("quant_linear"), op_calls("swiglu")
    got = tigon.generate(patched, ids, max_new_tokens=3, cuda_graph=False)
    assert op_calls("quant_linear") - before == _launches(3 + 1 + 2 + 1, 2)
    assert op_calls("swiglu") - glu == LAYERS * 3  # the prefill's and each decode step's glu_rows
    assert torch.equal(got, _greedy(ref, ids, 3))


def test_stack_follows_the_weights_and_unpatch_drops_it(reference_path):
    ref, other = _quantized("llama", "int4"), quantize(tiny_model("llama", seed=5).eval(), "int4", group_size=32)
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    ids = prompt_ids(1, 5)
    tigon.generate(patched, ids, max_new_tokens=2, cuda_graph=False)
    stacks = [layer.__dict__[STACK] for layer in patched.model.layers]
    patched.model.layers[0].load_state_dict(other.model.layers[0].state_dict())  # in place: new versions
    ref.model.layers[0].load_state_dict(other.model.layers[0].state_dict())
    assert torch.equal(tigon.generate(patched, ids, max_new_tokens=3, cuda_graph=False), _greedy(ref, ids, 3))
    assert patched.model.layers[0].__dict__[STACK] is not stacks[0]
    assert patched.model.layers[1].__dict__[STACK] is stacks[1]  # unchanged weights: built once
    tigon.unpatch(patched)
    assert not any(STACK in m.__dict__ for m in patched.modules())


def test_concat_joins_rows_where_one_layout_holds_them():
    from tigon.ops.quantized_weight import dequantize
    from tigon.quant import quantize_rtn

    g = torch.Generator().manual_seed(0)
    a, b = torch.randn(32, 64, generator=g), torch.randn(16, 64, generator=g)
    for kind, group in (("int4", 32), ("nf4", 16), ("fp8", 16), ("fp8", 0)):
        qa, qb = (quantize_rtn(w, kind, group, dtype=torch.float32) for w in (a, b))
        joined = concat([qa, qb], torch.bfloat16)
        assert joined.shape == (48, 64) and joined.dtype == torch.bfloat16
        assert torch.equal(dequantize(joined), torch.cat([dequantize(qa), dequantize(qb)]))
    qa, qb = (quantize_rtn(w, "fp8", 32, dtype=torch.float32) for w in (b, a))
    assert concat([qa, qb], torch.float32) is None  # 16 rows would split a 32 x 32 block
    qa, qb = quantize_rtn(a, "int4", 32, dtype=torch.float32), quantize_rtn(b, "int4", 16, dtype=torch.float32)
    assert concat([qa, qb], torch.float32) is None  # group sizes differ


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter on CPU tensors; a GPU runs the kernels in tests/ops/test_quant_linear.py")
def test_interpreted_kernels_decode_int4():
    """The Triton kernels (the interpreter on CPU): rms_norm_rows, quant_linear's GEMV and the decode step."""
    ref = _quantized("llama", "int4")
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    ids = prompt_ids(1, 5)
    want = _greedy(ref, ids, 3)
    before = ops.dispatch_counts[("quant_linear", "triton")]
    got = tigon.generate(patched, ids, max_new_tokens=3, cuda_graph=False)
    assert ops.dispatch_counts[("quant_linear", "triton")] - before == _launches(4, 2)
    assert torch.equal(got, want)


@pytest.mark.skipif(torch.cuda.is_available(),
                    reason="the interpreter on CPU tensors; a GPU runs the kernel in tests/ops/test_quant_code_mma.py")
def test_interpreted_code_mma_kernel_decodes_int4(monkeypatch, launches):  # noqa: F811
    """Every quant_linear launch of tigon.generate on the code-MMA kernel (the fused prefill's GEMMs over 10 rows,
    each step's GEMVs over 2), forced by the default config, on a bf16 model whose K are whole steps of 128: the
    greedy tokens of the FMA and dot kernels' run. Both sum the same exact products in fp32, in other orders."""
    ql = importlib.import_module("tigon.ops.quant_linear")
    model = _quantized("llama", "int4", hidden_size=128, intermediate_size=256, head_dim=32).bfloat16()
    tigon.patch(model)
    ids = prompt_ids(2, 5)
    want = tigon.generate(model, ids, max_new_tokens=3, cuda_graph=False)
    assert not launches  # the default launches: the FMA and dot kernels
    monkeypatch.setattr(ql, "_DEFAULT_CONFIG", ops.QuantLinearConfig(code_mma=1))
    assert torch.equal(tigon.generate(model, ids, max_new_tokens=3, cuda_graph=False), want)
    assert len(launches) == _launches(4, 2)


def test_a_quantized_layer_refuses_a_gradient_and_an_adopted_one_trains_through_its_original():
    model = _quantized("llama", "int4")
    q = model.model.layers[0].self_attn.q_proj
    x = torch.randn(2, 64, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"QuantLinear model.layers.0.self_attn.q_proj\(.*no backward"):
        q(x)
    with torch.no_grad():
        assert q(x).shape == (2, 64)
    original = torch.nn.Linear(64, 64)
    object.__setattr__(q, "original", original)  # as adopt sets it: the module runs where grads are wanted
    assert torch.equal(q(x), original(x)) and q(x).requires_grad
    q.train()  # training mode: the original's forward even for an input without grad (its weights may want one)
    assert torch.equal(q(x.detach()), original(x.detach()))
    q.eval()
    y = q(x.detach())
    assert not y.requires_grad and torch.equal(y, ops.quant_linear(x.detach(), q.quantized_weight))


def test_patch_argument_checks():
    model = tiny_model("llama")
    with pytest.raises(TypeError, match="tigon.patch: quantized must be True, False or 'auto'"):
        tigon.patch(model, quantized="yes")
    with pytest.raises(ValueError, match="tigon.patch: quantized=True swaps a model instance's"):
        tigon.patch(model_type="llama", quantized=True)
    assert "quantized" in str(__import__("inspect").signature(tigon.patch))


# -- bitsandbytes NF4 checkpoints (CPU backend of bitsandbytes >= 0.48) ------------------------------------------

@pytest.fixture(scope="module")
def nf4_path(tmp_path_factory):
    bnb = pytest.importorskip("bitsandbytes")
    pytest.importorskip("peft")
    w = torch.randn(64, 128)
    try:
        packed, state = bnb.functional.quantize_4bit(w, quant_type="nf4")
        bnb.functional.dequantize_4bit(packed, state)
    except Exception as e:  # a build without a CPU backend raises from its native library
        pytest.skip(f"bitsandbytes {bnb.__version__} cannot run NF4 on the CPU: {type(e).__name__}: {e}")
    path = tmp_path_factory.mktemp("nf4") / "base"
    # rows a multiple of bnb's 64-code block (tests/hf/test_qlora.py says why)
    tiny_model("llama", intermediate_size=128, attn_implementation="sdpa").save_pretrained(path)
    return path


def _nf4(path, lora=False):
    import peft
    import transformers

    config = transformers.BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                             bnb_4bit_compute_dtype=torch.float32)
    model = transformers.AutoModelForCausalLM.from_pretrained(path, quantization_config=config, device_map="cpu",
                                                              dtype=torch.float32)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    if lora:  # the QLoRA recipe, the adapters made to matter
        model = peft.prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(PROJECTIONS),
                                                           lora_dropout=0.0))
        with torch.no_grad():
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.1)
    return model.eval()


def _adopted_greedy(model, ids, new):
    """The model's tokens on its module forwards with the checkpoint's projections as QuantLinear (no patch)."""
    assert len(adopt(model)) == LAYERS * len(PROJECTIONS)
    try:
        return _greedy(model, ids, new)
    finally:
        release(model)


def test_nf4_checkpoint_adopted_by_patch_and_put_back_by_unpatch(nf4_path, reference_path):
    model = _nf4(nf4_path)
    modules = dict(model.named_modules())
    ids = prompt_ids(2, 6)
    want = _adopted_greedy(model, ids, 4)
    assert not tigon.patch(model).replaced.get("QuantLinear (quantized projections: tigon.ops.quant_linear)")
    tigon.unpatch(model)  # the default leaves a checkpoint's modules
    base = tigon.patch(model, quantized="auto")  # no adapters: a QLoRA base, which "auto" leaves to get_peft_model
    assert "quantized projections" in dict(base.skipped)
    assert type(model.model.layers[0].self_attn.q_proj) is not QuantLinear
    tigon.unpatch(model)
    report = tigon.patch(model, quantized=True)  # serving it fused
    try:
        assert report.replaced["QuantLinear (quantized projections: tigon.ops.quant_linear)"] == 14
        assert type(model.model.layers[0].self_attn.q_proj) is QuantLinear
        before = op_calls("quant_linear")
        got = tigon.generate(model, ids, max_new_tokens=4, cuda_graph=False)
        assert op_calls("quant_linear") - before == _launches(4, 3)
    finally:
        tigon.unpatch(model)
    assert torch.equal(got, want)
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(m is modules[n] for n, m in model.named_modules())  # the checkpoint's own modules, not copies


def test_qlora_model_generates_fused_and_trains_as_unpatched(nf4_path, reference_path):
    model = _nf4(nf4_path, lora=True)
    ids, labels = batch()
    model.train()
    loss_ref = model(input_ids=ids, labels=labels).loss
    loss_ref.backward()
    grads_ref = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)

    report = tigon.patch(model, quantized="auto")  # trainable adapters: a QLoRA run, left on the checkpoint's modules
    assert any(piece == "quantized projections" for piece, _ in report.skipped)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())
    tigon.unpatch(model)

    report = tigon.patch(model, quantized=True)
    try:
        assert report.replaced["QuantLinear (quantized projections: tigon.ops.quant_linear)"] == 14
        adds = op_calls("lora_add")
        loss = model(input_ids=ids, labels=labels).loss  # QuantLinear runs the bnb module: training unchanged
        loss.backward()
        assert op_calls("lora_add") - adds == LAYERS * len(PROJECTIONS)  # hf.lora sees through to the original
        torch.testing.assert_close(loss, loss_ref, rtol=1e-5, atol=0)
        for n, p in model.named_parameters():
            if p.requires_grad:
                torch.testing.assert_close(p.grad, grads_ref[n], rtol=1e-4, atol=1e-6)
        model.eval()
        gen_ids = prompt_ids(2, 6)
        tigon.unpatch(model)
        want = _adopted_greedy(model, gen_ids, 4)  # PEFT's forward over QuantLinear base layers, unpatched
        tigon.patch(model, quantized=True)
        before, adds = op_calls("quant_linear"), op_calls("lora_add")
        got = tigon.generate(model, gen_ids, max_new_tokens=4, cuda_graph=False)
        assert op_calls("quant_linear") - before == _launches(4, 3)
        assert op_calls("lora_add") - adds == 7 * LAYERS * 4  # every adapter, the prefill's and each step's
    finally:
        tigon.unpatch(model)
    assert torch.equal(got, want)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["int4", "fp8"])
def test_gpu_bf16_quantized_decode_close_to_hf(fmt):
    """bf16 on the GPU: the stacked launches split K differently from the per-module ones, so the first tokens
    and the graph replay are compared, not every token."""
    ref = _quantized("llama", fmt).cuda().bfloat16()
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    ids = prompt_ids(2, 9).cuda()
    want = _greedy(ref, ids, 3)
    before = ops.dispatch_counts[("quant_linear", "triton")]
    got = tigon.generate(patched, ids, max_new_tokens=3, cuda_graph=False)
    assert ops.dispatch_counts[("quant_linear", "triton")] - before == _launches(4, 2)
    assert torch.equal(got[:, :9], want[:, :9])
    # the first new token: Tigon's fused bf16 norms and attention round apart from HF's eager modules, so on this
    # random-init model a near tie may go either way; the token taken must be within bf16 rounding of HF's best
    with torch.no_grad():
        logits = ref(ids).logits[:, -1].float()
    gap = logits.max(-1).values - logits.gather(1, got[:, 9:10]).squeeze(1)
    assert (gap <= 2 ** -6 * logits.abs().max(-1).values).all(), (gap, got[:, 9], want[:, 9])
    assert torch.equal(tigon.generate(patched, ids, max_new_tokens=12, cuda_graph=False),
                       tigon.generate(patched, ids, max_new_tokens=12))


@pytest.mark.parametrize("model_type,fmt", [("llama", "int4"), ("llama", "fp8"), ("qwen3", "int4")],
                         ids=["int4", "fp8", "int4-qk-norm"])
def test_quantized_prefill_records_and_replays_a_graph(graphs, model_type, fmt, reference_path):  # noqa: F811
    """A quantized model's first prompt chunk runs the fused prefill step on every layer, so tigon.generate records
    it (the CPU stand-in for the CUDA graph) and replays it for a prompt of the same bucket; tokens equal the module
    forwards' (Qwen3: the q/k norms over the stacked launch's query rows, the last real row kept)."""
    from tests.decode.test_prefill_graph import SMALL, _ids

    ref = _quantized(model_type, fmt)
    patched = copy.deepcopy(ref)
    tigon.patch(patched)
    for p, seed, how in ((6, 1, "recorded"), (5, 2, "replayed")):
        ids = _ids(2, p, seed)
        got, stats = tigon.generate(patched, ids, max_new_tokens=2, return_stats=True, settings=SMALL)
        assert stats["prefill_graph"] == how
        assert torch.equal(got, _greedy(ref, ids, 2))
    tigon.decode.release(patched)


def test_gpu_quantized_prefill_replays_as_the_eager_one():
    """A real CUDA graph over a quantized model's prefill (quant_linear's dequantize-then-cuBLAS path from 256
    rows): a recorded call, then replays of other prompts in its bucket, greedy tokens equal to the eager
    prefill's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    from tigon.decode import DecodeSettings

    model = tiny_model("llama", attn_implementation="sdpa", max_position_embeddings=512).eval()
    model = model.to("cuda", torch.bfloat16)
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    model = quantize(model, "int4", group_size=32)
    tigon.patch(model)
    off = DecodeSettings(prefill_graphs=0)
    for p, how in ((300, "recorded"), (290, "replayed"), (40, "recorded")):
        ids = torch.randint(1, 131, (1, p), generator=torch.Generator().manual_seed(p)).cuda()
        got, stats = tigon.generate(model, ids, max_new_tokens=4, return_stats=True, settings=DecodeSettings())
        want = tigon.generate(model, ids, max_new_tokens=4, settings=off)
        assert stats["prefill_graph"] == how and torch.equal(got, want), p
    tigon.decode.release(model)


# -- checkpoints of each imported format (synthetic stand-ins, tests/quant/_formats.py) --------------------------

def _fp8_channel(n, k, seed):
    """compressed-tensors FP8: one scale an output channel, the module's quantization_scheme naming the format."""
    import types

    from tests.quant import _formats

    m, w = _formats.fp8(n, k, block=None, scale_name="weight_scale", scale_shape=(n, 1), scale_dtype=torch.bfloat16,
                        seed=seed)
    m.quantization_scheme = types.SimpleNamespace(weights=types.SimpleNamespace(num_bits=8, type="float"))
    return m, w


def _stand_in(fmt, n, k, seed):
    """A `fmt` checkpoint module [n, k] (tests/quant/_formats.py): int4 in groups of 32; transformers' finegrained
    FP8 in 32 x 32 or 64 x 64 blocks; compressed-tensors FP8 with a scale a channel."""
    from tests.quant import _formats

    if fmt.startswith("gptq"):
        return _formats.gptq(n, k, 32, act_order="act-order" in fmt, seed=seed, bias=False)
    return {"awq": lambda: _formats.awq(n, k, 32, seed=seed),
            "ct-int4": lambda: _formats.compressed_int4(n, k, 32, symmetric=False, seed=seed),
            "fp8-blocks": lambda: _formats.fp8(n, k, block=(32, 32), seed=seed),
            "fp8-blocks-64": lambda: _formats.fp8(n, k, block=(64, 64), seed=seed),
            "ct-fp8": lambda: _fp8_channel(n, k, seed)}[fmt]()


def _checkpoint(fmt, odd=None):
    """A tiny Llama whose projections are `fmt` stand-ins (distinct codes for each), as a loader builds them;
    `odd` {projection name: module} puts other modules in their place."""
    model = _tiny("llama")
    for i in range(LAYERS):
        for j, proj in enumerate(PROJECTIONS):
            name = f"model.layers.{i}.{'self_attn' if j < 4 else 'mlp'}.{proj}"  # q, k, v, o first
            module = (odd or {}).get(name)
            if module is None:
                lin = model.get_submodule(name)
                module, _ = _stand_in(fmt, lin.out_features, lin.in_features, seed=10 * i + j)
            model.set_submodule(name, module.eval())
    return model


def _tensors(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


def _given_back(model, modules, tensors):
    """The model holds the same module objects as before the patch (not copies), with the same tensors."""
    assert dict(model.named_modules()).keys() == modules.keys()
    assert all(m is modules[n] for n, m in model.named_modules())
    after = model.state_dict()
    assert after.keys() == tensors.keys() and all(torch.equal(after[k], tensors[k]) for k in after)


def _shared_act_order(monkeypatch):
    """GPTQ's act-order sorts a projection's input columns by the Hessian diagonal of its input, which the
    projections of one input share: one g_idx for every stand-in of a given K (q, k, v, o, gate, up; down its own),
    the codes still each stand-in's own."""
    from tests.quant import _formats

    drawn, groups = {}, _formats._groups
    monkeypatch.setattr(_formats, "_groups", lambda k, gs, act_order, gen: drawn.setdefault(
        (k, gs, act_order), groups(k, gs, act_order, gen)))


# quant_linear launches a layer per step (the fused prefill the same), from `_quantized_step`'s docstring: q|k|v
# one launch, o_proj one, gate|up one (the GLU in its epilogue), down_proj one = 4 where the layouts stack
# (`concat`: same kind, group size, zero points and act-order perm, fp8 blocks not split by a part's rows); with a
# perm of each projection's own q, k, v launch one by one (3), o 1, gate and up one by one (2, glu_rows after),
# down 1 = 7. FP8 in 32 x 32 blocks: every part a whole number of blocks, 4. In 64 x 64 blocks: q, k, v (64 x 64,
# 32 x 64) hold one block each, a single scale the importer reads as one a tensor (per channel, block 0), so they
# stack (1); o 1; gate's 96 rows would split a block, so gate and up launch apart (2); down 1 = 5.
CHECKPOINTS = {"gptq": 4, "gptq-act-order": 4, "gptq-act-order-unshared": 7, "awq": 4, "ct-int4": 4,
               "fp8-blocks": 4, "fp8-blocks-64": 5, "ct-fp8": 4}


@pytest.mark.parametrize("fmt", list(CHECKPOINTS))
def test_checkpoint_format_decodes_fused_and_unpatch_gives_it_back(fmt, monkeypatch):
    """A checkpoint of each imported format: tigon.patch(quantized=True) adopts every projection, tigon.generate
    runs the fused quantized step on each layer (the interpreted kernels on a CPU) with HF's greedy tokens over the
    checkpoint modules' own forwards, and unpatch puts back the same modules, their tensors untouched."""
    if fmt == "gptq-act-order":
        _shared_act_order(monkeypatch)
    model = _checkpoint(fmt)
    modules, tensors = dict(model.named_modules()), _tensors(model)
    ids = prompt_ids(2, 6)
    want = _greedy(model, ids, 3)
    report = tigon.patch(model, quantized=True)
    try:
        assert report.replaced["QuantLinear (quantized projections: tigon.ops.quant_linear)"] == 14
        assert not [piece for piece, _ in report.skipped if piece.startswith("quantized")]
        q, k = (model.get_submodule(f"model.layers.0.self_attn.{p}").perm for p in ("q_proj", "k_proj"))
        assert (q is not None) == ("act-order" in fmt)
        assert (q is not None and torch.equal(q, k)) == (fmt == "gptq-act-order")  # one perm: q|k|v stack
        before, glu = op_calls("quant_linear"), op_calls("swiglu")
        got = tigon.generate(model, ids, max_new_tokens=3, cuda_graph=False)
        assert op_calls("quant_linear") - before == _launches(CHECKPOINTS[fmt], 2)
        # the GLU in gate|up's epilogue where they stack, else glu_rows in the prefill and each decode step
        assert op_calls("swiglu") - glu == (0 if CHECKPOINTS[fmt] == 4 else LAYERS * 3)
        assert all(STACK in layer.__dict__ for layer in model.model.layers)
        stack = model.model.layers[0].__dict__[STACK]
        assert [stack.qkv.stacked, stack.gate_up.stacked] == [CHECKPOINTS[fmt] in (4, 5), CHECKPOINTS[fmt] == 4]
    finally:
        tigon.unpatch(model)
    assert torch.equal(got, want)
    _given_back(model, modules, tensors)


def _gptq_partial_group(n, k, group_size, seed):
    """A GPTQ stand-in whose group size does not divide K: ceil(K / group_size) groups, the last one short."""
    from tests.quant import _formats

    gen = torch.Generator().manual_seed(seed)
    groups, g_idx = -(-k // group_size), torch.arange(k) // group_size
    q = torch.randint(0, 16, (k, n), generator=gen)
    z = torch.randint(1, 16, (groups, n), generator=gen)
    s = (torch.rand(groups, n, generator=gen) * 0.02 + 0.005).half()
    m = _formats.TorchQuantLinear()
    m.bits, m.group_size, m.fmt = 4, group_size, 2
    m.register_buffer("qweight", _formats.pack(q, 0))
    m.register_buffer("qzeros", _formats.pack(z, 1))
    m.register_buffer("scales", s)
    m.register_buffer("g_idx", g_idx.to(torch.int32))
    m._finish(((q - z[g_idx]).float() * s.float()[g_idx]).T.contiguous(), n, k, None)
    return m


def _bnb_int8(n, k, seed):
    """bitsandbytes' own Linear8bitLt, quantized from a full-precision weight as load_in_8bit does."""
    bnb = pytest.importorskip("bitsandbytes")
    torch.manual_seed(seed)
    m = bnb.nn.Linear8bitLt(k, n, bias=False, has_fp16_weights=False, threshold=0.0)
    m.load_state_dict(torch.nn.Linear(k, n, bias=False).state_dict())
    try:
        m = m.to("cpu")  # the int8 quantization runs on the move
        with torch.no_grad():
            m(torch.randn(1, k))
    except Exception as e:  # a build without a CPU backend raises from its native library
        pytest.skip(f"bitsandbytes {bnb.__version__} cannot run 8-bit on the CPU: {type(e).__name__}: {e}")
    return m


# the module no importer takes, where it sits, and the reason adopt gives
FALLBACKS = {
    "no-importer": ("model.layers.0.self_attn.k_proj", lambda: _bnb_int8(32, 64, 1),
                    "format 'bnb8' (Linear8bitLt) has no importer"),
    "refused": ("model.layers.0.mlp.down_proj", lambda: _gptq_partial_group(64, 96, 64, 1),
                "tigon.quant.import_gptq: group_size 64 and 2 scale rows do not cover in_features 96"),
}


@pytest.mark.parametrize("case", list(FALLBACKS))
def test_a_projection_no_importer_takes_leaves_its_layer_on_the_module_forwards(case, caplog):
    """A GPTQ checkpoint with one projection adopt cannot take (bitsandbytes 8-bit: no importer; a GPTQ group size
    that does not divide K: refused): patch reports it by name and reason, its layer runs the modules' own forwards
    (the other six adopted, each its own quant_linear launch), the other layer the fused step; HF's greedy
    tokens."""
    name, build, reason = FALLBACKS[case]
    odd = build()
    model = _checkpoint("gptq", odd={name: odd})
    modules, tensors = dict(model.named_modules()), _tensors(model)
    ids = prompt_ids(2, 6)
    want = _greedy(model, ids, 3)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        report = tigon.patch(model, quantized=True)
    calls = []
    hook = odd.register_forward_hook(lambda *args: calls.append(1))
    try:
        assert [(p, r) for p, r in report.skipped if p.startswith("quantized")] == [(f"quantized {name}", reason)]
        assert f"{name}: {reason}" in caplog.text
        assert report.replaced["QuantLinear (quantized projections: tigon.ops.quant_linear)"] == 13
        assert model.get_submodule(name) is odd
        before = op_calls("quant_linear")
        got = tigon.generate(model, ids, max_new_tokens=3, cuda_graph=False)
        # the prefill and 2 decode steps: layer 0 on its module forwards (six QuantLinear launches and the odd
        # module's own forward each time), layer 1 on the fused step (4 launches)
        assert len(calls) == 3
        assert op_calls("quant_linear") - before == 3 * (6 + 4)
        assert STACK not in model.model.layers[0].__dict__ and STACK in model.model.layers[1].__dict__
    finally:
        hook.remove()
        tigon.unpatch(model)
    assert torch.equal(got, want)
    _given_back(model, modules, tensors)
