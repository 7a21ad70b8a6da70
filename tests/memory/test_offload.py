"""Checkpoints in host memory (tigon.memory.install_checkpoint_offload): the loss and every gradient are bitwise those
of Hugging Face's checkpointing, the layer inputs really leave the card (here: the CPU copy stands for host memory),
the layer below is fetched before the layer above recomputes, and install/uninstall change only what they say.

A recompute runs the same ops on the same inputs with the forward's RNG and autocast state, so on a deterministic
backend the gradients are equal bit for bit, to HF's checkpointing and to no checkpointing alike: `torch.equal`,
no tolerance, is the bound."""

import copy
import functools
import gc
import weakref

import pytest
import torch
from torch.utils.checkpoint import checkpoint

from tests.hf._tiny import batch, tiny_model
from tigon.memory import checkpoint_offload_installed, install_checkpoint_offload, offload, uninstall_checkpoint_offload

pytest.importorskip("transformers")
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _llama(layers=3, lora=False, dropout=0.25, **overrides):
    """A tiny Llama with dropout on (so the recompute must replay the RNG), LoRA r=4 with dropout if asked."""
    model = tiny_model("llama", num_hidden_layers=layers, attention_dropout=dropout, **overrides)
    if lora:
        import peft

        torch.manual_seed(0)
        model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS,
                                                           lora_dropout=0.2))
        with torch.no_grad():  # B is zero at init: give the adapters a gradient path that shows
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.normal_(0.0, 0.2)
    return model


def _step(model, ids, labels, **kw):
    """One training forward+backward from a fixed RNG state: (loss, {name: grad})."""
    model.train()
    model.zero_grad(set_to_none=True)
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=labels, use_cache=False, **kw).loss
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}


def _assert_same(ref, got):
    (l_ref, g_ref), (l_got, g_got) = ref, got
    assert torch.equal(l_ref, l_got), (l_ref, l_got)
    assert g_ref.keys() == g_got.keys() and g_ref
    bad = [n for n in g_ref if not torch.equal(g_ref[n], g_got[n])]
    assert not bad, bad


def _funcs(model):
    return [m.__dict__.get("_gradient_checkpointing_func") for m in model.modules()
            if isinstance(m, GradientCheckpointingLayer)]


def _in_backward() -> bool:
    """Whether autograd's engine is running a backward on this thread (the checkpoint's recompute)."""
    return torch._C._current_graph_task_id() != -1


class _Recorder(offload._HostStore):
    """The CPU store, recording each offload / keep / prefetch / wait as (what, layer)."""

    events = None

    def keep(self, layer, x):
        self.events.append(("keep", layer))
        return super().keep(layer, x)

    def offload(self, layer, x):
        self.events.append(("offload", layer))
        return super().offload(layer, x)

    def prefetch(self, ticket):
        if ticket is not None and ticket.host is not None and ticket.device is None:
            self.events.append(("prefetch", ticket.layer))
        super().prefetch(ticket)

    def wait(self, ticket):
        self.events.append(("wait", ticket.layer))
        return super().wait(ticket)


@pytest.fixture
def events(monkeypatch):
    log = []
    monkeypatch.setattr(_Recorder, "events", log)
    monkeypatch.setattr(offload, "_HostStore", _Recorder)
    return log


@pytest.mark.parametrize("lora, enable_first", [(False, True), (False, False), (True, False)],
                         ids=["full-enable-then-install", "full-install-then-enable", "lora-install-then-enable"])
def test_loss_and_every_grad_equal_hf_checkpointing_bitwise(lora, enable_first, events):
    """install-then-enable is the Trainer's order: it calls gradient_checkpointing_enable in train()."""
    ids, labels = batch()
    base = _llama(lora=lora)
    plain, hf, ours = copy.deepcopy(base), copy.deepcopy(base), copy.deepcopy(base)
    hf.gradient_checkpointing_enable()
    if enable_first:
        ours.gradient_checkpointing_enable()
    assert install_checkpoint_offload(ours) == 3
    if not enable_first:  # HF replaces every layer's function; the forward puts the offloading one back
        ours.gradient_checkpointing_enable()
    ref = _step(hf, ids, labels)
    _assert_same(ref, _step(ours, ids, labels))
    _assert_same(ref, _step(plain, ids, labels))
    assert [e for e in events if e[0] == "offload"] == [("offload", i) for i in range(3)]
    assert sorted(e for e in events if e[0] == "wait") == [("wait", i) for i in range(3)]
    _assert_same(ref, _step(ours, ids, labels))  # a second step: the store starts clean


