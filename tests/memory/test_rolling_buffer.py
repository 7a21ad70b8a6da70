import threading

import pytest
import torch

from tigon.memory import RollingBuffer, workspace

SPECS = [((3, 5), torch.float32), ((7,), torch.bfloat16), ((2, 3, 4), torch.float16), (9, torch.int64),
         ((), torch.float64), ((4,), torch.bool), ((1, 3), torch.complex64), ((5,), torch.uint8)]


def _span(t):
    return t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()


def _disjoint(views):
    spans = sorted(_span(v) for v in views if v.numel())
    return all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))


def test_shapes_dtypes_alignment(device):
    ws = RollingBuffer(device, alignment=256)
    with ws.borrow(*SPECS) as views:
        assert len(views) == len(SPECS)
        for v, (shape, dtype) in zip(views, SPECS, strict=True):
            assert v.shape == ((shape,) if isinstance(shape, int) else shape) and v.dtype == dtype
            assert v.device.type == device.type and v.is_contiguous() and v.data_ptr() % 256 == 0
        assert _disjoint(views)
    with ws.borrow((torch.Size([4, 4]), torch.float32)) as (a,):
        assert a.shape == (4, 4)


@pytest.mark.parametrize("alignment", [16, 1024])
def test_other_alignments(device, alignment):
    ws = RollingBuffer(device, alignment=alignment)
    with ws.borrow((3, torch.uint8), (3, torch.float64), (1, torch.complex128)) as views:
        assert all(v.data_ptr() % alignment == 0 for v in views) and _disjoint(views)


def test_simultaneous_loans_independent(device):
    ws = RollingBuffer(device)
    with ws.borrow(((4, 33), torch.float32), ((4, 33), torch.float32)) as (a, b):
        x = torch.randn(4, 33, device=device)
        torch.matmul(x, torch.eye(33, device=device), out=a)  # a kernel writing into a loan
        b.fill_(2.0)
        torch.testing.assert_close(a, x)
        assert bool((b == 2.0).all())
        with ws.borrow(((33,), torch.float32)) as (c,):
            c.fill_(-1.0)
            torch.testing.assert_close(a, x)
            assert bool((b == 2.0).all())


def test_returned_on_exception_and_nesting_stacks(device):
    ws = RollingBuffer(device, size_hint_bytes=4096)
    with pytest.raises(KeyError):
        with ws.borrow((10, torch.float32)):
            raise KeyError("boom")
    assert ws.stats()["in_use_bytes"] == 0 and ws.stats()["active_borrows"] == 0
    with ws.borrow((10, torch.float32)) as (a,):
        with ws.borrow((10, torch.float32)) as (b,):
            assert b.data_ptr() == a.data_ptr() + 256  # stacked right above the outer loan
            assert ws.stats()["in_use_bytes"] == 512
        with ws.borrow((3, torch.int32)) as (c,):
            assert c.data_ptr() == b.data_ptr()  # the inner loan's slot is reused
    assert ws.stats()["in_use_bytes"] == 0


def test_growth_keeps_lent_views_valid(device):
    ws = RollingBuffer(device, size_hint_bytes=1024)
    with ws.borrow(((8, 16), torch.float32)) as (a,):
        a.copy_(torch.arange(128.0, device=device).view(8, 16))
        first = ws.stats()["reserved_bytes"]
        with ws.borrow(((64, 64), torch.float32)) as (big,):  # 16 KiB does not fit in 1 KiB: grow
            s = ws.stats()
            assert s["grows"] == 2 and s["blocks"] == 2 and s["reserved_bytes"] > first
            big.fill_(7.0)
            torch.testing.assert_close(a, torch.arange(128.0, device=device).view(8, 16))
            assert _disjoint([a, big])
        with ws.borrow((4, torch.float32)) as (c,):  # the next borrow uses the new block
            assert not (_span(a)[0] <= c.data_ptr() < _span(a)[1])
    s = ws.stats()
    assert s["blocks"] == 1 and s["in_use_bytes"] == 0  # the outgrown block went with its last loan
    assert s["reserved_bytes"] >= 128 * 4 + 64 * 64 * 4


