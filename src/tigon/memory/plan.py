"""tigon.memory.plan: the peak GPU memory of a training step, by component, read before the step runs.

The byte model of a Llama-shaped decoder (norms, q/k/v/o projections with RoPE, attention, gated MLP, LM head) as
a patched model runs it, with or without gradient checkpointing, PEFT LoRA, a 4-bit base, offloaded checkpoints
and a sequence-tiled MLP. The peak is the largest of a few moments of the step (the loss, the backward of the top
and of the bottom layer, the embedding's backward, the optimizer step), each a sum of components. Every formula,
where its numbers come from and the measured peaks it was checked against: docs/memory/plan.md.
"""

import dataclasses
import inspect
import math
import re

import torch

from ..ops._rolling_buffer import RollingBuffer
from ..ops.linear_cross_entropy import chunk_rows
from .tiling import auto_tile_tokens

__all__ = ["MemoryPlan", "MemoryPlanError", "plan"]

_NAME = "tigon.memory.plan"
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
OPTIMIZERS = {  # optimizer -> bytes of state per trainable parameter of `e` bytes
    "adamw": lambda e: 2 * e,  # torch.optim.AdamW: two moments in the parameter's dtype
    "adamw_fp32": lambda e: 8,  # tigon.optim.AdamW(state_dtype=torch.float32)
    "adamw_master": lambda e: 8 + (4 if e < 4 else 0),  # fp32 moments + an fp32 master of a bf16/fp16 parameter
    "adamw_8bit": lambda e: 2 * (1 + 4 / 256),  # two uint8 moments, an fp32 scale per 256 (tigon.optim.AdamW
    # (state_bits=8), bitsandbytes' AdamW8bit)
    "sgd": lambda e: 0,
}
ATTENTIONS = ("flash", "sdpa", "flex", "eager")  # sdpa and flex keep what flash keeps (sdpa: but in fp32 with GQA)
LOSSES = ("fused", "logits")
NF4_BYTES = 0.5 + 4 / 64  # bitsandbytes NF4: 4 bits a weight and one fp32 absmax per block of 64
CONTEXT_BYTES = 512 << 20  # CUDA context and kernel images: outside torch's allocator
ALLOCATOR_SLACK = 0.05  # reserved over allocated in the caching allocator (2.8-3.8% measured on the 1.5B step)
ARENA_KEEP = inspect.signature(RollingBuffer.__init__).parameters["keep_bytes"].default
CARD = ("weights", "gradients", "optimizer_state", "checkpoints_on_card", "layer_working_set", "loss_chunk",
        "attention_workspace", "inputs")


class MemoryPlanError(ValueError):
    """The job does not fit its budget (or the budget not even the weights): raised before any step runs."""


@dataclasses.dataclass(frozen=True)
class _Job:
    """What the byte model needs: the shape, the trained tensors, the settings (seq_len left out)."""

    hidden: int
    inter: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    act: int  # bytes of an activation element
    weights: int
    layer_grads: int  # gradient bytes of one decoder layer
    down_grads: int  # of its down projection (made at the moment the MLP's backward peaks)
    head_grads: int  # LM head and final norm (the fused loss makes the head's in the forward)
    embed_grads: int  # 0 unless the input embedding trains
    embed_transient: int  # a tied embedding's second gradient, added into the first
    optimizer_state: int
    trains: tuple  # PROJECTIONS -> whether its input is kept (its weight or its adapters train)
    ranks: tuple  # PROJECTIONS -> LoRA rank (0: no adapter)
    dequant: int  # the bf16 copy of a 4-bit weight during a matmul
    mlp_fp32: int  # fp32 sums of one layer's trainable MLP parameters (a tiled MLP's backward)
    batch: int
    checkpointing: bool
    kept: int  # checkpointed layer inputs that stay on the card (layers when not offloaded)
    tile: int  # 0: untiled MLP
    attention: str
    loss: str
    in_backward: bool = False  # the optimizer steps each parameter as its gradient completes, then frees it
    input_leaf: bool = False  # the frozen embedding's output requires grad (enable_input_require_grads, LoRA)
    keep_activations: int = 0  # the last this-many checkpointed layers run without the recompute


def _check_int(name, value, low=1, high=None):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{_NAME}: {name} must be an int, got {type(value).__name__} {value!r}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{_NAME}: {name} must be {f'>= {low}' if high is None else f'in [{low}, {high}]'}, "
                         f"got {value}")
    return value


