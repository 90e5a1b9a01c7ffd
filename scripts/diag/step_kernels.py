"""Where a ``linear_log_probs`` forward+backward spends its GPU time, kernel by kernel.

python scripts/diag/step_kernels.py [--programs-per-sm K] [N,H,V ...]

One ``torch.profiler`` trace of 3 steps (after 2 warm-up steps) per shape; GPU kernel time summed
by kernel name (cuBLAS kernels grouped by their shape class), per step, as a multiple of one
cuBLAS ``hidden @ W.T`` of the same shape timed in the same run.
"""
import collections
import dataclasses

import torch
import triton.testing
from torch.profiler import ProfilerActivity, profile

from rl_kernels.tools import diag

STEPS = 3


def main():
    parser = diag.parser(__doc__, shapes=["4096,3584,152064", "32768,4096,128256"])
    parser.add_argument("--programs-per-sm", type=int, default=None,
                        help="the backward's persistent programs per SM (default: the shipped configuration's)")
    args = diag.start(parser, full_precision_bf16=True)
    ops = diag.ops
    cfg = ops.CUDA_CONFIG
    if args.programs_per_sm is not None:
        cfg = dataclasses.replace(cfg, bwd_programs_per_sm=args.programs_per_sm)
    for n, h, v in args.shapes:
        hid, w, lab, g_lp, g_ent = diag.head_inputs(n, h, v)
        t_mm = triton.testing.do_bench(lambda: hid @ w.T, rep=300, return_mode="median")
        step, hg, wg = diag.head_step(hid, w, lab, g_lp, g_ent)

        with ops.forced_config(cfg):
            for _ in range(2):
                step()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            start.record()
            for _ in range(STEPS):
                step()
            end.record()
            torch.cuda.synchronize()
            wall = start.elapsed_time(end) / STEPS
            t_bench = triton.testing.do_bench(step, rep=500, return_mode="median")
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(STEPS):
                    step()
                torch.cuda.synchronize()
        per_name = collections.defaultdict(lambda: [0.0, 0])
        runtime = collections.defaultdict(lambda: [0.0, 0])
        for evt in prof.events():
            if evt.device_type == torch.autograd.DeviceType.CPU and evt.name.startswith("cuda"):
                runtime[evt.name][0] += evt.cpu_time_total / 1e3 / STEPS
                runtime[evt.name][1] += 1
            if evt.device_type == torch.autograd.DeviceType.CUDA:
                name = evt.name
                key = name if len(name) < 70 else name[:67] + "..."
                per_name[key][0] += evt.device_time_total / 1e3 / STEPS
                per_name[key][1] += 1
        total = sum(t for t, _ in per_name.values())
        kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                         if e.device_type == torch.autograd.DeviceType.CUDA)
        gaps = sorted(((b[0] - a[1]) / 1e3, a[2][:40], b[2][:40]) for a, b in zip(kernels, kernels[1:]))
        idle = sum(g for g, _, _ in gaps) / STEPS
        print(f"\n{n}x{h}x{v}: cuBLAS mm {t_mm:.2f} ms; step (events, no profiler) {wall:.2f} ms = "
              f"{wall / t_mm:.3f}x mm; do_bench (L2 flushed before each step) {t_bench / t_mm:.3f}x mm; "
              f"GPU kernel time per step {total:.2f} ms = {total / t_mm:.3f}x mm")
        print(f"  GPU idle between kernels (profiled run): {idle:.2f} ms per step; largest gaps:")
        for gap, before, after in gaps[::-1][:6]:
            print(f"    {gap:7.3f} ms after {before} before {after}")
        for name, (t, count) in sorted(runtime.items(), key=lambda kv: -kv[1][0])[:6]:
            print(f"  host {name:40s} {t:8.3f} ms per step in {count // STEPS} calls")
        for key, (t, count) in sorted(per_name.items(), key=lambda kv: -kv[1][0]):
            if t / t_mm >= 0.003:
                print(f"  {t / t_mm:6.3f}x  {t:8.2f} ms  {count // STEPS:4d} calls  {key}")
        del hid, w, step, hg, wg
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
