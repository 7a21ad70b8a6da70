"""Programmatic dependent launch (PDL, Hopper and later) for the decode-step kernels.

A decode step is a chain of small kernels (projection, RoPE + cache write, attention, projection, ...),
each too short to hide the next one's launch and ramp-up. With PDL a kernel is launched with the
`launch_pdl` attribute and may start while its predecessor still runs; inside, `gdc_wait()` blocks until the
predecessor has finished and its writes are visible, and `gdc_launch_dependents()` lets the successor launch.
The kernels that take part (decode_linear, rope_kv_append / rope_kv_write, decode_attention):
- read nothing another kernel writes before `gdc_wait()` (a projection only prefetches its weights into L2
  there, which no kernel writes);
- the short ones (RoPE, attention) let their successor launch first thing, so a projection behind
  them is resident early and streams its weights into L2 while they run; a projection lets its successor
  launch only once it has passed its own wait, so at most one big weight is prefetched ahead.
A kernel launched without the attribute (the first in a chain, or any kernel on an older GPU) passes its
`gdc_wait()` at once: stream order holds as usual. Off (PDL=False constexpr) on CPU and before sm_90.
"""

import torch

from . import _library

try:  # absent from older Tritons
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover
    gdc_launch_dependents = gdc_wait = None

# Off by default: on the 1.5B Llama decode step (H200, benchmarks/results/decode_pdl.md) PDL on the whole chain
# measured no faster than plain launches in a CUDA graph, and on the projections alone ~8% slower.
ENABLED = False  # None: on for sm >= 90 where Triton has it; False: off everywhere


def options(device) -> dict:
    """Launch options: PDL constexpr, and the launch attribute when on."""
    on = ENABLED
    if on is None:
        on = (device.type == "cuda" and gdc_wait is not None
              and torch.cuda.get_device_capability(device)[0] >= 9)
    on = bool(on) and device.type == "cuda"
    return dict(PDL=True, launch_pdl=True) if on else dict(PDL=False)


def launch(kernel, grid, args, meta, device):
    """kernel[grid](*args, **meta) with PDL where available. A Triton or driver that refuses the launch with
    PDL: if the plain launch works, PDL is turned off for the process (logged once); if it fails too, that
    error is the real one and the switch is left as it was."""
    pdl = options(device)
    try:
        return kernel[grid](*args, **meta, **pdl)
    except Exception as e:
        if not pdl["PDL"]:
            raise
        out = kernel[grid](*args, **meta, PDL=False)
        global ENABLED
        ENABLED = False
        _library.logger.warning("tigon: decode kernels run without programmatic dependent launch (%s: %s)",
                                type(e).__name__, str(e)[:200])
        return out
