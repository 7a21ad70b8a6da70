"""A CUDA-graph decode step for Hugging Face's own `model.generate` over a RollingKVCache.

    tigon.patch(model, cuda_graph=True)          # also switches the model to the "tigon" attention
    cache = RollingKVCache(model.config, batch_size=B, capacity=P + N)
    model.generate(ids, past_key_values=cache, max_new_tokens=N, ...)   # HF's loop, processors, criteria

`install(model)` (what `tigon.patch(model, cuda_graph=True)` calls; `uninstall`, or `tigon.unpatch`, takes it
off) puts a `GraphForward` on the model instance's `forward`, in front of the forward it had. A call that is
a decode step (one token per row, a RollingKVCache, everything below graphable) goes through static buffers:
the step's input_ids, attention mask (HF's generate builds the 4-D `[B, 1, 1, ring]` mask before the
forward: a compileable cache) and position ids (HF's forward would read the cache's host counter; the step
fills a static `[1, 1]` with it instead) are copied in, and the forward runs over them:
- the first decode step of a generation eagerly (the warm-up: Triton JIT, cuBLAS handles),
- the second eagerly on a side stream (its real result), then captured once on that stream,
- every later one as a replay of that graph.
The output is `CausalLMOutputWithPast(logits=<a copy of the graph's logits>, past_key_values=<the cache>)`:
the logits are a fresh tensor the caller may keep (HF's loop copies them again to fp32 at once; the copy is
one `[B, 1, V]` kernel). Replay skips the Python, so after each replay every cache layer's host count
(`seen`, which HF's mask sizes read) is advanced by hand.

A graph lives for one generation: any call that is not a decode step (the prefill, length > 1) drops it, and
a decode step whose batch, cache object, dtypes, mask or position layout differ from the captured one drops it
and warms up anew (so one capture per generate call). Steps run the forward they had, with one log line per
reason (the "tigon" logger, WARNING) when: the cache is not a RollingKVCache (HF's DynamicCache, a
StaticCache), the model is not on the "tigon" attention or not on CUDA, autograd or training mode is on,
output_attentions / output_hidden_states / return_dict=False / use_cache=False / inputs_embeds / a 2-D mask
are passed, a submodule has a forward hook (looked for once per generation), the model is split over devices,
or the capture fails. Under torch.compile the wrapper is transparent.

HF's generate compiles the decode forward itself on CUDA for any compileable cache, RollingKVCache included;
while installed, the model's `_valid_auto_compile_criteria` says no for a RollingKVCache (the graph is the
decode step) and is HF's for every other cache.

The capture is injectable (`install(model, graphs=...)`, an object with `available(device)`, `warm(fn)` and
`capture(fn)`, see `CudaGraphs`): the CPU tests run the selection logic with a double that replays eagerly.
"""

import contextlib
import functools
import inspect
import weakref

import torch
from torch import nn

from .. import _log
from ..hf.bound import BoundForward
from ..hf.ring_decode import NAME as TIGON_ATTENTION
from ..hf.ring_decode import mark_unmasked
from ..hf.unwrap import unwrap_model
from ..memory.kv_cache import RollingKVCache
from .capture import capture, warm_up

STATE = "_tigon_hf_graph"  # model.__dict__ key: the installed GraphForward's state
_COMPILE_CHECK = "_valid_auto_compile_criteria"  # HF's method, overridden on the instance while installed
# What a graphed decode step may be called with (what HF's generate passes, and cache_position for remote code).
_KEYS = {"input_ids", "attention_mask", "position_ids", "cache_position", "past_key_values", "use_cache",
         "return_dict", "logits_to_keep", "output_attentions", "output_hidden_states"}


class CudaGraphs:
    """The CUDA capture: `warm` runs a step eagerly on a side stream (cuBLAS allocates that stream's workspace
    and the step's result is real), `capture` records the same step on that stream without running it and
    returns (replay, the graph's output)."""

    def __init__(self):
        self.stream = None

    def available(self, device) -> bool:
        return device.type == "cuda"

    def warm(self, fn):
        self.stream, out = warm_up(fn)
        return out

    def capture(self, fn):
        graph = torch.cuda.CUDAGraph()
        with capture(graph, self.stream):  # no device sync (decode/capture.py)
            out = fn()
        return graph.replay, out

    def __reduce__(self):
        return CudaGraphs, ()


