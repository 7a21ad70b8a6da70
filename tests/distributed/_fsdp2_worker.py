"""One rank of the FSDP2 check, run by test_fsdp2_cpu.py as `python _fsdp2_worker.py OUT_DIR`.

Environment (set by the test, like torchrun): RANK, WORLD_SIZE, TIGON_DIST_STORE (a FileStore path),
TRITON_INTERPRET=1, and TIGON_FSDP2_OPTIM: "torch" (torch.optim.AdamW) or "tigon" (tigon.optim.AdamW, clipping
the sharded gradients' norm to CLIP inside its step). Builds the tiny Llama, patches it with Tigon, shards it
with FSDP2 on a gloo CPU mesh, runs forward with labels on this rank's half of the batch and backward, gathers
every gradient, and rank 0 saves {"loss", "grads", "counts"} to OUT_DIR/fsdp2.pt; then one AdamW step on the
sharded parameters and a second forward, whose loss and gathered parameters are saved as "loss2" and "params"
(with tigon's optimizer, its norm and launches as "grad_norm" and "optim_counts").
"""

import os
import sys

import torch
import torch.distributed as dist

CLIP = 0.05  # below the tiny model's gradient norm: the clipping scales the step


def main(out_dir: str) -> None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    store = dist.FileStore(os.environ["TIGON_DIST_STORE"], world)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        run(out_dir, rank, world)
        dist.barrier()  # both ranks are done before either tears gloo down (and leaves: exit_without_finalization)
    finally:
        dist.destroy_process_group()


def run(out_dir, rank, world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    import tigon
    from tests.hf._tiny import batch, tiny_model
    from tigon.ops import _library

    torch.set_num_threads(1)  # two ranks on two cores
    model = tiny_model("llama", num_hidden_layers=1)  # one layer: FSDP2 still wraps a decoder layer apart
    tigon.patch(model)
    model.train()
    mesh = init_device_mesh("cpu", (world,))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model.lm_head, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # The lm_head weight really is split: each rank holds V / world rows of it.
    assert isinstance(model.lm_head.weight, DTensor)
    assert model.lm_head.weight.to_local().shape[0] < model.config.vocab_size

    ids, labels = batch(model.config.vocab_size, b=2 * world, t=7)
    n_items = (labels[:, 1:] != -100).sum()  # over the whole batch: the per-rank losses sum to its loss
    rows = slice(2 * rank, 2 * rank + 2)
    _library.dispatch_counts.clear()
    out = model(ids[rows], labels=labels[rows], num_items_in_batch=n_items)
    assert out.logits is None, "the fused loss must not build logits"
    # FSDP2 averages the gradients over ranks; the loss is a share of the global sum, so undo the mean.
    (out.loss * world).backward()

    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    grads = {}
    for name, p in model.named_parameters():  # full_tensor() is a collective: every rank, same order
        g = p.grad
        grads[name] = (g.full_tensor() if isinstance(g, DTensor) else g).detach().clone()
    counts = {f"{op}/{path}": n for (op, path), n in _library.dispatch_counts.items()}

    # A second step: the optimizer updates the local shards, the next forward all-gathers them again.
    _library.dispatch_counts.clear()
    if os.environ.get("TIGON_FSDP2_OPTIM", "torch") == "tigon":
        opt = tigon.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6, max_grad_norm=CLIP)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-6)
    opt.step()
    grad_norm = getattr(opt, "grad_norm", None)
    optim_counts = {f"{op}/{path}": n for (op, path), n in _library.dispatch_counts.items()}
    with torch.no_grad():
        loss2 = model(ids[rows], labels=labels[rows], num_items_in_batch=n_items).loss.clone()
    dist.all_reduce(loss2)
    params = {name: (p.full_tensor() if isinstance(p, DTensor) else p).detach().clone()
              for name, p in model.named_parameters()}
    if rank == 0:
        torch.save({"loss": loss, "grads": grads, "counts": counts, "loss2": loss2, "params": params,
                    "grad_norm": grad_norm, "optim_counts": optim_counts}, os.path.join(out_dir, "fsdp2.pt"))


if __name__ == "__main__":
    # the launcher (_ranks.launch) sets TRITON_INTERPRET=1 in this process's environment, before triton is imported;
    # this module never sets it itself: test collection imports it into every pytest worker
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run by tests/distributed/_ranks.launch, which sets TRITON_INTERPRET=1")
    main(sys.argv[1])
    from tests.distributed._ranks import exit_without_finalization

    exit_without_finalization()
