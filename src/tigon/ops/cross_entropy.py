"""Cross-entropy (placeholder until the kernel lands)."""


def cross_entropy(logits, target, **kwargs):
    raise NotImplementedError