def _check_choice(name, value, choices):
    if value not in choices:
        raise ValueError(f"{_NAME}: {name} must be one of {', '.join(map(repr, choices))}, got {value!r}")


def _text_config(config):
    if not hasattr(config, "hidden_size") and hasattr(config, "get_text_config"):
        config = config.get_text_config()
    missing = [a for a in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                           "vocab_size") if not isinstance(getattr(config, a, None), int)]
    if missing:
        raise ValueError(f"{_NAME}: model_or_config must describe a decoder (hidden_size, intermediate_size, "
                         f"num_hidden_layers, num_attention_heads, vocab_size); missing {', '.join(missing)}")
    if max(getattr(config, "num_local_experts", 0) or 0, getattr(config, "num_experts", 0) or 0) > 1:
        raise ValueError(f"{_NAME}: model_or_config is a mixture-of-experts model; only dense MLPs are modelled")
    return config


def _dims(config):
    """{projection: (in, out)} of one decoder layer."""
    h, i = config.hidden_size, config.intermediate_size
    heads = config.num_attention_heads
    hd = getattr(config, "head_dim", None) or h // heads
    q, kv = heads * hd, (getattr(config, "num_key_value_heads", None) or heads) * hd
    return dict(q_proj=(h, q), k_proj=(h, kv), v_proj=(h, kv), o_proj=(q, h), gate_proj=(h, i), up_proj=(h, i),
                down_proj=(i, h)), hd


def _from_config(config, act_dtype, rank, targets, quantized, state) -> dict:
    """The trained tensors' fields of _Job, counted from the config (biases left out: < 0.1% of a weight)."""
    dims, _ = _dims(config)
    h, v, L, e = config.hidden_size, config.vocab_size, config.num_hidden_layers, act_dtype.itemsize
    proj = sum(a * b for a, b in dims.values())
    tied = bool(getattr(config, "tie_word_embeddings", False))
    embed = v * h * e
    head = h * e + (0 if tied else embed)  # final norm, untied LM head
    weights = L * (proj * (NF4_BYTES if quantized else e) + 2 * h * e) + embed + head
    dequant = max(a * b for a, b in dims.values()) * e if quantized else 0  # bitsandbytes' bf16 copy of a weight
    if rank:  # fp32 adapters: get_peft_model upcasts bf16/fp16 ones (autocast_adapter_dtype=True)
        adapters = {p: rank * sum(dims[p]) for p in targets}
        n = sum(adapters.values())
        return dict(weights=int(weights + 4 * L * n), layer_grads=4 * n, down_grads=4 * adapters.get("down_proj", 0),
                    head_grads=0, embed_grads=0, embed_transient=0, optimizer_state=int(L * n * state(4)),
                    trains=tuple(p in targets for p in PROJECTIONS),
                    ranks=tuple(rank if p in targets else 0 for p in PROJECTIONS), dequant=dequant,
                    mlp_fp32=4 * sum(adapters.get(p, 0) for p in PROJECTIONS[4:]), input_leaf=True)
    layer = (proj + 2 * h) * e
    return dict(weights=int(weights), layer_grads=layer, down_grads=dims["down_proj"][0] * h * e,
                head_grads=head + (embed if tied else 0), embed_grads=0 if tied else embed,
                embed_transient=embed if tied else 0, optimizer_state=int(weights / e * state(e)),
                trains=(True,) * len(PROJECTIONS), ranks=(0,) * len(PROJECTIONS), dequant=0,
                mlp_fp32=4 * sum(a * b for p, (a, b) in dims.items() if p in PROJECTIONS[4:]))


_LAYER0 = re.compile(r"(^|\.)layers\.0\.")
_IN_LAYERS = re.compile(r"(^|\.)layers\.\d+\.")


