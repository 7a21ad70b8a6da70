"""offload_checkpoints="auto" (tigon.memory.install_auto_offload, tigon.patch's default): armed at the first
training forward of a (batch, seq_len) whose planned peak does not fit the card, with the largest keep_on_card the
plan fits, and only then; decided once per shape; a no-op without a card or without checkpointing; the armed step
is bitwise the unarmed one; unpatch takes it off.

The card is `auto._card_budget`, monkeypatched: on a CPU model it says None (nothing to fit), so every test that
wants a decision gives the budget in bytes. The tiny models train their first norms only, so that at a few dozen
tokens (the kernels run in Triton's interpreter) the checkpoints, not the parameters, decide the planned peak: it
grows with every layer kept past the two the backward holds anyway."""

import copy
import logging

import pytest
import torch

import tigon
from tigon.memory import (
    auto,
    auto_offload,
    checkpoint_offload_installed,
    install_auto_offload,
    install_checkpoint_offload,
    offload,
    plan,
    uninstall_auto_offload,
)

from .test_offload import _assert_same, _funcs, _llama, _step

pytest.importorskip("transformers")

LAYERS, T = 6, 32


def _patch(model, **kw):
    """tigon.patch with HF's own norms, RoPE, MLP and loss unless `kw` says otherwise: in Triton's interpreter
    Tigon's kernels take seconds a step, and what these tests check is the decision and the offload."""
    return tigon.patch(model, **{**dict(rope=False, rms_norm=False, swiglu=False, fused_linear_cross_entropy=False),
                                 **kw})


def _model(layers=LAYERS, enable=True):
    model = _llama(layers=layers)
    for name, p in model.named_parameters():
        p.requires_grad_("input_layernorm" in name)
    if enable:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    return model.train()


def _ids(t=T, b=1, seed=0):
    return torch.randint(0, 131, (b, t), generator=torch.Generator().manual_seed(seed))


def _peaks(model, t=T, b=1):
    """The plan's peak at each keep_on_card 0..L (L: no offload), as auto plans it (the tiny config is eager)."""
    return [plan(model, seq_len=t, batch_size=b, attention="eager", offload_checkpoints=k).peak
            for k in range(model.config.num_hidden_layers + 1)]


@pytest.fixture
def budget(monkeypatch):
    """budget.bytes is what the card gives (None: no card)."""

    class Card:
        bytes = None

    monkeypatch.setattr(auto, "_card_budget", lambda model: Card.bytes)
    return Card


@pytest.fixture
def plans(monkeypatch):
    """The (batch, seq_len) of every plan auto reads."""
    seen = []

    def counted(model, **kw):
        seen.append((kw["batch_size"], kw["seq_len"]))
        return plan(model, **kw)

    monkeypatch.setattr(auto, "plan", counted)
    return seen


def _armed_keep(model):
    state = model.__dict__.get(offload._STATE)
    return None if state is None else state.plan.keep_on_card


def test_the_plan_grows_with_every_layer_kept():
    peaks = _peaks(_model())
    # two fetched inputs on the card anyway (the one in use and the one prefetched below); the bottom layer's input
    # stays too (gradient checkpointing made the frozen embedding's output a leaf that requires grad), so keeping
    # all but it saves nothing
    assert peaks[0] == peaks[1] == peaks[2] < peaks[3] < peaks[4] < peaks[5] == peaks[6]


@pytest.mark.parametrize("between", [(4, 5), (2, 3)])
def test_arms_the_largest_keep_on_card_that_fits(budget, caplog, between):
    model = _model()
    peaks = _peaks(model)
    budget.bytes = (peaks[between[0]] + peaks[between[1]]) // 2
    _patch(model)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        _step(model, _ids(), _ids())
        _step(model, _ids(seed=1), _ids(seed=1))
    state = auto_offload(model)
    keep = state.decisions[(1, T)]
    # the plan's arithmetic: keep fits, one layer more does not
    assert plan(model, seq_len=T, attention="eager", offload_checkpoints=keep).peak <= budget.bytes
    assert plan(model, seq_len=T, attention="eager", offload_checkpoints=keep + 1).peak > budget.bytes
    assert keep == between[0] and state.keep_on_card == keep and _armed_keep(model) == keep
    assert checkpoint_offload_installed(model)
    assert all(isinstance(f, offload._OffloadingCheckpointFunc) for f in _funcs(model))
    warned = [r.getMessage() for r in caplog.records if "offload_checkpoints='auto'" in r.getMessage()]
    assert len(warned) == 1 and f"1 x {T} tokens" in warned[0] and f"all but the last {keep} of 6 layers" in warned[0]
    tigon.unpatch(model)


