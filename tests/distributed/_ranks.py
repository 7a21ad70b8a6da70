"""Launching and reaping the CPU ranks of the distributed tests (gloo, kernels through Triton's interpreter)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
_NUMPY = tuple(int(part) for part in __import__("numpy").__version__.split(".")[:2])

SKIPS = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
    # the ranks run the kernels through Triton 3.6's interpreter, which breaks on numpy >= 2.4 ("only 0-dimensional
    # arrays can be converted to Python scalars"); CI pins numpy<2.4, a GPU image may not
    pytest.mark.skipif(_NUMPY >= (2, 4), reason="Triton 3.6's interpreter needs numpy < 2.4"),
]


def launch(worker, tmp_path, world, **env_extra):
    """Start `world` ranks of `worker` like torchrun would (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE),
    rendezvous through a FileStore under tmp_path (TIGON_DIST_STORE): no port. Returns [(process, log)]."""
    procs = []
    for rank in range(world):
        env = dict(
            os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
            TIGON_DIST_STORE=str(tmp_path / "store"), TRITON_INTERPRET="1", OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
            PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
            **env_extra,
        )
        log = open(tmp_path / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(worker), str(tmp_path)], env=env, cwd=ROOT,
                                       stdout=log, stderr=subprocess.STDOUT), log))
    return procs


def wait(procs, tmp_path, what, timeout=240):
    """Wait for every rank; fail the test with the tail of each failed rank's log."""
    failed = []
    try:
        for rank, (proc, log) in enumerate(procs):
            proc.wait(timeout=timeout)
            log.close()
            if proc.returncode != 0:
                failed.append(rank)
    finally:
        for proc, log in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            log.close()
    if failed:
        logs = "\n".join(f"--- rank {r} ---\n{(tmp_path / f'rank{r}.log').read_text()[-4000:]}" for r in failed)
        pytest.fail(f"{what} ranks {failed} failed:\n{logs}")


def exit_without_finalization() -> None:
    """End a rank that has written its results: flush and leave without the interpreter's finalization. Gloo's
    worker threads can still hold work objects then, whose destruction needs the GIL of a dying interpreter and
    aborts the process ("terminate called without an active exception"; CI hit it twice in ~10 runs, after the
    ranks' work and their barrier; pytorch/pytorch#179291 describes the mechanism)."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
