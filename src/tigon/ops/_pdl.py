"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A decode step is a chain of small kernels, each reading the rows the previous one wrote. Launched in plain
stream order, a kernel starts only once the previous kernel has finished and its launch has gone through: HBM
idles through that gap and through the previous kernel's last programs. Launched with `launch_pdl=True`, a kernel
may start once every program of the previous one has called `start` (or exited); its programs set up and block in
`wait` until the previous kernel has completed and its writes are visible. Every read of another kernel's output
and every store comes after `wait`, so a kernel still sees the whole chain's results (a kernel cannot complete
before its own `wait` returns).

Where `start` goes was measured on the H200 (docs/generation.md, "Overlapping the launches"): the projections
and the attention call it after their main loop (their weights and K/V read), the short kernels (the RoPE write,
the split merge, the RMSNorm) not at all, so they release the next kernel when they exit. Called first thing in
every kernel, the chain ran ahead by several launches and the waiting programs crowded the SMs (the 1.5B step
1.052 -> 1.109 ms at batch 1); called first thing in the short kernels only, the 8B batch-8 step still lost (4.819
-> 4.932); placed as here, 1.047 -> 1.010 and 4.821 -> 4.726. Prefetching the first weight tiles into L2 before
`wait` gained nothing measurable.

The instructions need sm_90; the interpreter has no inline assembly, so the kernels take `PDL` as a constexpr
and launch with it only on such GPUs (`enabled`).
"""

import functools

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # Triton < 3.3 has no grid dependency control (nor the launch_pdl option): PDL stays off
    gdc_launch_dependents = gdc_wait = None


@functools.lru_cache(maxsize=16)
def _capable(index: int) -> bool:
    return (gdc_wait is not None and torch.version.hip is None
            and torch.cuda.get_device_capability(index) >= (9, 0))


def enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL: a CUDA GPU of compute capability 9.0 or later, and a Triton
    that has it."""
    return device.type == "cuda" and _capable(device.index if device.index is not None else torch.cuda.current_device())


def launch_options(pdl: bool) -> dict:
    """The launch keyword for `kernel[grid](...)`: none without PDL (a Triton without it refuses the option)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def start(PDL: tl.constexpr):
    """Let the next kernel's programs launch (once every program of this one has called it)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait(PDL: tl.constexpr):
    """Block until the previous kernel has completed and its memory is visible."""
    if PDL:
        gdc_wait()

