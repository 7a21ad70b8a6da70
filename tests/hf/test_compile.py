"""torch.compile over a patched model: training (forward + backward with labels) and evaluation match the eager
patched model, with fullgraph on and off, under PEFT LoRA and through the Trainer's torch_compile=True.

On CPU the backend is aot_eager (dynamo + AOTAutograd, the same graphs inductor gets, without its C++ build):
the Tigon ops run through Triton's interpreter as one custom-op node each. On a GPU the same checks run with
inductor (the marked test at the end).

Bounds: the compiled and the eager step run the same kernels (the one-node MLP included: its autograd.Function is
traced, its GLU pass two custom ops); what may change is the fusion around them, so the order of fp32 sums.
Each result must be within 2x the error of the eager patched model against an fp64 run of the same model, plus
8 fp32 (or 4 bf16) ulps of its magnitude: the house rule "err(new) <= 2 * err(yardstick) + eps".
"""

import copy
import sys

import pytest
import torch

import tigon
from tests.hf._tiny import batch, kernel_funcs_set_aside, tiny_model
from tigon.hf import causal_lm

U = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8}
CPU_BACKEND = "aot_eager"


def _step(model, ids, labels):
    """(loss, {name: grad}) of one training step."""
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    assert out.logits is None  # the fused loss ran: no [tokens, vocab] logits
    out.loss.backward()
    return out.loss.detach(), _grads(model)


