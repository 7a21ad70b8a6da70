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



def eager_body(custom_op, *tensors):
    """The Python body of a torch.library custom op, to call directly in eager inference: the dispatcher and
    the autograd wrapper cost ~140 us of host time per call (measured in a 1.5B Llama prefill on an H200,
    torch 2.11), more than the kernel. None (use the op) while compiling or when any of `tensors` needs grad."""
    if torch.compiler.is_compiling():
        return None
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        return None
    return getattr(custom_op, "_init_fn", None)
