"""CUDA-graph capture that leaves the GPU running.

`torch.cuda.graph` synchronizes the device and empties the allocator's cache before it captures, to free memory
for the graph. In a decode loop that stops the GPU for the whole capture: the host records the step (tens of ms
of Python at 8B) while nothing runs, the GPU drops to its idle clock, and the first replays after it run slower
(docs/generation.md, "Latency right after the capture"). `capture` begins and ends the capture on the given side
stream directly: the prefill and the eager first step queued before it keep the GPU busy while the host records,
and the captured work never runs during capture, so it needs no order against them. The graph's replay is
ordered on the stream it is replayed on, as with `torch.cuda.graph`.
"""

import contextlib

import torch


def warm_up(fn):
    """Run `fn()` once eagerly on a new side stream, ordered after the current stream's work and before its later
    work, and return (that stream, fn's result). What capture wants first: cuBLAS's handle and workspace for the
    stream exist, lazy initializations are done; the result is the step's real one."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = fn()
    torch.cuda.current_stream().wait_stream(stream)
    return stream, out


@contextlib.contextmanager
def capture(graph, stream, pool=None):
    """Capture the CUDA work issued inside the block on `stream` (a side stream, never the default one) into
    `graph`, allocating from `pool` (a `torch.cuda.graph_pool_handle()`; None: the graph's own pool). No device
    synchronize and no cache release before it. The capture ends when the block does, also when it raises."""
    with torch.cuda.stream(stream):
        if pool is None:
            graph.capture_begin()
        else:
            graph.capture_begin(pool=pool)
        try:
            yield graph
        finally:
            graph.capture_end()
