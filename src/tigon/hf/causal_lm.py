"""The ForCausalLM forward that computes the training loss without materializing the logits.

When only the loss is wanted, the loss comes from `tigon.ops.linear_cross_entropy` on the last hidden states
and the lm_head, and the output's `logits` is None (a [tokens, vocab] fp32 tensor is 8 GB at 16k tokens
and a 128k vocab). "Only the loss" follows Liger-Kernel's `skip_logits` forward argument: by default in
training with labels; `skip_logits=True` asks for it in eval too (the Trainer's `prediction_loss_only`
evaluation), `skip_logits=False` forces the logits. Otherwise the model's own forward runs and returns logits
exactly as Hugging Face does; a prefill over a RollingKVCache that keeps one logits row and no hidden states
(`model.generate`'s) tells the cache so (`last_position_only`), and the fused prefill's last layer then computes
that position alone.
"""

import functools
import inspect

import torch
import torch.nn.functional as F

from .. import ops

IGNORE_INDEX = -100
# HF forward per class, saved before any patch replaced it (class-level or instance-level).
_HF_FORWARD: dict = {}


def remember_hf_forward(cls) -> None:
    if cls not in _HF_FORWARD:
        _HF_FORWARD[cls] = cls.forward


def hf_forward_function(model):
    """The HF forward function of `model`'s class (unbound), as saved before any patch replaced it."""
    for klass in type(model).__mro__:
        if klass in _HF_FORWARD:
            return _HF_FORWARD[klass]
    return type(model).forward


def hf_forward(model):
    """HF's forward bound to `model`. A functools.partial, not `function.__get__`: torch 2.11's dynamo cannot
    trace `__get__` ("Attempted to call function marked as skipped" under fullgraph=True); it traces partials."""
    return functools.partial(hf_forward_function(model), model)


def _resolve_linear(lm_head):
    """The plain nn.Linear that computes the logits, or None when it is not one (LoRA on lm_head, or a
    quantized nn.Linear subclass such as bitsandbytes' Linear4bit, whose weight holds packed integers)."""
    if isinstance(lm_head, torch.nn.Linear):
        return lm_head if lm_head.weight.dtype.is_floating_point else None
    # PEFT's ModulesToSaveWrapper (lm_head in modules_to_save): use the active trainable copy.
    if hasattr(lm_head, "modules_to_save") and hasattr(lm_head, "original_module"):
        if getattr(lm_head, "disable_adapters", False):
            return _resolve_linear(lm_head.original_module)
        active = getattr(lm_head, "active_adapter", None)
        active = active[0] if isinstance(active, (list, tuple)) else active
        if active in lm_head.modules_to_save:
            return _resolve_linear(lm_head.modules_to_save[active])
    return None


LOSS_KEYWORD = "_tigon_loss"  # lm_head(hidden, _tigon_loss=(target, loss_kwargs)) computes the fused loss


def lm_head_forward(module, x, *args, _tigon_loss=None, **kwargs):
    """The forward Tigon gives an lm_head instance once, for good: with `_tigon_loss=(target, loss_kwargs)` it
    returns tigon.ops.linear_cross_entropy of x and the module's weight and bias; otherwise it is exactly the
    class forward (logits for generate() and evaluation)."""
    if _tigon_loss is None:
        return type(module).forward(module, x, *args, **kwargs)
    target, loss_kwargs = _tigon_loss
    return ops.linear_cross_entropy(x, module.weight, target, module.bias, **loss_kwargs)


class LossHeadLinear(torch.nn.Linear):
    """The class a plain nn.Linear lm_head gets from tigon (its instance `__class__`, set once): nn.Linear plus
    the `_tigon_loss=` keyword of lm_head_forward. A class rather than an instance forward: the module stays an
    ordinary module to dynamo (its forward is looked up on the class, as for any module), hooks and FSDP2's class
    swap work as on nn.Linear, isinstance(lm_head, nn.Linear) holds, pickle and deepcopy keep the class
    (importable), and unpatch sets nn.Linear back. Linear subclasses of other libraries keep the instance form."""

    def forward(self, x, *args, _tigon_loss=None, **kwargs):
        if _tigon_loss is None:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        target, loss_kwargs = _tigon_loss
        return ops.linear_cross_entropy(x, self.weight, target, self.bias, **loss_kwargs)


