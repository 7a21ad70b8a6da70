"""A decoder layer's quantized projections stacked for the fused decode step (`tigon.decode.layer_step`).

The decode step reads each weight once a token, so one launch over q|k|v and one over gate|up (the GLU in its
epilogue) replace five launches of `quant_linear`: `concat` joins QuantizedWeights along N (rows: output
features) where their layouts agree, and `layer_stack` builds, once a layer, the stacked weights from the
layer's QuantLinear modules (or those inside PEFT LoRA layers, the adapters being added by the caller) and keeps
them in the layer's `__dict__` under `STACK`. The stack is a view of the modules' own tensors: the parts of a
group (q, k, v; gate, up) hold their data, scales and zero points as consecutive row slices of one tensor each
(`share_rows`: `tigon.quantize` leaves them so; building a stack rebinds them so where they are not, e.g. after a
device move or for an imported checkpoint's repacked tensors), the same values and shapes in every module, so
`state_dict`, saving and each module's forward are untouched and the stack costs no memory (copies would cost a
70B model's ~35 GB of int4 projections once more: no fit on an 80 GB card beside a 32K cache). It is rebuilt when a
projection module, its tensors (a device move), their version (an in-place load) or the activation dtype change;
`tigon.quant.release` and `tigon.unpatch` drop it.
"""

import dataclasses

import torch
from torch import nn

from tigon.ops.quantized_weight import QuantizedWeight

from .module import QuantLinear

STACK = "_tigon_quant_stack"  # the key in a decoder layer's __dict__


def _same(a, b) -> bool:
    return (a is None) == (b is None) and (a is None or (a.shape == b.shape and a.dtype == b.dtype
                                                         and a.device == b.device and torch.equal(a, b)))


def concat(parts: list[QuantizedWeight], dtype: torch.dtype) -> QuantizedWeight | None:
    """The weight whose rows are `parts`' rows in order (one launch computes every part's output), activations
    in `dtype`; None where one layout cannot hold them: different kinds, group sizes, K, data or scale dtypes,
    zero points in some parts only, different act-order permutations (`perm`), or fp8 square blocks that a part's
    row count would split (every part but the last must be a whole number of blocks)."""
    first = parts[0]
    n_k = first.shape[1]
    for p in parts:
        if (p.kind != first.kind or p.group_size != first.group_size or p.shape[1] != n_k
                or p.data.dtype != first.data.dtype or p.scales.dtype != first.scales.dtype
                or (p.zeros is None) != (first.zeros is None) or p.data.device != first.data.device
                or not _same(p.perm, first.perm)):
            return None
    if first.kind == "fp8" and first.group_size and any(p.shape[0] % first.group_size for p in parts[:-1]):
        return None
    zeros = None if first.zeros is None else _rows([p.zeros for p in parts])
    return QuantizedWeight(first.kind, _rows([p.data for p in parts]), _rows([p.scales for p in parts]), zeros,
                           first.group_size, (sum(p.shape[0] for p in parts), n_k), dtype, first.perm)


def _rows(ts: list[torch.Tensor]) -> torch.Tensor:
    """The tensor whose rows are `ts`' rows in order: a view where they are consecutive rows of one storage
    already (`share_rows`), else a copy (fp8 joined as its bytes: not every torch build concatenates float8
    tensors on every device)."""
    first = ts[0]
    if all(t.is_contiguous() and t.shape[1:] == first.shape[1:] and t.dtype == first.dtype for t in ts) and all(
            b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()
            and b.storage_offset() == a.storage_offset() + a.numel() for a, b in zip(ts, ts[1:])):
        return first.as_strided((sum(t.shape[0] for t in ts), *first.shape[1:]), first.stride(),
                                first.storage_offset())
    if first.dtype.is_floating_point and first.element_size() == 1:
        return torch.cat([t.view(torch.uint8) for t in ts]).view(first.dtype)
    return torch.cat(ts)


SIBLINGS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # the fused decode step's stacked groups


def share_rows(model: nn.Module) -> None:
    """Each group of sibling QuantLinear projections (q, k, v; gate, up) that `concat` can join gets its data,
    scales and zero points as consecutive row slices of one tensor each, the separate tensors freed: the same
    values and shapes in every module (state_dict, forward), and the fused decode step's stack of them a view,
    not a copy. Groups of other modules, or that one layout cannot hold, are left as they are."""
    for parent in model.modules():
        for names in SIBLINGS:
            parts = [parent._modules.get(n) for n in names]
            if all(type(p) is QuantLinear for p in parts):
                _share(parts)


