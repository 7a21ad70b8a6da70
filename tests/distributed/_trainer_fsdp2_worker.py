"""One rank of the Trainer + FSDP2 check, run by test_trainer_fsdp2_cpu.py as `python _trainer_fsdp2_worker.py OUT`.

Environment (set by the test, like torchrun): RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, TIGON_DIST_STORE
(a FileStore path), TIGON_FORCE_FSDP (1: route_fsdp_plugin_on_cpu first), TRITON_INTERPRET=1. The rank joins a
gloo group through the FileStore (accelerate then finds it initialized and keeps it), builds the tiny Llama,
patches it with Tigon, and hands it to a Hugging Face Trainer configured the way users turn FSDP2 on:
`fsdp=True, fsdp_config={"fsdp_version": 2, ...}`. Rank 0 saves the logged per-step losses and grad norms, the gathered
parameters, its dispatch counts and what accelerate actually did (distributed type, wrapper, whether the
parameters ended up as DTensor shards) to OUT/trainer.pt; rank 1 saves its counts and that record to
OUT/counts1.pt.

`train()` is also what the test calls for the single-process reference (world 1, no FSDP).
"""

import os
import sys

import torch
import torch.distributed as dist

STEPS = 2
WORLD = 2
PER_DEVICE = 2
T = 7


def dataset(n):
    """A fixed dataset of n rows; row 0 of every global batch of 4 has two ignored label tokens."""
    from tests.hf._tiny import batch

    ids, labels = batch(131, b=n, t=T)
    labels[::4, -2:] = -100  # every global batch holds rows with different token counts
    return [{"input_ids": ids[i], "labels": labels[i]} for i in range(n)]


def fsdp_kwargs():
    """FSDP2, full_shard. transformers 5.17 deprecates `fsdp="full_shard"` (removal in 5.20) for `fsdp=True` and
    reshard_after_forward=True in fsdp_config, which is what it translates the string into."""
    return dict(fsdp=True, fsdp_config={
        "fsdp_version": 2, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"], "reshard_after_forward": True,
    })


def train(out_dir, world, fsdp):
    """Train the patched tiny Llama for STEPS steps of PER_DEVICE * WORLD rows in all, in order (no shuffling).

    Returns (per-step logged (loss, grad_norm), the Trainer, this process's dispatch counts)."""
    import transformers

    import tigon
    from tests.hf._tiny import tiny_model
    from tigon.ops import _library

    model = tiny_model("llama", num_hidden_layers=1)  # one layer: FSDP2 still wraps a decoder layer apart
    report = tigon.patch(model)
    assert report.replaced["SwiGLUMLP LlamaMLP"] == 1, report
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), max_steps=STEPS, per_device_train_batch_size=PER_DEVICE * WORLD // world,
        learning_rate=1e-3, adam_epsilon=1e-6, weight_decay=0.0, lr_scheduler_type="constant",
        logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0, data_seed=0,
        dataloader_num_workers=0, train_sampling_strategy="sequential", **(fsdp_kwargs() if fsdp else {}),
    )
    trainer = transformers.Trainer(model=model, args=args, train_dataset=dataset(PER_DEVICE * WORLD * STEPS))
    _library.dispatch_counts.clear()
    trainer.train()
    counts = {f"{op}/{path}": n for (op, path), n in _library.dispatch_counts.items()}
    # (loss, grad norm before clipping) per step: under FSDP2 the norm is reduced over DTensor shards
    losses = [(h["loss"], h["grad_norm"]) for h in trainer.state.log_history if "loss" in h]
    return losses, trainer, counts


def route_fsdp_plugin_on_cpu():
    """Make accelerate honour the FSDP plugin on a gloo CPU group. Returns a dict that gets {"fallback": the
    type accelerate had picked} if the shim had to step in.

    accelerate 1.15's AcceleratorState.__init__ switches to DistributedType.FSDP only for accelerator types
    (MULTI_GPU, MULTI_XPU, MULTI_NPU, ...); on MULTI_CPU it drops the plugin, and the Trainer wraps the model
    in DistributedDataParallel without a word. This sets the two attributes that branch would have set, so the
    rest (Accelerator.prepare -> fsdp2_prepare_model, the Trainer's FSDP paths) is accelerate's own code. Later
    AcceleratorState() calls copy PartialState's shared state over their own, so that gets the type too."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    original = AcceleratorState.__init__
    seen = {}

    def __init__(self, *args, fsdp_plugin=None, **kwargs):
        original(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            seen["fallback"] = str(self.distributed_type)
            self.distributed_type = DistributedType.FSDP
            self.fsdp_plugin = fsdp_plugin
            PartialState._shared_state["distributed_type"] = self.distributed_type  # as the end of __init__ does

    AcceleratorState.__init__ = __init__
    return seen


def gathered_params(model):
    """Full parameters by name; full_tensor() is a collective, so every rank calls this in the same order."""
    from torch.distributed.tensor import DTensor

    return {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
            for name, p in model.named_parameters()}


def main(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    torch.set_num_threads(1)  # two ranks on two cores
    store = dist.FileStore(os.environ["TIGON_DIST_STORE"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        from torch.distributed.tensor import DTensor

        seen = route_fsdp_plugin_on_cpu() if os.environ.get("TIGON_FORCE_FSDP") == "1" else {}
        losses, trainer, counts = train(out_dir, world, fsdp=True)
        model = trainer.model_wrapped
        state = trainer.accelerator.state
        info = {
            "distributed_type": str(state.distributed_type),
            "fsdp_plugin": getattr(state, "fsdp_plugin", None) is not None,
            "is_fsdp_enabled": bool(getattr(trainer, "is_fsdp_enabled", False)),
            "wrapper": type(model).__name__,
            "dtensor_params": sum(isinstance(p, DTensor) for p in trainer.model.parameters()),
            "n_params": sum(1 for _ in trainer.model.parameters()),
            "accelerate_fallback": seen.get("fallback"),
        }
        params = gathered_params(trainer.model)
        if rank == 0:
            torch.save({"losses": losses, "params": params, "counts": counts, "info": info},
                       os.path.join(out_dir, "trainer.pt"))
        else:
            torch.save({"counts": counts, "info": info}, os.path.join(out_dir, f"counts{rank}.pt"))
        dist.barrier()  # both ranks are done before either tears gloo down (and leaves: exit_without_finalization)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    # the launcher (_ranks.launch) sets TRITON_INTERPRET=1 in this process's environment, before triton is imported;
    # this module never sets it itself: test collection imports it into every pytest worker
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run by tests/distributed/_ranks.launch, which sets TRITON_INTERPRET=1")
    main(sys.argv[1])
    from tests.distributed._ranks import exit_without_finalization

    exit_without_finalization()
