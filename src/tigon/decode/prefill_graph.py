"""Recorded prefills: a short prompt's prefill replayed from a CUDA graph over a cache kept with the model.

A prefill of a few hundred tokens is bound by the host: at Llama-3-8B / 512 tokens / batch 1 the fused prefill
(`layer_step.prefill_layer_step`) takes ~12 ms of kernels and ~26 ms of Python to launch them (docs/
generation.md). `tigon.generate` therefore records such a prefill once per shape and replays it:

- the prompt is padded on the right to a multiple of `settings.prefill_graph_bucket` tokens (`L`, default 64), so
  prompts of nearby lengths share one recording. Causal attention keeps the real rows blind to the padding; the
  padded rows' keys and values land in ring slots past the prompt, and `RollingKVCache.keep_first` empties those
  slots again at the end of the graph. The model's last layer computes the last real row only
  (`RollingKVCache.prefill_rows`, a device count);
- the recording owns its inputs (ids `[B, L]`, positions, the real-row count), its logits and its cache (a ring of
  `capacity` slots, or the call's length rounded up to the bucket), all reused by every replay: a replay is one
  copy of the ids, one fill of the count, the graph, and the host counters set to the prompt length;
- a recording is made only where the whole prefill runs the fused layer step (every layer: nothing else is known
  to be free of host syncs, and the padded rows must not reach a layer that computes the last position by
  shape). Its first call runs the same function eagerly (that is the call's result) and then captures it.

A recording is valid while the model's weights stay where they were recorded (`data_ptr` of every parameter and
buffer), its attention implementation and fused layer steps are the same, and the call's settings match; a call
that finds one stale records again. Recordings (and their caches and graph memory) stay with the model
(`kept.py`) until `tigon.decode.release(model)`; at most `DecodeSettings.prefill_graphs` per model, least recently
used first out. One call at a time uses a recording; a concurrent call on the same model runs the eager prefill.
"""

import torch

from ..ops._launch import cdiv
from .capture import capture, warm_up
from .kept import kept
from .layer_step import LAYER_STEP


class _Recording:
    """One recorded prefill: its static inputs and outputs, its cache and its graph (None while refused)."""

    def __init__(self, cache, ids, positions, rows, layers, tables):
        self.cache, self.ids, self.positions, self.rows = cache, ids, positions, rows
        self.layers = layers  # the layers holding a fused step when recorded
        self.tables = list(tables)  # the rotary tables the graph reads: kept alive with it
        self.graph = self.logits = None
        self.busy = False


def _fingerprint(model, layers):
    """What a recording's validity rests on: the attention implementation, where every parameter and buffer lies
    and the recorded layers' fused steps. Checked every call, so one walk of the module tree that builds no names
    (`parameters()` and `buffers()` walk it twice with their names: 0.8-0.9 ms of host time at Llama-3-8B's tree,
    against a replayed prefill's ~12 ms; this walk 0.2)."""
    pointers = []
    _pointers(model, pointers)
    return (getattr(model.config, "_attn_implementation", None), tuple(pointers),
            tuple(layer.__dict__.get(LAYER_STEP) for layer in layers))


def _pointers(module, out):
    """Append the data_ptr of `module`'s parameters and buffers, then its children's, depth first."""
    for tensors in (module._parameters, module._buffers):
        for t in tensors.values():
            if t is not None:
                out.append(t.data_ptr())
    for child in module._modules.values():
        if child is not None:
            _pointers(child, out)


def _decoder_layers(model):
    return [m for m in model.modules() if LAYER_STEP in m.__dict__]


class Plan:
    """How one generate call prefills through a recording: `length` (the padded prompt), `ring` (its cache's
    capacity), `recording`: the one this call replays, else None until `record` makes it (busy until `release`),
    `state`: the model's `kept.Kept`."""

    def __init__(self, state, key, length, ring, recording, limit):
        self.state, self.key, self.length, self.ring, self.recording = state, key, length, ring, recording
        self.limit = limit  # recordings kept per model
        if recording is not None:
            recording.busy = True

    def release(self) -> None:
        """The call is over: its recording may serve the next one."""
        if self.recording is not None:
            self.recording.busy = False


