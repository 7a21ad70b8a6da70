"""MLP modules (placeholder until the ops land)."""

import torch


class SwiGLUMLP(torch.nn.Module):
    pass


class GeGLUMLP(torch.nn.Module):
    pass