def _grads(model):
    """{name: grad}, named as in the model torch.compile wrapped (OptimizedModule adds `_orig_mod.`)."""
    return {n.removeprefix("_orig_mod."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids, use_cache=False).logits


def _err(a, b):
    return (a.double() - b.double()).abs().max().item()


def _assert_within(name, got, eager, exact, dtype=torch.float32):
    """err(got vs exact) <= 2 * err(eager vs exact) + ulps * max|exact| (see the module docstring)."""
    ulps = 8 if dtype == torch.float32 else 4
    bound = 2 * _err(eager, exact) + ulps * U[dtype] * exact.abs().max().item()
    e = _err(got, exact)
    assert e <= bound, f"{name}: error {e:.3g} against fp64 over the bound {bound:.3g}"


def _exact_step(model, ids, labels):
    """The fp64 step of the unpatched model: the exact reference."""
    ref = copy.deepcopy(model).double()
    ref.train()
    return _step_hf(ref, ids, labels)


def _step_hf(model, ids, labels):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    return out.loss.detach(), _grads(model)


def _check_step(got, eager, exact):
    (loss, grads), (loss_e, grads_e), (loss_x, grads_x) = got, eager, exact
    _assert_within("loss", loss, loss_e, loss_x)
    assert grads.keys() == grads_e.keys() == grads_x.keys()
    for n in grads:
        _assert_within(f"grad {n}", grads[n], grads_e[n], grads_x[n])


def _tiny(model_type, **kw):
    # One layer, one short row: the interpreter runs every kernel program (~1 ms each) and dynamo traces the
    # model three times (forward, joint backward, eval); two layers would only repeat the first one's graph.
    return tiny_model(model_type, num_hidden_layers=1, **kw)


IDS, LABELS = batch(b=1, t=6, ignore_tail=1)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_compiled_patched_model_trains_and_evaluates_like_eager(model_type):
    """fullgraph=True: no graph break anywhere in the patched forward, the fused loss and its backward included
    (fullgraph=False then compiles the same single graph; the PEFT and Trainer tests below run it)."""
    torch._dynamo.reset()
    base = _tiny(model_type)
    exact = _exact_step(base, IDS, LABELS)
    with torch.no_grad():
        logits_exact = copy.deepcopy(base).double().eval()(input_ids=IDS, use_cache=False).logits
    model = copy.deepcopy(base)
    tigon.patch(model)
    model.train()
    calls = []
    # The loss runs inside lm_head's own call, compiled too: its forward pre-hook (where FSDP2 all-gathers a
    # sharded weight) fires once per step.
    model.lm_head.register_forward_pre_hook(lambda module, args: calls.append(type(module).__name__))
    eager = _step(model, IDS, LABELS)
    compiled = torch.compile(model, backend=CPU_BACKEND, fullgraph=True)
    _check_step(_step(compiled, IDS, LABELS), eager, exact)
    assert calls == ["LossHeadLinear", "LossHeadLinear"]
    # The lm_head's loss forward is its class's, set by patch() and never changed per call (nothing for dynamo to
    # replay); tigon.unpatch sets nn.Linear back (test_lm_head_forward_survives_copies_and_unpatch).
    assert type(model.lm_head) is causal_lm.LossHeadLinear and "forward" not in model.lm_head.__dict__
    model.eval()
    logits_eager = _logits(model, IDS)
    _assert_within("eval logits", _logits(compiled, IDS), logits_eager, logits_exact)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_dynamic_shapes_fullgraph_trains_like_eager(model_type):
    """dynamic=True: the sequence length symbolic and the ops' float arguments SymFloats; one graph for two lengths,
    each step as the eager patched model's."""
    torch._dynamo.reset()
    base = _tiny(model_type)
    model = copy.deepcopy(base)
    tigon.patch(model)
    compiled = torch.compile(model, backend=CPU_BACKEND, dynamic=True, fullgraph=True)
    for t in (6, 9):
        ids, labels = batch(b=1, t=t, ignore_tail=1)
        exact = _exact_step(base, ids, labels)
        _check_step(_step(compiled, ids, labels), _step(model, ids, labels), exact)


def test_lm_head_forward_survives_copies_and_unpatch():
    """patch() gives the lm_head its loss forward once (a plain nn.Linear becomes causal_lm.LossHeadLinear); a
    deepcopy and a pickled copy keep it and compute the same loss; without the keyword it is nn.Linear's forward
    (the logits); unpatch sets nn.Linear back."""
    import io
    import pickle

    model = _tiny("llama")
    tigon.patch(model)
    model.train()
    loss = model(input_ids=IDS, labels=LABELS).loss
    buf = io.BytesIO()
    with kernel_funcs_set_aside(model):
        torch.save(model, buf)
        pickled = pickle.dumps(model)
    buf.seek(0)
    for copy_ in (copy.deepcopy(model), torch.load(buf, weights_only=False), pickle.loads(pickled)):
        assert type(copy_.lm_head) is causal_lm.LossHeadLinear and causal_lm.has_loss_forward(copy_.lm_head)
        torch.testing.assert_close(copy_(input_ids=IDS, labels=LABELS).loss, loss, rtol=0, atol=0)
    hidden = torch.randn(2, model.config.hidden_size)
    assert torch.equal(model.lm_head(hidden), torch.nn.functional.linear(hidden, model.lm_head.weight))
    tigon.unpatch(model)
    assert type(model.lm_head) is torch.nn.Linear and not causal_lm.has_loss_forward(model.lm_head)


def test_compiled_class_patched_model_before_any_eager_step():
    """A class-level patch compiled before any eager call: the lm_head has no loss forward yet and none may be set
    inside the trace, so the compiled step computes the loss from the weight directly, with fullgraph; the first
    eager step then installs the forward."""
    torch._dynamo.reset()
    base = _tiny("llama")
    exact = _exact_step(base, IDS, LABELS)
    tigon.patch(model_type="llama")
    try:
        model = _tiny("llama")
        model.load_state_dict(base.state_dict())
        model.train()
        got = _step(torch.compile(model, backend=CPU_BACKEND, fullgraph=True), IDS, LABELS)
        assert type(model.lm_head) is torch.nn.Linear  # nothing installed inside the trace
        eager = _step(model, IDS, LABELS)
        assert causal_lm.has_loss_forward(model.lm_head)
    finally:
        tigon.unpatch(model_type="llama")
    _check_step(got, eager, exact)


@pytest.mark.parametrize("partition", ["default", "min_cut"])
def test_compiled_patched_mlp_is_the_one_node_op(partition):
    """Under torch.compile the patched MLP is still the one-node op (ops.swiglu_mlp): the forward graph computes the
    GLU product h but does not hand it to the backward (the three-Linear path saves it for down_proj's weight
    gradient: one [tokens, I] activation a layer, ~4 GiB at the 1.5B e2e shape), and the backward graph
    recomputes it in its gradient pass (tigon.glu_bwd_and_y). min_cut is inductor's partitioner: it does not
    recompute custom ops, so a backward glu_fwd equal to the forward's (merged as a common subexpression) made it
    keep h, 16 x 256 MiB at that shape."""
    from functorch.compile import default_partition, make_boxed_func, min_cut_rematerialization_partition
    from torch._dynamo.backends.common import aot_autograd

    torch._dynamo.reset()
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    partition_fn = {"default": default_partition, "min_cut": min_cut_rematerialization_partition}[partition]
    # On a CUDA machine CPU tensors take the reference ops (no kernels, no custom-op nodes): run there on the GPU.
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    model = _tiny("llama").to(dev)
    tigon.patch(model)
    model.train()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=partition_fn)
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    compiled(input_ids=IDS.to(dev), labels=LABELS.to(dev)).loss.backward()
    forward, backward = graphs

    def nodes(gm, op):
        return [n for n in gm.graph.nodes if n.target is op]

    layers = model.config.num_hidden_layers
    hs = nodes(forward, torch.ops.tigon.glu_fwd.default)
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    assert len(hs) == layers and not any(h in output.all_input_nodes for h in hs)  # h is not saved
    assert not nodes(backward, torch.ops.tigon.glu_fwd.default)
    assert len(nodes(backward, torch.ops.tigon.glu_bwd_and_y.default)) == layers  # the backward recomputes it


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the mask function's name is read from __code__.co_qualname "
                    "(Python >= 3.11); on 3.10 a compiled forward keeps HF's dense mask")
