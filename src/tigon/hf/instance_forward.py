"""The forward Tigon installs on an attention module instance, shared by RoPE routing and the "tigon" attention.

Two marks on the instance ask for it: `route_rope` (from `tigon.patch(model)`: run the class forward with Tigon's
RoPE, `hf.rope_routing`, or with the q/k norms and RoPE in one kernel, `hf.qk_norm_rope_forward`) and
`hf.attention.use_tigon_attention` (a decode step over a RollingKVCache runs on the ring, `hf.ring_decode`).
`sync_forward` sets `installed_forward` while either mark is there and removes it when neither is, so the two
install and undo in any order; a forward that another library set on the instance is left alone.
"""

import functools
import inspect

from .bound import BoundForward
from .qk_norm_rope_forward import QK_NORM_ROPE, qk_norm_rope_forward
from .ring_decode import RING_KWARG, ring_layer, rope_on_write
from .rope_routing import ROPE, rope_routed

_CALL_SHAPE = ("self", "hidden_states", "position_embeddings", "attention_mask", "past_key_values")


@functools.cache
def call_shape_ok(cls) -> bool:
    """`cls.forward` takes hidden_states, position_embeddings, attention_mask, past_key_values first."""
    try:
        names = tuple(inspect.signature(cls.forward).parameters)
    except (TypeError, ValueError):
        return False
    return names[:len(_CALL_SHAPE)] == _CALL_SHAPE


def _class_forward(module):
    """The forward of the module's class, with Tigon's RoPE where route_rope() routed this instance (its q/k norms
    and RoPE in one kernel where fuse_qk_norm_rope() fused them)."""
    fn = type(module).forward
    if not module.__dict__.get(ROPE):
        return fn
    return qk_norm_rope_forward if QK_NORM_ROPE in module.__dict__ else rope_routed(fn)


def installed_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                      **kwargs):
    """Installed on each attention module: a decode step over a RollingKVCache goes to tigon, the rest to the
    class forward (with Tigon's RoPE where the instance is routed)."""
    forward = _class_forward(self)
    layer = ring_layer(self, hidden_states, past_key_values)
    if layer is None:
        return forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)
    if self.__dict__.get("_tigon_rope_on_write"):
        out = rope_on_write(self, layer, hidden_states, position_embeddings, attention_mask)
        if out is not None:
            return out
    return forward(self, hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs,
                   **{RING_KWARG: layer})


def is_tigon_forward(module) -> bool:
    """The module runs the forward `use_tigon_attention` installed, with no hook around it."""
    forward = module.__dict__.get("forward")
    return (getattr(forward, "__func__", None) is installed_forward and not module._forward_hooks
            and not module._forward_pre_hooks)


def sync_forward(module) -> None:
    """Set `installed_forward` on the module while RoPE routing or the tigon attention needs it, remove it when
    neither does; another library's instance forward is left alone."""
    current = module.__dict__.get("forward")
    if current is not None and getattr(current, "__func__", None) is not installed_forward:
        return
    wanted = ROPE in module.__dict__ or "_tigon_rope_on_write" in module.__dict__
    if wanted and current is None:
        module.forward = BoundForward(installed_forward, module)
    elif not wanted and current is not None:
        del module.forward


def route_rope(module) -> str:
    """Make this attention module (an instance of a class that `calls_rope`) run Tigon's RoPE, and only this one.
    Returns "" when routed (or already), else why not."""
    if not call_shape_ok(type(module)):
        return f"{type(module).__name__}.forward does not take {', '.join(_CALL_SHAPE[1:])} first"
    current = module.__dict__.get("forward")
    if current is not None and getattr(current, "__func__", None) is not installed_forward:
        return "another library replaced forward on the instance"
    module.__dict__[ROPE] = True
    sync_forward(module)
    return ""


def unroute_rope(module) -> None:
    """Undo route_rope(module) (and fuse_qk_norm_rope)."""
    module.__dict__.pop(ROPE, None)
    module.__dict__.pop(QK_NORM_ROPE, None)
    sync_forward(module)
