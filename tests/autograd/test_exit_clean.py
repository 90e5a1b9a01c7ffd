"""Vocab-parallel linear_log_probs forward+backward over gloo exits cleanly (issue 35).

torch keeps a tensor's Python object alive while C++ also holds the tensor, and releases it, under
the GIL, when the C++ references fall from two to one. A gloo worker thread (``pt_gloo_runloop``)
holds a finished collective's Work, and through it the tensors, a while after ``wait()`` returns;
with the synchronous ``dist.all_gather`` / ``all_reduce`` of ``autograd/vocab_parallel.py`` it was
often the last holder, and a worker that asks for the GIL just before the interpreter finalizes is
ended inside the Work's destructor: "terminate called without an active exception", SIGABRT (12 of
30 runs on a loaded 2-core machine). ``vocab_parallel.collective`` is the fix.

One Python process imports torch and rl_kernels once and forks the two ranks of each run
(``gc.freeze()`` keeps the children's finalization cheap); each rank exits through the
interpreter's normal finalization and the parent checks its exit status. What makes the race
likely, independent of the machine's other load: each rank's threads share one core and gloo's
workers run at nice 19, so a worker is often still holding the last Work when the backward ends;
then the main thread moves to the other core, which lets that worker run at once and ask for the
GIL, while the main thread keeps the GIL (20 ms of pure Python, switch interval 50 ms, no torch op
to release it) and exits. Busy-loop processes were tried and lowered the abort rate (they delay the
main thread as much as the worker). Measured on the 2-core dev machine (2026-11-26, other test runs
going on): without the fix 63 of 200 runs aborted (4 and 5 of 50 in quieter minutes); with it 0 of
500; 100 runs take 30 s there.
"""
import os
import subprocess
import sys
import time

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUNS = 100

pytest.importorskip("torch.distributed")
pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="fork, sched_setaffinity and /proc: Linux only")

SCRIPT = r'''
import datetime, gc, os, shutil, sys, tempfile, time, traceback

import torch
import torch.distributed as dist

from rl_kernels import linear_log_probs


def rank_main(rank, init_file):
    cpus = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cpus[rank % len(cpus)]})  # this rank's threads (made below) share one core
    sys.setswitchinterval(0.05)
    dist.init_process_group("gloo", init_method="file://" + init_file, rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=60))
    for tid in os.listdir("/proc/self/task"):  # gloo's workers run late (nice 19)
        with open(f"/proc/self/task/{tid}/comm") as f:
            if f.read().strip() == "pt_gloo_runloop":
                os.setpriority(os.PRIO_PROCESS, int(tid), 19)
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 8, generator=g).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(11, 8, generator=g)).bfloat16()
    labels = torch.randint(0, 11, (6,), generator=g)
    shard = (weight[:5] if rank == 0 else weight[5:]).clone().requires_grad_()
    # three collectives: the shard sizes (no vocab_start_index), the merge, the float32 dh all-reduce
    out = linear_log_probs(hidden, shard, labels, backend="torch", process_group=dist.group.WORLD,
                           reduce_hidden_grad=True)
    (out.log_probs.sum() + out.entropy.sum()).backward()
    assert torch.isfinite(hidden.grad.float()).all() and torch.isfinite(shard.grad.float()).all()
    # the main thread leaves the workers' core, so that a worker still holding a finished Work
    # runs now, and wants the GIL, while the main thread keeps it (no torch op, which would
    # release it) for 20 ms and then exits
    os.sched_setaffinity(0, {cpus[(rank + 1) % len(cpus)]})
    end = time.perf_counter() + 0.02
    while time.perf_counter() < end:
        pass


def reap(pid, deadline):
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            return "timeout"
        time.sleep(0.005)


runs = int(sys.argv[1])
tmp = tempfile.mkdtemp()
gc.freeze()
failed = []
for i in range(runs):
    init_file = os.path.join(tmp, f"init{i}")
    pids = []
    for rank in range(2):
        pid = os.fork()
        if pid == 0:  # a rank: run, then the interpreter's normal exit (what is tested)
            try:
                rank_main(rank, init_file)
            except BaseException:
                traceback.print_exc()
                os._exit(3)
            sys.exit(0)
        pids.append(pid)
    deadline = time.monotonic() + 120
    codes = [reap(pid, deadline) for pid in pids]
    if codes != [0, 0]:
        failed.append((i, codes))
        print("run", i, "exit codes", codes, flush=True)
shutil.rmtree(tmp, ignore_errors=True)
print("FAILED", len(failed), "OF", runs, failed, flush=True)
'''


def run_script(tmp_path, runs, pythonpath=REPO):
    """(CompletedProcess, wall seconds) of ``runs`` runs of SCRIPT, importing rl_kernels from ``pythonpath``."""
    script = tmp_path / "exit_clean.py"
    script.write_text(SCRIPT)
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1", "PYTHONPATH": pythonpath}
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script), str(runs)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=900)
    return proc, time.monotonic() - t0


def test_vocab_parallel_backward_exits_cleanly(tmp_path):
    proc, _ = run_script(tmp_path, RUNS)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"FAILED 0 OF {RUNS}" in proc.stdout, (proc.stdout[-2000:], proc.stderr[-3000:])


# python tests/autograd/test_exit_clean.py RUNS [PYTHONPATH of another rl_kernels]: the counts
if __name__ == "__main__":
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        proc, wall = run_script(pathlib.Path(d), int(sys.argv[1]), *sys.argv[2:3])
    print(proc.stdout.splitlines()[-1] if proc.stdout else proc.stderr[-3000:], f"({wall:.0f} s)")