def test_packed_rows_and_autocast_are_replayed_bitwise():
    ids, labels = batch(b=1, t=9)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1]])  # three packed rows
    base = _llama()
    hf, ours = copy.deepcopy(base), copy.deepcopy(base)
    hf.gradient_checkpointing_enable()
    ours.gradient_checkpointing_enable()
    install_checkpoint_offload(ours)
    _assert_same(_step(hf, ids, labels, position_ids=position_ids), _step(ours, ids, labels, position_ids=position_ids))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref, got = _step(hf, ids, labels), _step(ours, ids, labels)
    _assert_same(ref, got)
    assert got[1]["model.layers.0.mlp.up_proj.weight"].dtype == torch.float32


class _Block(GradientCheckpointingLayer):
    """A layer with the argument shapes HF passes and more: a second positional tensor, a kwarg tuple of tensors
    (one of them needing grad from outside the layer), non-tensor kwargs, and a tuple output with a None, an
    integer tensor and a Python int."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(5, 5)

    def forward(self, x, scale, extras=None, flag=True, note="n"):
        a, b = extras
        y = torch.nn.functional.dropout(self.lin(x) * scale + a, 0.3, training=True) * b.sum()
        return (y if flag else -y), None, (y > 0).sum(-1), len(note)


def test_kwarg_tensors_get_gradients_and_outputs_keep_their_structure():
    torch.manual_seed(0)
    blocks = torch.nn.Sequential(_Block(), _Block())
    twin = copy.deepcopy(blocks)

    def run(model, install):
        for block in model:
            block.gradient_checkpointing = True
            block._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        if install:
            install_checkpoint_offload(model)
        g = torch.Generator().manual_seed(1)
        x0, a0 = torch.randn(3, 5, generator=g, requires_grad=True), torch.randn(5, generator=g, requires_grad=True)
        scale, b = torch.rand(3, 1, generator=g), torch.rand(2, generator=g)
        torch.manual_seed(3)
        x, a = x0 * 2, a0 * 3  # non-leaf: the layer must not backpropagate past them itself
        outs = []
        for block in model:
            x, none, count, n = block(x, scale, extras=(a, b), flag=False, note="abc")
            outs.append((none, count, n))
        x.square().sum().backward()
        return x, outs, [x0.grad, a0.grad, *[p.grad for p in model.parameters()]]

    x_ref, outs_ref, g_ref = run(blocks, False)
    x, outs, g = run(twin, True)
    assert torch.equal(x_ref, x)
    assert [(o[0], o[1].dtype, o[2]) for o in outs] == [(None, torch.int64, 3)] * 2
    assert all(torch.equal(r[1], o[1]) for r, o in zip(outs_ref, outs))
    assert all(r is not None and torch.equal(r, o) for r, o in zip(g_ref, g))


def test_a_layer_called_with_its_input_by_keyword_keeps_hf_checkpointing(caplog):
    block = _Block()
    block.gradient_checkpointing = True
    install_checkpoint_offload(torch.nn.Sequential(block))
    x = torch.randn(3, 5, requires_grad=True)
    with caplog.at_level("WARNING", logger="tigon"):
        y = block(x=x, scale=torch.ones(3, 1), extras=(torch.zeros(5), torch.ones(2)))[0]
    y.sum().backward()
    assert x.grad is not None and "offload_checkpoints: layer 0 was called without its input" in caplog.text


def test_without_the_rng_replay_the_gradients_differ(monkeypatch):
    """Negative control: the dropout of these models is live, so a recompute that drew fresh masks would fail
    the bitwise comparisons above."""
    ids, labels = batch()
    base = _llama(layers=2)
    base.gradient_checkpointing_enable()
    hf, ours = copy.deepcopy(base), copy.deepcopy(base)
    install_checkpoint_offload(ours)
    monkeypatch.setattr(offload, "_checkpoint", lambda function, holder, *rest: offload._torch_checkpoint(
        offload._run_layer, function, holder, holder.tensor.new_empty(0), *rest, use_reentrant=False,
        preserve_rng_state=False))
    (l_ref, g_ref), (l_got, g_got) = _step(hf, ids, labels), _step(ours, ids, labels)
    assert torch.equal(l_ref, l_got) and not all(torch.equal(g_ref[n], g_got[n]) for n in g_ref)


def test_the_checkpoint_sees_the_input_device_for_its_rng_state(monkeypatch):
    """torch's checkpoint stashes the RNG state of the devices of the tensors among its arguments. HF passes the
    layer's other inputs as keywords bound in the function, and the holder hides the input, so the offload adds
    an empty tensor on the input's device: without it a CUDA layer's dropout would draw new masks in the
    recompute (the GPU test above compares the gradients bitwise)."""
    import torch.utils.checkpoint as torch_checkpoint

    seen = []
    real = torch_checkpoint._infer_device_type  # what picks the device whose RNG state is stashed

    def spy(*args):
        seen.append([a.device for a in args if isinstance(a, torch.Tensor)])
        return real(*args)

    monkeypatch.setattr(torch_checkpoint, "_infer_device_type", spy)
    ids, labels = batch()
    model = _llama(layers=2)
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model)
    _step(model, ids, labels)
    # one look a layer at least (torch may look again, as it does where CUDA is available); none without a device
    assert len(seen) >= 2 and all(devices == [torch.device("cpu")] for devices in seen), seen


def test_prefetch_of_the_layer_below_is_issued_before_this_layer_recomputes(events):
    ids, labels = batch()
    model = _llama(layers=4)
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model)
    for i, layer in enumerate(model.model.layers):  # the recompute is the layer's run inside the backward
        layer.register_forward_pre_hook(
            lambda m, a, i=i: events.append(("recompute" if _in_backward() else "forward", i)))
    _step(model, ids, labels)
    at = {e: k for k, e in enumerate(events)}
    assert [e for e in events if e[0] in ("forward", "offload")] == [
        (w, i) for i in range(4) for w in ("offload", "forward")]
    assert [e for e in events if e[0] == "wait"] == [("wait", i) for i in (3, 2, 1, 0)]
    for i in (3, 2, 1):
        assert at[("wait", i)] < at[("prefetch", i - 1)] < at[("recompute", i)] < at[("wait", i - 1)]
    assert ("prefetch", 3) in at and at[("prefetch", 3)] < at[("recompute", 3)]  # nobody above: fetched at its wait


@pytest.mark.parametrize("budget", [dict(keep_on_card=2), dict(keep_on_card_bytes=2 * 2 * 7 * 64 * 4)])
def test_the_last_layers_keep_their_input_and_the_others_free_it(budget, events):
    ids, labels = batch()  # hidden states [2, 7, 64] fp32: 3584 bytes a layer
    base = _llama(layers=4)
    hf, model = copy.deepcopy(base), copy.deepcopy(base)
    for m in (hf, model):
        m.gradient_checkpointing_enable()
    install_checkpoint_offload(model, **budget)
    inputs = {}

    def note_input(i, module, args):  # the forward's run (not the recompute): a weak reference to its input
        if not _in_backward():
            inputs.setdefault(i, weakref.ref(args[0]))

    for i, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(functools.partial(note_input, i))
    model.train()
    torch.manual_seed(7)
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    assert [e for e in events if e[0] in ("offload", "keep")] == [
        ("offload", 0), ("offload", 1), ("keep", 2), ("keep", 3)]
    assert [inputs[i]() is None for i in range(4)] == [True, True, False, False]  # freed once copied
    loss.backward()
    _assert_same(_step(hf, ids, labels), (loss.detach(), {n: p.grad for n, p in model.named_parameters()}))


def test_no_grad_and_eval_offload_nothing(events):
    ids, _ = batch()
    model = _llama()
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model)
    model.train()
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    model.eval()
    model(input_ids=ids, use_cache=False)
    assert events == []


def test_a_second_backward_through_the_graph_is_refused():
    ids, labels = batch()
    model = _llama(layers=2)
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model)
    model.train()
    loss = model(input_ids=ids, labels=labels, use_cache=False).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="offload_checkpoints: .*retain_graph"):
        loss.backward()


def test_under_compile_the_replaced_function_runs(monkeypatch):
    model = _llama(layers=2)
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model)
    seen = []
    for func in _funcs(model):
        previous = func.previous
        func.previous = lambda f, *a, previous=previous: seen.append(1) or previous(f, *a)
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)  # the re-arming hook also stands aside
    ids, labels = batch()
    _step(model, ids, labels)
    assert len(seen) == 2


def test_compiled_layers_keep_the_offload_and_the_bits(events):
    """Compiling the layers (not the whole model) leaves the offload outside the compiled code: the forward runs
    the layer's no-grad graph, the recompute its training graph, and the bits are still HF's (aot_eager on a CPU
    runs the same ATen ops; on a GPU inductor's fusions may round the two graphs differently)."""
    if torch.cuda.is_available():
        # on a GPU machine the first compile initializes CUDA; inside a checkpoint's forward torch refuses that (it
        # could not have stashed the device's RNG state), with HF's checkpoint as with this one
        torch.cuda.init()
    ids, labels = batch()
    base = _llama(layers=2)
    base.gradient_checkpointing_enable()
    hf, ours = copy.deepcopy(base), copy.deepcopy(base)
    install_checkpoint_offload(ours)
    for layer in ours.model.layers:
        layer.compile(backend="aot_eager", fullgraph=True)
    _assert_same(_step(hf, ids, labels), _step(ours, ids, labels))
    assert [e for e in events if e[0] != "prefetch"] == [("offload", 0), ("offload", 1), ("wait", 1), ("wait", 0)]


def test_uninstall_restores_exactly_in_either_order():
    model = _llama(layers=2)
    assert _funcs(model) == [None, None] and not checkpoint_offload_installed(model)
    assert install_checkpoint_offload(model, keep_on_card=1) == 2 and checkpoint_offload_installed(model)
    assert install_checkpoint_offload(model) == 2  # again: new settings, one installation
    assert uninstall_checkpoint_offload(model) == 2 and not checkpoint_offload_installed(model)
    assert _funcs(model) == [None, None] and not model.model.layers[0]._forward_pre_hooks
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks
    assert uninstall_checkpoint_offload(model) == 0

    model.gradient_checkpointing_enable()
    before = _funcs(model)
    install_checkpoint_offload(model)
    assert all(isinstance(f, offload._OffloadingCheckpointFunc) for f in _funcs(model))
    uninstall_checkpoint_offload(model)
    assert all(a is b for a, b in zip(before, _funcs(model)))

    install_checkpoint_offload(model)
    model.gradient_checkpointing_enable()  # replaced after install, never run: uninstall keeps HF's newest
    newest = _funcs(model)
    uninstall_checkpoint_offload(model)
    assert all(a is b for a, b in zip(newest, _funcs(model)))


def test_a_copy_of_an_installed_model_trains_its_own_parameters(events):
    """TRL's reference model and similar are deep copies: the copy's layers must differentiate its own parameters
    and hold a store of their own."""
    ids, labels = batch()
    base = _llama(layers=2)
    base.gradient_checkpointing_enable()
    hf = copy.deepcopy(base)
    install_checkpoint_offload(base)
    twin = copy.deepcopy(base)
    assert checkpoint_offload_installed(twin) and _funcs(twin)[0] is not _funcs(base)[0]
    _assert_same(_step(hf, ids, labels), _step(twin, ids, labels))
    assert all(p.grad is None for p in base.parameters())
    assert [e for e in events if e[0] != "prefetch"] == [("offload", 0), ("offload", 1), ("wait", 1), ("wait", 0)]
    assert uninstall_checkpoint_offload(twin) == 2 and checkpoint_offload_installed(base)
    assert base._forward_pre_hooks and not twin._forward_pre_hooks


def test_bad_arguments_name_the_function_and_the_argument():
    model = _llama(layers=1)
    with pytest.raises(TypeError, match="install_checkpoint_offload: model must be a torch.nn.Module"):
        install_checkpoint_offload("model")
    with pytest.raises(ValueError, match="install_checkpoint_offload: model .*Linear.* has no .*GradientCheck"):
        install_checkpoint_offload(torch.nn.Linear(2, 2))
    for bad, error in [(-1, ValueError), (1.0, TypeError), (True, TypeError), ("2", TypeError)]:
        with pytest.raises(error, match="install_checkpoint_offload: keep_on_card must be an int >= 0"):
            install_checkpoint_offload(model, keep_on_card=bad)
        with pytest.raises(error, match="install_checkpoint_offload: keep_on_card_bytes must be an int >= 0"):
            install_checkpoint_offload(model, keep_on_card_bytes=bad)
    with pytest.raises(TypeError, match="uninstall_checkpoint_offload: model must be a torch.nn.Module"):
        uninstall_checkpoint_offload(None)
    assert not checkpoint_offload_installed(model) and _funcs(model) == [None]


def test_a_forward_the_host_cannot_hold_is_refused_before_any_copy(monkeypatch, events):
    """The host memory the offloaded inputs need is checked before the first one leaves the card: too little
    available is an error naming the need, raised before anything is copied or any parameter changes."""
    ids, labels = batch()
    model = _llama(layers=3)
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model, keep_on_card=1)
    state = {n: p.clone() for n, p in model.named_parameters()}
    layer_bytes = ids.numel() * model.config.hidden_size * 4  # fp32 tiny model, one input a layer
    monkeypatch.setattr(offload, "_host_available_bytes", lambda: 2 * layer_bytes - 1)  # two are offloaded
    with pytest.raises(RuntimeError, match=r"offload_checkpoints: the 2 offloaded layer inputs of this forward need "
                                           r".* GiB of host memory .* keep more layers on the card"):
        _step(model, ids, labels)
    assert events == [] and all(torch.equal(p, state[n]) and p.grad is None for n, p in model.named_parameters())
    checks = []
    real = offload._Plan.check_host
    monkeypatch.setattr(offload._Plan, "check_host", lambda self, x: checks.append(x.shape) or real(self, x))
    monkeypatch.setattr(offload, "_host_available_bytes", lambda: 2 * layer_bytes)  # enough: trains
    _step(model, ids, labels)
    _step(model, ids, labels)
    assert len(checks) == 4 and offload._host_block_bytes(1000, True) == 1024 == offload._host_block_bytes(1024, True)
    assert offload._host_block_bytes(1000, False) == 1000


