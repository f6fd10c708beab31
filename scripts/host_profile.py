"""Where a fused call's host time goes: cProfile of repeated eager calls on one GPU (the op at world
size 1, and rank 0's one-shot launches of two ranks sharing the GPU). A tool for the launch path's
work (docs/kernel-notes.md, "Host cost").

Usage: PYTHONPATH=src python3 scripts/host_profile.py
"""

import cProfile
import pstats

import torch
import torch.distributed as dist

import tpfuse
from tpfuse.bench.host import _process_group
from tpfuse.testing.cases import Case


def profile(name, fn, calls=3000):
    for _ in range(100):
        fn()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if i % 32 == 31:
            torch.cuda.synchronize()
    prof.disable()
    print(f"== {name}: {calls} calls")
    pstats.Stats(prof).sort_stats("tottime").print_stats(22)


def main():
    with _process_group():
        device = torch.device("cuda")
        case = Case(1, 4096)
        inputs = case.inputs(1, device)
        x, r, w = inputs["xs"][0], inputs["residual"], inputs["weight"]
        profile("op at world size 1", lambda: tpfuse.allreduce_add_rmsnorm(x, r, w, 1e-6))
        from tpfuse.kernels.local import local_add_rmsnorm
        call = case.fused_call(inputs, 0)
        profile("local kernel launcher alone", lambda: local_add_rmsnorm(call))


if __name__ == "__main__":
    main()
