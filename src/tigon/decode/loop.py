"""generate: a lean decode loop for Hugging Face causal LMs over a RollingKVCache, with CUDA-graph replay.

    from tigon import generate
    seqs = generate(model, input_ids, max_new_tokens=64)                    # greedy, like model.generate
    seqs, stats = generate(model, ids, max_new_tokens=64, do_sample=True, top_p=0.9, return_stats=True)

`generate` checks its arguments once, before the clock starts, into a frozen `GenerationRequest` (`request`):
what the loop reads. Then the cache (`_open_cache`), one prefill with the model's own forward
(`logits_to_keep=1`; a short unpadded prompt's prefill replays a CUDA graph recorded by the first call of its
shape, `prefill_graph`), then one token per step (`_decode_steps`). Everything per step stays on the device
(`_DecodeState`): token choice (`sampling`), the `finished` mask of rows that emitted EOS (later tokens of those
rows are the pad id), the output writes and the position counters. The host looks at `finished` only every
`settings.eos_check_every` steps and once at the end to trim the output to the longest row, as `model.generate`
returns it.

For the call the loop switches, and puts back at the end (also on an exception):
- the attention (`attention="auto"`): the "tigon" implementation (`tigon.hf.attention`: a decode step reads the
  ring in place with `decode_attention`) when every attention layer of the family is covered; "hf" keeps
  Hugging Face's. With "tigon" the decode steps get a ready 4-D boolean mask per ring size (`TigonMasks`)
  instead of HF's mask builder, so nothing in a step depends on a host integer that changes between steps;
- the fused layer step of a patched model (`settings.fused_layers`, `layer_step.fused_decode`);
- the rotary tables (`settings.rotary_table`, `rotary_table.cached_rotary`).
- the CUDA-graph step of HF's generate on a model patched with cuda_graph=True (`hf_graph.paused`): calls go
  straight to the forward under it, this loop captures its own graph.

CUDA graphs (`cuda_graph=True` on CUDA): the decode forward is captured once per call (the batch is fixed
within a call) over static `input_ids` / `position_ids` / mask tensors and the cache's static buffers, then
replayed; token choice runs eagerly after each replay (a few small kernels; a user `generator` needs no graph
registration). With "tigon" attention this holds for any generation, rings that wrap included. With HF's
attention it holds only while the whole generation fits every layer's ring (HF's mask sizes are then the
constant `(ring, 0)` and the query offset is the cache's device counter; past the ring HF's `kv_offset` is a
host integer that grows every step), so such a generation runs eagerly.
"""

import contextlib

import torch

from . import hf_graph, inputs, kept, prefill_graph
from .capture import capture, warm_up
from .layer_step import fused_decode
from .request import GenerationRequest
from .rotary_table import cached_rotary
from .settings import DEFAULT, DecodeSettings
from .stats import Clock, summary

NAME = inputs.NAME


def _cache_class():
    from tigon.memory.kv_cache import RollingKVCache  # imports transformers: only when generating

    class _DecodeCache(RollingKVCache):
        """A RollingKVCache whose query offset can be the device counter (`next_position`), so the decode mask
        does not bake a host integer into a captured graph."""

        device_offset = False

        def get_query_offset(self, layer_idx: int = 0):
            if self.device_offset:
                return self.layers[layer_idx].next_position
            return super().get_query_offset(layer_idx)

    return _DecodeCache


def _switch_attention(model, attention):
    """Put `model` on the attention this call runs: ("tigon" or "hf", a callable that undoes it or None)."""
    from tigon.hf import attention as tigon_attention  # imports transformers: only when generating

    on_tigon = getattr(model.config, "_attn_implementation", None) == tigon_attention.NAME
    if attention == "hf":
        if not on_tigon:
            return "hf", None
        tigon_attention.restore_attention(model)
        return "hf", lambda: tigon_attention.use_tigon_attention(model)
    if on_tigon:
        return "tigon", None
    covered = tigon_attention.use_tigon_attention(model).decode_modules
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    if covered and (layers is None or covered >= layers):
        return "tigon", lambda: tigon_attention.restore_attention(model)
    tigon_attention.restore_attention(model)
    if attention == "tigon":
        raise ValueError(f"{NAME}: attention='tigon': the \"tigon\" attention covers {covered} of the "
                         f"{layers} attention layers of this {type(model).__name__}; pass attention='auto' or "
                         "'hf'")
    return "hf", None