def _from_model(model, config, act, rank, targets, quantized, state) -> dict:
    """The same from a model's own parameters: their bytes and dtypes, what trains, the adapters it has."""
    params = list(model.named_parameters(remove_duplicate=False))
    unique = {}
    for name, p in params:
        unique.setdefault(id(p), (name, p))  # a tied weight is one Parameter; meta tensors share data_ptr 0
    weights, four_bit, found = 0, False, {}
    for name, p in unique.values():
        weights += p.nbytes
        qs = getattr(p, "quant_state", None)
        if qs is not None:  # bitsandbytes keeps the absmax beside the packed weight, not in a parameter
            four_bit = True
            weights += sum(getattr(t, "nbytes", 0) for t in (getattr(qs, "absmax", None),
                                                              getattr(getattr(qs, "state2", None), "absmax", None)))
        parts = name.split(".")
        if "lora_A" in parts and _LAYER0.search(name):
            found[next((q for q in PROJECTIONS if q in parts), "")] = p.shape[0]
    if quantized and not four_bit:
        raise ValueError(f"{_NAME}: quantized_base='nf4' but the model has no 4-bit weights")
    emb = model.get_input_embeddings().weight if hasattr(model, "get_input_embeddings") else None
    dequant = _from_config(config, act, 1, PROJECTIONS, True, state)["dequant"] if four_bit else 0
    if found and (rank not in (None, *found.values()) or (targets != "all" and set(targets) != set(found))):
        raise ValueError(f"{_NAME}: the model has LoRA adapters already (rank {max(found.values())} on "
                         f"{', '.join(sorted(found))}); leave lora_rank and lora_targets to them")
    if rank and not found:  # adapters to come: counted from the config, added to the base as it is
        job = _from_config(config, act, rank, PROJECTIONS if targets == "all" else targets, False, state)
        return dict(job, weights=weights + config.num_hidden_layers * job["layer_grads"], dequant=dequant)
    # HF's enable_input_require_grads (PEFT's recipes call it) hooks the input embedding: its output becomes a
    # leaf that requires grad while the embedding itself is frozen
    hooked = any(hasattr(m, "_require_grads_hook") for m in model.modules())
    trained = [(n, p) for n, p in unique.values() if p.requires_grad]
    if not trained:
        raise ValueError(f"{_NAME}: the model has no trainable parameters; pass lora_rank for adapters to come")

    def grads(keep):
        return sum(p.nbytes for n, p in trained if keep(n))

    emb_bytes = emb.nbytes if emb is not None and emb.requires_grad else 0
    tied = sum(p is emb for _, p in params) > 1
    outside = grads(lambda n: not _IN_LAYERS.search(n))
    return dict(weights=weights, layer_grads=grads(_LAYER0.search),
                down_grads=grads(lambda n: _LAYER0.search(n) and "down_proj" in n.split(".")),
                head_grads=outside - (0 if tied else emb_bytes), embed_grads=0 if tied else emb_bytes,
                embed_transient=emb_bytes if tied else 0,
                optimizer_state=int(sum(p.numel() * state(p.element_size()) for _, p in trained)),
                trains=tuple(any(_LAYER0.search(n) and q in n.split(".") for n, _ in trained) for q in PROJECTIONS),
                ranks=tuple(found.get(q, 0) for q in PROJECTIONS), dequant=dequant,
                mlp_fp32=4 * sum(p.numel() for n, p in trained if _LAYER0.search(n) and not set(n.split("."))
                                 .isdisjoint(PROJECTIONS[4:])),
                input_leaf=hooked and not emb_bytes)


def _layer_saved(job: _Job, n: int, seq_len: int):
    """[(part, side, bytes)] that one layer keeps for its backward at n tokens, its input (the checkpoint) left
    out; side "attention" is kept until the attention's backward, "mlp" is freed by the MLP's."""
    e, h, i, heads = job.act, job.hidden, job.inter, job.heads
    q, kv = heads * job.head_dim, job.kv_heads * job.head_dim
    tr, rk = dict(zip(PROJECTIONS, job.trains)), dict(zip(PROJECTIONS, job.ranks))
    tiled = 0 < job.tile < seq_len  # a sequence no longer than a tile runs the MLP untiled
    t = job.batch * job.tile if tiled else n  # tokens whose MLP intermediates are live at once
    keeps_product = tr["down_proj"] and (job.checkpointing or rk["down_proj"] > 0)  # else the one-node MLP
    eager = job.attention == "eager"
    return [
        ("norms", "attention", 4 * n),  # the first norm's fp32 rstd
        ("norms", "mlp", n * (e * h + 4)),  # the residual sum (kept by the fused add + norm), its rstd
        ("projections", "attention", n * e * h * (tr["q_proj"] or tr["k_proj"] or tr["v_proj"])),  # inputs of
        ("projections", "mlp", n * e * h * (tr["gate_proj"] or tr["up_proj"] or tiled)),  # trained ones
        ("lora", "attention", n * e * sum(rk[p] for p in PROJECTIONS[:4])),  # x A^T, r values a token
        ("lora", "mlp", n * e * sum(rk[p] for p in PROJECTIONS[4:])),
        ("attention_io", "attention", n * e * (4 * q if eager else 2 * q + 2 * kv)),  # q, k, v (repeated), out
        ("mlp", "mlp", t * e * i * (2 + keeps_product)),  # gate, up, their product if the down projection trains
        ("attention_kernel", "attention",  # flash's fp32 lse; eager's fp32 softmax and its cast (none in fp32)
         (4 + (e if e < 4 else 0)) * heads * job.batch * seq_len * seq_len if eager else 4 * n * heads),
    ]