def test_compiled_patched_model_attends_causally_without_a_mask():
    """Compiled, HF's own mask builder materializes the causal [B, 1, T, T] mask (transformers skips it only when
    not tracing), which takes SDPA's causal tile skipping away: on the H200 the 1.5B step's attention took 67 ms
    compiled against 27 ms eager. Under "tigon" attention the compiled layers call SDPA with is_causal and no
    mask, as the eager ones do."""
    torch._dynamo.reset()
    calls = []

    def keep(gm, _inputs):
        calls.extend(n for n in gm.graph.nodes if n.target is torch.nn.functional.scaled_dot_product_attention)
        return gm.forward

    model = _tiny("llama")
    model.config._attn_implementation = "sdpa"
    tigon.patch(model, attention=True)
    model.train()
    torch.compile(model, backend=keep, fullgraph=True)(input_ids=IDS, labels=LABELS).loss.backward()
    assert len(calls) == model.config.num_hidden_layers
    assert all(n.kwargs.get("attn_mask") is None and n.kwargs.get("is_causal") is True for n in calls), \
        [n.kwargs for n in calls]


def test_compiled_patched_model_trains_without_a_cache_under_fullgraph():
    """config.use_cache False (TRL sets it with gradient checkpointing): HF then looks for packed rows in the
    position ids and, while dynamo traces, hands the mask builder an AND of the causal and packed-sequence
    functions, whose closure dynamo cannot read. "tigon" leaves that mask to HF instead of failing the trace, and
    the compiled step equals the eager one."""
    torch._dynamo.reset()
    model = _tiny("llama")
    model.config._attn_implementation = "sdpa"
    model.config.use_cache = False
    exact = _exact_step(model, IDS, LABELS)
    tigon.patch(model, attention=True)
    model.train()
    eager = _step(model, IDS, LABELS)
    _check_step(_step(torch.compile(model, backend=CPU_BACKEND, fullgraph=True), IDS, LABELS), eager, exact)


