"""TRL (>= 1.15) glue: its trainers' losses through Tigon's fused-linear kernels.

SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer (and RLOOTrainer) all call `trl.trainer.utils.add_fused_lm_head`,
whose forward scores tokens with `trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets,
temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)` -> (log_probs, entropy, log_sum_sq_probs,
mean_logits, is_top1), each [N] or None, looked up at call time. `TigonChunkedLogProb` computes the same five
outputs (and the log-prob and entropy gradients) with `tigon.ops.fused_linear_logprobs`. TRL 1.15+ trainers have no
other loss hook: KTOTrainer's and GRPOTrainer's losses (and DPOTrainer's) are elementwise torch on these [B, T]
log-probs, and no trainer builds Liger's chunked losses any more.

`tigon.patch(model)` is enough: it arms the model (`arm`), and TRL's name then points at `RoutedChunkedLogProb`,
which sends a head whose weight is an armed model's LM head to Tigon and every other head to TRL's own function
(an unpatched model, a reference model loaded on its own, an FSDP2 head gathered into a new tensor). The name is set
when patch() runs if TRL's trainer utilities are imported, else at the model's first forward after they are (TRL's
fused forward runs the backbone before it reads the name); it goes back to TRL's once no armed model (unpatched,
or collected without unpatch) or explicit call is left. `use_tigon_losses()` routes every head, armed or not,
until the function it returns is called. A softcapped head (Gemma 2/3's final_logit_softcapping) keeps TRL's
function, as Tigon's log-prob kernels have no softcap yet.
"""

import functools
import importlib.util
import sys
import weakref

import torch

from .. import _log, ops

_OPTIONAL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TigonChunkedLogProb:
    """Drop-in for TRL 1.15+ ChunkedLogProbFunction (its `.apply` signature and return values)."""

    fallback = None  # TRL's own function, for heads Tigon does not cover

    @classmethod
    def apply(cls, hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping=None,
              logit_scale=1.0, outputs=_OPTIONAL):
        unknown = [k for k in outputs if k not in _OPTIONAL]
        if unknown:
            raise ValueError(f"TigonChunkedLogProb: unknown outputs {unknown}; TRL's head computes {list(_OPTIONAL)}")
        if final_logit_softcapping is not None:
            return cls.fallback.apply(hidden, weight, bias, targets, temperature, chunk_size, final_logit_softcapping,
                                      logit_scale, outputs)
        dev = hidden.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        with torch.autocast(dev, enabled=False):
            # the GEMMs run in the compute dtype, as TRL's; the casts are differentiable (master weights get grads)
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            lp, ent, lsq, mean, top1 = ops.fused_linear_logprobs(h, w, targets, b, temperature=float(temperature),
                                                                 logit_scale=float(logit_scale))
        got = dict(log_probs=lp, entropy=ent, log_sum_sq_probs=lsq, mean_logits=mean, is_top1=top1)
        return tuple(got[k] if (k == "log_probs" or k in outputs) else None for k in _OPTIONAL)


MARK = "_tigon_trl"  # model.__dict__ key: this model's LM head runs on Tigon inside TRL's trainers
_UTILS = "trl.trainer.utils"
_ARMED: "weakref.WeakSet" = weakref.WeakSet()  # models holding the mark
# armed model -> the forward pre-hook that routes TRL's name once TRL is imported
_PENDING: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
# armed model -> the finalizer that gives TRL its name back if the model is collected still armed (never unpatched)
_ON_COLLECT: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ROUTE_ALL = [0]  # open use_tigon_losses() calls
_TRL_FUNCTION: dict = {}  # "fn": TRL's own function while ours is installed


class TrlMark:
    """The mark patch() sets on a model (as `_tigon_trl`): TRL's fused LM head of this model runs on Tigon."""

    __tigon__ = True

    def __reduce__(self):
        return TrlMark, ()


def _head_weight(model):
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    return getattr(head, "weight", None)


class RoutedChunkedLogProb:
    """What TRL's `_ChunkedLogProbFunction` name holds while Tigon is routed: Tigon's for an armed model's head (or
    every head under use_tigon_losses()), TRL's own function for any other."""

    @classmethod
    def apply(cls, hidden, weight, bias, targets, *args, **kwargs):
        # read first: a collected armed model may restore TRL's name (and drop "fn") while this call runs
        own = _TRL_FUNCTION.get("fn", TigonChunkedLogProb.fallback)
        ours = _ROUTE_ALL[0] or any(MARK in m.__dict__ and _head_weight(m) is weight for m in list(_ARMED))
        fn = TigonChunkedLogProb if ours else own
        return fn.apply(hidden, weight, bias, targets, *args, **kwargs)