def plan(model, settings, *, batch, prompt, total, capacity, dtype, device):
    """The Plan of a call whose prompt is unpadded and whose attention is tigon's, or None (the eager prefill):
    None when recordings are off (`settings.prefill_graphs == 0`), the padded prompt exceeds
    `settings.prefill_graph_tokens` tokens over the batch, or the ring would not hold the padded prompt."""
    if settings.prefill_graphs == 0 or not settings.fused_layers:
        return None
    bucket = settings.prefill_graph_bucket
    length = cdiv(prompt, bucket) * bucket
    if batch * length > settings.prefill_graph_tokens:
        return None
    ring = cdiv(total, bucket) * bucket if capacity is None else capacity
    window = getattr(model.config.get_text_config(decoder=True), "sliding_window", None)
    if ring < length or (isinstance(window, int) and window < length):
        return None  # the padded prompt must fit every ring, sliding ones included
    state = kept(model)
    key = (batch, length, ring, dtype, device, settings.rotary_table)
    recording = state.recordings.get(key)
    if recording is not None:
        if recording.busy:
            return None
        if recording.fingerprint != _fingerprint(model, recording.layers):
            del state.recordings[key]
            recording = None
        else:
            state.recordings.move_to_end(key)
    if recording is None and key in state.refused:
        layers = _decoder_layers(model)
        if state.refused[key] == _fingerprint(model, layers):
            return None
        del state.refused[key]
    return Plan(state, key, length, ring, recording, settings.prefill_graphs)


def replay(recording, ids, prompt):
    """The prefill of `ids` `[B, prompt]` through `recording` (held by the caller: `busy`): the logits `[B, vocab]`
    of the last prompt position (the recording's own tensor, rewritten by its next replay)."""
    recording.ids[:, :prompt].copy_(ids)
    recording.rows.fill_(prompt)
    recording.graph.replay()
    for layer in recording.cache.layers:  # replay runs no Python: the host counts of a `prompt`-token prefill
        layer.seen = prompt
    return recording.logits


def _prefill_function(model, cache, ids, positions, rows):
    """The recorded function: the cache rewound, the padded prompt through the model with its last layer on the
    last real row, the padded rows' slots emptied again."""

    def prefill():
        cache.rewind()
        cache.last_position_only, cache.prefill_rows, cache.fused_prefill_layers = True, rows, 0
        try:
            logits = model(input_ids=ids, position_ids=positions, past_key_values=cache, use_cache=True,
                           logits_to_keep=1).logits[:, -1]
        finally:
            cache.last_position_only, cache.prefill_rows = False, None
        cache.keep_first(rows)
        return logits

    return prefill


def _capture(prefill, memory, stream):
    """CUDA graph of `prefill` (run once eagerly before, on `stream`, which it captures on): (graph, logits)."""
    graph = torch.cuda.CUDAGraph()
    with capture(graph, stream, memory):
        logits = prefill()
    return graph, logits


def record(plan, model, cache, ids, prompt, tables):
    """Record the prefill of `ids` `[B, prompt]` for `plan` over `cache` (a fresh one of `plan.ring` slots) and
    return (this call's logits, the recording, held: `busy`); the recording is None where the capture failed (the
    logits stand), and the whole result None where not every layer ran the fused step (the padded rows may have
    reached a layer that takes the last row by shape): the caller then resets the cache and prefills eagerly.
    Either way the key is refused while the model stays as it is. `tables`: the rotary tables of the call, which
    the graph reads."""
    b, device = ids.shape[0], ids.device
    static_ids = torch.zeros((b, plan.length), dtype=torch.int64, device=device)
    static_ids[:, :prompt].copy_(ids)
    positions = torch.arange(plan.length, device=device).expand(b, -1)
    rows = torch.full((1,), prompt, dtype=torch.int64, device=device)
    recording = _Recording(cache, static_ids, positions, rows, _decoder_layers(model), tables)
    recording.fingerprint = _fingerprint(model, recording.layers)
    prefill = _prefill_function(model, cache, static_ids, positions, rows)
    cuda = device.type == "cuda"
    # the warm-up on a side stream, as graph capture wants (cuBLAS workspaces exist before it)
    stream, logits = warm_up(prefill) if cuda else (None, prefill())
    if cache.fused_prefill_layers != len(cache.layers):
        plan.state.refused[plan.key] = recording.fingerprint
        return None
    state = plan.state
    if cuda and state.memory is None:
        state.memory = torch.cuda.graph_pool_handle()
    try:
        recording.graph, recording.logits = _capture(prefill, state.memory, stream)
    except RuntimeError:  # an op that syncs or is not capturable; the warm-up's result stands
        state.refused[plan.key] = recording.fingerprint
        recording = None
    for layer in cache.layers:  # the capture ran the Python once more: the counts of this call's prefill
        layer.seen = prompt
    if recording is None:
        return logits, None
    recording.busy, plan.recording = True, recording
    state.recordings[plan.key] = recording
    while len(state.recordings) > plan.limit:
        state.recordings.popitem(last=False)
    return logits, recording