def test_compiled_peft_lora_on_patched_model():
    """PEFT LoRA adapters on the patched model, compiled without fullgraph (as PEFT users compile): the adapters'
    gradients match eager and the fp64 run within the bound."""
    peft = pytest.importorskip("peft")
    torch._dynamo.reset()
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj", "down_proj"],
                          lora_dropout=0.0)
    model = peft.get_peft_model(_tiny("llama"), cfg)
    with torch.no_grad():  # LoRA B starts at zero: make the adapters matter
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0.0, 0.1)
    exact = _exact_step(model, IDS, LABELS)
    tigon.patch(model)
    model.train()
    eager = _step(model, IDS, LABELS)
    assert len(eager[1]) == 8 and all("lora_" in n for n in eager[1])  # A and B of 4 projections
    _check_step(_step(torch.compile(model, backend=CPU_BACKEND), IDS, LABELS), eager, exact)


def test_trainer_torch_compile_two_steps(tmp_path):
    """TrainingArguments(torch_compile=True) over a patched model: two steps whose losses match HF's eager
    Trainer (the unpatched model; patched vs HF is bounded in test_patch.py, this checks the compiled path)."""
    transformers = pytest.importorskip("transformers")
    torch._dynamo.reset()
    data = [{"input_ids": IDS[0], "labels": LABELS[0]}] * 2

    def run(patched, out):
        model = _tiny("llama")
        if patched:
            tigon.patch(model)
        args = transformers.TrainingArguments(
            output_dir=str(tmp_path / out), max_steps=2, per_device_train_batch_size=1, learning_rate=1e-3,
            logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
            dataloader_num_workers=0, torch_compile=patched, torch_compile_backend=CPU_BACKEND,
        )
        trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
        trainer.train()
        return torch.tensor([h["loss"] for h in trainer.state.log_history if "loss" in h]), trainer

    compiled, trainer = run(True, "compiled")
    hf, _ = run(False, "hf")
    assert isinstance(trainer.model_wrapped, torch._dynamo.eval_frame.OptimizedModule)
    assert len(compiled) == 2
    # The Trainer logs losses rounded to 4 significant digits (rtol 5e-4 of rounding); step 2 follows one AdamW
    # step of lr 1e-3 from gradients equal within fp32 summation order.
    torch.testing.assert_close(compiled, hf, rtol=1e-3, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="inductor over the Triton kernels needs a CUDA device")
@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
@pytest.mark.parametrize("fullgraph", [True, False])
def test_inductor_compiled_patched_model_bf16_gpu(model_type, fullgraph):
    """The H200 case: bf16 weights, sdpa attention, inductor, fullgraph on and off; training step and eval."""
    torch._dynamo.reset()
    base = _tiny(model_type, attn_implementation="sdpa")
    ids, labels = IDS, LABELS
    exact = _exact_step(base, ids, labels)
    with torch.no_grad():
        logits_exact = copy.deepcopy(base).double().eval()(input_ids=ids, use_cache=False).logits
    model = copy.deepcopy(base).to("cuda", torch.bfloat16)
    ids, labels = ids.cuda(), labels.cuda()
    tigon.patch(model)
    model.train()
    eager = _step(model, ids, labels)
    got = _step(torch.compile(model, fullgraph=fullgraph), ids, labels)
    exact = (exact[0].cuda(), {n: g.cuda() for n, g in exact[1].items()})
    _assert_within("loss", got[0], eager[0], exact[0], torch.bfloat16)
    for n in got[1]:
        _assert_within(f"grad {n}", got[1][n], eager[1][n], exact[1][n], torch.bfloat16)
    model.eval()
    compiled = torch.compile(model, fullgraph=fullgraph)
    _assert_within("eval logits", _logits(compiled, ids), _logits(model, ids), logits_exact.cuda(), torch.bfloat16)