class TigonMasks:
    """The decode step's attention masks for the "tigon" attention: one `[1 or B, 1, 1, ring]` boolean per
    ring size, column j = slot j, given to the model as a ready 4-D mask (a dict by layer type when the full
    and sliding rings differ), so HF's mask builder, whose `kv_offset` past the ring is a host integer, is not
    part of the step.

    Without padding the mask is a constant all-true tensor: decode_attention attends slot j iff its position
    is >= 0, <= the query's and inside the window. With left padding it is `keep[b, pos_j]` on the slot
    positions after this step's write (`keep` = the prompt mask, then ones), and `pos_j >= 0`: exact past the
    ring too, where HF's 2-D mask is applied by position instead of slot. Only device ops per step."""

    def __init__(self, cache, keep):
        self.keep = keep  # [B, >= total] bool, or None
        self.kinds = {}  # layer type -> its first cache layer (all layers of a type hold the same positions)
        for layer in cache.layers:
            self.kinds.setdefault("sliding_attention" if layer.is_sliding else "full_attention", layer)
        self.single = len({(layer.ring, layer.sink) for layer in self.kinds.values()}) == 1
        self.constant = None
        if keep is None:
            from tigon.hf.ring_decode import mark_unmasked

            self.constant = {kind: mark_unmasked(torch.ones((1, 1, 1, layer.ring), dtype=torch.bool,
                                                            device=layer.device))
                             for kind, layer in self.kinds.items()}

    def _one(self, kind):
        if self.constant is not None:
            return self.constant[kind]
        pos = self.kinds[kind].positions_after_append()  # after this step's write
        return (self.keep.index_select(1, pos.clamp(min=0)) & (pos >= 0))[:, None, None, :]

    def __call__(self):
        if self.single:
            return self._one(next(iter(self.kinds)))
        return {kind: self._one(kind) for kind in self.kinds}


