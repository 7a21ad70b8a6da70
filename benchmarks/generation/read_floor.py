"""The read floor of a quantized weight: the fastest a Triton kernel that only reads its packed codes takes.

`quant_linear`'s decode launches cost a fixed few microseconds plus a rate per byte below the copy ceiling
(docs/ops/quant_linear.md, "Where a decode launch's time goes"). A kernel that reads the same words and does
nothing with them but a running XOR, timed the same way (a CUDA graph over weight copies past the L2), splits that
cost: what any kernel pays to stream these bytes at this size (launch, the first loads' trip, the tail of the
grid) against what the GEMV's own structure adds. The codes only (`QuantizedWeight.data`, 97% of an int4 g128
weight's bytes); each program reads STEPS blocks of BLOCK int32 words in turn and writes their XOR.
"""

import os

import torch
import triton
import triton.language as tl

# (words a block, blocks a program, warps): one program per few KB up to 64 KB a program
GRID = [(block, steps, warps) for block in (1024, 2048, 4096) for steps in (1, 2, 4, 8) for warps in (4, 8)]


@triton.jit
def _read_words_kernel(W, OUT, n_words, BLOCK: tl.constexpr, STEPS: tl.constexpr):
    pid = tl.program_id(0)
    start = pid.to(tl.int64) * (BLOCK * STEPS)
    acc = tl.zeros([BLOCK], dtype=tl.int32)
    for s in range(STEPS):
        o = start + s * BLOCK + tl.arange(0, BLOCK)
        acc ^= tl.load(W + o, mask=o < n_words, other=0)
    tl.store(OUT + pid, tl.xor_sum(acc, axis=0))


def words(qw) -> torch.Tensor:
    """The weight's packed codes as int32 words (the bytes a kernel streams; a tail under 4 bytes left out)."""
    flat = qw.data.contiguous().view(torch.uint8).reshape(-1)
    return flat[: flat.numel() // 4 * 4].view(torch.int32)


def runs_on(device: torch.device) -> bool:
    """Whether the probe's Triton kernel can take tensors on `device`: a GPU, or any device under the interpreter."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def read_xors(w: torch.Tensor, block: int, steps: int, warps: int) -> torch.Tensor:
    """Each program's XOR of its words: the kernel's output, for checking it read them all."""
    if not runs_on(w.device):
        raise ValueError(f"read_xors: w must be a CUDA tensor (or Triton's interpreter on), got one on {w.device}")
    n = w.numel()
    programs = triton.cdiv(n, block * steps)
    out = torch.empty(programs, dtype=torch.int32, device=w.device)
    _read_words_kernel[(programs,)](w, out, n, BLOCK=block, STEPS=steps, num_warps=warps)
    return out


def read_floor(graph_bench, qw, grid=GRID) -> dict:
    """The fastest read of qw's codes over `grid`: {ms, block, steps, warps, bytes}. graph_bench(call, weight)
    times call on copies of weight in one CUDA graph (bench_quant_linear.graph_timer)."""
    best = None
    for block, steps, warps in grid:
        ms = graph_bench(lambda w, b=block, s=steps, nw=warps: read_xors(words(w), b, s, nw), qw)
        if best is None or ms < best["ms"]:
            best = dict(ms=ms, block=block, steps=steps, warps=warps)
    return dict(best, bytes=words(qw).numel() * 4)
