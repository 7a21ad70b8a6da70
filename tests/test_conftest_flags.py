"""tests/conftest.py's guard of process-wide numeric switches: what a test flips is set back, through the legacy
attributes, and torch's precision getters still answer afterwards (no legacy / new API mix)."""

import torch

from tests.conftest import numeric_flags, restore_numeric_flags


def test_a_flipped_tf32_switch_is_set_back():
    saved = numeric_flags()
    assert saved["torch.backends.cuda.matmul.allow_tf32"] is False  # torch's default, and every test's start
    try:
        torch.backends.cuda.matmul.allow_tf32 = True  # what accelerate's AcceleratorState does
        torch.backends.cudnn.allow_tf32 = not saved["torch.backends.cudnn.allow_tf32"]
        assert restore_numeric_flags(saved) == ["torch.backends.cuda.matmul.allow_tf32",
                                                "torch.backends.cudnn.allow_tf32"]
    finally:
        restore_numeric_flags(saved)
    assert numeric_flags() == saved and restore_numeric_flags(saved) == []
    assert torch.get_float32_matmul_precision() == "highest"