@torch.no_grad()
def generate(model: torch.nn.Module, input_ids: torch.Tensor, *, max_new_tokens: int,
             attention_mask: torch.Tensor | None = None, capacity: int | None = None, cuda_graph: bool = True,
             attention: str = "auto", return_stats: bool = False, do_sample: bool = False,
             temperature: float | None = 1.0, top_k: int | None = 0, top_p: float | None = 1.0,
             eos_token_id: int | list[int] | None = None, pad_token_id: int | None = None,
             generator: torch.Generator | None = None,
             settings: DecodeSettings = DEFAULT) -> torch.Tensor | tuple[torch.Tensor, dict]:
    """Generate `max_new_tokens` tokens per row; returns `[B, P + n]` int64 sequences (prompt then new tokens,
    n <= max_new_tokens: trimmed once every row has emitted an EOS), or `(sequences, stats)`.

    `input_ids` `[B, P]` (left padding with `attention_mask` `[B, P]`, 1 = real token). `capacity` is the
    ring size of the RollingKVCache (default P + max_new_tokens: exact full attention); below the prompt
    length it is refused unless every layer is a sliding-window layer. `attention`: "auto" (default) runs the
    "tigon" attention implementation for this call when the model's family is covered (Llama, Mistral, Qwen2,
    Qwen3, Gemma-2, ...; a model already on "tigon" stays there) and restores the model's own implementation
    afterwards, else HF's; "tigon" requires it; "hf" runs the model's HF attention (a model on "tigon" is
    switched back for the call). With "tigon" the CUDA-graph path also covers rings that wrap (sliding windows
    shorter than the sequence, capacity < P + max_new_tokens); with "hf" those run eagerly.

    Stopping, as `model.generate`: `eos_token_id` (int or list) finishes a row, whose later tokens are
    `pad_token_id`; either one left None is read from `model.generation_config` (an explicit argument wins).
    Without a pad id the first EOS id pads (0 without any EOS); with no EOS anywhere rows never stop (set
    `model.generation_config.eos_token_id = None` to force every new token). Ids must be inside the model's
    vocabulary. Sampling (`do_sample=True`) applies temperature (a float > 0; a tiny one tends to greedy), then
    top-k (0 = off), then top-p (in (0, 1], 1.0 = off), and draws with `generator` (on the model's
    device); as in `model.generate`, these are ignored (and not checked) when do_sample=False. `settings`: a
    `DecodeSettings` (how the loop runs; the tokens do not depend on it).

    `stats`: ttft_s (from the call to the first token), ttft_phases_s ({phase: seconds} over TTFT_PHASES,
    summing to ttft_s: CUDA-event intervals on CUDA), ttft_host_phases_s (the host's wall time of each phase),
    step_s (one latency per later step), p50_step_s, p99_step_s (`stats.percentile`), tokens_per_s (B * n / total
    time), decode_tokens_per_s, peak_memory_bytes (CUDA only, else None), new_tokens, batch_size, cuda_graph
    (whether the replay path ran), attention ("tigon" or "hf"), rotary_tables (the cos/sin tables the rotary
    modules read for the call; 0 = HF's modules computed them every step), prefill_graph ("recorded", "replayed"
    or None: the eager prefill). `tigon.decode.metrics` exposes them to Prometheus.

    Between calls the model keeps the last call's cache, its rotary tables and its recorded prefills
    (`tigon.decode.kept`); `tigon.decode.release(model)` frees them."""
    request = GenerationRequest.build(
        model, input_ids, max_new_tokens=max_new_tokens, attention_mask=attention_mask, capacity=capacity,
        cuda_graph=cuda_graph, attention=attention, return_stats=return_stats, do_sample=do_sample,
        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        generator=generator, settings=settings)
    clock = Clock(model.device)
    clock.mark()  # TTFT counts from here: the attention switch, the cache allocation and the prompt copies
    ran, undo = _switch_attention(model, request.attention)
    scope = contextlib.ExitStack()  # what the loop switches for the call, undone here
    try:
        scope.enter_context(hf_graph.paused(model))  # tigon.patch(cuda_graph=True)'s step: this loop graphs its own
        if request.settings.fused_layers:
            scope.enter_context(fused_decode(model))
        clock.phase("attention_switch")
        sequences, stats = _decode_loop(model, request, clock, scope, tigon=ran == "tigon")
    finally:
        scope.close()
        if undo is not None:
            undo()
    if not request.return_stats:
        return sequences
    stats["attention"] = ran
    return sequences, stats


def _decode_loop(model, request, clock, scope, *, tigon):
    """The call after the attention switch: (sequences `[B, P + n]`, stats or None). A short unpadded prompt
    prefills through a recorded CUDA graph over a cache kept with the model (`prefill_graph`); the first call
    of a shape records it."""
    device = model.device
    if request.return_stats and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    plan = None
    if request.cuda_graph and tigon and request.attention_mask is None and _graphs_available(device):
        plan = prefill_graph.plan(model, request.settings, batch=request.batch, prompt=request.prompt,
                                  total=request.total, capacity=request.capacity, dtype=model.dtype, device=device)
    try:
        return _decode_with_plan(model, request, clock, scope, plan, tigon=tigon)
    finally:
        if plan is not None:
            plan.release()


