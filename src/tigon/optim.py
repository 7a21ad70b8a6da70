"""Optimizers whose step is one kernel launch per parameter group (`tigon.ops.adamw_step_`).

    opt = tigon.optim.AdamW(model.parameters(), lr=2e-5, weight_decay=0.01, max_grad_norm=1.0)
    loss.backward(); opt.step(); opt.zero_grad()      # opt.grad_norm: the norm before clipping (a device scalar)

`AdamW` is `torch.optim.AdamW` (same arguments, same update, same state-dict keys, so checkpoints move between
the two) with gradient clipping optionally fused into the step: `max_grad_norm` replaces a call to
`torch.nn.utils.clip_grad_norm_` before `step()` (never do both). docs/ops/adamw.md has the numbers.

Two settings trade exactness of torch's update or its step order for memory (docs/memory/plan.md):

    opt = tigon.optim.AdamW(model.parameters(), lr=2e-5, state_bits=8, step_in_backward=True)
    loss.backward(); opt.step(); opt.zero_grad()      # the backward already stepped; step() finds no gradients

- `state_bits=8`: the moments in 8 bits with a scale per 256 elements (`tigon.ops.adamw8bit_step_`,
  docs/ops/adamw8bit.md): 2 bytes of state a parameter instead of 4 (bf16) or 8 (fp32);
- `step_in_backward=True`: each parameter steps as soon as its gradient is complete (a post-accumulate-grad
  hook) and its gradient is freed: the step never holds every gradient at once.
"""

import functools
import weakref

import torch

from . import ops as _ops
from .ops import _library, reference
from .ops import adamw as _adamw
from .ops.config import ADAMW, ADAMW8BIT, AdamW8bitConfig, AdamWConfig

__all__ = ["AdamW"]

_NAME = "tigon.optim.AdamW"
_CODES = ("exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales")  # state_bits=8's state


