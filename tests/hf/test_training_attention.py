"""tigon.hf.training_attention: HF's mask read without the [T, T] tensor, document ids on the device, each backend
against the fp64 spec (attention_reference), the table's pick and its fallbacks.

Bounds (tests/_grid.py assert_bound): err(backend) <= 2 * err(HF's pick in the same dtype) + ulps * u * max|ref|
against attention_reference in fp64 on the same inputs. In fp32 a softmax row is a sum of T <= 40 terms and the
two GEMMs sum over D = 16 and T: sum_ulps(40) = 8 sqrt(40) = 51 units of roundoff, so ulps = 64.
"""

import sys

import pytest
import torch

from tests._grid import assert_bound, randn
from tigon.hf import attention_table
from tigon.hf import training_attention as ta

ULPS = 64


def _docs(lengths, t=None):
    docs = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    return docs[None] if t is None else docs[None, :t]


def _positions(lengths):
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _hf_mask(fn, t, attention_mask=None):
    from transformers.masking_utils import sdpa_mask

    return sdpa_mask(batch_size=1, q_length=t, kv_length=t, q_offset=0, kv_offset=0, mask_function=fn,
                     attention_mask=attention_mask, allow_is_causal_skip=False)


def test_training_mask_reads_hfs_causal_window_and_packed_functions():
    from transformers import masking_utils as mu

    lengths, t = [5, 9, 3, 7], 24
    docs = mu.find_packed_sequence_indices(_positions(lengths))
    cases = {
        "packed": (mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(docs)), docs, None),
        "sliding": (mu.sliding_window_causal_mask_function(4), None, 4),
        "packed+sliding": (mu.and_masks(mu.sliding_window_causal_mask_function(4),
                                        mu.packed_sequence_mask_function(docs)), docs, 4),
    }
    for name, (fn, want_docs, want_window) in cases.items():
        got = ta.training_mask(mask_function=fn, q_length=t, kv_length=t)
        assert isinstance(got, ta.TrainingMask), name
        assert got.window == want_window and (got.docs is want_docs), name
        # the dense mask built from what was read is HF's, element for element
        assert torch.equal(ta.dense_mask(got.docs, got.window, t, "cpu").expand(1, 1, t, t), _hf_mask(fn, t)), name
    assert ta.training_mask(mask_function=mu.causal_mask_function, q_length=t, kv_length=t) is None
    # a window no row reaches is plain causal
    assert ta.training_mask(mask_function=mu.sliding_window_causal_mask_function(t), q_length=t, kv_length=t) is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="the mask function's name is read from __code__.co_qualname "
                    "(Python >= 3.11); on 3.10 a compiled forward keeps HF's dense mask")
@pytest.mark.parametrize("case", ["causal", "packed", "sliding", "packed+sliding"])
def test_training_mask_reads_the_same_while_dynamo_traces(case):
    """A compiled forward builds its masks inside the trace: there it must read HF's mask functions as in eager
    (else every compiled layer runs HF's dense [T, T] mask, without SDPA's causal tile skipping)."""
    from transformers import masking_utils as mu

    lengths, t = [5, 9, 3, 7], 24
    docs = mu.find_packed_sequence_indices(_positions(lengths))
    fn = {"causal": mu.causal_mask_function,
          "packed": mu.and_masks(mu.causal_mask_function, mu.packed_sequence_mask_function(docs)),
          "sliding": mu.sliding_window_causal_mask_function(4),
          "packed+sliding": mu.and_masks(mu.sliding_window_causal_mask_function(4),
                                         mu.packed_sequence_mask_function(docs))}[case]

    def read(x):
        got = ta.training_mask(mask_function=fn, q_length=t, kv_length=t)
        if got is None or got is NotImplemented:
            return x, got is None, None, None
        return x, True, got.window, got.docs

    if case != "causal" and not ta._DYNAMO_READS_CLOSURES:
        pytest.skip("torch < 2.13: dynamo cannot read the closure of a mask function made in the trace, so a "
                    "compiled forward keeps HF's mask for AND masks (training_attention._cells)")
    eager = read(torch.ones(1))
    torch._dynamo.reset()
    traced = torch.compile(read, backend="eager", fullgraph=True)(torch.ones(1))
    assert traced[1] is True and eager[1] is True, case
    assert traced[2] == eager[2] and (traced[3] is None) == (eager[3] is None), case
    if eager[3] is not None:
        assert torch.equal(traced[3], eager[3]), case


@pytest.mark.parametrize("case", ["padding", "offset", "cache", "unknown", "or", "decode"])
def test_training_mask_leaves_the_rest_to_hf(case):
    from transformers import masking_utils as mu

    t, fn, kw = 12, mu.causal_mask_function, {}
    if case == "padding":
        kw["attention_mask"] = torch.ones(1, t, dtype=torch.bool)
    elif case == "offset":
        kw["q_offset"] = 3
    elif case == "cache":
        kw["kv_length"] = t + 4
    elif case == "unknown":
        fn = mu.chunked_causal_mask_function(4, torch.zeros(1, dtype=torch.long))
    elif case == "or":
        fn = mu.or_masks(mu.causal_mask_function, mu.bidirectional_mask_function)
    kw.setdefault("kv_length", 1 if case == "decode" else t)
    got = ta.training_mask(mask_function=fn, q_length=1 if case == "decode" else t, **kw)
    assert got is NotImplemented


def test_document_ids_on_the_device_match_hfs_detection():
    from transformers.masking_utils import find_packed_sequence_indices

    lengths = [5, 1, 9, 3]
    pos = _positions(lengths)
    assert torch.equal(ta.documents_from_position_ids(pos), find_packed_sequence_indices(pos))
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    assert torch.equal(ta.documents_from_cu_seq_lens(cu, 18), _docs(lengths))
    # tokens past the last boundary (a row padded to a multiple) form one more document
    assert ta.documents_from_cu_seq_lens(cu, 20)[0, -2:].tolist() == [4, 4]


