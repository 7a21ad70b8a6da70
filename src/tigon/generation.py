"""generate: a lean decode loop for Hugging Face causal LMs over a RollingKVCache, with CUDA-graph replay.

    from tigon import generate
    seqs = generate(model, input_ids, max_new_tokens=64)                    # greedy, like model.generate
    seqs, stats = generate(model, ids, max_new_tokens=64, do_sample=True, top_p=0.9, return_stats=True)

One prefill with the model's own forward (`logits_to_keep=1`), then one token per step. Everything per step
stays on the device: token choice (argmax, or temperature / top-k / top-p sampling by the exponential race
`argmax(p / E)`, E ~ Exp(1), which is how torch.multinomial draws one sample), the `finished` mask of rows
that emitted EOS (later tokens of those rows are `pad_token_id`), the output writes and the position
counters. The host looks at `finished` only every `EOS_CHECK_EVERY` steps (a sync each time, at most
EOS_CHECK_EVERY - 1 wasted steps once every row is done) and once at the end to trim the output to the
longest row, as `model.generate` returns it.

Attention (`attention="auto"`): for the call, the model runs the "tigon" attention implementation
(`tigon.hf.attention`: a decode step reads the ring in place with `decode_attention`, positions on the
device) when every attention layer of its family is covered, and gets its own implementation back at the
end; `attention="hf"` keeps Hugging Face's. With "tigon" the decode steps do not go through HF's mask
builder: the loop hands the model a ready 4-D boolean mask per ring size (`_TigonMasks`), all true without
padding (decode_attention reads causality and the sliding window from the slot positions), else "slot holds
a real token", gathered on the device from the slot positions after this step's write. So nothing in a step
depends on a host integer that changes from step to step.

CUDA graphs (`cuda_graph=True` on CUDA): the decode forward is captured once per call (the batch is fixed
within a call) over static `input_ids` / `position_ids` / mask tensors and the cache's static buffers, then
replayed; token choice runs eagerly after each replay (a few small kernels, and a user `generator` needs no
graph registration). With "tigon" attention this holds for any generation, rings that wrap included
(Mistral's sliding window shorter than the prompt, `capacity` below prompt + max_new_tokens). With HF's
attention it holds only while the whole generation fits every layer's ring (HF's mask sizes are then the
constant `(ring, 0)`, and the query offset is read from the cache's device counter; past the ring HF's
`kv_offset` is a host integer that grows every step), so such a generation runs eagerly.
`stats["cuda_graph"]` says which path ran, `stats["attention"]` which attention.

Rotary embedding (`ROTARY_TABLE`): for the call, the model's rotary module reads cos/sin from a table that its own
forward computes once for positions 0 .. P + max_new_tokens - 1 (`tigon.hf.rotary_table`: bit for bit the rows it
would compute; one gather per step instead of ~8 kernels), where the rope type's inv_freq does not depend on the
sequence length; its class forward is back at the end.
"""

import contextlib
import math
import time

import torch

from .metrics import LATENCY_BUCKETS, prometheus_text  # noqa: F401 - re-exported: the metrics of these stats

EOS_CHECK_EVERY = 16  # host syncs on `finished` every 16 steps: < 1% of a ~10 us graph step's launch stream
# The rotary module reads cos/sin from a per-call table (tigon.hf.rotary_table): one gather instead of ~8 kernels
# per step. False runs HF's module as it is (A/B).
ROTARY_TABLE = True

_NAME = "generate"
ATTENTION = ("auto", "tigon", "hf")


