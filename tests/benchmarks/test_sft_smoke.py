"""benchmarks/training/bench_sft_packed.py's CPU logic: the length mix, steps of whole examples, the packed row
(position_ids restarting, -100 at each example's start, TRL's cu_seq_lens / max_length) against the padded
micro-batches, and the useful-token accounting (pads are waste). The timing needs a GPU (benchmarks/run_gpu.sh sft)."""


import pytest
import torch

from benchmarks.training import bench_sft_packed


@pytest.fixture(scope="module")
def bench():
    return bench_sft_packed


def test_steps_hold_whole_examples_of_the_log_normal_mix(bench):
    steps = bench.steps_of(6)
    assert steps == bench.steps_of(6)  # fixed seed
    assert len(steps) == 6
    flat = [n for s in steps for n in s]
    assert min(flat) >= 16 and max(flat) <= 4096
    assert 250 <= sorted(flat)[len(flat) // 2] <= 600  # median 400 (a sample of ~200)
    for s in steps:
        assert sum(s) <= bench.STEP_TOKENS and sum(s) > bench.STEP_TOKENS - 4096  # closes before passing 16k
    # in order: the steps are consecutive runs of the same draw
    from benchmarks.training.bench_training_attention import lengths_lognormal

    assert flat == lengths_lognormal(bench.STEP_TOKENS * 8)[:len(flat)]


def test_the_packed_row_restarts_positions_and_carries_trls_kwargs(bench):
    lengths = [5, 1, 9, 3]
    b = bench.batch_for("packed_tigon", lengths, 131, torch.Generator().manual_seed(0))
    assert b["input_ids"].shape == (1, 18)
    assert b["position_ids"][0].tolist() == [*range(5), 0, *range(9), *range(3)]
    starts = [0, 5, 6, 15]
    assert (b["labels"][0, starts] == -100).all() and (b["labels"] != -100).sum() == 18 - 4
    assert b["cu_seq_lens_q"].tolist() == [0, 5, 6, 15, 18] and b["cu_seq_lens_q"].dtype == torch.int32
    assert b["max_length_q"] == b["max_length_k"] == 9 and isinstance(b["max_length_q"], int)
    only = bench.batch_for("packed_tigon_position_ids", lengths, 131, torch.Generator().manual_seed(0))
    assert set(only) == {"input_ids", "position_ids", "labels"} and torch.equal(only["input_ids"], b["input_ids"])
    # the same document ids as Tigon reads from position_ids and from cu_seq_lens
    from tigon.hf import training_attention as ta

    assert torch.equal(ta.documents_from_position_ids(b["position_ids"]),
                       ta.documents_from_cu_seq_lens(b["cu_seq_lens_q"], 18))


def test_padded_micro_batches_and_useful_tokens(bench):
    lengths = [5, 1, 9, 3, 7]
    micro = bench.micro_batches("padded_hf", lengths, micro_batch=2)
    assert micro == [[5, 1], [9, 3], [7]]
    assert bench.micro_batches("packed_tigon", lengths, micro_batch=2) == [lengths]
    assert bench.token_counts("padded_hf", lengths, micro_batch=2) == (25, 2 * 5 + 2 * 9 + 7)
    assert bench.token_counts("packed_tigon", lengths) == (25, 25)  # no pads: nothing wasted
    b = bench.batch_for("padded_hf", [5, 1], 131, torch.Generator().manual_seed(0))
    assert b["input_ids"].shape == (2, 5) and b["attention_mask"].sum(1).tolist() == [5, 1]
    assert (b["labels"][b["attention_mask"] == 0] == -100).all()
    assert bench._targets(b) == 4  # the loss's targets: shifted labels that are not pads


def test_a_missing_liger_skips_its_row_with_the_reason(bench, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "liger_kernel" else real(name, *a))
    row = bench.run_variant("padded_liger", None, timeout=100)
    assert row == {"variant": "padded_liger", "skipped": "liger_kernel not installed"}
    assert "liger_kernel not installed" in "\n".join(bench.table([row]))
    with pytest.raises(SystemExit):
        bench.main(["--variants", "padded_hf,bogus"])


def test_a_timed_out_childs_row_keeps_its_last_stack(bench):
    stderr = "\n".join(["step 0: 900.0 ms, 16000 tokens", "Thread 0x1 (most recent call first):", '  File "old"',
                        "step 1: 800.0 ms, 16100 tokens", "Thread 0x1 (most recent call first):",
                        '  File "a.py", line 3 in inner', '  File "b.py", line 9 in outer'])
    assert bench.last_stack(stderr) == ["step 0: 900.0 ms, 16000 tokens", "step 1: 800.0 ms, 16100 tokens",
                                        "Thread 0x1 (most recent call first):", '  File "a.py", line 3 in inner',
                                        '  File "b.py", line 9 in outer']
    assert bench.last_stack("a\nb\nc", lines=2) == ["b", "c"]
