"""Each public thing has one home and the public names the docs use: the ops' launch settings (tigon.ops.config,
exported from tigon.ops), the workspace arena (defined in ops, public in tigon.memory), the loss modules (one
module), the HF patcher (tigon.hf.patching, whose functions do not look like tigon.patch)."""

import dataclasses
import importlib.util

import pytest


def test_every_launch_config_is_exported_from_ops():
    from tigon import ops
    from tigon.ops import config

    classes = {n for n, v in vars(config).items() if isinstance(v, type) and dataclasses.is_dataclass(v)
               and v.__module__ == config.__name__}
    assert len(classes) >= 10
    for name in classes:
        assert name in ops.__all__ and getattr(ops, name) is getattr(config, name), name
    assert importlib.util.find_spec("tigon.ops._config") is None


def test_the_workspace_arena_lives_in_ops_and_is_public_in_memory():
    from tigon import memory
    from tigon.ops import _rolling_buffer

    assert memory.RollingBuffer is _rolling_buffer.RollingBuffer and memory.workspace is _rolling_buffer.workspace
    assert {"RollingBuffer", "workspace"} <= set(memory.__all__)
    assert importlib.util.find_spec("tigon.ops._workspace") is None


def test_loss_modules_live_in_one_module():
    from tigon import modules

    losses = [n for n in modules.__all__ if n.endswith(("Loss", "LogProbs"))]
    assert len(losses) == 10
    assert {getattr(modules, n).__module__ for n in losses} == {"tigon.modules.losses"}
    assert importlib.util.find_spec("tigon.modules.loss") is None


def test_the_hf_patcher_does_not_look_like_the_public_patch():
    pytest.importorskip("transformers")
    import tigon
    import tigon.hf
    from tigon.hf import patching

    assert tigon.patch.__wrapped__ is patching.patch_hf_model
    assert tigon.unpatch.__wrapped__ is patching.unpatch_hf_model
    assert tigon.PatchReport is tigon.hf.PatchReport is patching.PatchReport
    assert not hasattr(tigon.hf, "patch") and not hasattr(tigon.hf, "unpatch")
    assert importlib.util.find_spec("tigon.hf.patch") is None


def test_entry_points_carry_their_public_names():
    import tigon

    assert (tigon.patch.__name__, tigon.unpatch.__name__) == ("patch", "unpatch")
    assert (tigon.patch.__qualname__, tigon.patch.__module__) == ("patch", "tigon")  # help() and repr()
    assert "cuda_graph=True" in tigon.patch.__doc__ and "model_type" in tigon.unpatch.__doc__


def test_quantize_is_public_at_the_top_level():
    import tigon
    from tigon import quant

    assert "quantize" in tigon.__all__ and tigon.quantize is quant.quantize
