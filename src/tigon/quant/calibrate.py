"""Activation-aware scales for `tigon.quantize(..., calibration=batches)`: an equivalent rewrite of the model that
lets round-to-nearest 4-bit keep the input channels carrying the largest activations more precisely.

A linear's error on an input x is sum_k x_k (w_k - q(w_k)): a channel with large activations turns the same
rounding step into a larger output error. Multiplying weight column k by s_k > 1 (and the input by 1 / s_k, folded
into the op that produces it) keeps the function and, since a group's scale is set by its largest element, shrinks
that column's relative rounding error. Per scaled group (linears sharing one input, and the op before them):
- s = mean|x| ** alpha over the calibration tokens, normalized by sqrt(max(s) * min(s)), for alpha in
  0, 0.05, ..., 0.95; alpha = 0 is plain round-to-nearest;
- the score is the summed squared error || X W^T - (X / s) Q(W s)^T ||^2 over the group's linears on up to `rows`
  sampled input rows X; the lowest wins, so on the samples a group is never worse than round-to-nearest;
- the fold: the preceding op's output divided by s (an RMSNorm weight, or a linear's rows and bias), the linears'
  columns multiplied by s, computed in fp32 and cast back to the weights' dtype.
Groups of a Llama / Mistral / Qwen2 / Qwen3 decoder layer: input_layernorm -> q, k, v; post_attention_layernorm ->
gate, up; up -> down (the GLU's product is linear in up); v -> o when every head has its own v head
(num_key_value_heads == num_attention_heads: a v channel shared by several heads reaches o through several columns,
which one scale per channel cannot serve). A group with a member kept in full precision (`skip`), not an exact
nn.Linear (a LoRA layer), or that no calibration input reached is left as it is.

The statistics come from one pass of the unquantized model over the calibration batches: every layer's scales are
chosen from the full-precision inputs, not from the inputs the already-quantized layers before it would produce.
Cost: one forward per batch, and 20 quantizations and sampled matmuls per group.
"""

import inspect

import torch
from torch import nn

from tigon import _log
from tigon.ops.quantized_weight import dequantize

from .module import _check_rtn, quantize_rtn

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
FORMATS = ("int4", "nf4")
ALPHAS = tuple(i / 20 for i in range(20))
_ATTN = ("q_proj", "k_proj", "v_proj", "o_proj")
_MLP = ("gate_proj", "up_proj", "down_proj")


def _skipped(name, skip):
    """Whether module `name` is kept in full precision by `skip` (a full name or its tail after a dot)."""
    return any(name == s or name.endswith("." + s) for s in skip)


class _Group:
    """Linears sharing one input, and the op (`prev`, an RMSNorm or a linear) whose output that input is."""

    def __init__(self, key, prev, members, names, reason=None):
        self.key, self.prev, self.members, self.names, self.reason = key, prev, members, names, reason


def _check_calibration(where, calibration):
    """The batches as a list: each an integer [batch, seq] / [seq] tensor or a dict of model keyword arguments."""
    if isinstance(calibration, (torch.Tensor, dict, str, bytes)):
        raise TypeError(f"{where}: calibration must be an iterable of batches (input-id tensors or dicts of model "
                        f"keyword arguments), got a single {type(calibration).__name__}; pass [batch]")
    try:
        batches = list(calibration)
    except TypeError:
        raise TypeError(f"{where}: calibration must be an iterable of batches (input-id tensors or dicts of model "
                        f"keyword arguments), got {type(calibration).__name__}") from None
    if not batches:
        raise ValueError(f"{where}: calibration is empty; pass at least one batch of input ids")
    for i, b in enumerate(batches):
        if isinstance(b, torch.Tensor):
            if b.is_floating_point() or b.is_complex() or b.dtype == torch.bool or b.dim() not in (1, 2) \
                    or not b.numel():
                raise TypeError(f"{where}: calibration batch {i} must be a non-empty integer tensor of input ids "
                                f"[batch, seq] or [seq], got {b.dtype} {list(b.shape)}")
        elif isinstance(b, dict):
            if not b or not all(isinstance(k, str) for k in b):
                raise TypeError(f"{where}: calibration batch {i} must be a non-empty dict of model keyword arguments "
                                f"(str keys), got {list(b)!r}")
        else:
            raise TypeError(f"{where}: calibration batch {i} must be an input-id tensor or a dict of model keyword "
                            f"arguments, got {type(b).__name__}")
    return batches


