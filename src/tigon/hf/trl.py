"""TRL 1.16 glue: its trainers' losses through Tigon's fused-linear kernels.

SFTTrainer, DPOTrainer, KTOTrainer, GRPOTrainer (and RLOOTrainer) all call `trl.trainer.utils.add_fused_lm_head`,
whose forward scores tokens with `trl.trainer.utils._ChunkedLogProbFunction.apply(hidden, weight, bias, targets,
temperature, chunk_size, final_logit_softcapping, logit_scale, outputs)` -> (log_probs, entropy, log_sum_sq_probs,
mean_logits, is_top1), each [N] or None, looked up at call time. `use_tigon_losses()` points that name at
`TigonChunkedLogProb`, which computes the same five outputs (and the log-prob and entropy gradients) with
`tigon.ops.fused_linear_logprobs`; every trainer's loss then runs on Tigon's kernels. TRL 1.16's trainers have no other
loss hook: KTOTrainer's and GRPOTrainer's losses (and DPOTrainer's) are elementwise torch on these [B, T] log-probs,
and no trainer builds Liger's chunked losses any more. The one line a TRL user adds, before `trainer.train()`:

    tigon.hf.trl.use_tigon_losses()

It returns a function that restores TRL's own head. A softcapped head (Gemma 2/3's final_logit_softcapping) keeps
TRL's function, as Tigon's log-prob kernels have no softcap yet.
"""

import torch

from .. import ops

_OPTIONAL = ("log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1")


class TigonChunkedLogProb:
    """Drop-in for TRL 1.16's ChunkedLogProbFunction (its `.apply` signature and return values)."""

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


def use_tigon_losses():
    """Route TRL's fused LM head (every trainer's loss) through Tigon; returns a function that undoes it."""
    try:
        from trl.trainer import utils as trl_utils
    except ImportError as e:
        raise ImportError("tigon.hf.trl.use_tigon_losses needs TRL >= 1.16 (pip install 'tigon[trl]')") from e
    original = getattr(trl_utils, "_ChunkedLogProbFunction", None)
    if original is None:
        import trl

        raise ImportError(f"tigon.hf.trl.use_tigon_losses needs TRL >= 1.16, whose fused LM head scores tokens "
                          f"through trl.trainer.utils._ChunkedLogProbFunction; trl {trl.__version__} has none")
    if original is TigonChunkedLogProb:
        return lambda: None
    TigonChunkedLogProb.fallback = original
    trl_utils._ChunkedLogProbFunction = TigonChunkedLogProb

    def restore():
        trl_utils._ChunkedLogProbFunction = original

    return restore
