"""The one place that decides which implementation runs, and the torch.library namespace.

Dispatch rule (the op contract):
- CUDA tensors run the Triton kernels;
- CPU tensors run the Triton kernels through Triton's interpreter when TRITON_INTERPRET=1;
- anything else runs the pure-PyTorch reference (`tigon.ops.reference`), and one log line says so.

Every public op records the path it took in `dispatch_counts`, so a test can prove which one ran.
"""

import collections
import logging
import os

import torch

NAMESPACE = "tigon"
logger = logging.getLogger("tigon")

# (op name, path) -> number of eager calls; path is "triton" or "reference".
dispatch_counts: collections.Counter = collections.Counter()
_warned_reference = False


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def validation_on() -> bool:
    """Extra data-dependent checks (they sync the host); always on for the CPU paths."""
    return os.environ.get("TIGON_VALIDATE", "0") not in ("", "0")


def backend_for(device: torch.device) -> str:
    """'triton' when the Triton kernels run for tensors on `device`, else 'reference'."""
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpreter_on():
        return "triton"
    return "reference"


def use_kernels(op: str, x: torch.Tensor) -> bool:
    """Choose the path for `op` on the device of `x` and record the choice."""
    path = backend_for(x.device)
    if not torch.compiler.is_compiling():
        dispatch_counts[(op, path)] += 1
        if path == "reference":
            _note_reference(x.device)
    return path == "triton"


def _note_reference(device: torch.device) -> None:
    global _warned_reference
    if not _warned_reference:
        _warned_reference = True
        logger.warning(
            "tigon: Triton kernels are off for %s tensors; running the PyTorch reference ops "
            "(set TRITON_INTERPRET=1 to run the kernels on CPU through Triton's interpreter)",
            device.type,
        )


def op_name(name: str) -> str:
    return f"{NAMESPACE}::{name}"


def call(op, function, *args):
    """Run an op: its torch.library custom op while torch.compile traces (one graph node, no break), else
    its autograd.Function, which runs the same launchers and saves the custom-op dispatcher's host time
    (~15-20 us per fwd+bwd measured on a CPU; small ops are host-bound at Llama-8B shapes)."""
    if torch.compiler.is_compiling():
        return op(*args)
    return function.apply(*args)


def reference_grads(fn, args, needs, grad_outputs):
    """Backward under create_graph=True, for ops whose saved tensors are enough to recompute the forward:
    the gradients of fn(*args) (the PyTorch reference) against grad_outputs, built from differentiable ops
    on the saved tensors, so that a gradient penalty or a Hessian-vector product sees the true second
    derivative. needs[i]: whether args[i] gets a gradient. Returns one entry per arg (None where not needed)."""
    wanted = [i for i, (a, n) in enumerate(zip(args, needs)) if n and a is not None and a.requires_grad]
    grads = [None] * len(args)
    if not wanted:
        return grads
    with torch.enable_grad():
        # Fresh aliases are where the recompute's graph starts: autograd.grad stops there. On the saved
        # tensors themselves it would also walk their history, and a saved output (add_rms_norm's sum) leads
        # back into the node running this backward, which would then run again, without end.
        args = [a.view_as(a) if a is not None and a.requires_grad else a for a in args]
        outs = fn(*args)
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    pairs = [(o, g) for o, g in zip(outs, grad_outputs) if g is not None and o.requires_grad]
    got = [None] * len(wanted)
    if pairs:
        got = torch.autograd.grad([o for o, _ in pairs], [args[i] for i in wanted], [g for _, g in pairs],
                                  create_graph=True, allow_unused=True)
    for i, g in zip(wanted, got):
        grads[i] = torch.zeros_like(args[i]) if g is None else g
    return grads


def refuse_double_backward(op):
    """Call first in the backward of an op whose gradients come from kernels with no graph (the losses make
    them in the forward and keep nothing else). Under create_graph=True (the only time a backward runs with
    grad mode on) it raises, naming the op: a gradient with no graph would make a gradient penalty or a
    Hessian through the op silently zero."""
    if torch.is_grad_enabled() and not torch.compiler.is_compiling():
        raise NotImplementedError(
            f"{op}: double backward (create_graph=True) is not supported: its gradient comes from Triton "
            "kernels that autograd cannot differentiate; build a gradient penalty or a Hessian through this "
            "op from PyTorch ops instead"
        )


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses create_graph=True, so the reference path of a loss refuses double backward
    exactly as its kernel path does (the two paths accept and refuse the same things)."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(ctx.op)
        return grad, None


def first_order_only(op, x):
    """x, with a backward that raises under create_graph=True (see refuse_double_backward)."""
    return _FirstOrderOnly.apply(x, op) if x.requires_grad else x


def eager_body(custom_op, *tensors):
    """The Python body of a torch.library custom op, to call directly in eager inference: the dispatcher and
    the autograd wrapper cost ~140 us of host time per call (measured in a 1.5B Llama prefill on an H200,
    torch 2.11), more than the kernel. None (use the op) while compiling or when any of `tensors` needs grad."""
    if torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    return getattr(custom_op, "_init_fn", None)