def _qkv(b=1, hq=4, hk=2, t=24, d=16, dtype=torch.float32, seed=0, grad=False):
    torch.manual_seed(seed)
    return [randn(b, h, t, d, dtype=dtype, requires_grad=grad) for h in (hq, hk, hk)]


SPECS = {
    "causal": (None, None, None),
    "packed": ([5, 9, 3, 7], None, None),
    "sliding": (None, 4, None),
    "packed+sliding+softcap": ([5, 9, 3, 7], 4, 3.0),
    "packed+softcap": ([5, 9, 3, 7], None, 2.0),
}


@pytest.mark.parametrize("spec", list(SPECS))
def test_flex_forward_matches_the_reference(spec):
    """FlexAttention's block mask and softcap score_mod (eager on CPU: forward only, torch has no CPU backward)."""
    lengths, window, softcap = SPECS[spec]
    docs = _docs(lengths) if lengths else None
    q, k, v = _qkv()
    scaling = 16 ** -0.5
    ref = ta.attention_reference(q.double(), k.double(), v.double(), scaling=scaling, docs=docs, window=window,
                                 softcap=softcap)
    hf = ta.attention_reference(q, k, v, scaling=scaling, docs=docs, window=window, softcap=softcap)
    mask = ta.TrainingMask(docs, window)
    with torch.no_grad():
        got = ta.flex_attention_forward(q, k, v, scaling=scaling, docs=docs, window=window, softcap=softcap,
                                        mask=mask, compiled=False)
    assert_bound(f"flex {spec}", got, hf, ref, torch.float32, ulps=ULPS)
    assert list(mask.block_masks) == [(window, 24, "cpu")]  # built once, kept for the next layer


def test_flex_takes_the_tables_tiles_for_its_gpu_and_head_dim(monkeypatch):
    """FLEX_KERNEL_OPTIONS reaches flex_attention as kernel_options on its GPU and head dim, 2-byte dtypes only;
    every entry names only flex's tile options, in sizes that divide its 128-token mask blocks."""
    import torch.nn.attention.flex_attention as fa

    names = {"BLOCK_M", "BLOCK_N", "BLOCK_M1", "BLOCK_N1", "BLOCK_M2", "BLOCK_N2", "num_stages", "num_warps"}
    for opts in attention_table.FLEX_KERNEL_OPTIONS.values():
        for key, value in opts.items():
            assert key[:4] in ("fwd_", "bwd_") and key[4:] in names, key
            assert key[4:].startswith("num_") or 128 % value == 0, (key, value)
    gpu, head = next(iter(attention_table.FLEX_KERNEL_OPTIONS))
    seen, flex = [], fa.flex_attention
    monkeypatch.setattr(fa, "flex_attention", lambda *a, **k: seen.append(k.get("kernel_options")) or flex(*a, **{
        n: v for n, v in k.items() if n != "kernel_options"}))
    monkeypatch.setattr(ta, "gpu_name", lambda device: gpu)
    for dtype in (torch.bfloat16, torch.float32):
        q, k, v = (torch.randn(1, h, 20, head, dtype=dtype) for h in (2, 1, 1))
        with torch.no_grad():
            ta.flex_attention_forward(q, k, v, scaling=head ** -0.5, softcap=5.0, compiled=False)
    assert seen == [attention_table.FLEX_KERNEL_OPTIONS[(gpu, head)], None]
    assert attention_table.flex_kernel_options("Other GPU", head, 2) == {}


