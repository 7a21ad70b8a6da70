"""A cos/sin table for the rotary embedding module of a Hugging Face model, for the duration of a generate call.

HF's rotary module recomputes cos/sin from `inv_freq` and `position_ids` on every forward: ~8 small kernels per
decode step (expand, float cast, a K = 1 matmul, transpose, cat, cos, sin, the scaling multiply, the dtype
casts). Inside `cached_rotary(model, length)` the module's forward is one `index_select` into a `[2, length, rd]`
table that the module's own forward computed once for positions `0 .. length - 1`. Every op of that forward is
elementwise per (position, dim) (the matmul has K = 1: an exact fp32 product), so a row of the table is bit for
bit what the module returns for that position (tests/decode/test_rotary_table.py checks it with `torch.equal`). This
assumes fp32 matmuls (PyTorch's default): with TF32 allowed, cuBLAS may round `inv_freq` for one shape and not
for another.

Applies only where the result depends on the positions alone:
- a transformers class in `_FORWARD_FORMS` (rotary forwards whose source was read in transformers 5.17; the
  test checks it still is), with the `inv_freq` (or `{layer_type}_inv_freq`) buffer, the class's own forward
  (no instance-level forward installed by someone else);
- rope types whose `inv_freq` is fixed at init (`STATIC_ROPE_TYPES`): "dynamic" and "longrope" are left out,
  `dynamic_rope_update` replaces their `inv_freq` with the sequence length;
- per call, the dtype and device the table was built for, int32/int64 `[B, T]` positions on that device;
  anything else runs the module's own forward.

Between calls: `tigon.generate` passes a `store` (`tigon.decode.kept`) that keeps the modules found and each
module's tables, rebuilt when a call needs more positions or the frequencies (their storage or in-place version),
the module's plain attributes, the dtype or the device changed.

Positions >= length: the table is sized so that generate never passes one (prompt + max_new_tokens covers every
position it uses; left padding only lowers positions). `index_select` checks its indices, so a wrong position
raises (a RuntimeError on a CPU, a device-side assert on CUDA) instead of reading outside the table.
"""

import contextlib

import torch

# Rotary module classes whose forward is HF's elementwise cos/sin of `inv_freq x position`; the value says
# whether it takes a `layer_type` (one `inv_freq` per attention layer type: Gemma-3, Olmo-3).
_FORWARD_FORMS = {
    **dict.fromkeys((
        "LlamaRotaryEmbedding", "MistralRotaryEmbedding", "MinistralRotaryEmbedding", "MixtralRotaryEmbedding",
        "Qwen2RotaryEmbedding", "Qwen2MoeRotaryEmbedding", "Qwen3RotaryEmbedding", "Qwen3MoeRotaryEmbedding",
        "GemmaRotaryEmbedding", "Gemma2RotaryEmbedding", "Phi3RotaryEmbedding", "GraniteRotaryEmbedding",
        "SmolLM3RotaryEmbedding", "Exaone4RotaryEmbedding", "SeedOssRotaryEmbedding",
        "HunYuanDenseV1RotaryEmbedding", "OlmoeRotaryEmbedding", "Olmo2RotaryEmbedding", "GlmRotaryEmbedding",
        "Glm4RotaryEmbedding", "HeliumRotaryEmbedding", "ArceeRotaryEmbedding", "ApertusRotaryEmbedding",
    ), False),
    **dict.fromkeys(("Gemma3RotaryEmbedding", "Olmo3RotaryEmbedding"), True),
}
# transformers' dynamic_rope_update touches "dynamic*" and "longrope"; these keep the inv_freq of __init__.
STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn", "proportional")