def has_loss_forward(linear) -> bool:
    if isinstance(linear, LossHeadLinear):
        return "forward" not in linear.__dict__ or has_bound_loss_forward(linear)
    return has_bound_loss_forward(linear)


def has_bound_loss_forward(linear) -> bool:
    return getattr(linear.__dict__.get("forward"), "__func__", None) is lm_head_forward


def install_loss_forward(linear, as_class=True):
    """Give `linear` the loss forward: a plain nn.Linear becomes a LossHeadLinear (as_class; an instance patch,
    whose unpatch sets the class back); otherwise, and for a subclass (another library's Linear), lm_head_forward
    becomes its instance forward (a BoundForward: deepcopy and pickle keep it; the module's type stays, as a
    class-level unpatch, which records nothing per instance, needs). Returns the undo record (owner, attribute,
    original) when this call installed it; None when it was there already, or when the instance has a forward of
    another library's (accelerate's device hooks), which stays: the loss is then computed outside the call."""
    if "forward" in linear.__dict__ or isinstance(linear, LossHeadLinear):
        return None
    if as_class and type(linear) is torch.nn.Linear:
        linear.__class__ = LossHeadLinear
        return (linear, "__class__", torch.nn.Linear)
    from .bound import BoundForward

    linear.forward = BoundForward(lm_head_forward, linear)
    return (linear, "forward", None)


def lm_head_loss(linear: torch.nn.Linear, hidden, target, **loss_kwargs):
    """linear_cross_entropy computed inside the lm_head module's own call.

    Running inside `linear(...)` fires the module's hooks, so a sharded weight (FSDP2 all-gathers on the
    pre-forward hook) is whole while it is read; `.weight` is never read outside the call.

    The module's forward is lm_head_forward, installed by patch() or at the first eager call, never per call:
    `linear(hidden, _tigon_loss=...)` is a plain module call with a keyword, which every dynamo version traces
    (fullgraph too). Setting and removing an instance forward around each call did not survive tracing: torch
    2.11's dynamo cannot trace the `__dict__.pop`, and with fullgraph=False it ran the class forward in the graph,
    so the "loss" was the [B, T, V] logits. While torch.compile traces a model whose lm_head has no
    lm_head_forward yet (a class-level patch compiled before any eager step), nothing is installed in the trace;
    the loss is computed from `.weight` directly, as it is beside another library's instance forward.
    """
    if not has_loss_forward(linear):
        return ops.linear_cross_entropy(hidden, linear.weight, target, linear.bias, **loss_kwargs)
    return linear(hidden, **{LOSS_KEYWORD: (target, loss_kwargs)})


def ensure_loss_forward(model, linear=None) -> None:
    """Install lm_head_forward on `linear` (by default the model's lm_head, resolved as the fused loss resolves
    it) in eager mode, never inside a trace: there the mutation would land after the graph. On an
    instance-patched model the install is recorded, so tigon.unpatch removes it."""
    linear = _resolve_linear(getattr(model, "lm_head", None)) if linear is None else linear
    if linear is None or torch.compiler.is_compiling():
        return
    undo = model.__dict__.get("_tigon_undo")
    record = install_loss_forward(linear, as_class=undo is not None)
    if record is not None and undo is not None:
        undo.append(record)


def _inner_model_kwargs(inner, past_key_values, cache):
    """transformers 5.17 names the cache `past_key_values`; newer versions call it `cache`."""
    value = cache if cache is not None else past_key_values
    params = inspect.signature(inner.forward).parameters
    if "cache" in params and "past_key_values" not in params:
        return {"cache": value}
    return {"past_key_values": value}


