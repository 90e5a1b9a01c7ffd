"""verl 0.9.1's Megatron paths on one GPU (NCCL tensor-parallel group of size 1): verl's own
functions against what rl-kernels' patch runs in their place, time and peak memory in one run.

    PYTHONPATH=<verl and megatron-core unpacked>:. python scripts/diag/megatron_bench.py

* logits path: the sequence of verl's ``_lm_head_logits_processor`` with entropy on (clone the
  logits, entropy of one copy, log-probs of the other, backward of both), with verl's
  ``vocab_parallel_entropy`` + ``vocab_parallel_log_probs_from_logits`` against rl-kernels'
  ``entropy_from_logits`` + ``log_probs_from_logits`` with the tensor-parallel group; and
  ``vocab_parallel_sum_pi_squared`` against ``sum_pi_squared_from_logits`` (forward);
* fused path: verl's ``linear_cross_entropy(hidden, weight, labels, T, "none", tp_group)`` against
  ``rl_kernels.linear_log_probs`` (fwd, fwd+bwd, max |error| of log-probs vs float64).

verl is imported without its package ``__init__`` files (no Ray / tensordict stack on the GPU
machine): only the modules named above are loaded. Prints a table (ms, x of verl, peak extra GiB).
"""
import importlib
import importlib.util
import os
import sys
import types

import torch
import torch.distributed as dist
import triton.testing

import rl_kernels
from rl_kernels.tools import diag
from rl_kernels.tools.diag import peak_extra_gib as peak_extra, reference_linear_log_probs


def import_verl(*names):
    spec = importlib.util.find_spec("verl")
    root = list(spec.submodule_search_locations)[0]
    for sub in ("", "utils", "utils.megatron", "utils.kernel"):
        name = "verl" + ("." + sub if sub else "")
        mod = types.ModuleType(name)
        mod.__path__ = [os.path.join(root, *sub.split("."))] if sub else [root]
        sys.modules[name] = mod
    return [importlib.import_module(n) for n in names]


def bench(fn):
    return triton.testing.do_bench(fn, warmup=50, rep=500, return_mode="median")