def _layout(value):
    """What a graph bakes in about an input: shapes, dtypes and devices, never values."""
    if isinstance(value, torch.Tensor):
        return tuple(value.shape), value.dtype, value.device
    if isinstance(value, dict):
        return tuple(sorted((k, _layout(v)) for k, v in value.items()))
    return value


def _static(value):
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _static(v) for k, v in value.items()}
    return value


def _copy_into(static, value):
    if isinstance(static, torch.Tensor):
        static.copy_(value)
    elif isinstance(static, dict):
        for k, v in static.items():
            _copy_into(v, value[k])


def _unmasked(cache):
    """The decode mask of a step without padding: a constant all-true `[1, 1, 1, ring]` per ring size, marked so
    the attention reads the slot positions as they are (a dict by layer type when the full and sliding rings
    differ), as tigon.generate passes it; HF's own mask builder (whose offsets are host integers) stays out."""
    kinds = {}
    for layer in cache.layers:
        kinds.setdefault("sliding_attention" if layer.is_sliding else "full_attention", layer)
    masks = {kind: mark_unmasked(torch.ones((1, 1, 1, layer.ring), dtype=torch.bool, device=layer.device))
             for kind, layer in kinds.items()}
    if len({(layer.ring, layer.sink) for layer in kinds.values()}) == 1:
        return next(iter(masks.values()))
    return masks


def _not_graphable(model, kwargs, graphs) -> str:
    """Why this decode step cannot replay a graph ("" when it can). Host checks only."""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, RollingKVCache):
        return (f"past_key_values is {type(cache).__name__ if cache is not None else 'not given'}, not a "
                "tigon.memory.RollingKVCache")
    if not graphs.available(cache.layers[0].device):
        return f"the cache is on {cache.layers[0].device.type}; CUDA graphs need a CUDA device"
    if getattr(model.config, "_attn_implementation", None) != TIGON_ATTENTION:
        return "the model is not on the \"tigon\" attention (tigon.patch(model, attention=True))"
    if torch.is_grad_enabled() or model.training:
        return "autograd or training mode is on"
    extra = sorted(set(kwargs) - _KEYS)
    if extra:
        return f"the forward is called with {extra[0]}"
    for flag in ("output_attentions", "output_hidden_states"):
        if kwargs.get(flag):
            return f"{flag}=True"
    if kwargs.get("return_dict") is False or kwargs.get("use_cache") is False:
        return "return_dict=False or use_cache=False"
    mask = kwargs.get("attention_mask")
    masks = mask.values() if isinstance(mask, dict) else [mask]
    if not all(m is None or (isinstance(m, torch.Tensor) and m.dim() == 4) for m in masks):
        return "the attention mask is not 4-D (HF's generate passes one for a RollingKVCache)"
    if not isinstance(kwargs.get("logits_to_keep", 0), int):
        return "logits_to_keep is a tensor"
    if nn.modules.module._global_forward_hooks or nn.modules.module._global_forward_pre_hooks:
        return "a global module forward hook is registered"
    if len(set(getattr(model, "hf_device_map", {}).values())) > 1:
        return "the model is split over devices (hf_device_map)"
    return ""


def _foreign(hooks) -> bool:
    # Tigon's own hooks are host-side one-shots (hf.lora arms PEFT's class forward at the first forward, a
    # functools.partial of its function): that a replay skips them changes no tensor.
    fns = (h.func if isinstance(h, functools.partial) else h for h in hooks.values())
    return any(not getattr(fn, "__module__", "").startswith("tigon.") for fn in fns)


def _hooked(model) -> str:
    """A submodule whose hooks would run only at capture, never on replay ("" if none)."""
    for name, m in model.named_modules():
        if m is not model and (_foreign(m._forward_hooks) or _foreign(m._forward_pre_hooks)):
            return f"{name} has a forward hook"
    return ""


class _GraphState:
    """One model's graph and counters. Not carried by copy.deepcopy / pickle: a copy starts without a graph."""

    def __init__(self, previous, graphs, on_capture):
        self.previous, self.graphs, self.on_capture = previous, graphs, on_capture
        self.counts = dict(captures=0, replays=0, eager_steps=0)
        self.logged = set()
        self.last_fallback = ""
        self.paused = 0
        self.drop()

    def __reduce__(self):
        return _GraphState, (self.previous, self.graphs, self.on_capture)

    def drop(self):
        """Forget the graph (it frees its memory pool) and the generation it belonged to."""
        self.key = self.cache = self.replay = self.logits = self.out_type = None
        self.inputs = self.failed = None
        self.steps = 0

    def note(self, why):
        self.last_fallback = why
        self.counts["eager_steps"] += 1
        if why not in self.logged:
            self.logged.add(why)
            _log.get_logger().warning("tigon cuda_graph: decode steps run eagerly: %s", why)