class AdamW(torch.optim.Optimizer):
    """torch.optim.AdamW's update over each parameter group in one Triton launch (on CUDA, or on CPU under
    TRITON_INTERPRET=1; the PyTorch reference otherwise).

    Arguments as torch.optim.AdamW's; `foreach` and `fused` are accepted and ignored (the step is fused);
    `amsgrad`, `capturable` and `differentiable` must stay off. Extra keywords:
    - `max_grad_norm`: clip the gradients of all groups together to this total 2-norm inside the step (the scale
      is applied in registers, the gradients are left as they were); `self.grad_norm` then holds the norm
      before clipping, an fp32 device scalar, as `clip_grad_norm_` returns it;
    - `state_dtype`: the moments' dtype (default: each parameter's; float32 keeps fp32 moments for bf16 weights);
    - `master_weights`: keep an fp32 copy of every bf16/fp16 parameter in the state (`master`), update it and
      write its rounding to the parameter: updates smaller than half an ulp of bf16 are not lost (4 bytes a
      parameter of memory, 6 more moved a step); the master owns the values, so change weights through it;
    - `state_bits`: None, or 8 for block-quantized 8-bit moments (`tigon.ops.adamw8bit_step_`: one launch a
      parameter, stochastic rounding; not with `state_dtype` or `master_weights`). Its state keys are
      exp_avg_codes / exp_avg_scales / exp_avg_sq_codes / exp_avg_sq_scales; a state with float moments (torch's
      AdamW's, loaded by load_state_dict) is quantized at its parameter's next step;
    - `step_in_backward`: step each parameter from a post-accumulate-grad hook as soon as the backward has made
      its gradient, then free the gradient (`step()` and `zero_grad()` then find none). Not with
      `max_grad_norm` (clipping needs every gradient first); gradient accumulation, `clip_grad_norm_` and a
      GradScaler see no gradients, and a parameter must receive its gradient once a backward (no parameter
      shared between reentrant-checkpointed segments). `remove_hooks()` turns it off;
    - `config`: an `AdamWConfig` (launch settings; an `AdamW8bitConfig` with state_bits=8).
    Parameters must be dense and contiguous. The step reads its scalars on the host (no CUDA-graph capture).

    FSDP2 (DTensor parameters, `fully_shard`): each rank steps its local shards, the moments are DTensors like the
    parameters (as torch's AdamW keeps them), and clipping all-reduces the squared norm over the mesh dimensions
    the parameters are sharded on; with `max_grad_norm`, every parameter must then be a DTensor on one mesh with
    one placement."""

    def __init__(self, params, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=1e-2, amsgrad=False, *,
                 maximize=False, foreach=None, capturable=False, differentiable=False, fused=None,
                 max_grad_norm=None, state_dtype=None, master_weights=False, state_bits=None,
                 step_in_backward=False, config=None):
        name = _NAME
        if isinstance(lr, torch.Tensor):
            raise TypeError(f"{name}: lr must be a Python number, got a tensor")
        if not isinstance(betas, (tuple, list)) or len(betas) != 2:
            raise ValueError(f"{name}: betas must be a pair (beta1, beta2), got {betas!r}")
        _adamw.check_hyper(name, lr, betas[0], betas[1], eps, weight_decay, 1, max_grad_norm)
        for flag, value in (("amsgrad", amsgrad), ("capturable", capturable), ("differentiable", differentiable)):
            if value:
                raise ValueError(f"{name}: {flag}=True is not supported (use torch.optim.AdamW for it)")
        if state_dtype not in (None, torch.float32, torch.float16, torch.bfloat16):
            raise TypeError(f"{name}: state_dtype must be None, torch.float32, float16 or bfloat16, got {state_dtype}")
        if state_bits not in (None, 8) or isinstance(state_bits, bool):
            raise ValueError(f"{name}: state_bits must be None or 8, got {state_bits!r}")
        if state_bits == 8 and (state_dtype is not None or master_weights):
            raise ValueError(f"{name}: state_bits=8 keeps 8-bit moments; state_dtype and master_weights do not apply")
        config = config if config is not None else (ADAMW8BIT if state_bits == 8 else ADAMW)
        want = AdamW8bitConfig if state_bits == 8 else AdamWConfig
        if not isinstance(config, want):
            raise TypeError(f"{name}: config must be an {want.__name__}, got {type(config).__name__}")
        if not isinstance(step_in_backward, bool):
            raise TypeError(f"{name}: step_in_backward must be True or False, got {step_in_backward!r}")
        if step_in_backward and max_grad_norm is not None:
            raise ValueError(f"{name}: step_in_backward steps each parameter before the next gradient exists, so "
                             "max_grad_norm (which needs the norm of them all) cannot apply; pass max_grad_norm=None")
        self.state_bits = state_bits
        self.step_in_backward = step_in_backward
        self._hooks = []  # step_in_backward's hook handles
        self._where = {}  # step_in_backward: parameter -> (its group's index, its index in the group)
        defaults = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, amsgrad=False,
                        maximize=maximize, foreach=foreach, capturable=False, differentiable=False, fused=fused)
        super().__init__(params, defaults)
        self.max_grad_norm = max_grad_norm
        self.state_dtype = state_dtype
        if not isinstance(master_weights, bool):
            raise TypeError(f"{name}: master_weights must be True or False, got {master_weights!r}")
        self.master_weights = master_weights
        self.config = config
        self.grad_norm = None
        self._norm_outs = []  # tensors the next step fills with its gradient norm (norm_at_next_step)
        self._mesh = None  # (device mesh, placements) of the DTensor parameters stepped last, for clipping
        self._tables = {}  # (group index, subgroup key) -> TensorTable, rebuilt when an address changes

    def add_param_group(self, param_group):
        super().add_param_group(param_group)
        if self.step_in_backward:
            gi = len(self.param_groups) - 1
            hook = functools.partial(_backward_step, weakref.ref(self))
            for i, p in enumerate(self.param_groups[gi]["params"]):
                if p.requires_grad:
                    self._where[p] = (gi, i)
                    self._hooks.append(p.register_post_accumulate_grad_hook(hook))

    def remove_hooks(self) -> None:
        """Stop stepping in the backward (step_in_backward): from now on `step()` steps the gradients it finds."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()
        self._where.clear()

    @torch.compiler.disable
    @torch.no_grad()
    def _step_one(self, p) -> None:
        """step_in_backward: the update of `p`, whose gradient the backward just completed; then free it."""
        if p.grad is None or p not in self._where:
            return
        gi, i = self._where[p]
        group = self.param_groups[gi]
        _check_lr(group)
        if self.state_bits == 8:
            self._step_8bit(group, p, None)
        else:
            self._mesh = _mesh_of([p], False)
            for key, lists in self._subgroups(group, [p]).items():
                kernels = _library.backend_for(p.device) == "triton"
                table = self._table(("backward", gi, i), lists) if kernels else None
                self._launch(group, key, lists, table, None)
        p.grad = None

    def _subgroups(self, group, params=None):
        """The group's parameters that have a gradient (or those of `params`), split by (device, dtype, moments'
        dtype, step): one launch each. The step advances here (one foreach add and one read of the CPU step
        counters for the group); a subgroup's step is shared by all its tensors."""
        name = _NAME
        local = _local if self._mesh is not None else _same  # DTensors: step their local shards
        params = [p for p in (group["params"] if params is None else params) if p.grad is not None]
        for p in params:
            if p.grad.is_sparse:
                raise ValueError(f"{name}: sparse gradients are not supported")
            if not local(p).is_contiguous() or not local(p.grad).is_contiguous():
                raise ValueError(f"{name}: a parameter of shape {tuple(p.shape)} or its gradient is not contiguous")
            state = self.state[p]
            if not state:
                dtype = self.state_dtype or p.dtype
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, dtype=dtype, memory_format=torch.preserve_format)
            elif state["step"].device.type != "cpu":  # loaded from a fused/capturable torch AdamW: once
                state["step"] = state["step"].detach().to("cpu", torch.float32)
            if self.master_weights and p.dtype != torch.float32 and "master" not in state:
                state["master"] = p.detach().float()
        states = [self.state[p] for p in params]
        if not states:
            return {}
        steps = [st["step"] for st in states]
        torch._foreach_add_(steps, 1.0)
        subs = {}
        for p, st, step in zip(params, states, torch.stack(steps).tolist()):
            master = st.get("master") if self.master_weights else None
            tensors = (p, p.grad, st["exp_avg"], st["exp_avg_sq"]) + (() if master is None else (master,))
            if self._mesh is not None:
                tensors = [_local(t) for t in tensors]  # a DTensor's local shard shares its storage
            # (params, grads, exp_avgs, exp_avg_sqs, masters): the masters' list stays empty without them
            lists = subs.setdefault((p.device, p.dtype, st["exp_avg"].dtype, int(step), master is not None),
                                    ([], [], [], [], []))
            for lst, t in zip(lists, tensors):
                lst.append(t)
        return subs

    def _table(self, key, lists):
        table, rows = self._tables.get(key), _adamw.kernel_rows(*lists)
        if table is not None and table.matches(rows):
            return table
        _check(lists)  # new addresses: check the lists once
        if table is not None and table.same_sizes(rows):
            table.retarget(rows)
        else:
            table = self._tables[key] = _adamw.TensorTable(rows, self.config.chunk)
        return table

    @torch.compiler.disable  # host tables and scalars: the step runs eagerly, also from a compiled loop
    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.state_bits == 8:
            self._step_all_8bit()
            return loss
        work = []  # (group, subgroup key, lists, its table on the kernel path or None)
        self._mesh = _mesh_of([p for g in self.param_groups for p in g["params"] if p.grad is not None],
                              self.max_grad_norm is not None or bool(self._norm_outs))
        for gi, group in enumerate(self.param_groups):
            _check_lr(group)
            for key, lists in self._subgroups(group).items():
                kernels = _library.backend_for(lists[0][0].device) == "triton"
                table = self._table((gi,) + key[:3] + key[4:], lists) if kernels else None
                work.append((group, key, lists, table))
        self.grad_norm = norm = None
        outs, self._norm_outs = self._norm_outs, []
        if (self.max_grad_norm is not None or outs) and work:
            norm = self._total_norm(work)
            self.grad_norm = norm
        self._fill_norm_outs(outs, norm)
        if self.max_grad_norm is None:
            norm = None  # computed for the outs only: nothing is clipped
        for group, key, lists, table in work:
            self._launch(group, key, lists, table, norm)
        return loss

    def _fill_norm_outs(self, outs, norm) -> None:
        """norm_at_next_step's tensors get the norm; with no gradients 0, as clip_grad_norm_ returns for none (NaN
        when the backward stepped and freed them)."""
        for out in outs:
            out.copy_(norm if norm is not None else torch.tensor(float("nan") if self.step_in_backward else 0.0))

    def _launch(self, group, key, lists, table, norm) -> None:
        """One subgroup's update: the kernel over its table, or the reference."""
        beta1, beta2 = group["betas"]
        kw = dict(lr=group["lr"], beta1=beta1, beta2=beta2, eps=group["eps"], weight_decay=group["weight_decay"],
                  step=key[3], maximize=group["maximize"], max_grad_norm=self.max_grad_norm)
        if _library.use_kernels("adamw", lists[0][0]):
            clip_norm = None if norm is None else norm.to(lists[0][0].device).reshape(1)
            _adamw.adamw_launch(table, key[1], key[2], **kw, norm=clip_norm, config=self.config)
        else:
            _check(lists)
            reference.adamw_step_(*lists[:4], **kw, norm=norm, master_params=lists[4] or None)

    def _step_all_8bit(self) -> None:
        """state_bits=8's step(): the norm over every gradient when clipping or asked for, then one launch a
        parameter."""
        todo = [(g, p) for g in self.param_groups for p in g["params"] if p.grad is not None]
        for g, _ in todo:
            _check_lr(g)
        if any(_is_dtensor(p) for _, p in todo):
            raise ValueError(f"{_NAME}: state_bits=8 does not support DTensor parameters (FSDP2); use state_bits=None")
        outs, self._norm_outs = self._norm_outs, []
        norm = None
        if (self.max_grad_norm is not None or outs) and todo:
            norm = _total_norm_of([p.grad for _, p in todo])
        self.grad_norm = norm
        self._fill_norm_outs(outs, norm)
        clip = norm if self.max_grad_norm is not None else None
        for group, p in todo:
            self._step_8bit(group, p, clip)

    def _step_8bit(self, group, p, norm) -> None:
        """One parameter's update with 8-bit moments (made at its first step, or quantized from float ones)."""
        st = self.state[p]
        if _CODES[0] not in st:
            step = st["step"] if "step" in st else torch.tensor(0.0, dtype=torch.float32)
            if "exp_avg" in st:  # float moments (torch's AdamW's state, loaded): quantized once
                codes = _ops.quantize_moments(st.pop("exp_avg").reshape(p.shape), st.pop("exp_avg_sq").reshape(
                    p.shape), step=int(step.item()))
            else:
                codes = _ops.new_moments(p)
            st["step"] = step.detach().to("cpu", torch.float32)
            st.update(zip(_CODES, codes))
        elif st["step"].device.type != "cpu":
            st["step"] = st["step"].detach().to("cpu", torch.float32)
        st["step"] += 1.0
        beta1, beta2 = group["betas"]
        clip = norm is not None
        _ops.adamw8bit_step_(p, p.grad, *(st[k] for k in _CODES), lr=group["lr"], beta1=beta1, beta2=beta2,
                             eps=group["eps"], weight_decay=group["weight_decay"], step=int(st["step"].item()),
                             maximize=group["maximize"], max_grad_norm=self.max_grad_norm if clip else None,
                             norm=norm.to(p.device).reshape(1) if clip else None, config=self.config)

    def norm_at_next_step(self, device=None) -> torch.Tensor:
        """A 0-dim fp32 tensor on `device` that the next step() fills with the total gradient 2-norm, NaN until
        then (and after a step that a GradScaler skips): the norm the step clips by, so one pass over the gradients
        serves clipping and logging (tigon.hf.trainer.use_fused_adamw hands it to the Trainer). Without
        max_grad_norm the step computes the norm for it and clips nothing."""
        out = torch.full((), float("nan"), dtype=torch.float32, device=device)
        self._norm_outs.append(out)
        return out

    def _total_norm(self, work):
        """The 2-norm over every gradient about to be stepped, on the first parameter's device (as
        clip_grad_norm_ computes it across devices), partial sums added in a fixed order."""
        device = work[0][2][0][0].device
        sums = []
        for _, key, lists, table in work:
            if _library.use_kernels("grad_norm", lists[0][0]):
                sums.append(_adamw.sq_sum_launch(table, 1, key[1], self.config).sum().to(device))
            else:
                sums.append(reference.grad_norm(lists[1]).square().to(device))
        sq = torch.stack(sums).sum() if len(sums) > 1 else sums[0]
        if self._mesh is not None:  # the local shards' squares, summed over the ranks that split each tensor
            import torch.distributed as dist
            from torch.distributed.tensor import Shard

            mesh, placements = self._mesh
            for dim, placement in enumerate(placements):
                if isinstance(placement, Shard):
                    dist.all_reduce(sq, group=mesh.get_group(dim))
        return sq.sqrt()


