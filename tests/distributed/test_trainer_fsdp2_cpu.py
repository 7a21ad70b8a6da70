"""The Hugging Face Trainer with FSDP2 on a Tigon-patched model, checked on CPU: two processes, gloo.

Each rank patches the tiny Llama (fused linear cross-entropy on) and hands it to a Trainer configured the way
users turn FSDP2 on: `TrainingArguments(fsdp=True, fsdp_config={"fsdp_version": 2, ...})` (`fsdp="full_shard"`,
deprecated in transformers 5.17, translates to the same plugin). Two steps in data order (sequential
sampler) with gradient clipping active; the per-step logged losses and grad norms and the gathered parameters
must equal a single-process Trainer on the same global batch (per-device batch x 2), and every rank must have
run the fused kernels.

accelerate 1.15 does not refuse FSDP on a CPU/gloo group: AcceleratorState.__init__ turns the FSDP plugin on
only for accelerator distributed types (MULTI_GPU, MULTI_XPU, MULTI_NPU, ...), so on MULTI_CPU it drops it
without a warning and the Trainer trains under DistributedDataParallel. The first test runs that exact user
configuration and checks the numbers whatever wrapper accelerate picked (it skips, after the checks, when that
was not FSDP2). The second routes the plugin through on CPU (two attributes, `route_fsdp_plugin_on_cpu` in the
worker), so accelerate's own fsdp2_prepare_model shards the patched model (decoder layers, embeddings, the
[norm, lm_head] tail group, the root) and the Trainer drives it: the FSDP2 path a GPU user runs.
"""

from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

from tests.distributed import _trainer_fsdp2_worker as worker  # noqa: E402
from tests.distributed._ranks import SKIPS, launch, wait  # noqa: E402

WORLD = worker.WORLD
WORKER = Path(worker.__file__)

pytestmark = SKIPS
_REFERENCE = {}


def _close(a, b, name, rtol=1e-4, atol=1e-6):
    torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{name}: {m}")


def _reference(tmp_path):
    """One process, no FSDP, per-device batch x 2: the logged losses and the parameters after training."""
    if not _REFERENCE:
        losses, trainer, counts = worker.train(tmp_path / "single", world=1, fsdp=False)
        assert counts.get("linear_cross_entropy/triton") == worker.STEPS, counts
        _REFERENCE.update(losses=losses, params=worker.gathered_params(trainer.model))
    return _REFERENCE["losses"], _REFERENCE["params"]


def _check(tmp_path):
    """Run-independent checks; returns what accelerate did ("info" of rank 0)."""
    got = torch.load(tmp_path / "trainer.pt")
    ranks = [got] + [torch.load(tmp_path / f"counts{r}.pt") for r in range(1, WORLD)]
    for rank, out in enumerate(ranks):
        # every rank ran the fused loss on each step (inside the lm_head call) and the MLP as one node
        assert out["counts"].get("linear_cross_entropy/triton") == worker.STEPS, (rank, out["counts"])
        assert out["counts"].get("swiglu_mlp/triton", 0) > 0, (rank, out["counts"])
    losses, params = _reference(tmp_path)
    assert len(got["losses"]) == worker.STEPS
    got_losses, want = torch.tensor(got["losses"], dtype=torch.float64), torch.tensor(losses, dtype=torch.float64)
    _close(got_losses[:, 0], want[:, 0], "per-step logged loss")
    assert (want[:, 1] > 1.0).all(), "max_grad_norm=1 must clip: the clipping path is part of the check"
    _close(got_losses[:, 1], want[:, 1], "per-step grad norm (before clipping)")
    assert got["params"].keys() == params.keys()
    # Adam turns a near-zero gradient into a full-size step: atol is a tenth of lr, as in test_fsdp2_cpu.py
    for name, p in params.items():
        _close(got["params"][name], p, f"param {name} after {worker.STEPS} steps", atol=1e-4)
    return got["info"]


def test_trainer_fsdp2_matches_single_process(tmp_path):
    procs = launch(WORKER, tmp_path, WORLD, TIGON_FORCE_FSDP="1")  # ranks run while this process takes the reference
    _reference(tmp_path)
    wait(procs, tmp_path, "Trainer")
    info = _check(tmp_path)
    # accelerate's fsdp2_prepare_model sharded every parameter and the Trainer trained the FSDP2 module
    assert info["is_fsdp_enabled"] and info["distributed_type"] == "DistributedType.FSDP", info
    assert info["wrapper"].startswith("FSDP") and info["dtensor_params"] == info["n_params"], info


def test_trainer_fsdp_config_as_users_run_it(tmp_path):
    procs = launch(WORKER, tmp_path, WORLD, TIGON_FORCE_FSDP="0")
    _reference(tmp_path)
    wait(procs, tmp_path, "Trainer")
    info = _check(tmp_path)  # the numbers hold whatever accelerate wrapped the model in
    if not info["is_fsdp_enabled"]:
        pytest.skip(f"accelerate ignores the FSDP plugin on a CPU/gloo group: distributed type "
                    f"{info['distributed_type']}, model wrapped in {info['wrapper']} (DDP: losses and params matched "
                    f"one process); test_trainer_fsdp2_matches_single_process routes the plugin through")
    assert info["dtensor_params"] == info["n_params"], info
