"""Reading transformers' attention forward as code: which classes compute Llama's attention, and which forward
transformers defined on a class.

The fused attention paths (RoPE on write in a decode step, `hf.ring_decode`; q/k norms + RoPE in one kernel,
`hf.qk_norm_rope_forward`) reproduce LlamaAttention.forward, so they may run only where a class forward computes
exactly that. `rope_on_write_form(cls)` decides from the code itself, not a table of class names: the forward,
parsed and normalized (docstring, comments and layout gone), reads as Llama's up to a sliding window and Qwen3's
head-dim q/k norms, and its apply_rotary_pos_emb is rotate-half. `llama_forward_mirrored` pins the
LlamaAttention.forward version the fused q/k-norm forward was written against (a sha of that normalized code).
`hf_class_forward` keeps transformers' forward readable after a class-level patch replaced it.
"""

import ast
import collections
import functools
import hashlib
import importlib
import inspect
import textwrap

from .unwrap import hub_function

ROPE_NAME = "apply_rotary_pos_emb"  # the RoPE function of transformers' modeling modules, read as a global


class RopeOnWrite(collections.namedtuple("RopeOnWrite", "window qk_norm")):
    """How a Llama-form attention forward differs from Llama's: where it reads its sliding window ("module":
    `self.sliding_window`, "config": `config.sliding_window`, None: no window) and whether it applies RMSNorm to
    q and k on the head dim before RoPE (Qwen3)."""


_LLAMA = "transformers.models.llama.modeling_llama"  # the form hf.ring_decode.rope_on_write computes
_WINDOW_SOURCES = {"self.sliding_window": "module", "getattr(self.config, 'sliding_window', None)": "config"}
_QK_NORMS = {"q_norm": "self.q_proj(hidden_states).view(hidden_shape)",
             "k_norm": "self.k_proj(hidden_states).view(hidden_shape)"}


def _forward_body(fn):
    """The function's statements as a module AST (docstring, comments and layout gone), or None without its
    source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    except (OSError, TypeError, SyntaxError):
        return None
    body = tree.body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]
    return ast.Module(body=body, type_ignores=[])


def _code(fn, defined=False):
    """The source of `fn` (a kernels function module read as the function it wraps; `defined`: also after
    kernelize gave it a hub forward, `hub_function`) as normalized code, or None."""
    body = _forward_body(hub_function(fn, defined)) if fn is not None else None
    return ast.unparse(body) if body is not None else None


class _LlamaVariations(ast.NodeTransformer):
    """Takes out the two ways a Llama-form forward may differ, recording them: the sliding_window argument of
    the attention call, and q_norm / k_norm around the head-dim view of q and k."""

    def __init__(self):
        self.windows, self.norms = [], set()

    def visit_Call(self, node):
        self.generic_visit(node)
        f = node.func
        if (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id == "self"
                and f.attr in _QK_NORMS and len(node.args) == 1 and not node.keywords
                and ast.unparse(node.args[0]) == _QK_NORMS[f.attr]):
            self.norms.add(f.attr)
            return node.args[0]
        kept = [k for k in node.keywords if k.arg != "sliding_window"]
        self.windows += [ast.unparse(k.value) for k in node.keywords if k.arg == "sliding_window"]
        node.keywords = kept
        return node


@functools.cache
def _llama_code(name):
    """The code of `name` ("LlamaAttention.forward", "apply_rotary_pos_emb", "rotate_half") in modeling_llama."""
    obj = importlib.import_module(_LLAMA)
    for part in name.split("."):
        obj = getattr(obj, part)
    return _code(obj, defined=True)  # the reference: Llama's source even where a kernelize replaced what runs


def _rotate_half_rope(fn) -> bool:
    """The forward's module-level apply_rotary_pos_emb is Llama's rotate-half (or Tigon's), not an interleaved
    one under the same name (GLM, Helium)."""
    rope = hub_function(fn.__globals__.get(ROPE_NAME))
    if getattr(rope, "__tigon__", False):
        return True
    code = _code(rope)
    return (code is not None and code == _llama_code(ROPE_NAME)
            and _code(getattr(rope, "__globals__", {}).get("rotate_half")) == _llama_code("rotate_half"))


_HF_FORWARD: dict = {}  # attention class -> the forward transformers defined on it, kept when a class patch replaces it


def hf_class_forward(cls, inherited=False):
    """The forward transformers defined on `cls` (kept from before a class-level patch replaced it), or None;
    `inherited`: else the one `cls` inherits."""
    return _HF_FORWARD.get(cls) or (getattr(cls, "forward", None) if inherited else cls.__dict__.get("forward"))


def keep_hf_class_forward(cls):
    """`hf_class_forward(cls)`, kept from now on: call it before a class-level patch replaces `cls.forward`."""
    forward = hf_class_forward(cls)
    _HF_FORWARD.setdefault(cls, forward)
    return forward


@functools.cache
def rope_on_write_form(cls):
    """`RopeOnWrite` when `cls.forward` is transformers' own (defined on the class, not replaced by another
    library) and, read as code, is LlamaAttention.forward with at most a sliding window and Qwen3's q/k norms;
    and its apply_rotary_pos_emb is rotate-half; else None. That is the computation `hf.ring_decode.rope_on_write`
    fuses; any other line (softcapping, a norm on the whole projection, a NoPE switch, a fused qkv projection) or
    an interleaved RoPE keeps the module's forward."""
    fn = hf_class_forward(cls)
    if (fn is None or not getattr(fn, "__module__", "").startswith("transformers.models.")
            or getattr(fn, "__qualname__", "") != f"{cls.__name__}.forward"):
        return None
    body = _forward_body(fn)
    if body is None or not _rotate_half_rope(fn):
        return None
    found = _LlamaVariations()
    body = found.visit(body)
    if (ast.unparse(body) != _llama_code("LlamaAttention.forward") or found.norms not in (set(), set(_QK_NORMS))
            or len(found.windows) > 1):
        return None
    window = _WINDOW_SOURCES.get(found.windows[0]) if found.windows else None
    if found.windows and window is None:
        return None
    return RopeOnWrite(window, bool(found.norms))


def sliding_window_of(module):
    """The sliding window a Llama-form attention module passes to its attention function (None: full)."""
    source = rope_on_write_form(type(module)).window
    if source == "module":
        return module.sliding_window
    if source == "config":
        return getattr(module.config, "sliding_window", None)
    return None


def has_qk_norm(module) -> bool:
    """The module's class forward is Llama-form and applies q_norm / k_norm on the head dim before RoPE (Qwen3);
    False for any other forward."""
    form = rope_on_write_form(type(module))
    return form is not None and form.qk_norm


# transformers' LlamaAttention.forward as `_code` normalizes it, in the version `hf.qk_norm_rope_forward` computes
# (5.17): sha-256, first 16 hex digits. Another version keeps the class forward (Tigon's norms and RoPE apart).
_LLAMA_FORWARD_SHA = "edb09e4cdb72174c"


@functools.cache
def llama_forward_mirrored() -> bool:
    """The installed LlamaAttention.forward is the one `hf.qk_norm_rope_forward` reproduces (read once a process)."""
    code = _llama_code("LlamaAttention.forward") or ""
    return hashlib.sha256(code.encode()).hexdigest()[:16] == _LLAMA_FORWARD_SHA