def _moments(job: _Job, seq_len: int):
    """{moment: {component: bytes}} of the step at seq_len; the peak is the moment with the largest sum."""
    if job.checkpointing and job.keep_activations:
        return _kept_moments(job, seq_len)
    n, e, h, L = job.batch * seq_len, job.act, job.hidden, job.layers
    q, kv, heads = job.heads * job.head_dim, job.kv_heads * job.head_dim, job.heads
    eager, quad = job.attention == "eager", job.batch * seq_len * seq_len
    tiled = 0 < job.tile < seq_len
    t = job.batch * job.tile if tiled else n
    parts = _layer_saved(job, n, seq_len)
    kernel = sum(b for part, _, b in parts if part == "attention_kernel")
    layer_input = e * h * n  # the checkpoint; without checkpointing the first norm keeps it
    saved = sum(b for part, _, b in parts if part != "attention_kernel") + (0 if job.checkpointing else layer_input)
    saved_attention = saved - sum(b for _, side, b in parts if side == "mlp")
    mlp_moving = (e * h * n  # the layer output's gradient, the product's gradient (and a recomputed product)
                  + t * e * job.inter * (1 + (job.trains[6] and not job.checkpointing and not job.ranks[6]))
                  + (e * h * n + job.mlp_fp32 if tiled else 0))  # a tiled MLP's input gradient (filled tile by
    # tile) and the fp32 sums of its trainable parameters
    attention_moving = e * n * (h + 2 * q + 2 * kv)  # residual and output gradients, dq, dk, dv
    if not eager and kv < q:  # flash's GQA backward: dk, dv for every query head, then summed per KV head
        attention_moving += e * n * 2 * q
    scratch = (8 + e) * heads * quad if eager else 4 * n * (q + heads)  # softmax gradients; flash's fp32 dq
    chunk = chunk_rows(n, job.vocab, e) * job.vocab * e if job.loss == "fused" else 0
    arena = min(chunk, ARENA_KEEP)  # the arena gives larger blocks back when the loss returns its chunk
    if job.loss == "fused":  # last hidden state, its norm, dh, rstd; one chunk of logits
        loss = n * (3 * e * h + 4) + chunk
    else:  # last hidden state, its norm, rstd; the logits and their gradient
        loss = n * (2 * e * h + 4) + 2 * n * job.vocab * e
    ckpt = layer_input if job.checkpointing else 0
    offloaded = job.checkpointing and job.kept < L
    top = L if job.kept >= L else min(L, max(job.kept, 2))  # the last `kept`, or the one in use and the next
    # a frozen input embedding under enable_input_require_grads (LoRA) makes the bottom layer's input a leaf that
    # requires grad: its gradient's accumulator holds it through the backward, so with the checkpoints in host
    # memory it stays on the card too (measured: the embedding's output live at the 256K step's peak)
    leaf = layer_input if offloaded and job.input_leaf else 0
    # ids, labels, positions (int64), RoPE's cos and sin; eager's additive [B, 1, T, T] mask
    static = dict(weights=job.weights, optimizer_state=job.optimizer_state,
                  inputs=n * (24 + 2 * job.head_dim * e) + (e * quad if eager else 0))
    live = 1 if job.checkpointing else L  # layers whose saved tensors are on the card

    def moment(grads, ckpts, working, attention, loss_chunk=arena, held_input=leaf):
        return dict(static, gradients=grads, checkpoints_on_card=ckpts * ckpt + held_input, loss_chunk=loss_chunk,
                    layer_working_set=working, attention_workspace=attention)

    stored = 0 if job.checkpointing else L  # layers whose saved tensors wait for the backward at the loss
    out = {"loss": moment(job.head_grads, top, stored * saved, stored * kernel, loss)}
    # Gradients held through the layers' backward. Stepped in the backward, a gradient lives from its making to
    # its parameter's update: the layer's largest one (its down projection's, an upper bound for the attention's)
    # and, with a tied embedding, the head's share, whose parameter completes only at the embedding's backward.
    held = (job.head_grads if job.embed_transient else 0) if job.in_backward else job.head_grads
    for where, grads, ckpts, layers in (("top", 0, top, live), ("bottom", (L - 1) * job.layer_grads, 1, 1)):
        grads = held + (0 if job.in_backward else grads)
        making = job.down_grads if job.in_backward else job.layer_grads
        others = (layers - 1) * saved + job.dequant
        out[f"{where} layer's MLP backward"] = moment(grads + job.down_grads, ckpts, others + saved + mlp_moving,
                                                      layers * kernel)
        out[f"{where} layer's attention backward"] = moment(grads + making, ckpts,
                                                            others + saved_attention + attention_moving,
                                                            layers * kernel + scratch)
    all_grads = L * job.layer_grads + job.head_grads + job.embed_grads
    if job.in_backward:
        all_grads = held + job.embed_grads  # the embedding's own, the last one made
    if job.embed_grads or job.embed_transient:  # dy, fp32 partial sums, sorted indices
        out["embedding backward"] = moment(all_grads + job.embed_transient, 0, n * (e * h + 4 * h + 16), 0)
    out["optimizer step"] = moment(0 if job.in_backward else all_grads, 0, 0, 0, 0, 0)
    return out