def _layer_types(module):
    """The keys of the module's tables ([None] for a single `inv_freq`), or None when it is not eligible."""
    per_type = _FORWARD_FORMS.get(type(module).__name__)
    if per_type is None or not type(module).__module__.startswith("transformers.") or "forward" in module.__dict__:
        return None
    rope = getattr(module, "rope_type", None)
    if per_type:
        if not isinstance(rope, dict) or not rope:
            return None
        kinds = list(rope)
        if not all(isinstance(getattr(module, f"{k}_inv_freq", None), torch.Tensor) for k in kinds):
            return None
    else:
        if not isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return None
        rope, kinds = {None: rope}, [None]
    if not all(r in STATIC_ROPE_TYPES for r in rope.values()):
        return None
    return kinds


def _table_forward(original, tables, dtype, device):
    """forward(x, position_ids, layer_type=None): cos/sin `[B, T, rd]` from the table, one gather for both."""

    def forward(x, position_ids, layer_type=None):
        table = tables.get(layer_type)
        if (table is None or not isinstance(position_ids, torch.Tensor) or position_ids.dim() != 2
                or position_ids.dtype not in (torch.int64, torch.int32) or position_ids.device != device
                or x.dtype != dtype or x.device != device):
            return original(x, position_ids) if layer_type is None else original(x, position_ids, layer_type)
        b, t = position_ids.shape
        both = table.index_select(1, position_ids.reshape(-1))  # [2, B * T, rd]: cos and sin, each contiguous
        return both[0].view(b, t, -1), both[1].view(b, t, -1)

    return forward


def _signature(module, kinds, dtype, device):
    """What a module's tables depend on, besides the positions: the frequencies (storage and in-place version of
    each `inv_freq`), the module's plain attributes (`attention_scaling`, the rope type...), dtype, device."""
    freqs = [getattr(module, "inv_freq" if k is None else f"{k}_inv_freq") for k in kinds]
    plain = tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, (bool, int, float, str))))
    return tuple((t.data_ptr(), t._version) for t in freqs), plain, dtype, device


@contextlib.contextmanager
def cached_rotary(model, length, dtype=None, device=None, keep=None, store=None):
    """Within the block, every eligible rotary module of `model` (see the module docstring) reads cos/sin for
    positions `< length` from a table built here by its own forward (x of `dtype`/`device`, default the model's);
    the others are left alone. Yields the number of tables built. The class forward is back on exit (also on an
    exception). `keep`: a list that receives every table (a CUDA graph captured in the block reads them after it).
    `store`: a dict the caller keeps between calls (`tigon.decode.kept`): the rotary modules found by the first
    call's walk over the model (a module that replaced one since runs its own forward) and each module's tables,
    reused while long enough and built from the same frequencies, attributes, dtype and device."""
    patched, count = [], 0
    try:
        with torch.no_grad():
            x = torch.empty(0, dtype=model.dtype if dtype is None else dtype,
                            device=model.device if device is None else device)
            dtype, device = x.dtype, x.device  # "cuda" -> "cuda:0": compared with the devices of the calls
            store = {} if store is None else store
            modules = store.get("modules")
            if modules is None:
                modules = store["modules"] = [m for m in model.modules()
                                              if type(m).__name__.endswith("RotaryEmbedding")]
            built = store.setdefault("tables", {})
            positions = None
            for module in modules:
                kinds = _layer_types(module)
                if kinds is None:
                    continue
                original = module.forward
                signature = _signature(module, kinds, dtype, device)
                held = built.get(id(module))
                if held is not None and held[0] == signature and held[1] >= length:
                    tables = held[2]
                else:
                    if positions is None:
                        positions = torch.arange(length, device=device)[None]
                    tables = {}
                    for kind in kinds:
                        cos, sin = original(x, positions) if kind is None else original(x, positions, kind)
                        if cos.dim() != 3 or cos.shape[:2] != (1, length) or sin.shape != cos.shape:
                            break
                        tables[kind] = torch.stack((cos[0], sin[0]))  # [2, length, rd], the module's dtype
                    if len(tables) != len(kinds):
                        continue
                    built[id(module)] = (signature, length, tables)
                module.forward = _table_forward(original, tables, dtype, device)
                if keep is not None:
                    keep.extend(tables.values())
                patched.append(module)
                count += len(tables)
        yield count
    finally:
        for module in patched:
            del module.forward