def _step(ws, device, n):
    """A training-like step: outer logits chunk, nested fp32 vectors, a second chunk of another size."""
    ptrs = []
    with ws.borrow(((n, 50), torch.bfloat16), ((n,), torch.float32)) as (logits, lse):
        ptrs += [logits.data_ptr(), lse.data_ptr()]
        with ws.borrow(((n,), torch.float32), ((n, 3), torch.float32)) as (m, g):
            ptrs += [m.data_ptr(), g.data_ptr()]
    with ws.borrow(((2 * n, 70), torch.float32)) as (x,):
        ptrs.append(x.data_ptr())
    return ptrs


def test_stable_addresses_after_warmup(device):
    ws = RollingBuffer(device)
    _step(ws, device, 17)
    _step(ws, device, 17)
    grows, ptrs = ws.stats()["grows"], _step(ws, device, 17)
    for _ in range(3):
        assert _step(ws, device, 17) == ptrs
    assert ws.stats()["grows"] == grows
    assert _step(ws, device, 5)[0] == ptrs[0]  # a smaller step fits in place, no growth
    assert ws.stats()["grows"] == grows


def test_threads_get_disjoint_memory(device):
    ws, n, barrier, errors = RollingBuffer(device), 8, threading.Barrier(8), []
    views = [None] * n

    def work(i):
        try:
            for r in range(20):
                with ws.borrow(((31 + i,), torch.float32), ((i + 1, 3), torch.int32)) as (a, b):
                    a.fill_(float(i))
                    b.fill_(i)
                    views[i] = (a, b)
                    barrier.wait()  # all 8 loans are out at once here
                    if r == 0 and i == 0:
                        assert _disjoint([v for pair in views for v in pair])
                    barrier.wait()
                    assert bool((a == i).all()) and bool((b == i).all())
        except Exception as e:  # surfaced in the main thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors
    s = ws.stats()
    assert s["in_use_bytes"] == 0 and s["active_borrows"] == 0 and s["loans"] == 2 * 20 * n


def test_stats_accounting(device):
    ws = RollingBuffer(device, size_hint_bytes=1000)
    s = ws.stats()
    assert (s["reserved_bytes"] >= 1000 and s["grows"] == 1 and s["loans"] == 0 and s["in_use_bytes"] == 0)
    with ws.borrow((10, torch.float32), (300, torch.uint8)):  # 256 + 512 bytes with alignment
        assert ws.stats()["in_use_bytes"] == 768
    with ws.borrow((10, torch.float32)):
        with ws.borrow((2000, torch.uint8)):  # grows
            assert ws.stats()["in_use_bytes"] == 256 + 2048
    s = ws.stats()
    assert s["loans"] == 4 and s["allocations_avoided"] == 3 and s["grows"] == 2
    assert s["peak_in_use_bytes"] == 2304 and s["in_use_bytes"] == 0
    ws.reset_peak()
    assert ws.stats()["peak_in_use_bytes"] == 0


def test_release(device):
    ws = RollingBuffer(device, size_hint_bytes=4096)
    with ws.borrow((10, torch.float32)):
        with pytest.raises(RuntimeError, match=r"RollingBuffer\.release: 1 loan"):
            ws.release()
    ws.release()
    assert ws.stats()["reserved_bytes"] == 0 and ws.stats()["blocks"] == 0
    with ws.borrow((10, torch.float32)) as (a,):  # usable again after release
        a.fill_(1.0)
    assert ws.stats()["grows"] == 2


def test_reserve(device):
    ws = RollingBuffer(device)
    ws.reserve(10_000)
    with ws.borrow((2000, torch.float32), ((10, 10), torch.float64)), ws.borrow((100, torch.uint8)):
        pass
    assert ws.stats()["grows"] == 1
    ws.reserve(5000)  # already fits: no growth
    assert ws.stats()["grows"] == 1
    with pytest.raises(ValueError, match=r"RollingBuffer\.reserve: nbytes"):
        ws.reserve(-5)


