"""DecodeSettings: how `tigon.generate` runs its loop, one frozen value passed in (`settings=`).

None of these changes the tokens: they trade host syncs, kernels per step and tracing hooks. What to generate
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
    prefill_graphs: how many recorded prefills (`tigon.decode.prefill_graph`: a CUDA graph of the prefill of a
        short unpadded prompt, its padded length and cache kept with the model, replayed by later calls of that
        shape) a model keeps; 0 records none. Each holds its cache (the ring's K/V) and the graph's activations.
    prefill_graph_tokens: the largest padded prompt, over the batch (batch x length rounded up to the bucket), that
        is recorded. Past ~2k tokens at 8B the prefill's kernels outlast the host's launches and a graph gains little.
    prefill_graph_bucket: a recorded prompt is padded on the right to a multiple of this many tokens (and a
        recording's default ring to one of the call's length): larger, fewer recordings serve more lengths, at up to
        bucket - 1 padded rows of prefill work.
    on_capture: called with no arguments right after the decode step's CUDA graph is captured, before its
        first replay (a profiler starts its trace there: it must never run over a capturing stream).
    """

    eos_check_every: int = 16
    rotary_table: bool = True
    fused_layers: bool = True
    prefill_graphs: int = 2
    prefill_graph_tokens: int = 2048
    prefill_graph_bucket: int = 64
    on_capture: Callable[[], None] | None = None

    def __post_init__(self):
        for name, least in (("prefill_graphs", 0), ("prefill_graph_tokens", 0), ("prefill_graph_bucket", 1)):
            value = getattr(self, name)
            if not _is_int(value) or value < least:
                raise ValueError(f"DecodeSettings: {name} must be an int >= {least}, got {value!r}")
        if not _is_int(self.eos_check_every) or self.eos_check_every < 1:
            raise ValueError(f"DecodeSettings: eos_check_every must be an int >= 1, got {self.eos_check_every!r}")
        for name in ("rotary_table", "fused_layers"):
            value = getattr(self, name)
            if not isinstance(value, bool):
                raise TypeError(f"DecodeSettings: {name} must be True or False, got {type(value).__name__} "
                                f"{value!r}")
        if self.on_capture is not None and not callable(self.on_capture):
            raise TypeError(f"DecodeSettings: on_capture must be a callable or None, got "
                            f"{type(self.on_capture).__name__}")


DEFAULT = DecodeSettings()