def _kept_moments(job: _Job, seq_len: int):
    """_moments with the last K layers run without the recompute (install_kept_activations): until their backward
    ends they hold what K layers hold without checkpointing (the same moments of a K-layer job without it), beside
    the other layers' checkpoints; the bottom layer's backward and what follows are the checkpointed job's."""
    K, L = job.keep_activations, job.layers
    if K >= L:
        return _moments(dataclasses.replace(job, checkpointing=False, kept=L, keep_activations=0), seq_len)
    out = _moments(dataclasses.replace(job, keep_activations=0), seq_len)
    kept_layers = _moments(dataclasses.replace(job, checkpointing=False, layers=K, kept=K, keep_activations=0),
                           seq_len)
    layer_input = job.act * job.hidden * job.batch * seq_len
    offloaded = job.kept < L
    # checkpoints on the card meanwhile: every checkpointed layer's, or with the offload those it keeps (the last
    # `kept` layers, the K among them first) and the one fetched ahead, and the held embedding output
    on_card = (max(job.kept - K, 1) + job.input_leaf) if offloaded else L - K
    for name in ("loss", "top layer's MLP backward", "top layer's attention backward"):
        moment = dict(kept_layers[name])
        moment["checkpoints_on_card"] += on_card * layer_input
        out[name] = moment
    return out


