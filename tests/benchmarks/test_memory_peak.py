"""benchmarks/tools/memory_peak.py on a synthetic allocator trace: the replay finds the largest moment and the
blocks live there, summed by the allocating site inside our code."""

from benchmarks.tools import memory_peak


def _ev(action, addr, size, where):
    frames = [{"filename": "/usr/lib/torch/functional.py", "line": 1, "name": "linear"},
              {"filename": f"/x/tigon/{where}.py", "line": 7, "name": where}]
    return dict(action=action, addr=addr, size=size, frames=frames)


def test_the_peak_and_its_live_blocks_by_site():
    trace = [_ev("alloc", 1, 100, "a"), _ev("alloc", 2, 50, "b"), _ev("free_requested", 1, 100, "a"),
             _ev("alloc", 3, 30, "b"), _ev("alloc", 4, 40, "b"),  # block 1 is no longer allocated here
             _ev("free_completed", 1, 100, "a"),  # reusable from here (a second stream was past it)
             _ev("free_requested", 9, 1000, "old"),  # a block allocated before the recording: ignored
             _ev("free_requested", 3, 30, "b")]
    peak, at, live = memory_peak.replay(trace)
    assert (peak, at) == (150, 1) and set(live) == {1, 2}
    assert memory_peak.replay(trace[:5])[0] == 150  # 50 + 30 + 40 = 120 after the free: still 150 at its peak
    report = memory_peak.peak_report({"device_traces": [trace]}, top=1)
    assert report["peak_bytes"] == 150 and report["sites"] == [("a.py:7 a", 100)] and report["other_bytes"] == 50
    assert report["at"] == "b.py:7 b"
    assert "| a.py:7 a | 0.000 |" in memory_peak.text(report)


def test_a_site_outside_our_code_is_the_innermost_frame():
    assert memory_peak.site([{"filename": "/t/torch/x.py", "line": 3, "name": "f"}]) == "x.py:3 f"
    assert memory_peak.site([]) == "(no stack)"