class GraphForward:
    """`model.forward` while `install(model)` holds: decode steps replay a CUDA graph (module docstring), every
    other call runs the forward the model had."""

    __slots__ = ("__self__",)

    def __init__(self, model):
        self.__self__ = model

    @property
    def state(self) -> _GraphState:
        return self.__self__.__dict__[STATE]

    def inner(self):
        previous = self.state.previous
        return previous if previous is not None else type(self.__self__).forward.__get__(self.__self__)

    @property
    def __signature__(self):  # what generate() inspects (logits_to_keep, the accepted kwargs)
        return inspect.signature(self.inner())

    def __reduce__(self):
        return GraphForward, (self.__self__,)

    def __repr__(self):
        return f"<tigon cuda-graph forward of {type(self.__self__).__name__}>"

    def __call__(self, *args, **kwargs):
        inner, state = self.inner(), self.state
        if state.paused or torch.compiler.is_compiling():
            return inner(*args, **kwargs)
        if len(args) == 1 and "input_ids" not in kwargs:
            kwargs, args = dict(kwargs, input_ids=args[0]), ()
        ids, cache = kwargs.get("input_ids"), kwargs.get("past_key_values")
        if (args or not (isinstance(ids, torch.Tensor) and ids.dim() == 2 and ids.shape[1] == 1)
                or (isinstance(cache, RollingKVCache) and cache.get_seq_length() == 0)):
            state.drop()  # a prefill (a 1-token prompt too), not a token step: never captured; the graph is done
            return inner(*args, **kwargs)
        model = self.__self__
        why = _not_graphable(model, kwargs, state.graphs)
        if why:
            state.drop()
            state.note(why)
            return inner(**kwargs)
        if cache.layers[0].device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return inner(**kwargs)  # the caller captures this forward in a graph of its own
        emb = model.get_input_embeddings().weight
        key = (_layout(ids), _layout(kwargs.get("attention_mask")), _layout(kwargs.get("position_ids")),
               _layout(kwargs.get("cache_position")), kwargs.get("logits_to_keep", 0), emb.data_ptr(), emb.dtype)
        if key != state.key or state.cache is None or state.cache() is not cache:
            self._start(key, kwargs, cache)
        if state.failed:
            state.note(state.failed)
            return inner(**kwargs)
        state.steps += 1
        static = state.inputs
        for name in ("input_ids", "attention_mask", "position_ids", "cache_position"):
            if kwargs.get(name) is not None:
                _copy_into(static[name], kwargs[name])
        if kwargs.get("position_ids") is None:  # HF's forward: arange(1) + the cache's host count
            static["position_ids"].fill_(cache.get_seq_length())
        if state.replay is not None:
            return self._replay(cache)
        if state.steps == 1:  # the warm-up, through the static inputs: the code the capture records
            return inner(**static, past_key_values=cache)
        return self._capture(inner, cache)

    def _start(self, key, kwargs, cache):
        """A new generation (or a new layout): static buffers like this step's inputs, no graph yet."""
        state = self.state
        state.drop()
        # A weak reference: the graph must not keep the user's cache (GBs of rings) alive after generate; when
        # the cache goes, so does the graph of its generation.
        state.key, state.cache = key, weakref.ref(cache, lambda ref: state.drop() if state.cache is ref else None)
        state.failed = _hooked(self.__self__) or None
        static = {name: _static(v) for name, v in kwargs.items() if name != "past_key_values"}
        if kwargs.get("attention_mask") is None:
            static["attention_mask"] = _unmasked(cache)
        if kwargs.get("position_ids") is None:
            static["position_ids"] = torch.zeros((1, 1), dtype=torch.int64, device=cache.layers[0].device)
        state.inputs = static

    def _capture(self, inner, cache):
        state = self.state

        def run():
            return inner(**state.inputs, past_key_values=cache)

        out = state.graphs.warm(run)  # this step's result; its errors are the model's
        seen = [layer.seen for layer in cache.layers]
        try:
            replay, logits = state.graphs.capture(lambda: run().logits)
        except Exception as e:  # noqa: BLE001 - any capture failure falls back to the eager forward
            state.failed = f"the capture failed ({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''})"
            state.note(state.failed)
            return out
        finally:
            for layer, count in zip(cache.layers, seen):  # capture ran the Python, not the step
                layer.seen = count
        state.replay, state.logits, state.out_type = replay, logits, type(out)
        state.counts["captures"] += 1
        if state.on_capture is not None:
            state.on_capture()
        return out

    def _replay(self, cache):
        state = self.state
        seen = [layer.seen for layer in cache.layers]
        state.replay()
        for layer, count in zip(cache.layers, seen):  # what the step's Python would have counted
            layer.seen = count + 1
        state.counts["replays"] += 1
        return state.out_type(logits=state.logits.clone(), past_key_values=cache)