def test_a_step_that_fits_arms_nothing(budget, plans):
    model = _model()
    budget.bytes = _peaks(model)[-1]  # exactly the unoffloaded peak
    _patch(model)
    _step(model, _ids(), _ids())
    assert auto_offload(model).decisions == {(1, T): None} and plans == [(1, T)]
    assert not checkpoint_offload_installed(model)
    tigon.unpatch(model)


def test_a_step_that_fits_nowhere_is_left_alone_and_said_once(budget, caplog):
    model = _model()
    budget.bytes = _peaks(model)[0] - 1
    _patch(model)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        _step(model, _ids(), _ids())
        _step(model, _ids(t=T - 8), _ids(t=T - 8))  # a second shape that does not fit either: not said again
    assert not checkpoint_offload_installed(model)
    assert auto_offload(model).decisions == {(1, T): None, (1, T - 8): None}
    said = [r.getMessage() for r in caplog.records if "offload_checkpoints='auto'" in r.getMessage()]
    assert len(said) == 1 and "even with every checkpoint in host memory" in said[0]
    assert "tigon.memory.plan: the step needs" in said[0] and "the largest component is" in said[0]
    tigon.unpatch(model)


def test_a_step_whose_checkpoints_the_host_cannot_hold_is_left_alone(budget, caplog, monkeypatch):
    model = _model()
    peaks = _peaks(model)
    budget.bytes = (peaks[4] + peaks[5]) // 2  # keep 4: two layer inputs to host memory
    layer_bytes = T * model.config.hidden_size * 4  # fp32 on the CPU: no pinned rounding
    monkeypatch.setattr(offload, "_host_available_bytes", lambda: 2 * layer_bytes - 1)
    _patch(model)
    with caplog.at_level(logging.WARNING, logger="tigon"):
        _step(model, _ids(), _ids())
    assert not checkpoint_offload_installed(model) and auto_offload(model).decisions == {(1, T): None}
    said = [r.getMessage() for r in caplog.records if "offload_checkpoints='auto'" in r.getMessage()]
    assert len(said) == 1 and "moving the checkpoints of 2 layers to host memory needs" in said[0]
    assert "left as it is" in said[0]
    tigon.unpatch(model)


def test_the_armed_step_is_bitwise_the_unarmed_step(budget):
    base = _model()
    peaks = _peaks(base)
    plain, ours = copy.deepcopy(base), copy.deepcopy(base)
    tigon.patch(plain, offload_checkpoints=False, rope=False)  # Tigon's norms, MLP and loss (RoPE: interpreter time)
    tigon.patch(ours, rope=False)
    budget.bytes = (peaks[3] + peaks[4]) // 2
    ids = _ids()
    ref = _step(plain, ids, ids)
    _assert_same(ref, _step(ours, ids, ids))
    assert _armed_keep(ours) == 3 and not checkpoint_offload_installed(plain) and auto_offload(plain) is None
    _assert_same(ref, _step(ours, ids, ids))  # armed from the start of this one
    tigon.unpatch(plain)
    tigon.unpatch(ours)


def test_decided_once_per_shape_and_never_offloads_less(budget, plans):
    model = _model()
    peaks = _peaks(model)
    budget.bytes = (peaks[4] + peaks[5]) // 2
    _patch(model)
    _step(model, _ids(), _ids())
    _step(model, _ids(seed=2), _ids(seed=2))
    assert plans == [(1, T)] and _armed_keep(model) == 4
    short = _ids(t=8)
    _step(model, short, short)  # fits without offload: planned once, armed as it was
    _step(model, short, short)
    assert plans == [(1, T), (1, 8)] and auto_offload(model).decisions == {(1, T): 4, (1, 8): None}
    assert _armed_keep(model) == 4
    with torch.no_grad():  # no grad, or eval: not looked at
        model(input_ids=_ids(t=12))
    model.eval()
    model(input_ids=_ids(t=20))
    assert len(plans) == 2
    tigon.unpatch(model)


