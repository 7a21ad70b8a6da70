"""Tigon's offload_checkpoints and tile_mlp through the Liger entry points: the Trainer's liger_kernel_config
(`_apply_liger_kernel_to_instance`), the apply functions on a model, AutoLigerKernelForCausalLM; refused on a
class, named when misspelled."""

import logging

import pytest
import torch

import tigon
from tests.hf._tiny import tiny_config, tiny_model
from tigon.compat import liger
from tigon.memory import auto_offload, checkpoint_offload_installed, kept_activation_layers, tiled_mlp_installed

pytest.importorskip("transformers")

KEPT = "checkpoint in host memory (1 kept on the card)"


@pytest.fixture
def calls(monkeypatch):
    """What the apply functions hand to tigon.patch, without patching anything."""
    seen = []
    monkeypatch.setattr(liger, "patch_hf_model", lambda model=None, **kw: seen.append((model, kw)) or "report")
    return seen


def test_the_trainers_config_reaches_tigon_patch(calls):
    model = tiny_model("llama", num_hidden_layers=1)
    # liger_kernel_config as the Trainer hands it over: Liger's flags (geglu: another family's, dropped) and Tigon's
    liger._apply_liger_kernel_to_instance(model=model, rope=False, geglu=True, offload_checkpoints=True, tile_mlp=64)
    assert calls == [(model, dict(rope=False, cross_entropy=False, fused_linear_cross_entropy=True, rms_norm=True,
                                  swiglu=True, layer_norm=False, offload_checkpoints=True, tile_mlp=64))]
    liger._apply_liger_kernel_to_instance(model=model)  # not given: tigon.patch's defaults
    assert "offload_checkpoints" not in calls[-1][1] and "tile_mlp" not in calls[-1][1]
    liger.apply_liger_kernel_to_llama(model=model, offload_checkpoints="auto")  # the apply function on a model too
    assert calls[-1][1]["offload_checkpoints"] == "auto"


def test_the_trainers_config_installs_offload_and_tiles():
    model = tiny_model("llama", num_hidden_layers=2)
    report = liger._apply_liger_kernel_to_instance(model=model, offload_checkpoints=True, tile_mlp=16)
    assert report.replaced[KEPT] == 2 and report.replaced["tiled MLP (16 tokens a tile)"] == 2
    assert checkpoint_offload_installed(model) and tiled_mlp_installed(model) and report.memory_plan
    tigon.unpatch(model)
    assert not checkpoint_offload_installed(model) and not tiled_mlp_installed(model)
    report = liger._apply_liger_kernel_to_instance(model=model, rms_norm=True)  # the default: "auto"
    assert auto_offload(model) is not None and not checkpoint_offload_installed(model)
    tigon.unpatch(model)
    assert auto_offload(model) is None


def test_the_trainers_config_keeps_activations():
    model = tiny_model("llama", num_hidden_layers=2)
    report = liger._apply_liger_kernel_to_instance(model=model, keep_activations=1, offload_checkpoints=False)
    assert kept_activation_layers(model) == 1 and "without the recompute" in str(report)
    tigon.unpatch(model)
    assert kept_activation_layers(model) == 0


def test_auto_liger_class_passes_them_to_the_patch_not_to_transformers():
    model = liger.AutoLigerKernelForCausalLM.from_config(tiny_config("llama"), offload_checkpoints=2)
    assert checkpoint_offload_installed(model)
    tigon.unpatch(model)


def test_on_a_class_they_are_refused_or_left_to_the_instance(calls, caplog):
    with pytest.raises(ValueError, match=r"apply_liger_kernel_to_llama: offload_checkpoints is set on a model "
                                         r"instance: apply_liger_kernel_to_llama\(model=model, offload_checkpoints"):
        liger.apply_liger_kernel_to_llama(offload_checkpoints=True)
    assert calls == []
    with caplog.at_level(logging.INFO, logger="tigon"):
        liger._apply_liger_kernel("llama", rms_norm=True, tile_mlp=True)  # pre-initialization: the class only
        liger._apply_liger_kernel("llava", tile_mlp=True)  # a function with **kwargs does not get them either
    assert [(model, kw.get("tile_mlp")) for model, kw in calls] == [(None, None)]  # llava's: nothing at all
    assert caplog.text.count("tile_mlp set on a model instance only") == 2