def _tiles(allowed, tile=ta.FLEX_BLOCK):
    """Per-tile any / all of a [B, T, T] boolean mask, padded with False past T (the ground truth of a block mask)."""
    b, t, _ = allowed.shape
    n = -(-t // tile)
    pad = torch.zeros(b, n * tile, n * tile, dtype=torch.bool)
    pad[:, :t, :t] = allowed
    valid = torch.zeros_like(pad)
    valid[:, :t, :t] = True
    blocks = pad.view(b, n, tile, n, tile).transpose(2, 3)
    return blocks.any((-1, -2)), (blocks | ~valid.view(b, n, tile, n, tile).transpose(2, 3)).all((-1, -2))


BLOCK_CASES = [  # (length, window, per-row document lengths or None)
    (1, None, None), (127, None, None), (128, None, None), (300, None, None), (517, 130, None), (517, 1, None),
    (300, 40, [[90, 17, 130, 63]]), (517, None, [[1, 77, 130, 3, 255, 51]]), (640, 200, [[128, 128, 256, 128]]),
    (400, None, [[150, 0, 0, 250], [10, 390, 0, 0]]),  # empty documents (cu_seq_lens repeats): ids skip values
]


@pytest.mark.parametrize("length,window,docs", BLOCK_CASES)
def test_block_sets_from_tile_bounds_are_the_masks_tiles(length, window, docs):
    """Every tile holding an allowed pair is in the block mask, a full tile holds only allowed pairs, and full is
    exact but for a ragged last row of tiles (kept partial: its mask_mod runs)."""
    ids = None
    if docs is not None:
        ids = torch.stack([torch.repeat_interleave(torch.arange(len(row)), torch.tensor(row)) for row in docs])
    partial, full = ta.block_sets(ids, window, length, "cpu")
    allowed = ta.dense_mask(ids, window, length, "cpu")[:, 0].expand(len(docs or [0]), -1, -1)
    some, every = _tiles(allowed)
    assert torch.equal((partial | full)[:, 0], some) and not (partial & full).any()
    ragged = length % ta.FLEX_BLOCK != 0
    exact = every.clone()
    if ragged:
        exact[:, -1, :] = False
    assert torch.equal(full[:, 0], exact & some)


def test_rows_without_documents_share_one_block_mask(monkeypatch):
    """A causal or windowed row's block mask holds no data: built once per (window, length, device) for every
    layer and step; one with documents is never kept past its forward."""
    monkeypatch.setattr(ta, "_DOCUMENTLESS_BLOCK_MASKS", {})
    built = []
    block_mask = ta._block_mask
    monkeypatch.setattr(ta, "_block_mask", lambda *a: built.append(a[1:3]) or block_mask(*a))
    q, k, v = (torch.randn(1, h, 150, 16) for h in (2, 1, 1))
    with torch.no_grad():
        for window in (None, None, 40, 40):
            ta.flex_attention_forward(q, k, v, scaling=0.25, window=window, compiled=False)
        for _ in range(2):
            ta.flex_attention_forward(q, k, v, scaling=0.25, docs=_docs([100, 50]), compiled=False)
    assert built == [(None, 150), (40, 150), (None, 150), (None, 150)]
    assert set(ta._DOCUMENTLESS_BLOCK_MASKS) == {(None, 150, "cpu"), (40, 150, "cpu")}


def test_flex_runs_the_tile_bounds_block_mask_like_create_block_mask():
    """The BlockMask built from tile bounds gives FlexAttention the same attention as create_block_mask's."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    lengths, window, t = [90, 17, 130, 63], 40, 300
    docs = _docs(lengths)
    q, k, v = (torch.randn(1, h, t, 16) for h in (4, 2, 2))
    ours = ta._block_mask(docs, window, t, torch.device("cpu"))
    ref = create_block_mask(lambda b, h, qi, ki: (qi >= ki) & (qi - ki < window) & (docs[b, qi] == docs[b, ki]),
                            1, None, t, t, device="cpu")
    assert ours.seq_lengths == ref.seq_lengths == (t, t)
    assert torch.equal(ours.to_dense(), ref.to_dense())
    with torch.no_grad():
        got, want = (flex_attention(q, k, v, block_mask=m, enable_gqa=True) for m in (ours, ref))
    torch.testing.assert_close(got, want, rtol=0, atol=0)


class _Module(torch.nn.Module):
    is_causal = True
    num_key_value_groups = 2  # HF repeats K/V by it (4 query heads, 2 KV heads)
    training = True


@pytest.mark.parametrize("spec", list(SPECS))
def test_hfs_pick_forward_and_gradients_match_the_reference(spec):
    """What a CPU (and a GPU without a measured row) runs: SDPA / eager with the dense mask of the same
    documents and window, forward and every gradient."""
    lengths, window, softcap = SPECS[spec]
    docs = _docs(lengths) if lengths else None
    q, k, v = _qkv(grad=True)
    go = randn(1, 24, 4, 16)
    scaling = 16 ** -0.5
    mask = ta.TrainingMask(docs, window) if docs is not None or window else None
    out, weights = ta.training_attention_forward(_Module(), q, k, v, mask, scaling=scaling, softcap=softcap)
    assert weights is None or softcap  # eager returns its weights
    got = [out, *torch.autograd.grad(out, (q, k, v), go)]
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out = ta.attention_reference(q64, k64, v64, scaling=scaling, docs=docs, window=window, softcap=softcap)
    ref = [ref_out, *torch.autograd.grad(ref_out, (q64, k64, v64), go.double())]
    q32, k32, v32 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    t_out = ta.attention_reference(q32, k32, v32, scaling=scaling, docs=docs, window=window, softcap=softcap)
    torch_f32 = [t_out, *torch.autograd.grad(t_out, (q32, k32, v32), go)]
    for name, a, b, r in zip(("out", "dq", "dk", "dv"), got, torch_f32, ref):
        assert_bound(f"{spec} {name}", a, b, r, torch.float32, ulps=ULPS)


def test_documents_kwarg_and_cu_seq_lens_confine_a_none_mask():
    lengths = [5, 9, 3, 7]
    q, k, v = _qkv()
    scaling = 16 ** -0.5
    ref = ta.attention_reference(q, k, v, scaling=scaling, docs=_docs(lengths))
    with torch.no_grad():
        by_docs, _ = ta.training_attention_forward(_Module(), q, k, v, None, scaling=scaling,
                                                   **{ta.DOCUMENTS: ta.TrainingMask(_docs(lengths))})
        cu = torch.tensor([0, 5, 14, 17, 24], dtype=torch.int32)
        by_cu, _ = ta.training_attention_forward(_Module(), q, k, v, None, scaling=scaling, cu_seq_lens_q=cu,
                                                 cu_seq_lens_k=cu, max_length_q=9, max_length_k=9)
    torch.testing.assert_close(by_docs, ref, rtol=ULPS * 2**-24, atol=ULPS * 2**-24)
    torch.testing.assert_close(by_cu, ref, rtol=ULPS * 2**-24, atol=ULPS * 2**-24)


def test_the_table_picks_measured_rows_and_falls_back_when_not_eligible(monkeypatch):
    assert attention_table.pick(None, "packed") == "sdpa"
    assert attention_table.pick("NVIDIA H200", "causal+softcap") == "eager" or \
        ("NVIDIA H200", "causal+softcap") in attention_table.MEASURED
    monkeypatch.setattr(attention_table, "MEASURED", {("Test GPU", "packed"): "flex"})
    monkeypatch.setattr(ta, "gpu_name", lambda device: "Test GPU")
    monkeypatch.setattr(ta, "_compiled_flex", lambda: __import__("torch").nn.attention.flex_attention.flex_attention)
    calls = []
    real = ta.flex_attention_forward
    monkeypatch.setattr(ta, "flex_attention_forward", lambda *a, **kw: calls.append(kw) or real(*a, **kw))
    lengths = [5, 9, 3, 7]
    mask = ta.TrainingMask(_docs(lengths))
    q, k, v = _qkv()
    with torch.no_grad():
        ta.training_attention_forward(_Module(), q, k, v, mask, scaling=0.25)
        assert len(calls) == 1 and calls[0]["mask"] is mask
        ta.training_attention_forward(_Module(), q, k, v, mask, scaling=0.25, dropout=0.1)  # flex has no dropout
        q24, k24, v24 = _qkv(d=24)
        ta.training_attention_forward(_Module(), q24, k24, v24, mask, scaling=0.25)  # head dim not a power of 2
    assert len(calls) == 1


def test_layer_plan_names_each_layer_kind():
    from transformers import AutoConfig

    config = AutoConfig.for_model("gemma2", sliding_window=16, attn_logit_softcapping=50.0, num_hidden_layers=2)
    plan = ta.layer_plan(config, torch.device("cpu"))
    assert set(plan) == {"sliding_attention", "full_attention"}
    assert plan["full_attention"] == {"causal+softcap": "eager", "packed+softcap": "eager"}
    assert plan["sliding_attention"]["packed+sliding+softcap"] == "eager"
    llama = ta.layer_plan(AutoConfig.for_model("llama"), torch.device("cpu"))
    assert llama == {"full_attention": {"causal": "sdpa", "packed": "sdpa"}}


# Packed training gives every step another total length and document count. 6 rows of 33..180 tokens, 2 to 6
# documents, two inside one 128-block: automatic dynamic compiles a static graph, then one with a symbolic T, then
# the one-block row (a size-1 block dimension specializes): 3 graphs, under dynamo's limit of 8. (10 rows gave
# the same 3 graphs at 2x the CPU time.)
PACKED_LENGTHS = [(30, 11), (50, 70, 44), (8, 25), (90, 17, 30, 13), (60, 5, 5, 5, 5, 80), (150, 30)]
MAX_FLEX_GRAPHS = 3
ULPS_LONG = 128  # documents of up to 150 tokens: sum_ulps(150) = 8 sqrt(150) = 98 units of roundoff


def _flex_on_the_test_gpu(monkeypatch, compiled):
    """training_attention_forward as on a GPU whose table names flex for packed rows, flex compiled by `compiled`
    (a CPU backend: inductor's flex kernel is GPU-only in practice, and CPU flex has no backward)."""
    import torch._dynamo

    torch._dynamo.reset()  # other tests' graphs of flex_attention would count against its limit
    monkeypatch.setattr(attention_table, "MEASURED", {("Test GPU", k): "flex" for k in ("packed", "packed+softcap")})
    monkeypatch.setattr(ta, "gpu_name", lambda device: "Test GPU")
    monkeypatch.setattr(ta, "_compiled_flex", lambda: compiled)


def _packed_layers(lengths, softcap=None, layers=2):
    """Two layers of one packed row through training_attention_forward: (output, fp32 reference, fp64 spec)."""
    docs = _docs(lengths)
    q, k, v = _qkv(t=docs.shape[-1], seed=len(lengths))
    mask = ta.TrainingMask(docs)
    for _ in range(layers):  # the second layer reuses the forward's block mask and graph
        got, _ = ta.training_attention_forward(_Module(), q, k, v, None, scaling=0.25, softcap=softcap,
                                               **{ta.DOCUMENTS: mask})
    hf = ta.attention_reference(q, k, v, scaling=0.25, docs=docs, softcap=softcap)
    ref = ta.attention_reference(q.double(), k.double(), v.double(), scaling=0.25, docs=docs, softcap=softcap)
    return got, hf, ref


def test_packed_lengths_reuse_the_compiled_flex(monkeypatch):
    """With the softcap score_mod: without it the same dynamic graphs compile (a second CPU compile of ~15 s; the
    GPU suite's test_ten_packed_steps_of_different_lengths_stay_on_the_compiled_kernel runs that one)."""
    import warnings

    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend

    softcap = 50.0
    counter = CompileCounterWithBackend("aot_eager")
    _flex_on_the_test_gpu(monkeypatch, ta._compile_flex(counter))  # the product's compile, a CPU backend
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)  # a recompile-limit fallback warns: fail instead
            for lengths in PACKED_LENGTHS:
                got, hf, ref = _packed_layers(lengths, softcap)
                assert_bound(f"flex packed {lengths}", got, hf, ref, torch.float32, ulps=ULPS_LONG)
        assert 1 <= counter.frame_count <= MAX_FLEX_GRAPHS < torch._dynamo.config.recompile_limit
    finally:
        torch._dynamo.reset()


def test_the_recompile_limit_raises_and_the_layer_runs_hfs_pick(monkeypatch):
    """A compile that specializes every length (dynamic=False) reaches the limit: no silent eager flex (the [T, T]
    scores), a warning and HF's pick (SDPA on the dense boolean mask), exact; dynamo's settings restored."""
    import torch._dynamo
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch.nn.attention.flex_attention import flex_attention

    counter = CompileCounterWithBackend("aot_eager")
    _flex_on_the_test_gpu(monkeypatch, torch.compile(flex_attention, backend=counter, dynamic=False))
    # not monkeypatch.setattr: its undo leaves torch's config module without recompile_limit (AttributeError
    # in every later compile of the process)
    saved_limit = torch._dynamo.config.recompile_limit
    torch._dynamo.config.recompile_limit = 2
    monkeypatch.setattr(ta, "FLEX_RECOMPILE_LIMIT", 2)
    try:
        for i, lengths in enumerate(PACKED_LENGTHS[:4]):
            if i < 2:
                got, hf, ref = _packed_layers(lengths)
            else:
                with pytest.warns(RuntimeWarning, match="recompile limit"):
                    got, hf, ref = _packed_layers(lengths)
            assert_bound(f"packed {lengths}", got, hf, ref, torch.float32, ulps=ULPS_LONG)
        assert counter.frame_count == 2
        assert torch._dynamo.config.recompile_limit == 2 and not torch._dynamo.config.fail_on_recompile_limit_hit
    finally:
        torch._dynamo.config.recompile_limit = saved_limit
        torch._dynamo.reset()


def test_a_second_softcap_compiles_a_static_graph_without_graph_breaks(monkeypatch):
    """Two softcap values in one process (the GPU suite's specs use 3.0 and 2.0): automatic dynamic would make the
    second a graph input, the HOP then graph-breaks and runs its autograd eagerly (torch 2.11: AssertionError in
    create_fw_bw_graph). Traced with grad-requiring inputs on a CPU backend (CPU flex refuses requires_grad before
    tracing, so that check is bypassed: only the trace is tested here, the GPU test runs the backward)."""
    import torch._dynamo
    import torch.nn.attention.flex_attention as flex_module
    from torch._dynamo.testing import CompileCounterWithBackend
    from torch._dynamo.utils import counters

    counter = CompileCounterWithBackend("aot_eager")
    _flex_on_the_test_gpu(monkeypatch, ta._compile_flex(counter))
    monkeypatch.setattr(flex_module, "_validate_device", lambda *args: None)
    breaks = sum(counters["graph_break"].values())
    specialize = torch._dynamo.config.specialize_float
    try:
        for softcap in (3.0, 2.0, 3.0):
            q, k, v = _qkv(grad=True)
            got = ta.flex_attention_forward(q, k, v, scaling=0.25, docs=_docs([5, 9, 3, 7]), softcap=softcap)
            with torch.no_grad():
                hf = ta.attention_reference(q, k, v, scaling=0.25, docs=_docs([5, 9, 3, 7]), softcap=softcap)
                ref = ta.attention_reference(q.double(), k.double(), v.double(), scaling=0.25,
                                             docs=_docs([5, 9, 3, 7]), softcap=softcap)
            assert_bound(f"softcap {softcap}", got.detach(), hf, ref, torch.float32, ulps=ULPS)
        assert sum(counters["graph_break"].values()) == breaks
        assert counter.frame_count == 2  # one static graph per softcap value, the third call reuses the first
        assert torch._dynamo.config.specialize_float == specialize
    finally:
        torch._dynamo.reset()


def test_a_flex_compile_failure_runs_hfs_pick_with_a_warning(monkeypatch):
    """Inductor finding no kernel config for a shape (torch 2.11: head 16, bf16, 64 tokens) must not crash the
    layer: a warning, HF's pick (exact), and no second compile attempt for the same shape."""
    import torch._dynamo

    attempts = []

    def no_kernel(*args, **kwargs):
        attempts.append(1)
        raise torch._dynamo.exc.BackendCompilerFailed(no_kernel, RuntimeError("NoValidChoicesError: no choices"),
                                                      None)

    _flex_on_the_test_gpu(monkeypatch, no_kernel)
    monkeypatch.setattr(ta, "_FLEX_FAILED", set())
    lengths = [5, 9, 3, 7]
    q, k, v = _qkv()
    ref = ta.attention_reference(q, k, v, scaling=0.25, docs=_docs(lengths))
    with torch.no_grad():
        with pytest.warns(RuntimeWarning, match="failed to compile for packed, head 16"):
            got, _ = ta.training_attention_forward(_Module(), q, k, v, ta.TrainingMask(_docs(lengths)),
                                                   scaling=0.25)
        again, _ = ta.training_attention_forward(_Module(), q, k, v, ta.TrainingMask(_docs(lengths)),
                                                 scaling=0.25)
    assert len(attempts) == 1
    for out in (got, again):
        torch.testing.assert_close(out, ref, rtol=ULPS * 2**-24, atol=ULPS * 2**-24)



def test_the_ranking_lists_measured_backends_then_hfs_pick(monkeypatch):
    monkeypatch.setattr(attention_table, "MEASURED", {("G", "packed"): ("varlen", "flex"), ("G", "sliding"): "flex",
                                                      ("G", "causal"): "sdpa", ("G", "bad"): "fast"})
    assert attention_table.ranking("G", "packed") == ("varlen", "flex", "sdpa")
    assert attention_table.ranking("G", "sliding") == ("flex", "sdpa")
    assert attention_table.ranking("G", "causal") == ("sdpa",)  # HF's pick once, not twice
    assert attention_table.ranking("G", "packed+softcap") == ("eager",)
    assert attention_table.ranking(None, "packed") == ("sdpa",) and attention_table.pick("G", "packed") == "varlen"
    with pytest.raises(ValueError, match="unknown backend"):
        attention_table.ranking("G", "bad")


def test_the_benchmarks_ranking_is_what_the_table_reads(tmp_path, monkeypatch):
    """bench_training_attention.fastest -> write_table -> ranking: backends faster than HF's pick on every shape
    both ran, by the geometric mean of the speedups; a backend slower on one shape, or not a table backend
    (varlen_maxT), stays out."""
    import importlib.util
    from types import SimpleNamespace

    from benchmarks.training import bench_training_attention as bench

    def row(kind, case, provider, us, backend=None):
        return dict(op=kind, case=case, provider=provider, fb_us=us, backend_of={provider: backend or provider})

    rows = [row("packed", "a", "sdpa", 100.0), row("packed", "a", "flex", 10.0), row("packed", "a", "varlen", 5.0),
            row("packed", "b", "sdpa", 100.0), row("packed", "b", "flex", 20.0), row("packed", "b", "varlen", 4.0),
            row("packed", "a", "varlen_maxT", 1.0, "varlen (max_length = T)"),
            row("causal", "a", "sdpa", 10.0), row("causal", "a", "cudnn", 5.0, "sdpa"),
            row("causal", "a", "varlen", 9.0), row("causal", "b", "sdpa", 10.0), row("causal", "b", "varlen", 11.0),
            row("sliding", "a", "sdpa", 10.0), row("sliding", "a", "flex", 9.0)]
    best = bench.fastest(SimpleNamespace(rows=rows))
    assert best == {"packed": ("varlen", "flex"), "sliding": "flex"}
    path = tmp_path / "attention_table.py"
    path.write_text(open(bench.TABLE).read())
    bench.write_table("Test GPU", best, str(path))
    spec = importlib.util.spec_from_file_location("table_copy", path)
    table = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(table)
    assert table.ranking("Test GPU", "packed") == ("varlen", "flex", "sdpa")
    assert table.ranking("Test GPU", "causal") == ("sdpa",)


def _flash_semantics_mask(t, window_size):
    """What flash / varlen_attn attend for window_size (left, right), -1 unbounded: i - left <= j <= i + right."""
    left, right = window_size
    i = torch.arange(t)[:, None]
    j = torch.arange(t)[None, :]
    return ((j >= i - left) | (left < 0)) & ((j <= i + right) | (right < 0))


@pytest.mark.parametrize("window", [None, 1, 4, 23])
def test_varlen_window_size_is_hfs_sliding_window(window, monkeypatch):
    """The window_size (or is_causal) handed to varlen_attn attends exactly HF's own mask: sliding_window_overlay is
    kv_idx > q_idx - window, so left = window - 1 (a window of 1 is the diagonal)."""
    from transformers import masking_utils as mu

    monkeypatch.setattr(ta, "varlen_device", lambda device: True)
    t = 24
    fn = mu.sliding_window_causal_mask_function(window) if window else mu.causal_mask_function
    q, k, _ = _qkv(t=t, dtype=torch.bfloat16)
    plan = ta.varlen_plan(q, k, scaling=0.25, window=window, params=frozenset({"window_size", "scale", "enable_gqa"}))
    assert plan.kwargs == {"window_size": (window - 1 if window else -1, 0), "scale": 0.25, "enable_gqa": True}
    assert torch.equal(_flash_semantics_mask(t, plan.kwargs["window_size"]), _hf_mask(fn, t)[0, 0])


def _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, scale=None, window_size=(-1, -1),
                      enable_gqa=False, is_causal=None):
    """varlen_attn's contract on a CPU, for the glue around it: [T, H, D] tokens, each sequence of cu on its own,
    flash's window semantics, max_q at least every length, GQA only when enabled."""
    assert query.dim() == 3 and query.stride(-1) == 1 and cu_seq_q.dtype == torch.int32
    assert torch.equal(cu_seq_q, cu_seq_k) and isinstance(max_q, int) and max_q == max_k
    if query.shape[1] != key.shape[1]:
        assert enable_gqa, "varlen_attn raises for GQA without enable_gqa"
    if is_causal is not None:  # torch 2.10's signature
        window_size = (-1, 0) if is_causal else (-1, -1)
    out = torch.full_like(query, float("nan"))
    bounds = cu_seq_q.tolist()
    for a, b in zip(bounds[:-1], bounds[1:]):
        assert b - a <= max_q
        qs, ks, vs = (x[a:b].transpose(0, 1)[None].float() for x in (query, key, value))
        mask = _flash_semantics_mask(b - a, window_size)[None, None]
        d = query.shape[-1]
        got = ta.attention_reference(qs, ks, vs, scaling=scale or d ** -0.5, mask=mask)
        out[a:b] = got[0].to(query.dtype)
    return out