def _check_lr(group) -> None:
    if isinstance(group["lr"], torch.Tensor):
        raise TypeError(f"{_NAME}: lr must be a Python number, got a tensor")


def _backward_step(optimizer_ref, param) -> None:
    """The post-accumulate-grad hook of step_in_backward (a weak reference: the hook keeps no optimizer alive)."""
    optimizer = optimizer_ref()
    if optimizer is not None:
        optimizer._step_one(param)


def _total_norm_of(grads) -> torch.Tensor:
    """The 2-norm over `grads` (any devices and dtypes), on the first one's device: one pass per (device, dtype)."""
    device = grads[0].device
    by_kind = {}
    for g in grads:
        by_kind.setdefault((g.device, g.dtype), []).append(g)
    sq = [_ops.grad_norm(gs).square().to(device) for gs in by_kind.values()]
    return (torch.stack(sq).sum() if len(sq) > 1 else sq[0]).sqrt()


def _is_dtensor(t) -> bool:
    return type(t).__name__ == "DTensor" and torch.distributed.is_available()


def _same(t):
    return t


def _local(t):
    """A DTensor's local shard (a view of its storage: updating it updates the DTensor), or t itself."""
    return t.to_local() if _is_dtensor(t) else t


def _mesh_of(params, clipping: bool):
    """(device mesh, placements) shared by DTensor parameters, None without DTensors. Clipping sums the shards'
    squares over the sharded mesh dimensions, so it needs every parameter on one mesh with one placement (FSDP2
    over the whole model); Replicate and Shard placements only."""
    dtensors = [p for p in params if _is_dtensor(p)]
    if not dtensors:
        return None
    mesh, placements = dtensors[0].device_mesh, tuple(dtensors[0].placements)
    if clipping:
        from torch.distributed.tensor import Replicate, Shard

        if len(dtensors) != len(params) or any(p.device_mesh != mesh or tuple(p.placements) != placements
                                               for p in dtensors):
            raise ValueError("tigon.optim.AdamW: max_grad_norm with DTensor parameters needs every parameter to be "
                             "a DTensor on one device mesh with one placement (FSDP2's fully_shard over the model)")
        if not all(isinstance(pl, (Shard, Replicate)) for pl in placements):
            raise ValueError(f"tigon.optim.AdamW: max_grad_norm supports Shard and Replicate placements, got "
                             f"{placements}")
    return mesh, placements


def _check(lists) -> None:
    """The layout contract for one subgroup's (params, grads, exp_avgs, exp_avg_sqs, masters)."""
    _adamw.check_lists("tigon.optim.AdamW", *lists[:4])
    _adamw.check_master("tigon.optim.AdamW", lists[0], lists[4] or None)