def test_a_block_over_keep_bytes_goes_back_when_its_last_loan_returns(device):
    """A fused loss's chunk of logits is not held through the backward pass: a block larger than keep_bytes is
    freed when its last loan returns (a block that still holds a loan stays); one within
    keep_bytes stays, with its addresses; reserve() keeps what it asks for."""
    ws = RollingBuffer(device, keep_bytes=4096)
    with ws.borrow((256, torch.float32)) as (small,):  # 1 KiB: kept
        first = small.data_ptr()
    assert ws.stats()["blocks"] == 1
    with ws.borrow((256, torch.float32)) as (small,):
        assert small.data_ptr() == first and ws.stats()["grows"] == 1
    with ws.borrow((4096, torch.float32)) as (big,):  # 16 KiB: the arena grows past keep_bytes
        assert ws.stats()["grows"] == 2 and ws.stats()["blocks"] == 1  # the idle 1 KiB block is freed on growth
        with ws.borrow((256, torch.float32)) as (inner,):  # does not fit: a third block, the second retired
            big.fill_(1.0)
            inner.fill_(2.0)
            assert ws.stats()["grows"] == 3 and ws.stats()["blocks"] == 2
        assert ws.stats()["blocks"] == 1 and ws.stats()["reserved_bytes"] >= 16384  # the outer loan's block stays
    stats = ws.stats()
    assert stats["blocks"] == 0 and stats["reserved_bytes"] == 0 and stats["in_use_bytes"] == 0
    with ws.borrow((4096, torch.float32)) as (big,):  # the next call takes a block again
        big.fill_(2.0)
    assert ws.stats()["grows"] == 4 and ws.stats()["blocks"] == 0
    ws.reserve(1 << 16)  # asked for: kept between loans from now on
    assert ws.keep_bytes == 1 << 16
    with ws.borrow((4096, torch.float32)):
        pass
    assert ws.stats()["blocks"] == 1 and ws.stats()["grows"] == 5
    hinted = RollingBuffer(device, size_hint_bytes=1 << 15, keep_bytes=0)
    with hinted.borrow((4096, torch.float32)):
        pass
    assert hinted.keep_bytes == 1 << 15 and hinted.stats()["blocks"] == 1 and hinted.stats()["grows"] == 1


def test_zero_size_loans(device):
    ws = RollingBuffer(device)
    with ws.borrow(((0, 5), torch.float32), (0, torch.bfloat16)) as (a, b):
        assert a.shape == (0, 5) and b.shape == (0,) and b.dtype == torch.bfloat16
    assert ws.stats()["reserved_bytes"] == 0 and ws.stats()["grows"] == 0  # nothing allocated
    with ws.borrow((3, torch.float32), ((4, 0), torch.float32), (3, torch.float32)) as (x, z, y):
        assert z.shape == (4, 0) and y.data_ptr() == x.data_ptr() + 256
        assert ws.stats()["in_use_bytes"] == 512


@pytest.mark.parametrize("spec,exc,match", [
    (((-1, 4), torch.float32), ValueError, "shape must not be negative"),
    (((2, 4), "float32"), TypeError, "dtype must be a torch.dtype"),
    (((2, 4), torch.ones(1)), TypeError, "dtype must be a torch.dtype"),
    (((2.5, 4), torch.float32), TypeError, "shape must be an int or a sequence of ints"),
    (((True, 4), torch.float32), TypeError, "shape must be an int or a sequence of ints"),
    (("ab", torch.float32), TypeError, "shape must be an int"),
    ((torch.float32,), TypeError, r"must be a \(shape, dtype\) pair"),
])
def test_bad_specs(device, spec, exc, match):
    ws = RollingBuffer(device)
    with pytest.raises(exc, match=rf"RollingBuffer\.borrow: spec 0.*{match}"):
        ws.borrow(spec)
    assert ws.stats()["loans"] == 0


