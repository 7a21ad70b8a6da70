"""DecodeSettings: how `tigon.generate` runs its loop, one frozen value passed in (`settings=`).

None of these changes the math: they trade host syncs, kernels per step, attention backends and tracing hooks
(a backend rounds differently; bf16 logits may then break a near-tie another way). What to generate
(lengths, sampling, stop ids, the ring size, whether to replay a CUDA graph) stays in generate's arguments.
"""

import dataclasses
from collections.abc import Callable


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """Settings of the decode loop (`tigon.generate(..., settings=DecodeSettings(...))`).

    eos_check_every: the host reads the device's `finished` mask every this many steps (one sync each); once
        every row is done at most eos_check_every - 1 steps are wasted. 16 is < 1% of a ~10 us graph step's
        launch stream.
    rotary_table: the rotary module reads cos/sin from a table its own forward computed once for the call
        (`tigon.decode.rotary_table`): one gather per step instead of ~8 kernels. False runs HF's module.
    fused_layers: install the fused decoder-layer step (`tigon.decode.layer_step`) on the layers of a patched
        model for the call (a model patched by `tigon.patch(model)` has it already). False runs the layers'
        module-by-module forward.
    flash_prefill_tokens: on CUDA, a prompt of at most this many tokens prefills with SDPA's backends in the order
        FlashAttention-2, cuDNN, memory-efficient, math (0: SDPA's own order, cuDNN first on Hopper). cuDNN builds
        an execution plan for every new prompt length and K/V stride, 45-80 ms on the H200 at 508-8191 tokens,
        where flash takes 0.2-4 ms; warm, flash costs 1.3-1.6x cuDNN's attention at ~510 tokens and 1.9x at 8191
        (benchmarks/sdpa_new_shapes.py, docs/generation.md). Default 2048.
    on_capture: called with no arguments right after the decode step's CUDA graph is captured, before its
        first replay (a profiler starts its trace there: it must never run over a capturing stream).
    """

    eos_check_every: int = 16
    rotary_table: bool = True
    fused_layers: bool = True
    flash_prefill_tokens: int = 2048
    on_capture: Callable[[], None] | None = None

    def __post_init__(self):
        if not _is_int(self.eos_check_every) or self.eos_check_every < 1:
            raise ValueError(f"DecodeSettings: eos_check_every must be an int >= 1, got {self.eos_check_every!r}")
        if not _is_int(self.flash_prefill_tokens) or self.flash_prefill_tokens < 0:
            raise ValueError(f"DecodeSettings: flash_prefill_tokens must be an int >= 0, got "
                             f"{self.flash_prefill_tokens!r}")
        for name in ("rotary_table", "fused_layers"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"DecodeSettings: {name} must be True or False, got {type(value).__name__} "
                                f"{value!r}")
        if self.on_capture is not None and not callable(self.on_capture):
            raise TypeError(f"DecodeSettings: on_capture must be a callable or None, got "
                            f"{type(self.on_capture).__name__}")


DEFAULT = DecodeSettings()
