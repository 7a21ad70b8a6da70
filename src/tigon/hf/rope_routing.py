"""Tigon's RoPE for one model instance, by a bytecode rename of the class forward.

transformers' attention forwards call their modeling module's global `apply_rotary_pos_emb`; swapping that global
would change every model of the family. `rope_routed(forward)` is instead a copy of the class forward whose code
reads the global `_tigon_apply_rotary_pos_emb` (Tigon's, set in the modeling module beside Hugging Face's, which
stays) where it read `apply_rotary_pos_emb`: the same bytecode and the same live module globals otherwise, so it
computes what the class forward does with Tigon's RoPE, and torch.compile traces it as any function of that module.
The instances marked with `ROPE` (`hf.instance_forward.route_rope`, what `tigon.patch(model)` uses) run it; another
model of the same class keeps Hugging Face's RoPE.
"""

import dis
import types

from ..ops import apply_rope
from .forward_source import ROPE_NAME, hf_class_forward


def apply_rotary_pos_emb(q, k, cos, sin, position_ids=None, unsqueeze_dim=1):
    """transformers' apply_rotary_pos_emb (rotate-half) on tigon.ops.apply_rope."""
    return apply_rope(q, k, cos, sin, unsqueeze_dim=unsqueeze_dim)


apply_rotary_pos_emb.__tigon__ = True
# The name a routed forward reads Tigon's function under, set in the modeling module beside HF's (which stays).
_ALIAS = "_tigon_apply_rotary_pos_emb"
ROPE = "_tigon_rope"  # module.__dict__ key: this attention module runs Tigon's RoPE
_ROUTED: dict = {}  # class forward -> the routed function (the forward itself where it cannot be routed)


def _loads_rope_as_global(code) -> bool:
    """Every use of the name in `code` (and the code nested in it) is a global load: renaming it changes no
    attribute access or store."""
    uses = [ins.opname for ins in dis.get_instructions(code) if ins.opcode in dis.hasname and ins.argval == ROPE_NAME]
    nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return all(op == "LOAD_GLOBAL" for op in uses) and all(_loads_rope_as_global(c) for c in nested)


def _renamed(code):
    names = tuple(_ALIAS if n == ROPE_NAME else n for n in code.co_names)
    consts = tuple(_renamed(c) if isinstance(c, types.CodeType) else c for c in code.co_consts)
    return code.replace(co_names=names, co_consts=consts)


def rope_routed(fn):
    """`fn` (an attention class's forward) as a function whose code reads the global `_tigon_apply_rotary_pos_emb`
    where it read `apply_rotary_pos_emb`: the same bytecode otherwise, the same (live) module globals, so it
    computes exactly what the class forward does with Tigon's RoPE, and torch.compile traces it as any function
    of that module. HF's apply_rotary_pos_emb is not touched: the other instances of the class keep it."""
    routed = _ROUTED.get(fn)
    if routed is None:
        code = getattr(fn, "__code__", None)
        if code is None or ROPE_NAME not in code.co_names or not _loads_rope_as_global(code):
            routed = fn
        else:
            fn.__globals__.setdefault(_ALIAS, apply_rotary_pos_emb)
            routed = types.FunctionType(_renamed(code), fn.__globals__, fn.__name__, fn.__defaults__,
                                        fn.__closure__)
            routed.__kwdefaults__ = fn.__kwdefaults__
            routed.__qualname__, routed.__doc__, routed.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
            routed.__dict__.update(fn.__dict__)
        routed = _ROUTED.setdefault(fn, routed)
    return routed


def calls_rope(cls, modeling: str) -> bool:
    """The class forward is a function of the `modeling` module that calls that module's apply_rotary_pos_emb
    (and can be routed to Tigon's)."""
    fn = hf_class_forward(cls, inherited=True)
    return (getattr(fn, "__globals__", {}).get("__name__") == modeling and rope_routed(fn) is not fn)