@pytest.mark.parametrize("kw,match", [
    (dict(size_hint_bytes=-1), "size_hint_bytes"), (dict(size_hint_bytes=1.5), "size_hint_bytes"),
    (dict(alignment=100), "alignment"), (dict(alignment=8), "alignment"), (dict(alignment=True), "alignment"),
    (dict(keep_bytes=-1), "keep_bytes"), (dict(keep_bytes=True), "keep_bytes"), (dict(keep_bytes=2.0), "keep_bytes"),
])
def test_bad_constructor_args(device, kw, match):
    with pytest.raises(ValueError, match=rf"RollingBuffer: {match}"):
        RollingBuffer(device, **kw)


def test_loan_object_reuse_and_inference_mode(device):
    ws = RollingBuffer(device)
    loan = ws.borrow((4, torch.float32))
    with loan:
        with pytest.raises(RuntimeError, match="already active"):
            loan.__enter__()
    with torch.inference_mode():  # the block is created here, but must not be an inference tensor
        with ws.borrow((4, torch.float32)) as (a,):
            a.fill_(1.0)
    x = torch.ones(4, device=device, requires_grad=True)
    with ws.borrow((4, torch.float32)) as (a,):
        a.fill_(3.0)
        (x * a).sum().backward()
    assert bool((x.grad == 3.0).all())


def test_workspace_is_one_per_device():
    assert workspace("cpu") is workspace(torch.device("cpu")) is workspace("cpu:0")
    arenas = []
    threads = [threading.Thread(target=lambda: arenas.append(workspace("cpu"))) for _ in range(8)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert all(a is arenas[0] for a in arenas) and arenas[0] is workspace("cpu")
    with workspace("cpu").borrow(((2, 2), torch.float32)) as (a,):
        assert a.shape == (2, 2)


@pytest.mark.gpu
def test_cuda_graph_capture_after_warmup():
    ws, x = RollingBuffer("cuda"), torch.randn(64, 128, device="cuda")
    w = torch.randn(256, 128, device="cuda")
    out = torch.empty(64, device="cuda")

    def step():
        with ws.borrow(((64, 256), torch.bfloat16), ((64,), torch.float32)) as (logits, lse):
            torch.matmul(x.bfloat16(), w.bfloat16().T, out=logits)
            torch.logsumexp(logits.float(), dim=-1, out=lse)
            out.copy_(lse)

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: the arena grows here, outside capture
    torch.cuda.current_stream().wait_stream(s)
    grows, g = ws.stats()["grows"], torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        step()
    x.copy_(torch.randn_like(x))
    g.replay()
    torch.cuda.synchronize()
    expected = torch.logsumexp((x.bfloat16() @ w.bfloat16().T).float(), dim=-1)
    torch.testing.assert_close(out, expected)
    assert ws.stats()["grows"] == grows


def test_pinned_buffers_keep_their_address_until_release():
    # A pinned buffer is the same tensor for every request that fits, a bigger (doubled, zero-filled) one when a
    # request does not, the outgrown one still held (a captured graph may write it), and all dropped by release().
    ws = RollingBuffer("cpu")
    a = ws.pinned("t.counters", 10, torch.int32, zeros=True)
    assert not a.any() and ws.pinned("t.counters", 7, torch.int32, zeros=True) is a
    assert ws.pinned("t.counters", 10, torch.float32) is not a  # keyed by dtype too
    b = ws.pinned("t.counters", 15, torch.int32, zeros=True)
    assert b.numel() == 20 and not b.any()
    st = ws.stats()
    assert (st["pinned_calls"], st["pinned_hits"]) == (4, 1)
    assert st["pinned_bytes"] == 10 * 4 + 10 * 4 + 20 * 4
    with ws.borrow(((4,), torch.float32)):
        pass
    ws.release()
    assert ws.stats()["pinned_bytes"] == 0 and ws.pinned("t.counters", 1, torch.int32) is not b