def _fake_varlen_2_10(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
    return _fake_varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=is_causal)


VARLEN_CASES = {  # name: (lengths or None, window, signature)
    "packed": ([5, 9, 1, 3, 6], None, _fake_varlen_attn),
    "packed+sliding": ([5, 9, 1, 3, 6], 4, _fake_varlen_attn),
    "sliding, 2 rows": (None, 4, _fake_varlen_attn),
    "packed, torch 2.10": ([5, 9, 1, 3, 6], None, _fake_varlen_2_10),
}


@pytest.mark.parametrize("case", list(VARLEN_CASES))
def test_varlen_glue_matches_the_reference(case, monkeypatch):
    """training_attention_forward on a GPU whose table names varlen, with varlen_attn's contract in place of its
    CUDA kernel: the [B, H, T, D] -> [B * T, H, D] flattening, cu_seq_lens, the window and GQA (native, or K/V
    repeated for torch 2.10's signature), against the bf16 reference."""
    import inspect

    import torch.nn.attention.varlen as varlen_module

    lengths, window, fake = VARLEN_CASES[case]
    monkeypatch.setattr(attention_table, "MEASURED", {("Test GPU", k): "varlen" for k in ("packed", "sliding",
                                                                                           "packed+sliding")})
    monkeypatch.setattr(ta, "gpu_name", lambda device: "Test GPU")
    monkeypatch.setattr(ta, "varlen_device", lambda device: True)
    monkeypatch.setattr(ta, "varlen_parameters", lambda: frozenset(inspect.signature(fake).parameters))
    calls = []
    monkeypatch.setattr(varlen_module, "varlen_attn", lambda *a, **kw: calls.append(kw) or fake(*a, **kw))
    b = 1 if lengths else 2
    q, k, v = _qkv(b=b, dtype=torch.bfloat16)
    docs = _docs(lengths) if lengths else None
    kw = {}
    if lengths:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
        kw = dict(cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(lengths), max_length_k=max(lengths))
    mask = ta.TrainingMask(docs, window) if window else None
    got, _ = ta.training_attention_forward(_Module(), q, k, v, mask, scaling=0.25, **kw)
    assert len(calls) == 1, "varlen_attn did not run"
    hf = ta.attention_reference(q, k, v, scaling=0.25, docs=docs, window=window)
    ref = ta.attention_reference(q.double(), k.double(), v.double(), scaling=0.25, docs=docs, window=window)
    assert_bound(case, got, hf, ref, torch.bfloat16, ulps=2)