def test_a_failed_host_allocation_names_the_argument_and_changes_nothing(monkeypatch):
    ids, labels = batch()
    model = _llama(layers=2)
    model.gradient_checkpointing_enable()
    install_checkpoint_offload(model)
    funcs, state = _funcs(model), {n: p.clone() for n, p in model.named_parameters()}

    def refuse(like, pin):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(offload, "_allocate_host", refuse)
    with pytest.raises(RuntimeError, match=r"offload_checkpoints: could not allocate 3584 bytes .*out of memory"):
        _step(model, ids, labels)
    assert _funcs(model) == funcs and checkpoint_offload_installed(model)
    assert all(torch.equal(p, state[n]) and p.grad is None for n, p in model.named_parameters())


def test_tigon_kernels_under_the_offloaded_checkpoint():
    """A patched model (Tigon's kernels, through the interpreter on a CPU) gives the same bits with the offload."""
    import tigon
    from tests.hf._tiny import op_calls

    ids, labels = batch(b=1, t=6, ignore_tail=1)
    base = _llama(layers=2, dropout=0.0)
    tigon.patch(base)
    try:
        hf, ours = copy.deepcopy(base), copy.deepcopy(base)
        hf.gradient_checkpointing_enable()
        ours.gradient_checkpointing_enable()
        install_checkpoint_offload(ours)
        ref = _step(hf, ids, labels)
        calls = op_calls("rms_norm", "add_rms_norm")
        _assert_same(ref, _step(ours, ids, labels))
        assert op_calls("rms_norm", "add_rms_norm") > calls
    finally:
        tigon.unpatch(base)  # a patched model left behind keeps process-wide routing (TRL's loss name) in place


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("keep", [0, 1])
def test_cuda_bitwise_equal_and_the_card_memory_is_freed(dtype, keep):
    ids, labels = batch(b=2, t=512, vocab=131)
    base = _llama(layers=4, hidden_size=256, intermediate_size=384, max_position_embeddings=1024).to("cuda", dtype)
    ids, labels = ids.cuda(), labels.cuda()
    hf, ours = copy.deepcopy(base), copy.deepcopy(base)
    hf.gradient_checkpointing_enable()
    ours.gradient_checkpointing_enable()
    install_checkpoint_offload(ours, keep_on_card=keep)
    _assert_same(_step(hf, ids, labels), _step(ours, ids, labels))

    layer_bytes = 2 * 512 * 256 * dtype.itemsize
    held = []
    for model in (hf, ours):
        model.zero_grad(set_to_none=True)
        gc.collect()  # what earlier tests left in reference cycles is freed here, not inside the measured forward
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        torch.cuda.synchronize()  # the copies are done: their blocks are free once the allocator sees it
        torch.empty(1, device="cuda")
        held.append(torch.cuda.memory_allocated() - start)
        loss.backward()
    assert held[0] - held[1] >= (4 - keep - 1) * layer_bytes, held


@pytest.mark.gpu
def test_cuda_store_round_trip_has_no_host_sync():
    store = offload._HostStore()
    x = torch.randn(64, 1000, device="cuda")
    expect = x.clone()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        ticket = store.offload(0, x)
        del x
        torch.full((64, 1000), 7.0, device="cuda")  # may not get x's block before the copy out of it ends
        store.prefetch(ticket)
        back = store.wait(ticket)
        assert back.is_cuda
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    assert torch.equal(back, expect)


@pytest.mark.gpu
def test_cuda_install_without_pinned_memory_changes_nothing(monkeypatch):
    model = _llama(layers=2).cuda()
    model.gradient_checkpointing_enable()
    funcs = _funcs(model)

    def refuse(like, pin):
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(offload, "_allocate_host", refuse)
    with pytest.raises(RuntimeError, match="offload_checkpoints: could not allocate .*pinned host memory"):
        install_checkpoint_offload(model)
    assert _funcs(model) == funcs and not checkpoint_offload_installed(model)