def _gib(b) -> str:
    return f"{b / 2**30:.2f} GiB"


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """The bytes of a training step at its peak moment, by component (`plan` builds it; docs/memory/plan.md).

    On the card: weights, gradients, optimizer_state, checkpoints_on_card (the checkpointed layer inputs),
    layer_working_set (what the layer being recomputed keeps and the gradients moving through it), loss_chunk,
    attention_workspace (flash's lse and backward scratch; eager's [T, T] softmax), inputs (ids, positions, RoPE
    tables) and overhead (CUDA context and allocator slack, outside torch.cuda.max_memory_allocated). In host
    memory: checkpoints_host (pinned, offloaded layer inputs). `peak_allocated` is what max_memory_allocated
    reports, `peak` what the card must hold. `layer_saved_per_token`: the bytes one layer keeps for its backward
    per token (its input left out, eager's [T, T] terms too), by part in `layer_saved_parts`."""

    seq_len: int
    batch_size: int
    moment: str
    weights: int
    gradients: int
    optimizer_state: int
    checkpoints_on_card: int
    checkpoints_host: int
    layer_working_set: int
    loss_chunk: int
    attention_workspace: int
    inputs: int
    overhead: int
    layer_saved_per_token: float
    layer_saved_parts: tuple
    _job: _Job = dataclasses.field(repr=False, compare=False)  # what it was computed from

    @property
    def tile_tokens(self):
        """The MLP's tile length the plan assumed (tile_tokens="auto" resolved), None for an untiled MLP."""
        return self._job.tile or None

    @property
    def peak_allocated(self) -> int:
        return sum(getattr(self, c) for c in CARD)

    @property
    def peak(self) -> int:
        return self.peak_allocated + self.overhead

    def components(self) -> dict:
        """{component: bytes}, the card's then checkpoints_host."""
        names = CARD + ("overhead", "checkpoints_host")
        return {c: getattr(self, c) for c in names}

    def fits(self, budget_bytes) -> bool:
        """Whether the peak (overhead included) is within budget_bytes."""
        return self.peak <= _check_budget("MemoryPlan.fits", budget_bytes)

    def longest_seq_len(self, budget_bytes) -> int:
        """The longest seq_len (at this batch_size and settings) whose peak fits budget_bytes, 0 if none does;
        MemoryPlanError (a ValueError) when the budget is below the weights alone."""
        budget = _check_budget("MemoryPlan.longest_seq_len", budget_bytes, self.weights)
        fits = lambda s: _build(self._job, s).peak <= budget  # noqa: E731
        if not fits(1):
            return 0
        lo, hi = 1, 2
        while fits(hi) and hi < 1 << 40:  # the peak grows with the sequence: double, then bisect
            lo, hi = hi, hi * 2
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def most_kept_activations(self, budget_bytes) -> int:
        """The most layers (at this seq_len, batch_size and settings) that can run without the recompute
        (install_kept_activations) with the peak within budget_bytes: 0 when none can, or without checkpointing."""
        budget = _check_budget("MemoryPlan.most_kept_activations", budget_bytes, self.weights)
        if not self._job.checkpointing:
            return 0
        fits = lambda k: _build(dataclasses.replace(self._job, keep_activations=k), self.seq_len).peak <= budget  # noqa: E731
        lo, hi = 0, self._job.layers  # the peak grows with the layers that keep their activations
        if fits(hi):
            return hi
        if not fits(lo):
            return 0
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (mid, hi) if fits(mid) else (lo, mid)
        return lo

    def __str__(self) -> str:
        rows = [(c, _gib(b), f"{100 * b / max(1, self.peak):.1f}%") for c, b in self.components().items()
                if c != "checkpoints_host"]
        rows += [("peak (allocated)", _gib(self.peak_allocated), ""), ("peak (card)", _gib(self.peak), "100.0%"),
                 ("checkpoints_host (pinned host memory)", _gib(self.checkpoints_host), "")]
        head = (f"tigon memory plan: {self.batch_size} x {self.seq_len} tokens, peak at the {self.moment}; one "
                f"layer keeps {self.layer_saved_per_token / 1024:.1f} KiB a token")
        if self._job.checkpointing and self._job.keep_activations:
            head += f"; the last {self._job.keep_activations} layers skip the recompute (keep_activations)"
        try:
            from tabulate import tabulate
        except ImportError:
            width = max(len(r[0]) for r in rows)
            return "\n".join([head] + [f"  {a:<{width}}  {b:>11}  {c:>6}" for a, b, c in rows])
        return head + "\n" + tabulate(rows, headers=("component", "bytes", "of peak"), colalign=("left", "right",
                                                                                               "right"))


def _check_budget(name, budget, weights=None):
    if isinstance(budget, bool) or not isinstance(budget, (int, float)) or not math.isfinite(budget):
        raise TypeError(f"{name}: budget_bytes must be a number of bytes, got {type(budget).__name__} {budget!r}")
    if budget <= 0:
        raise ValueError(f"{name}: budget_bytes must be > 0, got {budget}")
    if weights is not None and budget < weights:
        raise MemoryPlanError(f"{name}: budget_bytes ({_gib(budget)}) is smaller than the weights alone "
                              f"({_gib(weights)}): no sequence length fits")
    return budget


def _build(job: _Job, seq_len: int) -> MemoryPlan:
    moments = _moments(job, seq_len)
    moment, parts = max(moments.items(), key=lambda kv: sum(kv[1].values()))
    allocated = sum(parts.values())
    n = job.batch * seq_len
    saved = _layer_saved(job, n, seq_len)
    by_part = {}
    for part, _, b in saved:
        if not (part == "attention_kernel" and job.attention == "eager"):
            by_part[part] = by_part.get(part, 0) + b / n
    offloaded = job.checkpointing and job.kept < job.layers  # the kept-activation layers are never offloaded
    host = (job.layers - max(job.kept, job.keep_activations)) * job.act * job.hidden * n if offloaded else 0
    return MemoryPlan(seq_len=seq_len, batch_size=job.batch, moment=moment, checkpoints_host=host,
                      overhead=CONTEXT_BYTES + math.ceil(ALLOCATOR_SLACK * allocated),
                      layer_saved_per_token=sum(by_part.values()), layer_saved_parts=tuple(by_part.items()),
                      _job=job, **parts)


