"""Rotary position embedding (placeholder until the kernel lands)."""


def apply_rope(q, k, cos, sin, unsqueeze_dim=1):
    raise NotImplementedError
