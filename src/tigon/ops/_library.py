"""The one place that decides which implementation runs, and the torch.library namespace.

Dispatch rule (the op contract):
- CUDA tensors run the Triton kernels;
- CPU tensors run the Triton kernels through Triton's interpreter when TRITON_INTERPRET=1;
- anything else runs the pure-PyTorch reference (`tigon.ops.reference`), and one log line says so.

Every public op records the path it took in `dispatch_counts`, so a test can prove which one ran. On the kernel
path, `dispatch` picks between an op's custom op, its autograd.Function and its plain launcher.

An op file writes its launchers, fakes, setup and backward; `Kernel` and `Op` build the rest from them: the
custom op `tigon::<name>` with its fake and registered autograd, and the eager autograd.Function twin over the
same launcher, setup and backward. custom_op, not triton_op: Inductor adds no fusion into a user Triton kernel,
and the launchers hold host logic and launch options (PDL, partial-sum reductions) that its kernel tracing
would have to take apart, so an opaque node loses nothing and keeps one launcher for every path.
"""

import collections
import functools
import inspect
import logging
import os
import sys

import torch

logger = logging.getLogger("tigon")

# (op name, path) -> number of eager calls; path is "triton" or "reference".
dispatch_counts: collections.Counter = collections.Counter()
_warned_reference = False


def interpreter_on() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def validation_on() -> bool:
    """Extra data-dependent checks (they sync the host); always on for the CPU paths."""
    return os.environ.get("TIGON_VALIDATE", "0") not in ("", "0")


def backend_for(device: torch.device | str) -> str:
    """'triton' when the Triton kernels run for tensors on `device`, else 'reference'. `device`: a torch.device or
    a device string as torch takes it ("cuda", "cuda:1", "cpu"); a tensor's is `t.device`."""
    if not isinstance(device, torch.device):
        device = _as_device(device)
    if device.type == "cuda":
        return "triton"
    if device.type == "cpu" and interpreter_on():
        return "triton"
    return "reference"


def _as_device(device) -> torch.device:
    if not isinstance(device, str):
        hint = " (pass t.device)" if isinstance(device, torch.Tensor) else ""
        raise TypeError(f"tigon.ops.backend_for: device must be a torch.device or a device string such as 'cuda' or "
                        f"'cpu', got {type(device).__name__}{hint}")
    try:
        return torch.device(device)
    except RuntimeError:
        raise ValueError(f"tigon.ops.backend_for: device {device!r} is not a device string torch knows (such as "
                         "'cuda', 'cuda:1' or 'cpu')") from None


def use_kernels(op: str, x: torch.Tensor) -> bool:
    """Choose the path for `op` on the device of `x` and record the choice."""
    path = backend_for(x.device)
    record(op, path)
    if path == "reference" and not torch.compiler.is_compiling():
        _note_reference(x.device)
    return path == "triton"


def _note_reference(device: torch.device) -> None:
    global _warned_reference
    if not _warned_reference:
        _warned_reference = True
        logger.info(  # INFO: a CPU run is expected, not a problem to warn about on every start
            "tigon: Triton kernels are off for %s tensors; running the PyTorch reference ops "
            "(set TRITON_INTERPRET=1 to run the kernels on CPU through Triton's interpreter)",
            device.type,
        )


def record(op: str, path: str) -> None:
    """Count one eager call of `op` on `path` ("triton" or "reference"); nothing while torch.compile traces."""
    if not torch.compiler.is_compiling():
        dispatch_counts[(op, path)] += 1