def _kept_bytes_of(attention: str, act: torch.dtype, config) -> str:
    """Whose bytes an attention keeps for its backward: "eager"'s (the [T, T] softmax) or "flash"'s (an fp32 lse).
    torch's SDPA has no flash kernel in fp32 and its memory-efficient kernel takes no grouped KV heads (HF passes
    enable_gqa when a step has no mask), so fp32 with GQA runs SDPA's math path, which keeps the softmax as eager
    does (measured on an H100: two such layers of 4 heads at 2 x 512 tokens held 32 MB, the flash count 14 MB)."""
    heads = config.num_attention_heads
    gqa = (getattr(config, "num_key_value_heads", None) or heads) < heads
    return "eager" if attention == "eager" or (attention == "sdpa" and act == torch.float32 and gqa) else "flash"


def plan(model_or_config, *, seq_len, batch_size=1, lora_rank=None, lora_targets="all", quantized_base=None,
         optimizer="adamw", checkpointing=True, offload_checkpoints=False, tile_tokens=None, attention="flash",
         loss="fused", dtype=None, budget_bytes=None, step_in_backward=False, keep_activations=None) -> MemoryPlan:
    """Predict the peak GPU memory of one training step (forward, backward, optimizer step) of a Llama-shaped
    decoder patched by tigon.patch, by component, without a GPU.

    model_or_config: a transformers config, or a model (its parameters' bytes, dtypes and requires_grad are read;
    PEFT adapters it has decide the LoRA rank and targets). seq_len, batch_size: tokens a row, rows a step.
    lora_rank: adapters of this rank to be added (fp32, PEFT's default) on lora_targets ("all": the seven
    projections, or names from PROJECTIONS), the base frozen; None: the trainable parameters train (a config:
    all). quantized_base: "nf4" for a bitsandbytes 4-bit base (with lora_rank). optimizer: a key of OPTIMIZERS.
    checkpointing: HF's gradient checkpointing (each layer's input kept). offload_checkpoints: True moves them
    to pinned host memory, an int keeps the last that many layers' on the card (install_checkpoint_offload's
    keep_on_card). tile_tokens: the MLP runs in tiles of that many tokens of each row (install_tiled_mlp; a
    sequence no longer than a tile runs untiled); "auto": the tile install_tiled_mlp's "auto" picks at the first
    step, from the memory free then (the card, budget_bytes if given, less the CUDA context and the weights; on a
    model off CUDA with no budget, the CPU's tile). attention: "flash" ("flex": the same bytes; "sdpa": the same but in
    fp32 with grouped KV heads, where torch runs its math path and keeps eager's bytes) or "eager".
    loss: "fused" (no logits) or "logits". dtype: of the activations (None: the model's embedding dtype, bf16 for a
    config). budget_bytes: if given, raise MemoryPlanError naming the largest component when the peak exceeds
    it. step_in_backward: the optimizer steps each parameter as the backward completes its gradient and frees it
    (tigon.optim.AdamW(step_in_backward=True)). keep_activations: the last that many checkpointed layers run
    without the recompute (install_kept_activations; None: as many as the model was installed with, 0 for a
    config). Returns a MemoryPlan; docs/memory/plan.md has the formulas and how they were checked."""
    if isinstance(tile_tokens, str) and tile_tokens != "auto":
        raise ValueError(f"{_NAME}: tile_tokens must be an int >= 1, 'auto' or None, got {tile_tokens!r}")
    for name, value in (("seq_len", seq_len), ("batch_size", batch_size), ("lora_rank", lora_rank),
                        ("tile_tokens", None if tile_tokens == "auto" else tile_tokens)):
        if value is not None or name in ("seq_len", "batch_size"):
            _check_int(name, value)
    if lora_targets != "all" and (isinstance(lora_targets, str) or not lora_targets
                                  or not set(lora_targets) <= set(PROJECTIONS)):
        raise ValueError(f"{_NAME}: lora_targets must be 'all' or names from {PROJECTIONS}, got {lora_targets!r}")
    for name, value, choices in (("quantized_base", quantized_base, (None, "nf4")), ("optimizer", optimizer,
                                 tuple(OPTIMIZERS)), ("attention", attention, ATTENTIONS), ("loss", loss, LOSSES)):
        _check_choice(name, value, choices)
    for name, value in (("checkpointing", checkpointing), ("step_in_backward", step_in_backward)):
        if not isinstance(value, bool):
            raise TypeError(f"{_NAME}: {name} must be True or False, got {value!r}")
    if dtype is not None and dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"{_NAME}: dtype must be torch.bfloat16, torch.float16 or torch.float32, got {dtype!r}")
    model = model_or_config if isinstance(model_or_config, torch.nn.Module) else None
    if model is None and (model_or_config is None or isinstance(model_or_config, (str, int, float, dict))):
        raise TypeError(f"{_NAME}: model_or_config must be a transformers config or a model, got "
                        f"{type(model_or_config).__name__}")
    if quantized_base and lora_rank is None and model is None:
        raise ValueError(f"{_NAME}: quantized_base='nf4' needs lora_rank: a 4-bit base does not train")
    config = _text_config(model_or_config if model is None else getattr(model, "config", None) or model)
    layers = config.num_hidden_layers
    if isinstance(offload_checkpoints, bool):
        kept = 0 if offload_checkpoints else layers
    else:
        kept = _check_int("offload_checkpoints", offload_checkpoints, 0, layers)
    if kept < layers and not checkpointing:
        raise ValueError(f"{_NAME}: offload_checkpoints needs checkpointing=True (it moves the checkpoints)")
    if keep_activations is None:
        from .recompute import kept_activation_layers

        keep_activations = kept_activation_layers(model) if model is not None else 0
    keep_activations = _check_int("keep_activations", keep_activations, 0, layers)
    if keep_activations and not checkpointing:
        raise ValueError(f"{_NAME}: keep_activations needs checkpointing=True (without it every layer keeps them)")
    state = OPTIMIZERS[optimizer]
    if model is None:
        act = dtype or torch.bfloat16
        targets = PROJECTIONS if lora_targets == "all" else tuple(lora_targets)
        counted = _from_config(config, act, lora_rank, targets, quantized_base, state)
    else:
        emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
        act = dtype or (emb.weight.dtype if emb is not None else torch.bfloat16)
        counted = _from_model(model, config, act, lora_rank, lora_targets, quantized_base, state)
    _, head_dim = _dims(config)
    if tile_tokens == "auto":
        tile_tokens = _auto_tile(model, config, act, counted, batch_size, budget_bytes)
    job = _Job(config.hidden_size, config.intermediate_size, layers, config.num_attention_heads,
               getattr(config, "num_key_value_heads", None) or config.num_attention_heads, head_dim,
               config.vocab_size, act.itemsize, **counted, batch=batch_size, checkpointing=checkpointing, kept=kept,
               tile=tile_tokens or 0, attention=_kept_bytes_of(attention, act, config), loss=loss,
               in_backward=step_in_backward, keep_activations=keep_activations)
    result = _build(job, seq_len)
    if budget_bytes is not None:
        budget = _check_budget(_NAME, budget_bytes, result.weights)
        if not result.fits(budget):
            _refuse(result, budget)
    return result


