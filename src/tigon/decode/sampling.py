"""Token choice on the device: greedy argmax (two passes on CUDA for a large vocabulary), or one sample after
temperature, top-k and top-p (HF's warper order) by the exponential race `argmax(p / E)`, E ~ Exp(1), which is
how torch.multinomial draws one sample. No host sync: this runs after every CUDA-graph replay.
"""

import math

import torch

from .inputs import NAME, check_int


def check_args(temperature, top_k, top_p):
    """`tigon.generate`'s sampling arguments, checked when do_sample=True: temperature a finite number > 0,
    top_k an int >= 0 (0 = off), 0 < top_p <= 1 (1 = off). top_p = 0 is refused, as HF's TopPLogitsWarper
    documents it ("> 0"): an empty nucleus has no token to draw; top_k=1 keeps the top token only."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"{NAME}: temperature must be a float > 0, got {type(temperature).__name__} "
                        f"{temperature!r}")
    if not (math.isfinite(temperature) and temperature > 0):
        hint = " (for greedy decoding pass do_sample=False)" if temperature == 0 else ""
        raise ValueError(f"{NAME}: temperature must be a finite float > 0, got {temperature!r}{hint}")
    check_int("top_k", top_k, 0)
    if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
        raise TypeError(f"{NAME}: top_p must be a float in (0, 1], got {type(top_p).__name__} {top_p!r}")
    if not 0 < top_p <= 1:
        hint = " (for the top token only pass top_k=1, or do_sample=False for greedy decoding)" if top_p == 0 else ""
        raise ValueError(f"{NAME}: top_p must be in (0, 1] (1.0 = off), got {top_p!r}{hint}")


def argmax(x, two_pass=None):
    """argmax over the last dim of [B, V], first index on ties. On CUDA in two passes: torch's argmax gives a
    [1, V] row one thread block (28 us at V = 128256 on an H200, more than a decoder layer); viewed as
    [B, G, V / G] the first pass spreads over G blocks, the second reduces G values."""
    B, V = x.shape
    if not (x.device.type == "cuda" if two_pass is None else two_pass) or V < 8192:
        return x.argmax(-1)
    groups = next((g for g in range(256, 31, -1) if V % g == 0), None)
    if groups is None:
        return x.argmax(-1)
    part = x.view(B, groups, V // groups)
    idx = part.argmax(-1)  # [B, G] first max of each group
    best = part.gather(-1, idx.unsqueeze(-1)).squeeze(-1).argmax(-1, keepdim=True)  # first group holding the max
    return (best * (V // groups) + idx.gather(-1, best)).squeeze(-1)


def choose(logits, do_sample, temperature, top_k, top_p, generator):
    """Next token [B] from last-position logits [B, V]: argmax, or one sample after temperature, top-k, top-p
    (HF's warper order), all in fp32 on the device."""
    if not do_sample:
        return argmax(logits)  # the order of bf16 values is their fp32 order: no upcast needed
    logits = logits.float()
    if temperature < 1.0:
        # logits / temperature overflows to inf (then softmax gives NaN) once |logit| / temperature > 3.4e38:
        # shifted by the max the quotients are <= 0, so a tiny temperature tends to greedy (ties share the draw).
        # Below fp32's smallest normal the temperature itself would round to 0 (0 / 0 on the top token): fp64.
        if temperature < torch.finfo(torch.float32).tiny:
            logits = logits.double()
        logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    elif temperature != 1.0:
        logits = logits / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        # HF's rule: drop the low tail whose cumulative probability is <= 1 - top_p; the top token stays.
        sorted_logits, order = torch.sort(logits, dim=-1)
        drop = sorted_logits.softmax(-1).cumsum(-1) <= 1 - top_p
        drop[:, -1] = False
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    probs = logits.softmax(-1)
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return argmax(probs / race)