def test_a_misspelled_key_still_errors_or_is_named(calls, caplog):
    model = tiny_model("llama", num_hidden_layers=1)
    with pytest.raises(TypeError, match=r"apply_liger_kernel_to_llama\(\) got an unexpected keyword argument "
                                        r"'offload_checkpoint' \(did you mean 'offload_checkpoints'\?\).*takes rope, "
                                        r"cross_entropy, fused_linear_cross_entropy, rms_norm, swiglu, model \(and on "
                                        r"a model, offload_checkpoints, tile_mlp, keep_activations\)"):
        liger.apply_liger_kernel_to_llama(model=model, offload_checkpoint=True)
    with pytest.raises(TypeError, match=r"got an unexpected keyword argument 'rms_nrom' \(did you mean 'rms_norm'"):
        liger.apply_liger_kernel_to_llama(model=model, rms_nrom=True, tile_mlp=True)
    assert calls == []
    # the Trainer's path drops what the function does not take, as Liger does; a key no function takes is named
    with caplog.at_level(logging.WARNING, logger="tigon"):
        liger._apply_liger_kernel_to_instance(model=model, tile_mpl=True, geglu=False)
    assert "offload_checkpoints" not in calls[-1][1] and "tile_mlp" not in calls[-1][1]
    assert "'tile_mpl' is not a flag of any apply function nor of Tigon (did you mean 'tile_mlp'?)" in caplog.text
    assert "geglu" not in caplog.text


def test_a_bad_value_is_tigon_patchs_error():
    model = tiny_model("llama", num_hidden_layers=1)
    with pytest.raises(TypeError, match=r"tigon.patch: offload_checkpoints must be 'auto', True, False or a number "
                                        r"of layers kept on the card \(>= 0\), got str 'yes'"):
        liger._apply_liger_kernel_to_instance(model=model, offload_checkpoints="yes")
    assert not checkpoint_offload_installed(model)


def test_the_trainer_patches_then_enables_checkpointing_and_the_offload_runs(tmp_path, monkeypatch):
    """transformers' Trainer with use_liger_kernel=True, liger_kernel_config={"offload_checkpoints": True} and
    gradient_checkpointing=True: it patches (transformers.integrations.liger.apply_liger_kernel, which imports
    liger_kernel's entry point; here Tigon's, as install_as_liger_kernel() makes it), then enables checkpointing,
    and the offloading function is what the layers run."""
    import transformers
    from transformers import trainer as trainer_module

    from tigon.memory import offload

    seen = []

    def apply_liger_kernel(model, kernel_config):  # the integration, with the import resolved to Tigon's
        liger._apply_liger_kernel_to_instance(model=model, **(kernel_config or {}))

    class Store(offload._HostStore):
        def offload(self, layer, x):
            seen.append(layer)
            return super().offload(layer, x)

    monkeypatch.setattr(trainer_module, "apply_liger_kernel", apply_liger_kernel)
    monkeypatch.setattr(offload, "_HostStore", Store)
    model = tiny_model("llama", num_hidden_layers=2)
    data = [{"input_ids": torch.arange(1, 9), "labels": torch.arange(1, 9)}] * 2
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=1, report_to=[], save_strategy="no",
        use_cpu=True, dataloader_num_workers=0, gradient_checkpointing=True, use_liger_kernel=True,
        liger_kernel_config={"offload_checkpoints": True, "rope": False})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    assert checkpoint_offload_installed(trainer.model) and seen == [0]  # the last layer's kept
    tigon.unpatch(trainer.model)
