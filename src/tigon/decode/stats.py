"""The statistics of a `tigon.generate` call: the step clock, the TTFT phases, the one percentile rule.

`percentile` is the rule every p50/p99 of Tigon uses (the stats, their Prometheus gauges,
benchmarks/generation/bench_decode.py): nearest rank, `sorted[ceil(q * n) - 1]`, the smallest value with at least a
fraction q of the values at or below it. (For the benchmark's 255 decode steps it picks the element the peer
benchmarks' index rule `sorted[int(q * n)]` picks, at q = 0.5 and 0.99; the two rules part only where q * n is an
integer.)
"""

import math
import time

import torch

TTFT_PHASES = ("attention_switch", "cache_alloc", "prompt_setup", "prefill", "first_token")


class Clock:
    """Step boundaries: CUDA events (read once at the end) on CUDA, perf_counter on the host otherwise.

    `phase(name)` also closes one TTFT phase (TTFT_PHASES, in order): a stamp like `mark` plus the host's
    perf_counter, so each phase has a device interval (when the stream reached its boundaries) and a host
    wall time. The last phase's stamp is the TTFT end mark, so the phases sum to ttft_s."""

    def __init__(self, device):
        self.cuda = device.type == "cuda"
        self.marks = []
        self.phases = []  # (name, stamp, host perf_counter)
        self.host_start = None

    def _stamp(self):
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def _delta(self, a, b):
        return a.elapsed_time(b) / 1e3 if self.cuda else b - a

    def mark(self):
        stamp = self._stamp()
        self.marks.append(stamp)
        if len(self.marks) == 1:
            self.host_start = time.perf_counter() if self.cuda else stamp

    def phase(self, name):
        stamp = self._stamp()
        self.phases.append((name, stamp, time.perf_counter() if self.cuda else stamp))
        return stamp

    def seconds(self):
        if self.cuda:
            self.marks[-1].synchronize()
        return [self._delta(a, b) for a, b in zip(self.marks, self.marks[1:])]

    def phase_seconds(self):
        """({phase: device-interval seconds}, {phase: host wall seconds}); call after `seconds()`."""
        device, host = {}, {}
        prev, prev_host = self.marks[0], self.host_start
        for name, stamp, host_t in self.phases:
            device[name] = self._delta(prev, stamp)
            host[name] = host_t - prev_host
            prev, prev_host = stamp, host_t
        return device, host


def percentile(sorted_values, q):
    """The nearest-rank q-quantile (0 < q <= 1) of an ascending sequence; None when it is empty."""
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


def summary(clock, *, batch, new_tokens, device, cuda_graph, rotary_tables):
    """The stats dict of a call (keys in docs/generation.md); reads the clock's events (one sync on CUDA)."""
    lat = clock.seconds()
    ttft_phases, ttft_host_phases = clock.phase_seconds()
    ttft, step_s = lat[0], lat[1:]  # every step that ran, including any after the last EOS
    elapsed = ttft + sum(step_s)
    ordered = sorted(step_s)
    return dict(
        ttft_s=ttft, ttft_phases_s=ttft_phases, ttft_host_phases_s=ttft_host_phases, step_s=step_s,
        p50_step_s=percentile(ordered, 0.5), p99_step_s=percentile(ordered, 0.99),
        tokens_per_s=batch * new_tokens / elapsed if elapsed > 0 else float("inf"),
        decode_tokens_per_s=batch * len(step_s) / sum(step_s) if sum(step_s) > 0 else None,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        new_tokens=new_tokens, batch_size=batch, cuda_graph=cuda_graph, rotary_tables=rotary_tables)