def _is_rms_weight(norm, hidden):
    w = getattr(norm, "weight", None)
    return (isinstance(w, torch.Tensor) and w.is_floating_point() and tuple(w.shape) == (hidden,)
            and getattr(norm, "bias", None) is None)


def _decoder_layers(where, model):
    """[(name, layer)] of the decoder layers, after checking the model type and each layer's structure."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in MODEL_TYPES:
        raise ValueError(f"{where}: calibration supports the decoder layers of model types {MODEL_TYPES} (plain "
                         f"RMSNorm weights and separate q/k/v and gate/up projections, so the scales fold exactly); "
                         f"got model_type {model_type!r}; pass calibration=None for round-to-nearest")
    layers = [(n, m) for n, m in model.named_modules()
              if all(isinstance(getattr(m, a, None), nn.Module)
                     for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))]
    if not layers:
        raise ValueError(f"{where}: calibration found no decoder layer (a module with self_attn, mlp, "
                         f"input_layernorm and post_attention_layernorm) in the {model_type!r} model")
    for name, layer in layers:
        missing = [f"self_attn.{p}" for p in _ATTN if not isinstance(getattr(layer.self_attn, p, None), nn.Module)]
        missing += [f"mlp.{p}" for p in _MLP if not isinstance(getattr(layer.mlp, p, None), nn.Module)]
        hidden = getattr(getattr(layer.self_attn, "q_proj", None), "in_features", None)
        norms = [n for n in ("input_layernorm", "post_attention_layernorm")
                 if hidden is None or not _is_rms_weight(getattr(layer, n), hidden)]
        if missing or norms:
            raise ValueError(f"{where}: decoder layer {name!r} of the {model_type!r} model is not of the supported "
                             f"structure: missing {missing}, norms without a plain [hidden] weight {norms}")
    return layers


def _groups(model, skip=("lm_head",)):
    """Every scaled group of the model, in layer order (input_layernorm, v -> o, post_attention_layernorm, up ->
    down); a group that cannot be scaled carries its `reason`."""
    where = "tigon.quantize"
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    get = getattr(model, "get_output_embeddings", None)
    output = get() if callable(get) else None
    groups = []
    for name, layer in _decoder_layers(where, model):
        attn, mlp = layer.self_attn, layer.mlp
        specs = [(f"{name}.input_layernorm", layer.input_layernorm, attn, "self_attn", ("q_proj", "k_proj", "v_proj")),
                 (f"{name}.self_attn.v_proj", attn.v_proj, attn, "self_attn", ("o_proj",)),
                 (f"{name}.post_attention_layernorm", layer.post_attention_layernorm, mlp, "mlp",
                  ("gate_proj", "up_proj")),
                 (f"{name}.mlp.up_proj", mlp.up_proj, mlp, "mlp", ("down_proj",))]
        for key, prev, parent, sub, parts in specs:
            members = [getattr(parent, p) for p in parts]
            names = tuple(f"{name}.{sub}.{p}" for p in parts)
            reason = None
            bad = [n for n, m in zip(names, members) if type(m) is not nn.Linear or m is output or _skipped(n, skip)]
            if parts == ("o_proj",) and heads != kv_heads:
                reason = (f"num_key_value_heads ({kv_heads}) != num_attention_heads ({heads}): a v channel reaches "
                          "o_proj through several columns")
            elif bad or (parts[0] in ("o_proj", "down_proj") and type(prev) is not nn.Linear):
                reason = f"kept in full precision or not an nn.Linear: {list(bad) or [key]}"
            elif prev.weight.shape[0] != members[0].in_features:
                reason = f"{key} gives {prev.weight.shape[0]} channels, {names[0]} takes {members[0].in_features}"
            groups.append(_Group(key, prev, members, names, reason))
    return groups


class _Inputs:
    """A forward pre-hook's running statistics of a linear's input: sum |x| per channel and the row count (fp32),
    and a uniform sample of up to `rows` input rows (the rows of smallest random key, so each batch's rows and the
    kept ones compete on equal terms)."""

    def __init__(self, rows, seed):
        self.rows, self.count, self.abs_sum, self.sample, self.keys = rows, 0, None, None, None
        self.mask = None
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, module, args, kwargs):
        x = (args[0] if args else kwargs["input"]).detach()
        if self.mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(self.mask.shape):
            x = x[self.mask.to(x.device)]
        x = x.reshape(-1, x.shape[-1]).float()
        if not x.shape[0]:
            return
        a = x.abs().sum(0)
        self.abs_sum = a if self.abs_sum is None else self.abs_sum + a
        self.count += x.shape[0]
        keys = torch.rand(x.shape[0], generator=self.generator)
        if x.shape[0] > self.rows:
            keys, idx = keys.topk(self.rows, largest=False)
            x = x[idx.to(x.device)]
        if self.sample is not None:
            x, keys = torch.cat([self.sample, x]), torch.cat([self.keys, keys])
            if x.shape[0] > self.rows:
                keys, idx = keys.topk(self.rows, largest=False)
                x = x[idx.to(x.device)]
        self.sample, self.keys = x, keys


def _collect(model, batches, groups, rows):
    """Run the model over `batches` (no grad, eval mode) with a pre-hook on each group's first linear; returns
    {group key: _Inputs}. The training flags and hooks are restored whatever happens."""
    emb = model.get_input_embeddings() if callable(getattr(model, "get_input_embeddings", None)) else None
    weight = getattr(emb, "weight", None)
    device = weight.device if isinstance(weight, torch.Tensor) else next(model.parameters()).device
    params = inspect.signature(model.forward).parameters
    stats, handles = {}, []
    flags = [(m, m.training) for m in model.modules()]
    try:
        for i, g in enumerate(groups):
            stats[g.key] = _Inputs(rows, seed=i)
            handles.append(g.members[0].register_forward_pre_hook(stats[g.key], with_kwargs=True))
        model.eval()
        with torch.no_grad():
            for b in batches:
                if isinstance(b, torch.Tensor):
                    kwargs = {"input_ids": (b[None] if b.dim() == 1 else b).to(device)}
                else:
                    kwargs = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in b.items()}
                if "use_cache" in params or any(p.kind == p.VAR_KEYWORD for p in params.values()):
                    kwargs.setdefault("use_cache", False)
                if "logits_to_keep" in params and "labels" not in kwargs:  # the layers' inputs are what is wanted
                    kwargs.setdefault("logits_to_keep", 1)
                mask = kwargs.get("attention_mask")
                mask = mask.bool() if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None
                for s in stats.values():
                    s.mask = mask
                model(**kwargs)
    finally:
        for h in handles:
            h.remove()
        for m, training in flags:
            m.training = training
    return stats


def _score(group, x, s, fmt, group_size, symmetric, reference):
    """Summed squared error of the group's outputs on the sampled rows x with the columns scaled by s."""
    xs = x / s
    err = 0.0
    for lin, y in zip(group.members, reference):
        w = lin.weight
        dtype = w.dtype if w.dtype in (torch.float32, torch.float16, torch.bfloat16) else None
        q = dequantize(quantize_rtn((w.float() * s).to(w.dtype), fmt, group_size, symmetric=symmetric, dtype=dtype))
        err += (y - xs @ q.T).square().sum().item()
    return err