def _cache_class():
    from tigon.memory.kv_cache import RollingKVCache  # imports transformers: only when generating

    class _DecodeCache(RollingKVCache):
        """A RollingKVCache whose query offset can be the device counter (`_next`), so the decode mask
        does not bake a host integer into a captured graph."""

        device_offset = False

        def get_query_offset(self, layer_idx: int = 0):
            if self.device_offset:
                return self.layers[layer_idx]._next
            return super().get_query_offset(layer_idx)

    return _DecodeCache


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _int(name, value, minimum):
    if not _is_int(value):
        raise TypeError(f"{_NAME}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < minimum:
        raise ValueError(f"{_NAME}: {name} must be >= {minimum}, got {value}")
    return value


def _bool(name, value):
    if not isinstance(value, bool):
        raise TypeError(f"{_NAME}: {name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def _validate_sampling(temperature, top_k, top_p):
    """HF's rules (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper): temperature > 0, top_k >= 0
    (0 = off), 0 <= top_p <= 1 (1 = off; 0 keeps the top token only); checked only when sampling, as there."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{_NAME}: temperature must be a float > 0, got {type(temperature).__name__} "
                        f"{temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        hint = " (for greedy decoding pass do_sample=False)" if temperature == 0 else ""
        raise ValueError(f"{_NAME}: temperature must be a finite float > 0, got {temperature!r}{hint}")
    _int("top_k", top_k, 0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"{_NAME}: top_p must be a float in [0, 1], got {type(top_p).__name__} {top_p!r}")
    if not 0 <= top_p <= 1:
        raise ValueError(f"{_NAME}: top_p must be in [0, 1], got {top_p!r}")


def _token_ids(name, value, vocab):
    if value is None:
        return None
    ids = [value] if _is_int(value) else value
    if isinstance(ids, torch.Tensor):
        ids = ids.flatten().tolist()
    if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(i) and i >= 0 for i in ids):
        raise ValueError(f"{_NAME}: {name} must be a token id >= 0 or a non-empty list of them, "
                         f"got {value!r}")
    outside = [i for i in ids if vocab is not None and i >= vocab]
    if outside:  # the model could never emit it, so the row would never stop
        raise ValueError(f"{_NAME}: {name} {outside} is outside the model's vocabulary (ids 0..{vocab - 1})")
    return list(ids)


def _check_model(model):
    """The model must be a decoder-only causal LM with its LM head: what HF's model.generate takes."""
    what = type(model).__name__
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{_NAME}: model must be a Hugging Face causal LM (e.g. AutoModelForCausalLM), got {what}")
    config = getattr(model, "config", None)
    if not hasattr(config, "get_text_config") or not callable(getattr(model, "get_output_embeddings", None)):
        raise TypeError(f"{_NAME}: model must be a Hugging Face causal LM (e.g. AutoModelForCausalLM), got {what}, "
                        "which has no transformers config")
    if getattr(config, "is_encoder_decoder", False):
        raise ValueError(f"{_NAME}: model must be a decoder-only causal LM, got the encoder-decoder {what}")
    if model.get_output_embeddings() is None:
        raise ValueError(f"{_NAME}: model {what} has no LM head (get_output_embeddings() is None): pass the "
                         "ForCausalLM model, not its base model (e.g. `model`, not `model.model`)")


def _vocab_size(model):
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    n = getattr(emb, "num_embeddings", None)
    return n if _is_int(n) else getattr(model.config.get_text_config(decoder=True), "vocab_size", None)


def _check_prompt(input_ids, attention_mask, vocab):
    """Token ids inside the vocabulary (an id past it is a device-side assert on CUDA, which ends the process's
    CUDA context) and a left-padded 0/1 mask: one host sync, before the clock starts."""
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (
            torch.int64, torch.int32) or input_ids.shape[0] < 1 or input_ids.shape[1] < 1:
        got = (f"{tuple(input_ids.shape)} {input_ids.dtype}" if isinstance(input_ids, torch.Tensor)
               else type(input_ids).__name__)
        raise ValueError(f"{_NAME}: input_ids must be a [batch, seq] int64 (or int32) tensor with batch >= 1 and "
                         f"seq >= 1, got {got}")
    b, p = input_ids.shape
    checks = [input_ids.min(), input_ids.max()]
    if attention_mask is not None:
        if not isinstance(attention_mask, torch.Tensor) or tuple(attention_mask.shape) != (b, p):
            raise ValueError(f"{_NAME}: attention_mask must be a [{b}, {p}] tensor like input_ids, got "
                             f"{getattr(attention_mask, 'shape', type(attention_mask).__name__)}")
        if attention_mask.is_complex():
            raise ValueError(f"{_NAME}: attention_mask must hold 0 and 1, got a {attention_mask.dtype} tensor")
        m = attention_mask.to(device=input_ids.device)
        checks += [((m != 0) & (m != 1)).any(), (m[:, -1] != 1).any()]
    lo, hi, *mask = torch.stack([c.to(torch.int64) for c in checks]).tolist()
    if lo < 0 or (vocab is not None and hi >= vocab):
        raise ValueError(f"{_NAME}: input_ids must be token ids in 0..{vocab - 1 if vocab else '?'} (the model's "
                         f"vocabulary), got values in {lo}..{hi}")
    if mask and mask[0]:
        raise ValueError(f"{_NAME}: attention_mask must hold only 0 (padding) and 1 (token)")
    if mask and mask[1]:
        raise ValueError(f"{_NAME}: attention_mask: every row must end with a real token (left padding, as "
                         "decoder-only generation needs; a right-padded or all-padding row would continue from "
                         "padding)")


def _argmax(x, two_pass=None):
    """argmax over the last dim of [B, V], first index on ties. On CUDA in two passes: torch's argmax gives a
    [1, V] row one thread block (28 us at V = 128256 on an H200, more than a decoder layer); viewed as
    [B, G, V / G] the first pass spreads over G blocks, the second reduces G values."""
    B, V = x.shape
    if not (x.device.type == "cuda" if two_pass is None else two_pass) or V < 8192:
        return x.argmax(-1)
    groups = next((g for g in range(256, 31, -1) if V % g == 0), None)
    if groups is None:
        return x.argmax(-1)
    part = x.view(B, groups, V // groups)
    idx = part.argmax(-1)  # [B, G] first max of each group
    best = part.gather(-1, idx.unsqueeze(-1)).squeeze(-1).argmax(-1, keepdim=True)  # first group holding the max
    return (best * (V // groups) + idx.gather(-1, best)).squeeze(-1)


def _choose(logits, do_sample, temperature, top_k, top_p, generator):
    """Next token [B] from last-position logits [B, V]: argmax, or one sample after temperature, top-k, top-p
    (HF's warper order), all in fp32 on the device."""
    if not do_sample:
        return _argmax(logits)  # the order of bf16 values is their fp32 order: no upcast needed
    logits = logits.float()
    if temperature < 1.0:
        # logits / temperature overflows to inf (then softmax gives NaN) once |logit| / temperature > 3.4e38:
        # shifted by the max the quotients are <= 0, so a tiny temperature tends to greedy (ties share the draw).
        # Below fp32's smallest normal the temperature itself would round to 0 (0 / 0 on the top token): fp64.
        if temperature < torch.finfo(torch.float32).tiny:
            logits = logits.double()
        logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    elif temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # HF's rule: drop the low tail whose cumulative probability is <= 1 - top_p; the top token stays.
        sorted_logits, order = torch.sort(logits, dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return _argmax(probs / race)


TTFT_PHASES = ("attention_switch", "cache_alloc", "prompt_setup", "prefill", "first_token")


class _Clock:
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


def _percentile(sorted_values, q):
    if not sorted_values:
        return None
    return sorted_values[min(len(sorted_values) - 1, max(0, math.ceil(q * len(sorted_values)) - 1))]


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
    counts = tigon_attention.use_tigon_attention(model)
    covered = sum(n for piece, n in counts.items() if " decode (" in piece)
    layers = getattr(model.config.get_text_config(decoder=True), "num_hidden_layers", None)
    if covered and (layers is None or covered >= layers):
        return "tigon", lambda: tigon_attention.restore_attention(model)
    tigon_attention.restore_attention(model)
    if attention == "tigon":
        raise ValueError(f"{_NAME}: attention='tigon': the \"tigon\" attention covers {covered} of the "
                         f"{layers} attention layers of this {type(model).__name__}; pass attention='auto' or "
                         "'hf'")
    return "hf", None


class _TigonMasks:
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
            from tigon.hf.attention import mark_unmasked

            self.constant = {kind: mark_unmasked(torch.ones((1, 1, 1, layer.ring), dtype=torch.bool,
                                                            device=layer.device))
                             for kind, layer in self.kinds.items()}

    def _one(self, kind):
        if self.constant is not None:
            return self.constant[kind]
        layer = self.kinds[kind]
        nxt = layer._next
        pos = layer.positions.scatter(0, layer._slots_of(nxt), nxt)  # after this step's write
        return (self.keep.index_select(1, pos.clamp(min=0)) & (pos >= 0))[:, None, None, :]

    def __call__(self):
        if self.single:
            return self._one(next(iter(self.kinds)))
        return {kind: self._one(kind) for kind in self.kinds}


@torch.no_grad()
def generate(model, input_ids, *, max_new_tokens, attention_mask=None, capacity=None, cuda_graph=True,
             attention="auto", return_stats=False, do_sample=False, temperature=1.0, top_k=0, top_p=1.0,
             eos_token_id=None, pad_token_id=None, generator=None):
    """Generate `max_new_tokens` tokens per row; returns `[B, P + n]` int64 sequences (prompt then new tokens,
    n <= max_new_tokens: trimmed once every row has emitted an EOS), or `(sequences, stats)`.

    `input_ids` `[B, P]` (left padding with `attention_mask` `[B, P]`, 1 = real token). `capacity` is the
    ring size of the RollingKVCache (default P + max_new_tokens: exact full attention); below the prompt
    length it is refused unless every layer is a sliding-window layer. `attention`: "auto" (default) runs the
    "tigon" attention implementation for this call when the model's family is covered (Llama, Mistral, Qwen2,
    Qwen3, Gemma-2, ...; a model already on "tigon" stays there) and restores the model's own implementation
    afterwards, else HF's; "tigon" requires it; "hf" runs the model's HF attention (a model on "tigon" is
    switched back for the call). With "tigon" the CUDA-graph path also covers rings that wrap (sliding windows
    shorter than the sequence, capacity < P + max_new_tokens); with "hf" those run eagerly. `eos_token_id`
    (int or list; None = never stop, pass `model.generation_config.eos_token_id` to stop like HF) finishes a
    row, whose later tokens are `pad_token_id` (default: the first EOS id); ids must be inside the model's
    vocabulary. Sampling (`do_sample=True`) applies temperature (a float > 0; a tiny one tends to greedy), then
    top-k (0 = off), then top-p (1.0 = off, 0 keeps the top token), and draws with `generator` (on the model's
    device); as in `model.generate`, these are ignored (and not checked) when do_sample=False.
    `stats`: ttft_s (from the call to the first token: cache allocation, prefill, first token choice),
    ttft_phases_s ({phase: seconds} over TTFT_PHASES, summing to ttft_s: CUDA-event intervals on CUDA),
    ttft_host_phases_s (the host's wall time of each phase: host ~ device = host-bound), step_s
    (one latency per later step), p50_step_s, p99_step_s, tokens_per_s (B * n / total time),
    decode_tokens_per_s, peak_memory_bytes (CUDA only, else None), new_tokens, batch_size, cuda_graph (whether
    the replay path ran), attention ("tigon" or "hf": which attention ran), rotary_tables (the cos/sin tables the
    rotary modules read for the call, `tigon.hf.rotary_table`; 0 = HF's modules computed them every step). Step
    times are CUDA events on CUDA (read once at the end, no sync in the loop), perf_counter on a CPU.
    `prometheus_text(stats)` formats them for scraping."""
    _check_model(model)
    vocab = _vocab_size(model)
    _int("max_new_tokens", max_new_tokens, 1)
    for name, flag in (("do_sample", do_sample), ("cuda_graph", cuda_graph), ("return_stats", return_stats)):
        _bool(name, flag)
    if do_sample:
        # None is "off", as in model.generate's keyword arguments
        temperature = 1.0 if temperature is None else temperature
        top_k, top_p = 0 if top_k is None else top_k, 1.0 if top_p is None else top_p
        _validate_sampling(temperature, top_k, top_p)
        if generator is not None and (not isinstance(generator, torch.Generator)
                                      or generator.device.type != model.device.type):
            raise TypeError(f"{_NAME}: generator must be a torch.Generator on the model's device "
                            f"({model.device.type}), got {getattr(generator, 'device', type(generator).__name__)}")
    if not isinstance(attention, str) or attention not in ATTENTION:
        raise ValueError(f"{_NAME}: attention must be one of {', '.join(map(repr, ATTENTION))}, got {attention!r}")
    eos = _token_ids("eos_token_id", eos_token_id, vocab)
    if pad_token_id is not None:
        _int("pad_token_id", pad_token_id, 0)
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)
    if vocab is not None and pad >= vocab:  # a finished row feeds it back to the model
        raise ValueError(f"{_NAME}: pad_token_id {pad} is outside the model's vocabulary (ids 0..{vocab - 1})")
    if capacity is not None:
        _int("capacity", capacity, 1)
    _check_prompt(input_ids, attention_mask, vocab)

    clock = _Clock(model.device)
    clock.mark()  # TTFT counts from here: the attention switch, the cache allocation and the prompt copies
    ran, undo = _switch_attention(model, attention)
    clock.phase("attention_switch")
    scope = contextlib.ExitStack()  # what the loop switches for the call (the rotary tables), undone here
    try:
        sequences, stats = _decode_loop(
            model, input_ids, clock, scope, max_new_tokens=max_new_tokens, attention_mask=attention_mask,
            capacity=capacity, cuda_graph=cuda_graph, tigon=ran == "tigon", return_stats=return_stats,
            sampling=(do_sample, temperature, top_k, top_p, generator), eos=eos, pad_token_id=pad_token_id)
    finally:
        scope.close()
        if undo is not None:
            undo()
    if not return_stats:
        return sequences
    stats["attention"] = ran
    return sequences, stats


def _decode_loop(model, input_ids, clock, scope, *, max_new_tokens, attention_mask, capacity, cuda_graph, tigon,
                 return_stats, sampling, eos, pad_token_id):
    do_sample, temperature, top_k, top_p, generator = sampling
    pad = pad_token_id if pad_token_id is not None else (eos[0] if eos else 0)  # checked in generate
    b, p = input_ids.shape
    total = p + max_new_tokens
    capacity = total if capacity is None else capacity
    device = model.device
    if return_stats and device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    cache = _cache_class()(model.config, batch_size=b, capacity=capacity, dtype=model.dtype, device=device)
    if capacity < p and not all(cache.is_sliding):
        raise ValueError(f"{_NAME}: capacity ({capacity}) is smaller than the prompt ({p} tokens) and the "
                         "model has full-attention layers, which would drop prompt tokens; pass capacity >= "
                         "the prompt length")
    clock.phase("cache_alloc")
    # HF's decode mask is valid in a graph only while every ring fits; the tigon masks always are.
    use_graph = (cuda_graph and _graphs_available(device) and max_new_tokens >= 3
                 and (tigon or total <= min(layer.ring for layer in cache.layers)))

    ids = input_ids.to(device=device, dtype=torch.int64)
    rotary_tables = 0
    if ROTARY_TABLE:  # positions stay < total: left padding only lowers them
        from tigon.hf.rotary_table import cached_rotary

        rotary_tables = scope.enter_context(cached_rotary(model, total, dtype=model.dtype, device=device))
    out = torch.full((b, total), pad, dtype=torch.int64, device=device)
    out[:, :p].copy_(ids)
    if attention_mask is not None:
        prompt_mask = attention_mask.to(device=device, dtype=torch.int64)
        positions = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        # One static mask for every decode step: the prompt's padding, then ones. HF indexes it by absolute
        # position (slot == position while the ring fits), and the causal mask hides the future columns.
        width = max(total, capacity)
        step_mask = torch.ones((b, width), dtype=torch.int64, device=device)
        step_mask[:, :p].copy_(prompt_mask)
    else:
        prompt_mask = step_mask = None
        positions = torch.arange(p, device=device).expand(b, -1)
    if tigon:
        decode_masks = _TigonMasks(cache, step_mask.bool() if step_mask is not None else None)
    eos_t = torch.tensor(eos, dtype=torch.int64, device=device) if eos else None
    pad_t = torch.full((b,), pad, dtype=torch.int64, device=device)
    finished = torch.zeros((b,), dtype=torch.bool, device=device)
    lengths = torch.zeros((b,), dtype=torch.int64, device=device)  # new tokens per row, its EOS included
    tok = torch.zeros((b, 1), dtype=torch.int64, device=device)     # static decode inputs
    pos = positions[:, -1:].clone()

    def emit(logits, step):
        nxt = _choose(logits, do_sample, temperature, top_k, top_p, generator)
        if eos_t is not None:
            nxt = torch.where(finished, pad_t, nxt)
            lengths.add_(~finished)
            # A broadcast compare, not torch.isin: isin may take a sort/unique path for larger id lists.
            finished.logical_or_((nxt[:, None] == eos_t).any(-1))
        out[:, p + step].copy_(nxt)
        tok.copy_(nxt[:, None])
        pos.add_(1)

    def forward():
        mask = decode_masks() if tigon else step_mask
        return model(input_ids=tok, attention_mask=mask, position_ids=pos, past_key_values=cache,
                     use_cache=True, logits_to_keep=1).logits[:, -1]

    clock.phase("prompt_setup")
    logits = model(input_ids=ids, attention_mask=prompt_mask, position_ids=positions, past_key_values=cache,
                   use_cache=True, logits_to_keep=1).logits[:, -1]
    clock.phase("prefill")
    emit(logits, 0)
    clock.marks.append(clock.phase("first_token"))  # the TTFT end: the phases sum to ttft_s
    cache.device_offset = True
    graph = graph_logits = None
    steps = 1
    for step in range(1, max_new_tokens):
        if eos_t is not None and step % EOS_CHECK_EVERY == 0 and bool(finished.all()):
            break
        if graph is not None:
            graph.replay()
            for layer in cache.layers:  # the host count HF reads for mask sizes: replay skips the Python
                layer.seen += 1
            logits = graph_logits
        elif use_graph:
            graph, graph_logits, logits = _capture(forward, cache)
        else:
            logits = forward()
        emit(logits, step)
        clock.mark()
        steps += 1

    if eos_t is not None:
        steps = int(lengths.max())  # the one sync of a run without stats: trim like model.generate
    sequences = out[:, :p + steps]
    if not return_stats:
        return sequences, None
    lat = clock.seconds()
    ttft_phases, ttft_host_phases = clock.phase_seconds()
    ttft, step_s = lat[0], lat[1:]  # every step that ran, including any after the last EOS
    elapsed = ttft + sum(step_s)
    ordered = sorted(step_s)
    stats = dict(
        ttft_s=ttft, ttft_phases_s=ttft_phases, ttft_host_phases_s=ttft_host_phases, step_s=step_s,
        p50_step_s=_percentile(ordered, 0.5), p99_step_s=_percentile(ordered, 0.99),
        tokens_per_s=b * steps / elapsed if elapsed > 0 else float("inf"),
        decode_tokens_per_s=b * len(step_s) / sum(step_s) if sum(step_s) > 0 else None,
        peak_memory_bytes=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        new_tokens=steps, batch_size=b, cuda_graph=graph is not None, rotary_tables=rotary_tables)
    return sequences, stats


def _graphs_available(device) -> bool:
    return device.type == "cuda"


def _capture(forward, cache):
    """First CUDA-graph step: run it eagerly on a side stream (the warm-up capture needs: cuBLAS handles and
    workspaces exist before capture; its logits are this step's real result), then capture the next step
    without running it. Capture runs the Python once, so the host counters it advanced are put back."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        logits = forward()
    torch.cuda.current_stream().wait_stream(stream)
    seen = [layer.seen for layer in cache.layers]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        graph_logits = forward()
    for layer, count in zip(cache.layers, seen):
        layer.seen = count
    return graph, graph_logits, logits


# Step-latency histogram buckets (seconds): a CUDA-graph step of a 1-8B model is 0.5-5 ms, an eager one 10-100 ms.