def _reads_last_position_only(model, cache, logits_to_keep, labels, kwargs) -> bool:
    """The forward's caller reads the last position only: one logits row kept (`logits_to_keep=1`, as
    `model.generate` asks), no labels, no hidden states or attentions returned, over a RollingKVCache (the only
    cache whose prefill reads `last_position_only`)."""
    from ..memory.kv_cache import RollingKVCache

    if not (isinstance(logits_to_keep, int) and not isinstance(logits_to_keep, bool) and logits_to_keep == 1
            and isinstance(cache, RollingKVCache)):
        return False
    config = model.config
    return (labels is None and kwargs.get("shift_labels") is None
            and not (kwargs.get("output_hidden_states") or getattr(config, "output_hidden_states", False))
            and not (kwargs.get("output_attentions") or getattr(config, "output_attentions", False)))


def fused_causal_lm_forward(
    self,
    input_ids=None,
    attention_mask=None,
    position_ids=None,
    past_key_values=None,
    inputs_embeds=None,
    labels=None,
    use_cache=None,
    logits_to_keep=0,
    cache=None,
    skip_logits=None,
    **kwargs,
):
    shift_labels = kwargs.get("shift_labels")
    if skip_logits and labels is None and shift_labels is None:
        raise ValueError(f"{type(self).__name__}.forward: skip_logits=True returns the loss only, so it needs "
                         "labels or shift_labels; both are None")
    if skip_logits is None:
        skip_logits = self.training and labels is not None  # like HF: shift_labels alone computes no loss
    linear = _resolve_linear(self.lm_head)
    router = kwargs.get("output_router_logits")
    router = bool(getattr(self.config, "output_router_logits", False) if router is None else router)
    balance = _load_balancing(self) if router else None
    # A quantized or LoRA-wrapped lm_head has no plain weight to fuse: HF's forward then runs, logits and all,
    # with skip_logits=True too (the loss is the same; the memory is HF's). So does an MoE model asked for its
    # router logits whose class computes its aux loss in a way _load_balancing does not know.
    fused = bool(skip_logits) and linear is not None and not (router and balance is None)
    if not fused:
        if cache is not None:
            kwargs.update(_inner_model_kwargs(self.model, None, cache))
            past_key_values = kwargs.pop("past_key_values", past_key_values)
        hf_kwargs = dict(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                         use_cache=use_cache, logits_to_keep=logits_to_keep, **kwargs)
        if not _reads_last_position_only(self, past_key_values, logits_to_keep, labels, kwargs):
            return hf_forward(self)(**hf_kwargs)
        before, past_key_values.last_position_only = past_key_values.last_position_only, True
        try:
            return hf_forward(self)(**hf_kwargs)
        finally:
            past_key_values.last_position_only = before
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    if router:
        kwargs["output_router_logits"] = True
    outputs = self.model(
        input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
        inputs_embeds=inputs_embeds, use_cache=use_cache,
        **_inner_model_kwargs(self.model, past_key_values, cache), **kwargs,
    )
    hidden = outputs.last_hidden_state
    keep = slice(-logits_to_keep, None) if isinstance(logits_to_keep, int) else logits_to_keep
    hidden = hidden[:, keep, :]
    ensure_loss_forward(self, linear)
    if shift_labels is None:
        # tokens < n predict token n, exactly as transformers' ForCausalLMLoss shifts
        shift_labels = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]
    loss = lm_head_loss(
        linear, hidden, shift_labels.to(hidden.device), ignore_index=IGNORE_INDEX,
        softcap=getattr(self.config, "final_logit_softcapping", None),
        num_items_in_batch=kwargs.get("num_items_in_batch"), skip_ignored=True,
    )
    common = dict(past_key_values=outputs.past_key_values, hidden_states=getattr(outputs, "hidden_states", None),
                  attentions=getattr(outputs, "attentions", None))
    if not router:
        return CausalLMOutputWithPast(loss=loss, logits=None, **common)
    # HF's MoE forwards: aux = load_balancing_loss_func(router logits, experts, top-k, attention_mask), added to
    # the loss times router_aux_loss_coef where labels are given (shift_labels alone: HF computes no loss)
    aux_loss = balance(outputs.router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)
    if labels is not None:
        loss = loss + self.router_aux_loss_coef * aux_loss.to(loss.device)
    return MoeCausalLMOutputWithPast(loss=loss, aux_loss=aux_loss, logits=None, router_logits=outputs.router_logits,
                                     **common)