def _scales(mean_abs, alpha):
    """mean|x| ** alpha, normalized so the largest and smallest are reciprocal, kept away from zero."""
    m = mean_abs.clamp(min=mean_abs.max().item() * 1e-4)
    s = m.pow(alpha)
    return (s / (s.max() * s.min()).sqrt()).clamp(min=1e-4)


def _fold(group, s):
    """Divide the preceding op's output by s (an RMSNorm weight, or a linear's rows and bias) and multiply the
    group's columns by s, in fp32, cast back: the model computes the same function."""
    with torch.no_grad():
        prev = group.prev
        w = prev.weight
        sp = s.to(w.device)
        if isinstance(prev, nn.Linear):
            w.copy_((w.float() / sp[:, None]).to(w.dtype))
            if prev.bias is not None:
                prev.bias.copy_((prev.bias.float() / sp.to(prev.bias.device)).to(prev.bias.dtype))
        else:
            w.copy_((w.float() / sp).to(w.dtype))
        for lin in group.members:
            lw = lin.weight
            lw.copy_((lw.float() * s.to(lw.device)[None, :]).to(lw.dtype))


def search_scales(model: nn.Module, calibration, fmt: str, group_size: int, symmetric: bool, skip=("lm_head",), *,
                  rows: int = 512) -> dict:
    """Choose activation-aware scales for each group of `model` on the `calibration` batches and fold them into the
    model, in place (module docstring); `tigon.quantize` then quantizes the rescaled weights round-to-nearest.
    `calibration`: an iterable of input-id tensors ([batch, seq] or [seq]) or dicts of keyword arguments for
    `model(**batch)` (an `attention_mask` there keeps padding out of the statistics), moved to the device of the
    input embeddings. `rows`: input rows sampled per group for the score.

    Returns {the preceding op's name: {"linears": names, "alpha": the exponent chosen (0: round-to-nearest), "error"
    and "rtn_error": the summed squared output error on the samples with it and with alpha = 0}}; a group left as it
    is has "alpha" None and a "reason". Every check runs before anything changes."""
    where = "tigon.quantize"
    if fmt not in FORMATS:
        raise ValueError(f"{where}: calibration searches scales for 4-bit formats {FORMATS} only (fp8's rounding "
                         f"error is small and relative per element); got fmt={fmt!r}; pass calibration=None")
    if isinstance(rows, bool) or not isinstance(rows, int) or rows <= 0:
        raise ValueError(f"{where}: rows must be an int > 0, got {rows!r}")
    if isinstance(skip, str) or not all(isinstance(s, str) for s in skip):
        raise TypeError(f"{where}: skip must be a tuple of module names, got {skip!r}")
    batches = _check_calibration(where, calibration)
    groups = _groups(model, skip)
    live = [g for g in groups if g.reason is None]
    for g in live:
        for name, lin in zip(g.names, g.members):
            try:
                _check_rtn(where, lin.weight, fmt, group_size, symmetric, None)
            except (TypeError, ValueError) as e:
                raise type(e)(f"{e} (layer {name!r})") from None
    stats = _collect(model, batches, live, rows)
    chosen = {}
    for g in groups:
        entry = chosen[g.key] = {"linears": g.names, "alpha": None}
        st = stats.get(g.key)
        if g.reason is None and (st is None or not st.count or not st.abs_sum.max().item() > 0):
            g.reason = "no calibration input reached it"
        if g.reason is not None:
            entry["reason"] = g.reason
            continue
        with torch.no_grad():
            x = st.sample.to(g.members[0].weight.device)
            mean_abs = (st.abs_sum / st.count).to(x.device)
            reference = [x @ lin.weight.float().T for lin in g.members]
            best = None
            for alpha in ALPHAS:
                s = _scales(mean_abs, alpha)
                err = _score(g, x, s, fmt, group_size, symmetric, reference)
                if alpha == 0:
                    entry["rtn_error"] = err
                if best is None or err < best[1]:
                    best = (alpha, err, s)
        entry["alpha"], entry["error"] = best[0], best[1]
        if best[0] > 0:
            _fold(g, best[2])
    _summary(chosen, max((s.count for s in stats.values()), default=0))
    return chosen


def _summary(chosen, tokens):
    done = [e for e in chosen.values() if e["alpha"] is not None]
    left = len(chosen) - len(done)
    if not done:
        _log.get_logger().warning("tigon.quantize: activation-aware scales: no group searched (%d left as they are: "
                                  "%s)", left, sorted({e["reason"] for e in chosen.values()}))
        return
    alphas = [e["alpha"] for e in done]
    rtn = sum(e["rtn_error"] for e in done)
    ratio = sum(e["error"] for e in done) / rtn if rtn > 0 else 1.0
    _log.get_logger().info(
        "tigon.quantize: activation-aware scales over %d calibration tokens: %d group(s) searched, %d scaled, %d "
        "left as they are; alpha mean %.2f (min %.2f, max %.2f); sampled output error %.3f of round-to-nearest's",
        tokens, len(done), sum(a > 0 for a in alphas), left, sum(alphas) / len(alphas), min(alphas), max(alphas),
        ratio)