def _auto_tile(model, config, act, counted, batch_size, budget_bytes) -> int:
    """The tile install_tiled_mlp's "auto" picks: its rule over the memory free at the first training step, which
    is the card (or budget_bytes) less the CUDA context and the weights (the gradients and optimizer state come
    after the first forward)."""
    card = None
    if budget_bytes is not None:
        card = _check_budget(_NAME, budget_bytes)
    elif model is not None:
        device = next((p.device for p in model.parameters()), torch.device("cpu"))
        if device.type == "cuda":
            card = torch.cuda.get_device_properties(device).total_memory
    free = None if card is None else max(0, card - CONTEXT_BYTES - counted["weights"])
    return auto_tile_tokens(config.intermediate_size, act.itemsize, free, rows_per_token=batch_size)


def _refuse(result: MemoryPlan, budget):
    name, size = max(((c, b) for c, b in result.components().items() if c != "checkpoints_host"),
                     key=lambda kv: kv[1])
    longest = result.longest_seq_len(budget)
    hints = [f"seq_len <= {longest} fits" if longest else "no seq_len fits with these settings"]
    if result._job.checkpointing and result._job.kept >= result._job.layers:
        hints.append("offload_checkpoints=True moves the checkpoints to host memory")
    if not result._job.tile:
        hints.append("tile_tokens bounds the MLP's working set")
    raise MemoryPlanError(
        f"{_NAME}: the step needs {_gib(result.peak)} at batch_size={result.batch_size}, seq_len={result.seq_len}, "
        f"{_gib(result.peak - budget)} over budget_bytes ({_gib(budget)}); the largest component is {name} "
        f"({_gib(size)}, {100 * size / result.peak:.0f}% of the peak, at the {result.moment}); "
        + "; ".join(hints))