def _share(parts: list[QuantLinear]) -> None:
    """`share_rows` for one group of QuantLinear modules: a no-op where they share one tensor already or `concat`
    cannot join them."""
    joined = concat([p.quantized_weight for p in parts], parts[0].dtype)
    if joined is None or joined.data.untyped_storage().data_ptr() == parts[0].data.untyped_storage().data_ptr():
        return
    data = joined.data.view(torch.uint8) if joined.kind == "fp8" else joined.data
    for field, whole in (("data", data), ("scales", joined.scales), ("zeros", joined.zeros)):
        row = 0
        for p in parts:
            t = p._buffers[field]
            if t is not None:
                p._buffers[field] = whole[row:row + t.shape[0]]
                row += t.shape[0]


def projection(module) -> QuantLinear | None:
    """The hook-free QuantLinear computing `module`'s base product: `module` itself, or the `base_layer` of a
    hook-free wrapper (PEFT's LoRA layers); else None."""
    if type(module) is not QuantLinear:
        base = module.__dict__["_modules"].get("base_layer") if isinstance(module, nn.Module) else None
        if type(base) is not QuantLinear or _hooked(module):
            return None
        module = base
    return None if _hooked(module) else module


def _hooked(m) -> bool:
    return bool(m._forward_hooks or m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks)


def _weight(ql: QuantLinear, dtype) -> QuantizedWeight:
    qw = ql.quantized_weight
    return dataclasses.replace(qw, dtype=dtype)


def _bias(parts: list[QuantLinear], dtype, device) -> torch.Tensor | None:
    """The parts' biases joined (a part without one adds zeros: exact), None when none has one."""
    if all(p.bias is None for p in parts):
        return None
    return torch.cat([p.bias.to(dtype) if p.bias is not None else torch.zeros(p.out_features, dtype=dtype,
                                                                               device=device) for p in parts])


@dataclasses.dataclass(frozen=True)
class Group:
    """One or more projections of the same input: `weights` [(QuantizedWeight, bias)], a single stacked one
    where `concat` could join them, else one per projection; `sizes` each projection's output features."""

    weights: tuple
    sizes: tuple

    @property
    def stacked(self) -> bool:
        return len(self.weights) == 1


def _group(parts: list[QuantLinear], dtype) -> Group:
    sizes = tuple(p.out_features for p in parts)
    joined = concat([p.quantized_weight for p in parts], dtype) if len(parts) > 1 else None
    if joined is not None:
        return Group(((joined, _bias(parts, dtype, joined.data.device)),), sizes)
    return Group(tuple((_weight(p, dtype), _bias([p], dtype, p.data.device)) for p in parts), sizes)


@dataclasses.dataclass(frozen=True)
class LayerStack:
    """What the fused quantized decode step reads for one layer: `qkv` (q, k, v), `o`, `gate_up` (gate, up; a
    layer with one fused gate_up projection has a single part), `down`; `sources` and `versions`, the modules'
    `data` tensors and their versions when it was built, `dtype` the activations'."""

    qkv: Group
    o: Group
    gate_up: Group
    down: Group
    sources: tuple
    versions: tuple
    dtype: torch.dtype

    def current(self, datas, dtype) -> bool:
        return (dtype == self.dtype and all(a is b for a, b in zip(datas, self.sources))
                and all(t._version == v for t, v in zip(datas, self.versions)))


def layer_stack(layer: nn.Module, qkv: list, o, gate_up: list, down, dtype: torch.dtype) -> LayerStack | None:
    """The layer's LayerStack for activations in `dtype`, from the modules the layer holds for its projections
    (`gate_up`: [gate, up], or [gate_up] for a fused one); built on first use and kept in the layer's `__dict__`.
    None where a projection is not a hook-free QuantLinear (or a wrapper of one), or while a CUDA graph is being
    captured and the stack is not built yet (a copy made during capture would hold no values until a replay)."""
    groups = [[projection(m) for m in ms] for ms in (qkv, [o], gate_up, [down])]
    if any(p is None for ms in groups for p in ms):
        return None
    datas = tuple(p.data for ms in groups for p in ms)
    stack = layer.__dict__.get(STACK)
    if stack is not None and stack.current(datas, dtype):
        return stack
    if datas[0].is_cuda and torch.cuda.is_current_stream_capturing():
        return None
    for ms in (groups[0], groups[2]):
        if len(ms) > 1:
            _share(ms)  # the modules' own tensors become the stack's rows (after a device move, an import)
    datas = tuple(p.data for ms in groups for p in ms)
    stack = LayerStack(*(_group(ms, dtype) for ms in groups), datas, tuple(t._version for t in datas), dtype)
    layer.__dict__[STACK] = stack
    return stack


def drop_stacks(model: nn.Module) -> None:
    """Forget every layer's stacked weights (their memory is freed with the last reference)."""
    for m in model.modules():
        m.__dict__.pop(STACK, None)