def _decode_with_plan(model, request, clock, scope, plan, *, tigon):
    """The cache, the prompt's tensors, the prefill (replayed, recorded or eager), the decode steps, the trim
    and the stats, each closing its TTFT phase on `clock`."""
    device = model.device
    replaying = plan is not None and plan.recording is not None  # `record` sets plan.recording: read it now
    cache, spare = _open_cache(model, request, plan, device, tigon=tigon, replaying=replaying)
    clock.phase("cache_alloc")
    # HF's decode mask is valid in a graph only while every ring fits; the tigon masks always are.
    use_graph = (request.cuda_graph and _graphs_available(device) and request.max_new_tokens >= 3
                 and (tigon or request.total <= min(layer.ring for layer in cache.layers)))

    ids = request.input_ids.to(device=device, dtype=torch.int64)
    rotary_tables, tables = 0, []
    if request.settings.rotary_table:  # positions stay < total (left padding only lowers them), or < the padded prompt
        length = request.total if plan is None else max(request.total, plan.length)
        rotary_tables = scope.enter_context(cached_rotary(model, length, dtype=model.dtype, device=device,
                                                          keep=tables, store=kept.kept(model).rotary))
    state = _DecodeState(model, request, cache, ids, tigon=tigon)
    clock.phase("prompt_setup")
    if replaying:
        logits, prefilled = prefill_graph.replay(plan.recording, ids, request.prompt), "replayed"
    else:
        logits, prefilled = _prefill(model, request, plan, cache, ids, state, tables)
    clock.phase("prefill")
    state.emit(logits, 0)
    clock.marks.append(clock.phase("first_token"))  # the TTFT end: the phases sum to ttft_s
    cache.device_offset = True
    steps, graphed = _decode_steps(state, request, cache, clock, use_graph=use_graph)

    if spare is not None:
        kept.keep_cache(model, spare, cache)
    if state.eos is not None:
        steps = int(state.lengths.max())  # the one sync of a run without stats: trim like model.generate
    sequences = state.out[:, :request.prompt + steps]
    if not request.return_stats:
        return sequences, None
    stats = summary(clock, batch=request.batch, new_tokens=steps, device=device, cuda_graph=graphed,
                    rotary_tables=rotary_tables)
    stats["prefill_graph"] = prefilled
    return sequences, stats


def _open_cache(model, request, plan, device, *, tigon, replaying):
    """(the call's cache, the key it is kept under for the next call, or None): the recording's own cache when
    replaying; else the model's kept one with the "tigon" attention (a recording makes its own, HF's attention
    gets zeroed rings), else a new one. Refuses a capacity below the prompt on full-attention layers."""
    spare = cache = None
    if replaying:
        cache = plan.recording.cache
    else:
        ring = plan.ring if plan is not None else request.ring
        if tigon and plan is None:
            spare = (request.batch, ring, model.dtype, device, id(model.config))
            cache = kept.take_cache(model, spare)
        if cache is None:
            cache = _cache_class()(model.config, batch_size=request.batch, capacity=ring, dtype=model.dtype,
                                   device=device)
    cache.device_offset = False  # a kept cache ended its last call with the decode steps' offset
    if request.ring < request.prompt and not all(cache.is_sliding):
        raise ValueError(f"{NAME}: capacity ({request.ring}) is smaller than the prompt ({request.prompt} tokens) "
                         "and the model has full-attention layers, which would drop prompt tokens; pass capacity "
                         ">= the prompt length")
    return cache, spare