def _load_balancing(model):
    """The load_balancing_loss_func of the model's own modeling module (Mixtral, Qwen2/3-MoE, OLMoE... each
    define one) when the model has the attributes HF's MoE forwards pass it (num_experts, num_experts_per_tok,
    router_aux_loss_coef), else None."""
    forward = hf_forward_function(model)
    module = inspect.getmodule(forward) if forward is not None else None
    fn = getattr(module, "load_balancing_loss_func", None)
    if fn is None or not all(hasattr(model, a) for a in ("num_experts", "num_experts_per_tok",
                                                          "router_aux_loss_coef")):
        return None
    return fn


def causal_lm_loss(logits, labels, vocab_size, num_items_in_batch=None, ignore_index=IGNORE_INDEX,
                   shift_labels=None, **kwargs):
    """transformers' ForCausalLMLoss on tigon.ops.cross_entropy: no fp32 copy of the logits."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]
    target = shift_labels.reshape(-1).to(logits.device)
    logits = logits.reshape(-1, vocab_size)
    if num_items_in_batch is None:
        return ops.cross_entropy(logits, target, ignore_index=ignore_index)
    loss = ops.cross_entropy(logits, target, ignore_index=ignore_index, reduction="sum")
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def fused_prenorm_decoder_forward(self, hidden_states, attention_mask=None, position_ids=None,
                                  past_key_values=None, use_cache=False, position_embeddings=None, **kwargs):
    """Llama's pre-norm decoder block with the attention's residual add fused into the second norm
    (tigon.ops.add_rms_norm: one kernel reads the two inputs and writes the norm and the sum). A layer
    whose norm is not Tigon's (built before a class-level patch) runs its HF forward. In a no-grad step with a
    cache, a layer step installed on the instance (`_tigon_layer_step`: tigon.decode.layer_step.install, the
    fused decode step and the direct prefill) runs first; where it returns None the block runs as written."""
    from ..modules import RMSNorm

    if not isinstance(self.post_attention_layernorm, RMSNorm):
        return hf_forward(self)(hidden_states, attention_mask=attention_mask, position_ids=position_ids,
                                past_key_values=past_key_values, use_cache=use_cache,
                                position_embeddings=position_embeddings, **kwargs)
    step = self.__dict__.get("_tigon_layer_step")  # set by tigon.decode (hf/ does not import it)
    if step is not None and past_key_values is not None and not torch.is_grad_enabled():
        out = step(self, hidden_states, attention_mask, past_key_values, position_embeddings)
        if out is not None:  # generation over a RollingKVCache: the fused decode step, the direct prefill
            return out
    residual = hidden_states
    hidden_states = self.input_layernorm(hidden_states)
    hidden_states, _ = self.self_attn(
        hidden_states=hidden_states, attention_mask=attention_mask, position_ids=position_ids,
        past_key_values=past_key_values, use_cache=use_cache, position_embeddings=position_embeddings, **kwargs,
    )
    # Under autocast (Trainer's bf16=True) attention returns bf16 while the residual stream stays fp32; HF's
    # `residual + hidden_states` promotes to fp32, so promote both before the fused add (exact upcast).
    dtype = torch.promote_types(hidden_states.dtype, residual.dtype)
    normed, hidden_states = self.post_attention_layernorm(hidden_states.to(dtype), residual.to(dtype))
    return hidden_states + self.mlp(normed)