def test_no_card_or_no_checkpointing_plans_nothing(budget, plans):
    model = _model(enable=False)
    _patch(model)
    budget.bytes = 1  # a card that fits nothing: still nothing without checkpointing
    _step(model, _ids(t=16), _ids(t=16))
    assert auto_offload(model).decisions == {} and plans == []
    budget.bytes = None  # the CPU: decided (nothing), never planned
    model.gradient_checkpointing_enable()
    _step(model, _ids(t=16), _ids(t=16))
    assert auto_offload(model).decisions == {(1, 16): None} and plans == []
    assert not checkpoint_offload_installed(model)
    tigon.unpatch(model)


def test_checkpointing_enabled_after_the_patch_is_seen_and_rearmed(budget):
    """The Trainer's order: patch (liger_kernel_config), then gradient_checkpointing_enable, then train."""
    model = _model(enable=False)
    peaks = _peaks(_model())  # as planned once checkpointing is on (it hooks the embedding's output)
    budget.bytes = (peaks[4] + peaks[5]) // 2
    _patch(model)
    model.gradient_checkpointing_enable()
    _step(model, _ids(), _ids())
    assert _armed_keep(model) == 4
    model.gradient_checkpointing_enable()  # HF's function again on every layer: the offload's comes back
    assert not any(isinstance(f, offload._OffloadingCheckpointFunc) for f in _funcs(model))
    _step(model, _ids(), _ids())
    assert all(isinstance(f, offload._OffloadingCheckpointFunc) for f in _funcs(model))
    tigon.unpatch(model)


def test_unpatch_and_explicit_values_take_auto_off(budget):
    model = _model()
    hf_funcs = _funcs(model)
    peaks = _peaks(model)
    budget.bytes = (peaks[4] + peaks[5]) // 2
    report = _patch(model)
    assert report.replaced["checkpoint in host memory when needed ('auto')"] == LAYERS and not report.memory_plan
    _patch(model)  # again: still one
    assert sum(isinstance(h, auto.AutoOffload) for h in model._forward_pre_hooks.values()) == 1
    _step(model, _ids(), _ids())
    assert checkpoint_offload_installed(model)
    tigon.unpatch(model)
    assert auto_offload(model) is None and not checkpoint_offload_installed(model)
    assert not model._forward_pre_hooks and not model.model._forward_pre_hooks
    assert all(a is b for a, b in zip(hf_funcs, _funcs(model)))

    _patch(model)  # auto, armed; then an explicit True replaces it
    _step(model, _ids(), _ids())
    _patch(model, offload_checkpoints=True)
    assert auto_offload(model) is None and _armed_keep(model) == 1
    tigon.unpatch(model)

    _patch(model)
    _step(model, _ids(), _ids())
    _patch(model, offload_checkpoints=False)  # False takes auto off, and the offload it armed
    assert auto_offload(model) is None and not checkpoint_offload_installed(model)
    tigon.unpatch(model)
    assert not model._forward_pre_hooks


def test_an_offload_installed_by_the_user_is_theirs(budget):
    model = _model()
    install_checkpoint_offload(model, keep_on_card=5)
    assert not any("'auto'" in piece for piece in _patch(model).replaced) and auto_offload(model) is None
    tigon.unpatch(model)
    assert not checkpoint_offload_installed(model)

    _patch(model)  # auto first, then the user's own install: auto leaves it as set
    install_checkpoint_offload(model, keep_on_card=5)
    budget.bytes = 1
    _step(model, _ids(t=16), _ids(t=16))
    assert _armed_keep(model) == 5 and auto_offload(model).decisions == {(1, 16): None}
    assert uninstall_auto_offload(model) and checkpoint_offload_installed(model)  # not auto's to take off
    tigon.unpatch(model)