def _no_compile_over_ring(model, model_kwargs, generation_config):
    """generate()'s auto-compile check while the graph step is installed: never for a RollingKVCache."""
    if isinstance(model_kwargs.get("past_key_values"), RollingKVCache):
        return False
    return type(model)._valid_auto_compile_criteria(model, model_kwargs, generation_config)


@contextlib.contextmanager
def paused(model):
    """Within the block `model`'s graph step passes every call straight to the forward under it (tigon.generate
    captures its own graph); a no-op where it is not installed."""
    try:
        hf = unwrap_model(model)
    except TypeError:
        hf = None
    state = hf.__dict__.get(STATE) if hf is not None else None
    if state is None:
        yield
        return
    state.paused += 1
    try:
        yield
    finally:
        state.paused -= 1


def installed(model) -> bool:
    """`install(model)` holds (on the transformers model inside any wrapper); False for anything else."""
    try:
        return STATE in unwrap_model(model, "tigon.decode.hf_graph.installed").__dict__
    except TypeError:
        return False


def install(model, *, graphs=None, on_capture=None) -> None:
    """Put the CUDA-graph decode step on `model` (a transformers causal LM instance, or a PEFT/other wrapper of
    one; idempotent). `graphs`: the capture (default `CudaGraphs()`); `on_capture`: called with no arguments
    right after each capture, before its first replay (a profiler starts there). Raises TypeError for a
    non-callable on_capture or a graphs object without available/warm/capture."""
    hf = unwrap_model(model, "tigon.decode.hf_graph.install")
    if on_capture is not None and not callable(on_capture):
        raise TypeError(f"hf_graph.install: on_capture must be a callable or None, got {type(on_capture).__name__}")
    graphs = CudaGraphs() if graphs is None else graphs
    missing = [name for name in ("available", "warm", "capture") if not callable(getattr(graphs, name, None))]
    if missing:
        raise TypeError(f"hf_graph.install: graphs ({type(graphs).__name__}) has no {', '.join(missing)} method")
    if STATE in hf.__dict__:
        return
    if not callable(getattr(type(hf), _COMPILE_CHECK, None)) or not callable(getattr(hf, "generate", None)):
        raise TypeError(f"hf_graph.install: {type(hf).__name__} is not a transformers generation model (no "
                        f"generate / {_COMPILE_CHECK})")
    hf.__dict__[STATE] = _GraphState(hf.__dict__.get("forward"), graphs, on_capture)
    hf.forward = GraphForward(hf)
    hf.__dict__[_COMPILE_CHECK] = BoundForward(_no_compile_over_ring, hf)


def uninstall(model) -> None:
    """Take the graph step off `model` (its graph is freed): the forward it had before `install` comes back."""
    hf = unwrap_model(model, "tigon.decode.hf_graph.uninstall")
    state = hf.__dict__.pop(STATE, None)
    if state is None:
        return
    if isinstance(hf.__dict__.get("forward"), GraphForward):
        if state.previous is None:
            del hf.forward
        else:
            hf.forward = state.previous
    hf.__dict__.pop(_COMPILE_CHECK, None)
    state.drop()


def graph_stats(model) -> dict:
    """{captures, replays, eager_steps (decode steps that ran eagerly for a reason), last_fallback (that reason,
    "" if none)} since install, or None where the graph step is not installed."""
    state = unwrap_model(model, "tigon.decode.hf_graph.graph_stats").__dict__.get(STATE)
    if state is None:
        return None
    return dict(state.counts, last_fallback=state.last_fallback)