class _DecodeState:
    """A call's tensors on the device: `out` `[B, P + max_new_tokens]` (the prompt, then each step's tokens; the
    pad id after a row's EOS), the prompt's positions and mask, `finished` and `lengths` (new tokens per row, its
    EOS included), and the decode step's static inputs (`tok`, `pos`, the masks), which `emit` rewrites in place
    so that a captured graph reads each step's values. Nothing here syncs the host."""

    def __init__(self, model, request, cache, ids, *, tigon):
        b, p, device = request.batch, request.prompt, ids.device
        self.model, self.request, self.cache = model, request, cache
        self.out = torch.full((b, request.total), request.pad, dtype=torch.int64, device=device)
        self.out[:, :p].copy_(ids)
        if request.attention_mask is not None:
            self.prompt_mask = request.attention_mask.to(device=device, dtype=torch.int64)
            self.positions = (self.prompt_mask.cumsum(-1) - 1).masked_fill(self.prompt_mask == 0, 0)
            # One static mask for every decode step: the prompt's padding, then ones. HF indexes it by absolute
            # position (slot == position while the ring fits), and the causal mask hides the future columns.
            self.step_mask = torch.ones((b, max(request.total, request.ring)), dtype=torch.int64, device=device)
            self.step_mask[:, :p].copy_(self.prompt_mask)
        else:
            self.prompt_mask = self.step_mask = None
            self.positions = torch.arange(p, device=device).expand(b, -1)
        self.tigon_masks = None
        if tigon:
            self.tigon_masks = TigonMasks(cache, self.step_mask.bool() if self.step_mask is not None else None)
        self.eos = torch.tensor(request.eos, dtype=torch.int64, device=device) if request.eos else None
        self.pad = torch.full((b,), request.pad, dtype=torch.int64, device=device)
        self.finished = torch.zeros((b,), dtype=torch.bool, device=device)
        self.lengths = torch.zeros((b,), dtype=torch.int64, device=device)
        self.tok = torch.zeros((b, 1), dtype=torch.int64, device=device)
        self.pos = self.positions[:, -1:].clone()

    def emit(self, logits, step):
        """Choose step `step`'s tokens from `logits` `[B, V]` and write them: the output, the next input, the
        position, and (with EOS ids) the finished rows."""
        nxt = self.request.choose(logits)
        if self.eos is not None:
            nxt = torch.where(self.finished, self.pad, nxt)
            self.lengths.add_(~self.finished)
            # A broadcast compare, not torch.isin: isin may take a sort/unique path for larger id lists.
            self.finished.logical_or_((nxt[:, None] == self.eos).any(-1))
        self.out[:, self.request.prompt + step].copy_(nxt)
        self.tok.copy_(nxt[:, None])
        self.pos.add_(1)

    def forward(self):
        """One decode step's model forward over the static inputs: the last position's logits `[B, V]`."""
        mask = self.tigon_masks() if self.tigon_masks is not None else self.step_mask
        return self.model(input_ids=self.tok, attention_mask=mask, position_ids=self.pos,
                          past_key_values=self.cache, use_cache=True, logits_to_keep=1).logits[:, -1]


def _prefill(model, request, plan, cache, ids, state, tables):
    """The prompt through the model, recorded when `plan` asks: (last-position logits `[B, V]`, "recorded" or
    None). A recording refused because not every layer ran the fused step leaves its padded result unused."""
    if plan is not None:
        recorded = prefill_graph.record(plan, model, cache, ids, request.prompt, tables)
        if recorded is not None:
            return recorded[0], "recorded" if recorded[1] is not None else None
        cache.reset()
    cache.last_position_only = True  # the last layer's other rows feed nothing read here
    try:
        logits = model(input_ids=ids, attention_mask=state.prompt_mask,
                       position_ids=state.positions, past_key_values=cache, use_cache=True,
                       logits_to_keep=1).logits[:, -1]
    finally:
        cache.last_position_only = False
    return logits, None


def _decode_steps(state, request, cache, clock, *, use_graph):
    """Steps 1 .. max_new_tokens - 1: eager, or the first eager and the next captured (`_capture`), then replays.
    Stops early once every row has finished, which the host reads every `eos_check_every` steps. Returns (new
    tokens per row before the trim, whether a graph was captured)."""
    graph = graph_logits = None
    steps = 1
    for step in range(1, request.max_new_tokens):
        if state.eos is not None and step % request.settings.eos_check_every == 0 and bool(state.finished.all()):
            break
        if graph is not None:
            graph.replay()
            for layer in cache.layers:  # the host count HF reads for mask sizes: replay skips the Python
                layer.seen += 1
            logits = graph_logits
        elif use_graph:
            graph, graph_logits, logits = _capture(state.forward, cache)
            if request.settings.on_capture is not None:
                request.settings.on_capture()
        else:
            logits = state.forward()
        state.emit(logits, step)
        clock.mark()
        steps += 1
    return steps, graph is not None


def _graphs_available(device) -> bool:
    return device.type == "cuda"


def _capture(forward, cache):
    """First CUDA-graph step: run it eagerly on a side stream (the warm-up capture needs: cuBLAS handles and
    workspaces exist before capture; its logits are this step's real result), then capture the next step
    without running it. Capture runs the Python once, so the host counters it advanced are put back."""
    stream, logits = warm_up(forward)
    seen = [layer.seen for layer in cache.layers]
    graph = torch.cuda.CUDAGraph()
    with capture(graph, stream):  # no device sync: the queued prefill and step keep the GPU's clocks up
        graph_logits = forward()
    for layer, count in zip(cache.layers, seen):
        layer.seen = count
    return graph, graph_logits, logits