def _install() -> bool:
    """Point TRL's name at RoutedChunkedLogProb if TRL's trainer utilities are imported; True once it is."""
    utils = sys.modules.get(_UTILS)
    if utils is None:
        return False
    current = getattr(utils, "_ChunkedLogProbFunction", None)
    if current is RoutedChunkedLogProb:
        return True
    if current is None or not hasattr(utils, "add_fused_lm_head"):
        import trl

        # TRL 1.14 has an older _ChunkedLogProbFunction that its trainers never call: routing it would run nothing
        raise ImportError(f"tigon.hf.trl: Tigon's TRL losses need TRL >= 1.15, whose fused LM head "
                          f"(add_fused_lm_head) scores tokens through trl.trainer.utils._ChunkedLogProbFunction; "
                          f"trl {trl.__version__} has no such head (pip install 'tigon[trl]')")
    _TRL_FUNCTION["fn"] = TigonChunkedLogProb.fallback = current
    utils._ChunkedLogProbFunction = RoutedChunkedLogProb
    return True


def _uninstall_if_unused() -> None:
    """TRL's own function back under its name once no armed model (and no use_tigon_losses()) is left. Also a
    model's finalizer: iterating skips the dying model, which len(_ARMED) may still count."""
    if _ROUTE_ALL[0] or any(True for _ in _ARMED) or "fn" not in _TRL_FUNCTION:
        return
    utils = sys.modules.get(_UTILS)
    if utils is not None and getattr(utils, "_ChunkedLogProbFunction", None) is RoutedChunkedLogProb:
        utils._ChunkedLogProbFunction = _TRL_FUNCTION["fn"]
    del _TRL_FUNCTION["fn"]


def _install_at_first_forward(model, module, args, kwargs):
    if torch.compiler.is_compiling() or sys.modules.get(_UTILS) is None:
        return
    handle = _PENDING.pop(model, None)
    if handle is not None:
        handle.remove()
    if model in _ARMED:  # not a deep copy's hook (it carries one, bound to itself, unarmed): nothing would undo it
        _try_install(model)


def _try_install(model) -> bool:
    """_install(), or for a TRL without the name: the model disarmed, logged, and False (patch never fails on it)."""
    try:
        return _install()
    except ImportError as e:
        _ARMED.discard(model)
        _log.get_logger().info("%s; TRL's trainers score this model's LM head with TRL's own function", e)
        return False


def arm(hf, undo) -> bool:
    """tigon.patch(model) with the fused loss: mark `hf` (recorded in `undo`) so that TRL's trainers score its LM
    head on Tigon, and route TRL's name now or at the first forward after TRL is imported. False (nothing done)
    where TRL is not installed, too old, or the head is not a floating-point Linear (a quantized one)."""
    weight = _head_weight(hf)
    if not isinstance(weight, torch.Tensor) or not weight.is_floating_point():
        return False
    if sys.modules.get(_UTILS) is None and importlib.util.find_spec("trl") is None:
        return False
    _ARMED.add(hf)
    if sys.modules.get(_UTILS) is not None:
        if not _try_install(hf):
            return False
    elif hf not in _PENDING:
        inner = getattr(hf, "base_model", hf)
        _PENDING[hf] = inner.register_forward_pre_hook(functools.partial(_install_at_first_forward, hf),
                                                       with_kwargs=True)
    if hf not in _ON_COLLECT:
        _ON_COLLECT[hf] = done = weakref.finalize(hf, _uninstall_if_unused)
        done.atexit = False
    if MARK not in hf.__dict__:
        undo.append((hf, MARK, None))
        hf.__dict__[MARK] = TrlMark()
    return True


def release(hf) -> None:
    """After unpatch(hf): TRL's own function back once no armed model (and no use_tigon_losses()) is left."""
    _ARMED.discard(hf)
    hf.__dict__.pop(MARK, None)
    handle = _PENDING.pop(hf, None)
    if handle is not None:
        handle.remove()
    done = _ON_COLLECT.pop(hf, None)
    if done is not None:
        done.detach()
    _uninstall_if_unused()


def use_tigon_losses():
    """Route TRL's fused LM head of every model (every trainer's loss) through Tigon, patched or not; returns a
    function that undoes it (a second call while one is open is a no-op, and so is its undo)."""
    try:
        from trl.trainer import utils  # noqa: F401  (imports TRL's trainer utilities for _install)
    except ImportError as e:
        raise ImportError("tigon.hf.trl.use_tigon_losses needs TRL >= 1.15 (pip install 'tigon[trl]')") from e
    if _ROUTE_ALL[0]:
        return lambda: None
    _install()
    _ROUTE_ALL[0] = 1

    def restore():
        _ROUTE_ALL[0] = 0
        _uninstall_if_unused()

    return restore