def needs_grad(*tensors) -> bool:
    """Whether autograd will want a gradient of any of `tensors` (None entries are skipped)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def dispatch(op, function, launcher, *args, grad_from=()):
    """Run one call of an op by the cheapest path that is correct, the same rule for every op:

    - while torch.compile traces: `op(*args)`, the torch.library custom op (or a function that ends in one):
      one graph node, no graph break;
    - eager, and a tensor of `grad_from` needs a gradient: `function.apply(*args)`, the op's autograd.Function
      over the same launchers; with function None, the custom op itself (its registered autograd is the rule);
    - eager otherwise (inference, or a backward pass, where grad mode is off): `launcher(*args)`, the plain
      Python launcher the custom op wraps.

    Why not always the custom op: its dispatcher and autograd wrapper cost ~140 us of host time per call
    (measured in a 1.5B Llama prefill on an H200, torch 2.11), more than the kernel at decode shapes, and
    `Function.apply` saves the dispatcher's ~15-20 us per fwd+bwd (measured on a CPU; small ops are host-bound
    at Llama-8B shapes). All three paths run the same launcher, so their outputs are bitwise the same."""
    if torch.compiler.is_compiling():
        return op(*args)
    if needs_grad(*grad_from):
        return function.apply(*args) if function is not None else op(*args)
    return launcher(*args)


def tracing() -> bool:
    """True while torch.compile traces: the one place the ops and modules ask."""
    return torch.compiler.is_compiling()


class Kernel:
    """A launcher registered as the custom op `tigon::<name>` with its fake (shapes, dtypes, no data).

    `kernel(*args)`: the custom op while torch.compile traces (one graph node), else the launcher itself (no
    dispatcher: see `dispatch`). `kernel.on(ctx)`: the one a backward calls, the custom op in an `Op`'s registered
    autograd (which AOTAutograd traces) and the launcher in its eager twin. The launcher's annotations are the
    op's schema. An eager call bumps the version of each argument in mutates_args, as the custom op would: a node
    that saved one then fails loudly ("modified by an inplace operation") instead of reading what was written;
    bump_versions=False where no graph can hold them (an optimizer's state: one host call a tensor saved)."""

    def __init__(self, name, launch, fake, *, mutates_args=(), bump_versions=True):
        self.name, self.launch = name, _late_bound(launch)
        self.op = torch.library.custom_op(f"tigon::{name}", self.launch, mutates_args=mutates_args)
        self.op.register_fake(fake)
        params = list(inspect.signature(launch).parameters)
        self._mutated = tuple(params.index(a) for a in mutates_args) if bump_versions else ()

    def eager(self, *args):
        out = self.launch(*args)
        for i in self._mutated:
            _bump_versions(args[i] if i < len(args) else None)
        return out

    def __call__(self, *args):
        return dispatch(self.op, None, self.eager, *args)  # no grad_from: the op when traced, else the launcher

    def on(self, ctx):
        return self.eager if getattr(ctx, "eager_twin", False) else self.op


def _late_bound(launch):
    """`launch` looked up in its module at each call, as the module's own code would call it: every path of the
    op runs whatever the module holds under that name (a test may wrap a launcher to record its calls). Its
    signature and annotations stay `launch`'s (they are the custom op's schema)."""
    module, name = sys.modules[launch.__module__], launch.__name__

    @functools.wraps(launch)
    def call(*args):
        return getattr(module, name)(*args)

    return call


def _bump_versions(t):
    if isinstance(t, torch.Tensor):
        torch.autograd.graph.increment_version(t)
    elif isinstance(t, (list, tuple)):
        for x in t:
            _bump_versions(x)


class Op(Kernel):
    """A differentiable `Kernel`: `setup(ctx, inputs, output)` and `backward(ctx, *grad_outputs)` become the
    custom op's registered autograd (what torch.compile traces) and an autograd.Function twin (`.function`,
    what eager training runs) whose forward is the launcher followed by the same setup. Both paths run the same
    launcher, setup and backward, so their outputs and gradients are the same bits; a backward launches its own
    kernels through `Kernel.on(ctx)`. `op(*args, grad_from=...)` runs one call by the `dispatch` rule."""

    def __init__(self, name, launch, fake, setup, backward):
        super().__init__(name, launch, fake)
        self.op.register_autograd(backward, setup_context=setup)

        def forward(ctx, *inputs):
            out = self.launch(*inputs)
            ctx.eager_twin = True
            setup(ctx, inputs, out)
            return out

        self.function = type(f"{name}_function", (torch.autograd.Function,),
                             {"forward": staticmethod(forward), "backward": staticmethod(backward),
                              "__doc__": f"tigon::{name} in eager mode: its launcher, setup and backward."})

    def __call__(self, *args, grad_from=()):
        return dispatch(self.op, self.function, self.launch, *args, grad_from=grad_from)

    def on(self, ctx):
        """For a backward that runs this op itself (a linear map's transpose): the custom op when traced, else
        this op by the dispatch rule, so that under create_graph=True the gradient has a graph."""
        if not getattr(ctx, "eager_twin", False):
            return self.op
        return lambda *args: self(*args, grad_from=[a for a in args if isinstance(a, torch.Tensor)])


def double_backward() -> bool:
    """True inside an eager backward run with create_graph=True (the only time a backward runs with grad mode
    on): the op must then build its gradients from differentiable ops (`reference_grads`) or refuse."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


def host_checks(device: torch.device) -> bool:
    """Data-dependent input checks that read tensors on the host: never while tracing (a sync the graph cannot
    hold), always on CPU, on CUDA only with TIGON_VALIDATE=1 (a host sync per call)."""
    return not torch.compiler.is_compiling() and (device.type != "cuda" or validation_on())


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
    if double_backward():
        raise NotImplementedError(
            f"{op}: double backward (create_graph=True) is not supported: its gradient comes from Triton "
            "kernels that autograd cannot differentiate; build a gradient penalty or a Hessian through this "
            "op from PyTorch ops instead"
        )


class _FirstOrderOnly(torch.autograd.Function):
    """Identity whose backward refuses create_graph=True, so the reference path of a loss refuses double backward
    exactly as its kernel path does (the two paths accept and refuse the same things).

    The output is a new tensor, not a view of x: the kernel path's loss is a fresh tensor that callers may modify
    in place (the Trainer scales its loss with `loss *= ...`), and autograd refuses an in-place write to the
    output of a Function that returns a view. The copy is a scalar or one value a row (a [N] loss)."""

    @staticmethod
    def forward(ctx, x, op):
        ctx.op = op
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        refuse_double_backward(ctx.op)
        return grad, None


def first_order_only(op, x):
    """x, with a backward that raises under create_graph=True (see refuse_double_backward)."""
    return _FirstOrderOnly.apply(x, op) if x.requires_grad else x
