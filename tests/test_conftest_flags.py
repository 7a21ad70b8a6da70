"""tests/conftest.py's guard of process-wide numeric switches: a switch a test flips is set back through the API
that flipped it, and torch's legacy getters still answer afterwards (its two precision APIs agree again)."""

import torch

from tests.conftest import loosened, numeric_flags, restore_numeric_flags


def _effective():
    """What fp32 matmuls and the legacy getters say; raises if torch's two APIs disagree."""
    return (torch.get_float32_matmul_precision(), torch.backends.cuda.matmul.allow_tf32,
            torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction)


def test_a_legacy_tf32_switch_is_set_back():
    """accelerate's write: torch.backends.cuda.matmul.allow_tf32 = True."""
    saved, before = numeric_flags(), _effective()
    assert before[0] == "highest" and before[1] is False  # torch's defaults, and every test's start
    try:
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = not before[3]
        assert _effective()[0] == "high"
        assert "torch.backends.cuda.matmul.allow_tf32" in loosened(saved, numeric_flags())
        changed = restore_numeric_flags(saved)
        assert {"torch.backends.cuda.matmul.allow_tf32", "torch.backends.cuda.matmul.fp32_precision",
                "torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction"} <= set(changed), changed
        assert _effective() == before
    finally:
        restore_numeric_flags(saved)


def test_a_newer_api_tf32_switch_is_set_back():
    """transformers' write under TrainingArguments(torch_compile=True): torch.backends.fp32_precision = "tf32"."""
    saved, before = numeric_flags(), _effective()
    try:
        torch.backends.fp32_precision = "tf32"
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"
        assert "torch.backends.fp32_precision" in loosened(saved, numeric_flags())
        assert "torch.backends.fp32_precision" in restore_numeric_flags(saved)
        assert _effective() == before and numeric_flags() == saved
    finally:
        torch.backends.fp32_precision = saved["torch.backends.fp32_precision"]
    assert restore_numeric_flags(saved) == []


def test_an_explicit_exact_setting_is_set_back_without_being_called_looser():
    """benchmarks/_harness.py's `allow_tf32 = False`: the newer API then reads "ieee" where it read "none"."""
    saved = numeric_flags()
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        now = numeric_flags()
        assert loosened(saved, now) == []
        assert restore_numeric_flags(saved) == [k for k in saved if now[k] != saved[k]]
        assert numeric_flags() == saved
    finally:
        restore_numeric_flags(saved)
