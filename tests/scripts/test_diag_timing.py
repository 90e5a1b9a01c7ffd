"""Scripts that time collectives call them the same number of times on every rank (never
``triton.testing.do_bench``, whose repeat count each rank picks from its own timing: ranks that
disagree hang). On the CPU with gloo: rl_kernels.tools.diag.slowest_rank_ms with ranks of
different speed, and scripts/diag/tp_bench.py end to end (torch backend, timing included)."""
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIAG = os.path.join(REPO, "scripts", "diag")

pytest.importorskip("torch.distributed")


def _torchrun(args, tmp_path, timeout=300):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                           *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=timeout)


AGREE = """
import datetime, time
import torch, torch.distributed as dist
from rl_kernels.tools.diag import slowest_rank_ms

dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
rank = dist.get_rank()
calls = [0]

def fn():  # a collective in every call; rank 1 is slower
    calls[0] += 1
    time.sleep(0.002 * (1 + 4 * rank))
    dist.all_reduce(torch.ones(4))

cpu = torch.device("cpu")
for iters in (7, None):
    calls[0] = 0
    ms = slowest_rank_ms(fn, cpu, warmup=2, iters=iters, rep_ms=30.0)
    every = [None, None]
    dist.all_gather_object(every, (calls[0], ms))
    if rank == 0:
        print("RESULT", iters, every)
dist.destroy_process_group()
"""


def test_slowest_rank_ms_agrees_over_ranks(tmp_path):
    script = tmp_path / "agree.py"
    script.write_text(AGREE)
    proc = _torchrun([str(script)], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            iters, rest = line[len("RESULT "):].split(" ", 1)
            results[iters] = eval(rest)  # noqa: S307 - our own printout
    assert set(results) == {"7", "None"}
    for iters, ((calls0, ms0), (calls1, ms1)) in results.items():
        assert calls0 == calls1, results  # the same number of collectives on both ranks
        assert ms0 == ms1 >= 10.0, results  # rank 1's time (sleeps 10 ms), reported on both
    assert results["7"][0][0] == 2 + 7  # warm-up + timed; the agreed count adds one estimate call
    assert results["None"][0][0] == 2 + 1 + 5  # 30 ms at >= 10 ms per call: at most 3, so the minimum, 5


@pytest.mark.parametrize("iters", [["--iters", "3"], []])
def test_tp_bench_on_cpu(tmp_path, iters):
    proc = _torchrun([os.path.join(DIAG, "tp_bench.py"), "64,32,101", "--cpu", *iters], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout
    assert "CPU, 2 ranks, gloo, 64x32x101 bf16, shards [0, 50, 101]" in out
    assert "identical bits on all ranks: log_probs True, entropy True, dh True" in out
    assert "logits_stats on a logits shard: identical on all ranks True" in out
    assert "one process unsharded: cuBLAS mm" in out
    assert "2 CPU ranks vocab-parallel: fwd" in out and "with the partial dh" in out