def test_varlen_steps_aside_for_what_it_cannot_take(monkeypatch):
    """Position_ids without the collator's cu_seq_lens, softcap, fp32, a window on torch 2.10, a CPU tensor: the next
    backend of the ranking (HF's pick here) runs, exactly."""
    import torch.nn.attention.varlen as varlen_module

    monkeypatch.setattr(attention_table, "MEASURED", {("Test GPU", k): "varlen" for k in (
        "packed", "sliding", "packed+softcap")})
    monkeypatch.setattr(ta, "gpu_name", lambda device: "Test GPU")
    monkeypatch.setattr(ta, "varlen_parameters", lambda: frozenset({"window_size", "scale", "enable_gqa"}))
    calls = []
    monkeypatch.setattr(varlen_module, "varlen_attn", lambda *a, **kw: calls.append(kw) or _fake_varlen_attn(*a, **kw))
    docs = _docs([5, 9, 3, 7])
    q, k, v = _qkv(dtype=torch.bfloat16)
    cu = torch.tensor([0, 5, 14, 17, 24], dtype=torch.int32)
    # a CPU tensor with the real check: HF's pick
    got, _ = ta.training_attention_forward(_Module(), q, k, v, ta.TrainingMask(docs), scaling=0.25, cu_seq_lens_q=cu,
                                           max_length_q=9)
    ref = ta.attention_reference(q.double(), k.double(), v.double(), scaling=0.25, docs=docs)
    assert_bound("cpu", got, ta.attention_reference(q, k, v, scaling=0.25, docs=docs), ref, torch.bfloat16, ulps=2)
    monkeypatch.setattr(ta, "varlen_device", lambda device: True)
    assert isinstance(ta.varlen_plan(q, k, scaling=0.25, docs=docs, cu=cu, max_length=9), ta.VarlenPlan)
    reasons = {
        "position_ids only": ta.varlen_plan(q, k, scaling=0.25, docs=docs),
        "max_length a tensor": ta.varlen_plan(q, k, scaling=0.25, docs=docs, cu=cu, max_length=torch.tensor(9)),
        "softcap": ta.varlen_plan(q, k, scaling=0.25, softcap=50.0),
        "fp32": ta.varlen_plan(q.float(), k.float(), scaling=0.25),
        "head 12": ta.varlen_plan(q[..., :12], k[..., :12], scaling=0.25),
        "window on 2.10": ta.varlen_plan(q, k, scaling=0.25, window=4, params=frozenset({"is_causal"})),
        "scale on 2.10": ta.varlen_plan(q, k, scaling=0.3, params=frozenset({"is_causal"})),
        "no varlen_attn": ta.varlen_plan(q, k, scaling=0.25, params=frozenset()),
    }
    assert all(isinstance(r, str) and r for r in reasons.values()), reasons
    with torch.no_grad():
        for mask, kw in ((ta.TrainingMask(docs), {}), (ta.TrainingMask(docs), {"softcap": 2.0})):
            got, _ = ta.training_attention_forward(_Module(), q, k, v, mask, scaling=0.25, **kw)
            want = ta.attention_reference(q, k, v, scaling=0.25, docs=docs, softcap=kw.get("softcap"))
            torch.testing.assert_close(got, want, rtol=2**-7, atol=2**-7)
    assert not calls

CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled FlexAttention needs a CUDA GPU")


@CUDA
@pytest.mark.parametrize("spec", list(SPECS))
@pytest.mark.parametrize("dtype,head_dim", [(torch.bfloat16, 64), (torch.float32, 64), (torch.bfloat16, 256)])
def test_compiled_flex_forward_and_gradients_on_the_gpu(spec, dtype, head_dim):
    """The kernel the table picks on a GPU, forward and backward, at a length past two 128-blocks; head 256 runs
    FLEX_KERNEL_OPTIONS' tiles where the GPU has them."""
    lengths, window, softcap = SPECS[spec]
    t = 300
    if lengths:
        lengths = [90, 17, 130, 63]
    docs = _docs(lengths).cuda() if lengths else None
    window = 40 if window else None
    torch.manual_seed(0)
    q, k, v = (torch.randn(2 if docs is None else 1, h, t, head_dim, device="cuda", dtype=dtype, requires_grad=True)
               for h in (8, 2, 2))
    go = torch.randn(q.shape[0], t, 8, head_dim, device="cuda", dtype=dtype)
    scaling = head_dim ** -0.5
    out = ta.flex_attention_forward(q, k, v, scaling=scaling, docs=docs, window=window, softcap=softcap)
    got = [out, *torch.autograd.grad(out, (q, k, v), go)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    r = ta.attention_reference(q64, k64, v64, scaling=scaling, docs=docs, window=window, softcap=softcap)
    ref = [r, *torch.autograd.grad(r, (q64, k64, v64), go.double())]
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    mask = ta.dense_mask(docs, window, t, "cuda")
    hq = torch.nn.functional.scaled_dot_product_attention
    if softcap:
        td = ta.attention_reference(qd, kd, vd, scaling=scaling, docs=docs, window=window, softcap=softcap)
    else:
        td = hq(qd, kd, vd, attn_mask=mask, scale=scaling, enable_gqa=True).transpose(1, 2)
    tdt = [td, *torch.autograd.grad(td, (qd, kd, vd), go)]
    for name, a, b, rr in zip(("out", "dq", "dk", "dv"), got, tdt, ref):
        assert_bound(f"{spec} {name}", a, b, rr, dtype, ulps=ULPS)


VARLEN_GPU = pytest.mark.skipif(not torch.cuda.is_available() or not ta.varlen_parameters(),
                                reason="varlen_attn needs a CUDA GPU and a torch that has it")
ODD_LENGTHS = [1, 77, 130, 3, 255, 61]  # 527 tokens: a one-token example, lengths across 128-blocks


def _varlen_on_the_test_gpu(monkeypatch):
    """The table names varlen for every non-softcap kind on this GPU; returns the list its calls land in."""
    gpu = torch.cuda.get_device_name()
    kinds = ("causal", "packed", "sliding", "packed+sliding")
    monkeypatch.setattr(attention_table, "MEASURED", {(gpu, k): "varlen" for k in kinds})
    calls = []
    real = ta.varlen_attention_forward
    monkeypatch.setattr(ta, "varlen_attention_forward", lambda *a: calls.append(a[3]) or real(*a))
    return calls


@VARLEN_GPU
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("window", [None, 40])
def test_varlen_on_the_gpu_equals_the_examples_one_by_one(head_dim, window, monkeypatch):
    """A packed bf16 row (GQA 8/2, the collator's cu_seq_lens) through varlen_attn, forward and every gradient,
    against the examples run one by one through SDPA in bf16 (the baseline's error) and the fp64 spec."""
    import numpy as np
    import torch.nn.functional as F

    calls = _varlen_on_the_test_gpu(monkeypatch)
    t, scaling = sum(ODD_LENGTHS), head_dim ** -0.5
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, h, t, head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for h in (8, 2, 2))
    go = torch.randn(1, t, 8, head_dim, device="cuda", dtype=torch.bfloat16)
    cu = torch.tensor([0, *np.cumsum(ODD_LENGTHS)], dtype=torch.int32, device="cuda")
    docs = _docs(ODD_LENGTHS).cuda()
    out, _ = ta.training_attention_forward(_Module(), q, k, v, ta.TrainingMask(docs, window), scaling=scaling,
                                           cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=max(ODD_LENGTHS),
                                           max_length_k=max(ODD_LENGTHS))
    assert len(calls) == 1 and calls[0].max_length == 255
    got = [out, *torch.autograd.grad(out, (q, k, v), go)]
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    outs = []
    for a, b in zip(cu[:-1].tolist(), cu[1:].tolist()):
        mask = ta.dense_mask(None, window, b - a, "cuda") if window else None
        outs.append(F.scaled_dot_product_attention(qd[:, :, a:b], kd[:, :, a:b], vd[:, :, a:b], attn_mask=mask,
                                                   is_causal=mask is None, scale=scaling, enable_gqa=True))
    one_by_one = torch.cat(outs, 2).transpose(1, 2)
    base = [one_by_one, *torch.autograd.grad(one_by_one, (qd, kd, vd), go)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    r = ta.attention_reference(q64, k64, v64, scaling=scaling, docs=docs, window=window)
    ref = [r, *torch.autograd.grad(r, (q64, k64, v64), go.double())]
    for name, a, b, rr in zip(("out", "dq", "dk", "dv"), got, base, ref):
        assert_bound(f"varlen head {head_dim} window {window} {name}", a, b, rr, torch.bfloat16, ulps=8)


@VARLEN_GPU
def test_varlen_on_the_gpu_for_sliding_rows_without_documents(monkeypatch):
    """Two unpacked rows with a window: cu from the shapes (no collator kwargs), against SDPA's dense mask."""
    import torch.nn.functional as F

    calls = _varlen_on_the_test_gpu(monkeypatch)
    torch.manual_seed(1)
    q, k, v = (torch.randn(2, h, 300, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for h in (8, 2, 2))
    go = torch.randn(2, 300, 8, 64, device="cuda", dtype=torch.bfloat16)
    out, _ = ta.training_attention_forward(_Module(), q, k, v, ta.TrainingMask(None, 40), scaling=0.125)
    assert len(calls) == 1 and calls[0].cu.tolist() == [0, 300, 600]
    got = [out, *torch.autograd.grad(out, (q, k, v), go)]
    qd, kd, vd = (x.detach().clone().requires_grad_() for x in (q, k, v))
    sd = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=ta.dense_mask(None, 40, 300, "cuda"), scale=0.125,
                                        enable_gqa=True).transpose(1, 2)
    base = [sd, *torch.autograd.grad(sd, (qd, kd, vd), go)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    r = ta.attention_reference(q64, k64, v64, scaling=0.125, window=40)
    ref = [r, *torch.autograd.grad(r, (q64, k64, v64), go.double())]
    for name, a, b, rr in zip(("out", "dq", "dk", "dv"), got, base, ref):
        assert_bound(f"sliding {name}", a, b, rr, torch.bfloat16, ulps=8)


@VARLEN_GPU
def test_a_packed_bf16_llama_runs_varlen_in_every_layer(monkeypatch):
    """tigon.patch on a tiny bf16 Llama fed TRL's padding-free batch (position_ids, cu_seq_lens, max_length): every
    layer runs varlen_attn, and each example's loss is the loss of that example run alone unpatched."""
    from transformers import DataCollatorWithFlattening

    import tigon

    from ._tiny import tiny_model

    calls = _varlen_on_the_test_gpu(monkeypatch)
    model = tiny_model("llama").cuda().to(torch.bfloat16).eval()
    alone = tiny_model("llama").cuda().to(torch.bfloat16).eval()
    alone32 = tiny_model("llama").cuda().eval()  # the reference: fp32, one example at a time
    for m in (alone, alone32):
        m.config._attn_implementation = "sdpa"
    tigon.patch(model, rms_norm=False, swiglu=False, rope=False, fused_linear_cross_entropy=False, attention=True)
    g = torch.Generator().manual_seed(0)
    examples = [torch.randint(0, 131, (n,), generator=g) for n in (5, 17, 3, 9)]
    batch = DataCollatorWithFlattening(return_tensors="pt", return_flash_attn_kwargs=True)(
        [{"input_ids": e.tolist()} for e in examples])
    batch = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    with torch.no_grad():
        packed = model(**{k: v for k, v in batch.items() if k != "labels"}).logits[0].float()
        want = torch.cat([alone(input_ids=e[None].cuda()).logits[0] for e in examples]).float()
        ref = torch.cat([alone32(input_ids=e[None].cuda()).logits[0] for e in examples])
    assert len(calls) == model.config.num_hidden_layers
    assert_bound("packed logits", packed, want, ref, torch.bfloat16, ulps=8)
