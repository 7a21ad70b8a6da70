"""The attention forward that runs Qwen3's q/k norms and RoPE as one `tigon.ops.qk_norm_rope` kernel.

Where a class forward is Llama's with Qwen3's q/k norms on the head dim (`hf.forward_source.rope_on_write_form`)
and both norms are Tigon RMSNorms of one setting, the normalized q and k need never go through memory. Two ways in:
`fuse_qk_norm_rope(module)` (one instance that `route_rope` routed, from `tigon.patch(model)`: the instance forward
then runs `qk_norm_rope_forward`) and `qk_norm_rope_class_forward(cls)` (every instance of a class, for a
class-level patch). Both reproduce transformers' LlamaAttention.forward of one version
(`hf.forward_source.llama_forward_mirrored`); on another the class forward runs, with Tigon's norms and RoPE apart.
"""

import functools

from ..modules.norms import RMSNorm
from ..ops import qk_norm_rope
from .forward_source import hf_class_forward, keep_hf_class_forward, llama_forward_mirrored, rope_on_write_form
from .rope_routing import ROPE, rope_routed

# module.__dict__ key: the q/k norms and RoPE of this module run as one kernel; its value: where the class forward
# reads its sliding window ("module", "config", "": none)
QK_NORM_ROPE = "_tigon_qk_norm_rope"
NO_QK_NORM = "no q/k norms on the head dim before RoPE in a Llama-form forward"


def _norms_fusable(q_norm, k_norm, head_dim) -> bool:
    return (isinstance(q_norm, RMSNorm) and isinstance(k_norm, RMSNorm) and q_norm.weight is not None
            and k_norm.weight is not None and q_norm.weight.shape == k_norm.weight.shape == (head_dim,)
            and (q_norm.eps, q_norm.offset, q_norm.casting_mode) == (k_norm.eps, k_norm.offset, k_norm.casting_mode))


def qk_norm_rope_class_ready(cls) -> str:
    """"" when the class forward of `cls` can run its q/k norms and RoPE as one kernel (whatever an instance's
    norms are), else why not (`NO_QK_NORM` where there is nothing to fuse)."""
    form = rope_on_write_form(cls)
    if form is None or not form.qk_norm:
        return NO_QK_NORM
    if not llama_forward_mirrored():
        return "transformers' LlamaAttention.forward is not the version the fused forward computes"
    return ""


def qk_norm_rope_ready(module) -> str:
    """"" when the q/k norms and the RoPE of this attention module can run as one `tigon.ops.qk_norm_rope`
    kernel (`qk_norm_rope_forward`), else why not."""
    why = qk_norm_rope_class_ready(type(module))
    if why:
        return why
    if not _norms_fusable(getattr(module, "q_norm", None), getattr(module, "k_norm", None), module.head_dim):
        return "q_norm / k_norm are not Tigon RMSNorms of head_dim with the same settings"
    return ""


def qk_norm_rope_forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None,
                         **kwargs):
    """The class forward (Llama's with Qwen3's q/k norms, `rope_on_write_form`) with the two norms and RoPE in one
    `tigon.ops.qk_norm_rope` kernel, on an instance `fuse_qk_norm_rope` fused."""
    hf_forward = hf_class_forward(type(self), inherited=True)  # also where a class patch came after this instance's
    return _qk_norm_rope_compute(self, hf_forward, self.__dict__.get(QK_NORM_ROPE),
                                 hidden_states, position_embeddings, attention_mask, past_key_values, **kwargs)


def _qk_norm_rope_compute(self, hf_forward, window_source, hidden_states, position_embeddings, attention_mask,
                          past_key_values, **kwargs):
    """transformers' forward `hf_forward` with the q/k norms and RoPE in one kernel: the normalized q and k never go
    through memory. `window_source` says where it reads its sliding window ("module", "config", "": none). Where
    the kernel cannot run (norms swapped since, a partial rotary table) `hf_forward` runs, with Tigon's RoPE."""
    q_norm, k_norm = self.q_norm, self.k_norm
    cos, sin = position_embeddings
    if not _norms_fusable(q_norm, k_norm, self.head_dim) or cos.shape[-1] != self.head_dim:
        return rope_routed(hf_forward)(self, hidden_states, position_embeddings, attention_mask, past_key_values,
                                       **kwargs)
    input_shape = hidden_states.shape[:-1]
    hidden_shape = (*input_shape, -1, self.head_dim)
    q = self.q_proj(hidden_states).view(hidden_shape)
    k = self.k_proj(hidden_states).view(hidden_shape)
    v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
    q, k = qk_norm_rope(q, k, q_norm.weight, k_norm.weight, cos, sin, q_norm.eps, offset=q_norm.offset,
                        casting_mode=q_norm.casting_mode)
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    if past_key_values is not None:
        k, v = past_key_values.update(k, v, self.layer_idx)
    names = hf_forward.__globals__  # the modeling module's attention functions, as the class forward reads them
    attention = names["ALL_ATTENTION_FUNCTIONS"].get_interface(self.config._attn_implementation,
                                                               names["eager_attention_forward"])
    window = {"sliding_window": self.sliding_window if window_source == "module" else
              getattr(self.config, "sliding_window", None)} if window_source else {}
    out, weights = attention(self, q, k, v, attention_mask, dropout=0.0 if not self.training else
                             self.attention_dropout, scaling=self.scaling, **window, **kwargs)
    return self.o_proj(out.reshape(*input_shape, -1).contiguous()), weights


def qk_norm_rope_class_forward(cls):
    """A forward for the attention class `cls` (Llama-form with Qwen3's q/k norms, `qk_norm_rope_class_ready`)
    running its q/k norms and RoPE as one kernel for every instance whose norms are Tigon's (the others run
    transformers' forward), for a class-level patch; `hf_class_forward(cls)` keeps transformers' forward."""
    hf_forward = keep_hf_class_forward(cls)
    window_source = rope_on_write_form(cls).window or ""

    @functools.wraps(hf_forward)  # the signature, which the call-shape check and generate() inspect
    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, past_key_values=None, **kwargs):
        return _qk_norm_rope_compute(self, hf_forward, window_source, hidden_states, position_embeddings,
                                     attention_mask, past_key_values, **kwargs)

    forward.__tigon__ = True
    return forward


def fuse_qk_norm_rope(module) -> str:
    """Make this attention module (routed to Tigon's RoPE by `route_rope`) run its q/k norms and RoPE as one kernel.
    Returns "" when done (or already), else why not. `unroute_rope` undoes it too."""
    if not module.__dict__.get(ROPE):
        return "RoPE is not routed to Tigon's on this instance"
    if getattr(type(module).forward, "__tigon__", False):
        return ""  # a class-level patch fused the class forward: every instance runs it
    why = qk_norm_rope_ready(module)
    if not why:  # the window's source, read here: the forward traced by torch.compile then reads a plain str
        module.__dict__[QK_NORM_ROPE] = rope_on_write_form(type(module)).window or ""
    return why