def test_a_model_without_checkpointing_layers_never_arms(monkeypatch):
    assert install_auto_offload(torch.nn.Linear(2, 2)) is None
    assert uninstall_auto_offload(torch.nn.Linear(2, 2)) is False
    model = _model(layers=2)
    monkeypatch.setattr(offload, "_checkpoint_layers", lambda m: [])
    report = _patch(model, offload_checkpoints="auto")  # no error, unlike True
    assert auto_offload(model) is None and not any("'auto'" in piece for piece in report.replaced)
    tigon.unpatch(model)


def test_sharded_parameters_are_never_planned(budget, plans):
    model = _model(layers=2)
    model.model.norm.weight.ds_id = 0  # DeepSpeed ZeRO-3 marks its partitioned parameters so
    _patch(model)
    budget.bytes = 1
    _step(model, _ids(t=12), _ids(t=12))
    assert auto_offload(model).decisions == {(1, 12): None} and plans == []
    assert not checkpoint_offload_installed(model)
    tigon.unpatch(model)


def test_a_model_the_plan_cannot_read_trains_as_it_is(budget, monkeypatch):
    model = _model(layers=2)
    _patch(model)
    budget.bytes = 1

    def unreadable(model, **kw):
        raise ValueError("tigon.memory.plan: model_or_config is a mixture-of-experts model")

    monkeypatch.setattr(auto, "plan", unreadable)
    _step(model, _ids(t=12), _ids(t=12))
    _step(model, _ids(t=20), _ids(t=20))
    assert auto_offload(model).decisions == {(1, 12): None, (1, 20): None}
    assert not checkpoint_offload_installed(model)
    tigon.unpatch(model)


@pytest.mark.parametrize("value, error, words", [
    ("yes", TypeError, r"offload_checkpoints must be 'auto', True, False or a number of layers kept on the card "
                       r"\(>= 0\), got str 'yes'"),
    (-1, ValueError, r"offload_checkpoints must be 'auto', True, False or .*got -1"),
    (2.5, TypeError, r"offload_checkpoints must be 'auto', .*got float 2.5"),
])
def test_bad_values_name_auto(value, error, words):
    model = _model(layers=2)
    with pytest.raises(error, match=words):
        _patch(model, offload_checkpoints=value)
    assert auto_offload(model) is None and not model.__dict__.get("_tigon_undo")


def test_auto_is_nothing_on_a_model_type():
    report = tigon.patch(model_type="llama", offload_checkpoints="auto")
    try:
        assert not any("'auto'" in piece for piece in report.replaced)
    finally:
        tigon.unpatch(model_type="llama")


def test_a_copy_of_a_watched_model_decides_for_itself(budget):
    model = _model()
    _patch(model)
    twin = copy.deepcopy(model)
    peaks = _peaks(model)
    budget.bytes = (peaks[4] + peaks[5]) // 2
    _step(twin, _ids(), _ids())
    assert _armed_keep(twin) == 4 and auto_offload(model).decisions == {} and not checkpoint_offload_installed(model)
    assert auto_offload(twin) is not auto_offload(model)
    tigon.unpatch(twin)
    tigon.unpatch(model)


def test_the_card_budget_respects_the_process_cap(monkeypatch):
    """The budget auto plans against: the free bytes plus what this process reserved and its CUDA context, at most
    the card (or the cap of torch.cuda.set_per_process_memory_fraction, how a 24 GB card is emulated), less the
    margin."""
    from types import SimpleNamespace

    from tigon.memory.plan import CONTEXT_BYTES

    gib = 1 << 30
    model = SimpleNamespace(parameters=lambda: iter([SimpleNamespace(device=torch.device("cuda", 0))]))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (70 * gib, 80 * gib))
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=80 * gib))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 6 * gib)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 1.0)
    margin = auto.AUTO_MARGIN * 80 * gib
    assert auto._card_budget(model) == int(min(80 * gib, 76 * gib + CONTEXT_BYTES) - margin)
    monkeypatch.setattr(torch.cuda, "get_per_process_memory_fraction", lambda device=None: 0.3)
    assert auto._card_budget(model) == int(int(0.3 * 80 * gib) + CONTEXT_BYTES - margin)
    assert auto._card_budget(SimpleNamespace(parameters=lambda: iter([]))) is None