def main():
    diag.start(diag.parser(__doc__))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    from megatron.core import parallel_state

    parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
    tp = parallel_state.get_tensor_model_parallel_group()
    vtp, vlce = import_verl("verl.utils.megatron.tensor_parallel", "verl.utils.kernel.linear_cross_entropy")
    rows = []

    # ---------------------------------------------------------------- logits path
    n, v = 16384, 152064
    g = torch.Generator(device="cuda").manual_seed(0)
    base = (2 * torch.randn(n, v, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    up = torch.randn(2, n, device="cuda", generator=g)

    def verl_logits(backward):
        def run():
            logits = base.clone().requires_grad_(backward)
            x = logits * 1.0 if backward else logits  # a non-leaf, as the lm head's output
            bak = x.clone()
            ent = vtp.vocab_parallel_entropy(x)
            lp = vtp.vocab_parallel_log_probs_from_logits(bak, labels)
            if backward:  # random upstream gradients: contiguous, as verl's losses give
                torch.autograd.backward([ent, lp], [up[0].to(ent.dtype), up[1].to(lp.dtype)])
            return lp, ent
        return run

    def ours_logits(backward):
        def run():
            logits = base.clone().requires_grad_(backward)
            x = logits * 1.0 if backward else logits
            bak = x.clone()  # verl's processor still clones
            ent = rl_kernels.entropy_from_logits(x, process_group=tp, vocab_start_index=0)
            lp = rl_kernels.log_probs_from_logits(bak, labels, process_group=tp, vocab_start_index=0)
            if backward:
                torch.autograd.backward([ent, lp], [up[0], up[1]])
            return lp, ent
        return run

    z64 = base.double()
    ref_lp = torch.log_softmax(z64, -1).gather(1, labels[:, None])[:, 0]
    del z64
    for name, make in (("verl vocab_parallel (bf16)", verl_logits), ("rl_kernels (fp32 out)", ours_logits)):
        with torch.no_grad():
            lp, ent = make(False)()
            err = (lp.double() - ref_lp).abs().max().item()
            t_f = bench(make(False))
        t_fb = bench(make(True))
        mem = peak_extra(make(True))
        rows.append(("logits", name, t_f, t_fb, mem, err, str(lp.dtype).replace("torch.", "")))
        print(rows[-1], flush=True)
    with torch.no_grad():
        sq_v = vtp.vocab_parallel_sum_pi_squared(base)
        sq_o = rl_kernels.sum_pi_squared_from_logits(base, process_group=tp, vocab_start_index=0)
        p = torch.softmax(base.double()[:2048], -1)
        ref_sq = (p * p).sum(-1)
        del p
        for name, fn, out in (("verl sum_pi_squared", lambda: vtp.vocab_parallel_sum_pi_squared(base), sq_v),
                              ("rl_kernels sum_pi_squared", lambda: rl_kernels.sum_pi_squared_from_logits(
                                  base, process_group=tp, vocab_start_index=0), sq_o)):
            rows.append(("sum_pi^2", name, bench(fn), float("nan"), peak_extra(fn),
                         (out[:2048].double() - ref_sq).abs().max().item(), str(out.dtype).replace("torch.", "")))
            print(rows[-1], flush=True)
    del base

    # ---------------------------------------------------------------- fused path
    n, h, v = 16384, 3584, 152064
    hidden = torch.randn(n, h, device="cuda", generator=g).bfloat16()
    weight = (0.02 * torch.randn(v, h, device="cuda", generator=g)).bfloat16()
    labels = torch.randint(0, v, (n,), device="cuda", generator=g)
    t_mm = bench(lambda: hidden @ weight.T)
    ref = reference_linear_log_probs(hidden[:2048], weight, labels[:2048])
    hx, wx = hidden.clone().requires_grad_(), weight.clone().requires_grad_()

    def verl_fused(backward):
        def run():
            hx.grad = wx.grad = None
            lp, ent = vlce.linear_cross_entropy(hx if backward else hidden, wx if backward else weight,
                                                labels, 1.0, "none", tp)
            if backward:
                torch.autograd.backward([lp, ent], [up[0].to(lp.dtype), up[1].to(ent.dtype)])
            return lp, ent
        return run

    def ours_fused(backward):
        def run():
            hx.grad = wx.grad = None
            out = rl_kernels.linear_log_probs(hx if backward else hidden, wx if backward else weight, labels)
            if backward:
                torch.autograd.backward([out.log_probs, out.entropy], [up[0], up[1]])
            return out.log_probs, out.entropy
        return run

    for name, make in (("verl linear_cross_entropy", verl_fused), ("rl_kernels linear_log_probs", ours_fused)):
        with torch.no_grad():
            lp, _ = make(False)()
            err = (lp[:2048].double() - ref.log_probs).abs().max().item()
            t_f = bench(make(False))
        t_fb = bench(make(True))
        mem = peak_extra(make(True))
        rows.append(("fused", name, t_f / t_mm, t_fb / t_mm, mem, err, str(lp.dtype).replace("torch.", "")))
        print(rows[-1], flush=True)

    # the fused head with sum_j p_j^2 on (one more accumulator in the mainloop)
    def ours_fused_sq(backward):
        def run():
            hx.grad = wx.grad = None
            out = rl_kernels.linear_log_probs(hx if backward else hidden, wx if backward else weight, labels,
                                              return_sum_pi_squared=True)
            if backward:
                torch.autograd.backward([out.log_probs, out.entropy, out.sum_pi_squared], [up[0], up[1], up[0]])
            return out.log_probs, out.entropy
        return run
    with torch.no_grad():
        t_f = bench(ours_fused_sq(False))
    rows.append(("fused", "rl_kernels + sum_pi_squared", t_f / t_mm, bench(ours_fused_sq(True)) / t_mm,
                 peak_extra(ours_fused_sq(True)), float("nan"), "float32"))
    print(rows[-1], flush=True)

    print(f"\nlogits: {16384}x{152064} bf16 (ms); fused: 16384x3584x152064 bf16 (x cuBLAS mm = {t_mm:.2f} ms)")
    print(f"{'path':9s} {'implementation':30s} {'fwd':>9s} {'fwd+bwd':>9s} {'peak GiB':>9s} {'max|err| lp':>12s} out")
    for path, name, f, fb, mem, err, dt in rows:
        print(f"{path:9s} {name:30s} {f:9.3f} {fb:9.3f} {mem:9.2f} {err:12.2e} {dt}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
