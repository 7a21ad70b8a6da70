"""Checkpointing without the recompute on the last layers (tigon.memory.install_kept_activations): the loss and every
gradient are bitwise those of checkpointing every layer (a recompute computes the same values from the same RNG
state), the chosen layers really run once a step, installing composes with the offload and with HF's
gradient_checkpointing_enable in either order, tigon.patch's keep_activations installs and unpatch removes it, and
the memory plan counts the activations those layers keep."""

import gc

import pytest
import torch

import tigon
from tests.hf._tiny import batch
from tests.memory.test_offload import _assert_same, _funcs, _llama, _step
from tigon.memory import (
    install_checkpoint_offload,
    install_kept_activations,
    kept_activation_layers,
    plan,
    uninstall_checkpoint_offload,
    uninstall_kept_activations,
)

pytest.importorskip("transformers")
from transformers.modeling_layers import GradientCheckpointingLayer  # noqa: E402


def _checkpointed(**kw):
    """A tiny Llama (test_offload's `_llama(**kw)`) with HF's gradient checkpointing on."""
    model = _llama(**kw)
    model.gradient_checkpointing_enable()
    return model


def _layers(model):
    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def _calls(model):
    """Counts each decoder layer's forward runs (a checkpointed layer runs twice a step: forward, recompute)."""
    counts = [0] * len(_layers(model))
    for i, layer in enumerate(_layers(model)):
        layer.register_forward_pre_hook(lambda m, a, i=i: counts.__setitem__(i, counts[i] + 1))
    return counts


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
@pytest.mark.parametrize("kept", [1, 3])
def test_bitwise_checkpointing_and_the_kept_layers_run_once(lora, kept):
    ids, labels = batch()
    ref_model = _checkpointed(lora=lora)
    ref = _step(ref_model, ids, labels)
    model = _checkpointed(lora=lora)
    assert install_kept_activations(model, layers=kept) == kept
    assert kept_activation_layers(model) == kept
    calls = _calls(model)
    _assert_same(ref, _step(model, ids, labels))
    assert calls == [2] * (3 - kept) + [1] * kept  # the last `kept` layers: no recompute
    # and the same as no checkpointing at all
    plain = _llama(lora=lora)
    _assert_same(ref, _step(plain, ids, labels))


def test_install_before_enable_and_uninstall_restores():
    ids, labels = batch()
    model = _llama()
    install_kept_activations(model, layers=2)  # before gradient_checkpointing_enable: re-armed at the forward
    model.gradient_checkpointing_enable()
    hf_funcs = _funcs(model)
    calls = _calls(model)
    _step(model, ids, labels)
    assert calls == [2, 1, 1]
    assert uninstall_kept_activations(model) == 2 and kept_activation_layers(model) == 0
    assert _funcs(model) == hf_funcs  # HF's functions back on every layer
    calls[:] = [0, 0, 0]
    _step(model, ids, labels)
    assert calls == [2, 2, 2]
    assert install_kept_activations(model, layers=1) == 1
    assert install_kept_activations(model, layers=0) == 0 and kept_activation_layers(model) == 0


@pytest.mark.parametrize("order", ["offload_first", "kept_first"])
def test_with_the_offload_in_either_order(order):
    """The chosen layers run without the recompute and their inputs are not offloaded; the others are offloaded;
    gradients bitwise the plain checkpointed step's."""
    ids, labels = batch()
    ref_model = _checkpointed(lora=True)
    ref = _step(ref_model, ids, labels)
    model = _checkpointed(lora=True)
    if order == "offload_first":
        install_checkpoint_offload(model)
        install_kept_activations(model, layers=1)
    else:
        install_kept_activations(model, layers=1)
        install_checkpoint_offload(model)
    calls = _calls(model)
    _assert_same(ref, _step(model, ids, labels))
    assert calls == [2, 2, 1]
    _assert_same(ref, _step(model, ids, labels))  # a second step (re-armed hooks) too
    uninstall_checkpoint_offload(model)
    uninstall_kept_activations(model)
    calls[:] = [0, 0, 0]
    _assert_same(ref, _step(model, ids, labels))
    assert calls == [2, 2, 2]


