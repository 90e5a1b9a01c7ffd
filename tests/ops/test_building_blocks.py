"""``ops.building_blocks``' K loop with the partials promoted (``PROMOTE_EVERY`` > 0, the issue 54
item 4 experiment): set before the first launch in a fresh interpreter process, the head's
log-probs and entropy stay within the float32 rounding bound of float64, and differ from the
one-accumulator loop's (so the grouped loop is the one that ran)."""
import os
import subprocess
import sys

import torch

from tolerances import assert_close_f32, head_magnitude

from rl_kernels.tools.reference import make_inputs, reference_linear_log_probs

N, H, V, T = 37, 200, 301, 0.8
SNIPPET = """
import sys, torch, triton.language as tl
from rl_kernels.ops import building_blocks
building_blocks.PROMOTE_EVERY = tl.constexpr(int(sys.argv[1]))
import rl_kernels
from rl_kernels.tools.reference import make_inputs
hidden, weight, labels = make_inputs({n}, {h}, {v}, torch.float32, seed=4)
out = rl_kernels.linear_log_probs(hidden, weight, labels, temperature={t}, backend="triton")
torch.save((out.log_probs, out.entropy), sys.argv[2])
"""


def _run(promote: int, path: str):
    env = dict(os.environ, TRITON_INTERPRET="1")
    subprocess.run([sys.executable, "-c", SNIPPET.format(n=N, h=H, v=V, t=T), str(promote), path], env=env,
                   check=True, timeout=300)
    return torch.load(path)


def test_promoted_k_loop_within_the_float32_bound(tmp_path):
    promoted = _run(3, str(tmp_path / "promoted.pt"))  # 3 K steps per group: H is not a multiple of a group
    plain = _run(0, str(tmp_path / "plain.pt"))
    hidden, weight, labels = make_inputs(N, H, V, torch.float32, seed=4)
    ref_lp, ref_ent, _ = reference_linear_log_probs(hidden, weight, labels, temperature=T)
    scale = head_magnitude(hidden, weight, T)
    assert_close_f32(promoted[0], ref_lp, depth=H + V, logits=scale, msg="log_probs")
    assert_close_f32(promoted[1], ref_ent, depth=H + V, logits=scale, msg="entropy")
    assert not torch.equal(promoted[0], plain[0])
