"""Norm modules (placeholder until the ops land)."""

import torch


class RMSNorm(torch.nn.Module):
    pass


class LayerNorm(torch.nn.Module):
    pass