def test_patch_argument_and_unpatch():
    ids, labels = batch()
    ref_model = _checkpointed()
    ref = _step(ref_model, ids, labels)
    model = _llama()
    report = tigon.patch(model, keep_activations=2, offload_checkpoints=False)
    assert "without the recompute" in str(report)
    model.gradient_checkpointing_enable()  # after the patch, as the Trainer does
    calls = _calls(model)
    got = _step(model, ids, labels)
    assert calls == [2, 1, 1]
    tigon.unpatch(model)
    assert kept_activation_layers(model) == 0
    patched_ref = _llama()
    tigon.patch(patched_ref, offload_checkpoints=False)
    patched_ref.gradient_checkpointing_enable()
    # a patched full fine-tune's MLP runs as one node in the kept layers: its input gradient may sum in another
    # order, so fp32 agreement to a reordering of sums over <= 96 terms (96 x 2^-24 relative) is the bound
    (l_ref, g_ref), (l_got, g_got) = _step(patched_ref, ids, labels), got
    torch.testing.assert_close(l_got, l_ref, rtol=1e-5, atol=0)
    assert g_ref.keys() == g_got.keys()
    for name in g_ref:
        torch.testing.assert_close(g_got[name], g_ref[name], rtol=1e-5, atol=1e-7 * g_ref[name].abs().max().item())
    del ref


@pytest.mark.parametrize("value,error", [(True, TypeError), ("all", TypeError), (1.0, TypeError), (-1, ValueError),
                                         (4, ValueError)])
def test_patch_refuses_bad_keep_activations(value, error):
    model = _llama()
    with pytest.raises(error, match="tigon.patch: keep_activations"):
        tigon.patch(model, keep_activations=value)
    assert kept_activation_layers(model) == 0
    with pytest.raises(ValueError, match="keep_activations is set on a model instance"):
        tigon.patch(model_type="llama", keep_activations=1)


@pytest.mark.parametrize("value,error", [(-1, ValueError), (4, ValueError), (True, ValueError), (None, ValueError)])
def test_install_refuses_bad_layers(value, error):
    model = _llama()
    with pytest.raises(error, match="install_kept_activations: layers"):
        install_kept_activations(model, layers=value)
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        install_kept_activations("model", layers=1)
    assert kept_activation_layers(model) == 0


def test_plan_counts_the_kept_layers():
    """Each layer kept adds its activations (and its input) less its checkpoint to the peak until the layers
    above the bottom are through; all of them kept is the plan without checkpointing."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256)
    peaks = [plan(cfg, seq_len=4096, batch_size=2, lora_rank=16, keep_activations=k).peak for k in (0, 8, 16, 32)]
    assert peaks == sorted(peaks) and len(set(peaks)) == 4
    full = plan(cfg, seq_len=4096, batch_size=2, lora_rank=16, keep_activations=16)
    per_layer = full.layer_saved_per_token * 2 * 4096  # one layer's saved tensors, its input left out
    assert abs((peaks[2] - peaks[1]) - 8 * per_layer) < 0.05 * 8 * per_layer
    assert "the last 16 layers skip the recompute" in str(full) and "recompute" not in str(
        plan(cfg, seq_len=4096, batch_size=2, lora_rank=16))
    none = plan(cfg, seq_len=4096, batch_size=2, lora_rank=16, checkpointing=False)
    assert peaks[3] == none.peak
    base = plan(cfg, seq_len=4096, batch_size=2, lora_rank=16)
    most = base.most_kept_activations(peaks[2])
    assert 16 <= most < 32 and base.most_kept_activations(base.peak - 1) == 0
    assert base.most_kept_activations(80 << 30) == 32
    with pytest.raises(ValueError, match="keep_activations"):
        plan(cfg, seq_len=4096, keep_activations=33)
    with pytest.raises(ValueError, match="keep_activations needs checkpointing=True"):
        plan(cfg, seq_len=4096, keep_activations=1, checkpointing=False)


def test_plan_reads_the_model():
    model = _checkpointed()
    base = plan(model, seq_len=2048)  # long enough for the activations to make the peak
    install_kept_activations(model, layers=2)
    assert plan(model, seq_len=2048).peak > base.peak
    assert plan(model, seq_len=2048, keep_activations=0).peak == base.peak
    uninstall_kept_activations(model)
    assert plan(model, seq_len=2048).peak == base.peak


def test_compiled_model_with_kept_layers_matches():
    """Under torch.compile the chosen layers run plainly too; loss and gradients equal the eager checkpointed step
    within fp32 rounding (inductor fuses in another order)."""
    ids, labels = batch()
    ref_model = _checkpointed(dropout=0.0)
    ref = _step(ref_model, ids, labels)
    model = _checkpointed(dropout=0.0)
    install_kept_activations(model, layers=1)
    compiled = torch.compile(model, backend="aot_eager")
    loss, grads = _step(compiled, ids, labels)
    torch.testing.assert_close(loss, ref[0])
    for name, g in ref[1].items():
        torch.testing.assert_close(grads[name.replace("_orig_mod.", "")] if name in grads else
                                   grads["_orig_mod." + name], g, rtol=1e-5, atol=1e-6)


class TestAuto:
    """keep_activations="auto" (tigon.memory.install_auto_kept_activations): the card is `auto._card_budget`,
    monkeypatched (a CPU model has none), and the card's total for the margin `torch.cuda.get_device_properties`,
    faked; the plan's own arithmetic decides, and the decided step stays bitwise the checkpointed one."""

    T = 512  # long enough for the tiny model's activations to decide the plan's peak

    @pytest.fixture
    def card(self, monkeypatch):
        from tigon.memory import auto

        budget = {"bytes": None}
        monkeypatch.setattr(auto, "_card_budget", lambda model: budget["bytes"])

        class _Props:
            total_memory = 0  # no KEPT_MARGIN: the tests give the budget itself

        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: _Props)
        return budget

    def _peaks(self, model, b=1):
        return [plan(model, seq_len=self.T, batch_size=b, attention="eager", keep_activations=k).peak
                for k in range(4)]

    def test_as_many_as_fit_then_only_fewer(self, card):
        from tigon.memory import auto_kept_activations

        ids = torch.randint(0, 131, (1, self.T), generator=torch.Generator().manual_seed(0))
        ref_model = _llama(dropout=0.0)
        ref_model.gradient_checkpointing_enable()
        ref = _step(ref_model, ids, ids)
        model = _llama(dropout=0.0)
        tigon.patch(model, keep_activations="auto", offload_checkpoints=False, rope=False, rms_norm=False,
                    swiglu=False, fused_linear_cross_entropy=False)
        model.gradient_checkpointing_enable()
        peaks = self._peaks(model)
        assert peaks == sorted(peaks) and peaks[1] < peaks[2] < peaks[3]
        card["bytes"] = (peaks[2] + peaks[3]) // 2  # two layers' activations fit, not three
        got = _step(model, ids, ids)
        state = auto_kept_activations(model)
        assert state.decisions == {(1, self.T): 2} and kept_activation_layers(model) == 2
        torch.testing.assert_close(got[0], ref[0])  # tigon.patch's attention may differ from HF's in rounding
        card["bytes"] = peaks[3] * 10  # more room later: a decided shape keeps its choice, a new one cannot raise
        _step(model, ids[:, : self.T - 1], ids[:, : self.T - 1])
        assert kept_activation_layers(model) == 2
        tigon.unpatch(model)
        assert auto_kept_activations(model) is None and kept_activation_layers(model) == 0

    def test_nothing_without_a_card_or_checkpointing_or_room(self, card):
        from tigon.memory import install_auto_kept_activations, uninstall_auto_kept_activations

        ids = torch.randint(0, 131, (1, 64), generator=torch.Generator().manual_seed(0))
        model = _llama(dropout=0.0)
        state = install_auto_kept_activations(model)
        assert install_auto_kept_activations(model) is state  # one a model
        _step(model, ids, ids)  # no checkpointing: not decided
        assert state.decisions == {}
        model.gradient_checkpointing_enable()
        _step(model, ids, ids)  # no card (budget None): decided as nothing
        assert state.decisions == {(1, 64): None} and kept_activation_layers(model) == 0
        card["bytes"] = 1 << 20  # a card too small for even the checkpointed step
        _step(model, ids[:, :63], ids[:, :63])
        assert state.decisions[(1, 63)] == 0 and kept_activation_layers(model) == 0
        assert uninstall_auto_kept_activations(model) and not uninstall_auto_kept_activations(model)
        with pytest.raises(ValueError, match="active can only be set to False"):
            state.active = True

    def test_with_the_offloads_auto(self, card):
        """Both "auto"s: where the checkpointed step fits, layers are kept and nothing is offloaded; where it does
        not, none is kept and the offload arms (the kept hook decides first, the offload reads its choice)."""
        from tigon.memory import auto_offload, checkpoint_offload_installed

        model = _llama(layers=3, dropout=0.0)
        tigon.patch(model, keep_activations="auto", rope=False, rms_norm=False, swiglu=False,
                    fused_linear_cross_entropy=False)  # offload_checkpoints="auto", the default
        model.gradient_checkpointing_enable()
        peaks = self._peaks(model)
        card["bytes"] = (peaks[2] + peaks[3]) // 2
        ids = torch.randint(0, 131, (1, self.T), generator=torch.Generator().manual_seed(0))
        _step(model, ids, ids)
        assert kept_activation_layers(model) == 2 and not checkpoint_offload_installed(model)
        offloaded = [plan(model, seq_len=2 * self.T, attention="eager", keep_activations=0,
                          offload_checkpoints=k).peak for k in (0, 3)]
        card["bytes"] = (offloaded[0] + offloaded[1]) // 2  # a longer row fits only with checkpoints offloaded
        long_ids = torch.randint(0, 131, (1, 2 * self.T), generator=torch.Generator().manual_seed(1))
        _step(model, long_ids, long_ids)
        assert kept_activation_layers(model) == 0 and checkpoint_offload_installed(model)
        assert auto_offload(model).decisions[(1, 2 * self.T)] is not None
        tigon.unpatch(model)
        assert not checkpoint_offload_installed(model) and kept_activation_layers(model) == 0

    def test_patch_refuses_other_strings(self):
        with pytest.raises(TypeError, match="keep_activations must be 'auto' or a number of layers"):
            tigon.patch(_llama(), keep_activations="all")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_bitwise_equal_and_the_kept_layers_hold_their_activations(dtype):
    """On the card, with attention dropout: the loss and every gradient bitwise those of checkpointing every layer
    (the forward's RNG draws are the recompute's). Then, patched, on SDPA without dropout, what two kept layers
    hold after the forward beyond their checkpoints is the plan's difference at the loss within 25%."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    import copy

    from tigon.memory.plan import _moments

    ids, labels = batch(b=2, t=512, vocab=131)
    ids, labels = ids.cuda(), labels.cuda()
    shape = dict(layers=4, hidden_size=256, intermediate_size=384, max_position_embeddings=1024)
    base = _llama(**shape).to("cuda", dtype)
    hf, ours = copy.deepcopy(base), copy.deepcopy(base)
    hf.gradient_checkpointing_enable()
    ours.gradient_checkpointing_enable()
    install_kept_activations(ours, layers=2)
    _assert_same(_step(hf, ids, labels), _step(ours, ids, labels))
    del hf, ours

    base = _llama(dropout=0.0, attn_implementation="sdpa", **shape).to("cuda", dtype)
    held, planned = [], []
    for kept in (0, 2):
        model = copy.deepcopy(base)
        tigon.patch(model, offload_checkpoints=False, keep_activations=kept)  # the model the plan describes
        model.gradient_checkpointing_enable()
        model.train()
        gc.collect()  # what earlier steps left in reference cycles is freed here, not inside the measured forward
        torch.cuda.synchronize()
        start = torch.cuda.memory_allocated()
        loss = model(input_ids=ids, labels=labels, use_cache=False).loss
        held.append(torch.cuda.memory_allocated() - start)
        loss.backward()
        job = plan(model, seq_len=512, batch_size=2, attention="sdpa")._job
        planned.append(sum(_moments(job, 512)["loss"].values()))
        del model, loss
    grew, want = held[1] - held[0], planned[1] - planned[0]
    assert 0.75 * want <= grew <= 1.25 * want, (held, planned)


def test_a_deep_copy_keeps_the_choice_and_uninstalls_on_its_own():
    """TRL deep-copies the policy for its reference model: the copy's chosen layers run once too, and uninstalling
    the copy gives it HF's functions back (the 'no function' marker survives the copy) without touching the
    original."""
    import copy

    ids, labels = batch()
    model = _llama()
    install_kept_activations(model, layers=1)  # before enable: the copy's layers have no function of HF's yet
    twin = copy.deepcopy(model)
    twin.gradient_checkpointing_enable()
    calls = _calls(twin)
    _step(twin, ids, labels)
    assert calls == [2, 2, 1] and kept_activation_layers(twin) == 1
    assert uninstall_kept_activations(twin) == 1 and kept_activation_layers(model) == 1
    from tigon.memory.recompute import _KeptActivationsFunc

    assert not any(isinstance(f, _KeptActivationsFunc) for f in _funcs(twin)) and all(_funcs(twin))
    calls[:] = [0, 0, 0]
    _step(twin, ids, labels)
    assert calls == [2, 2, 2]
