"""Where a fused call's host time goes: cProfile of repeated eager calls on one GPU (the op at world
size 1, and rank 0's one-shot launch and op of two ranks sharing the GPU), and what the torch calls
on the path cost by themselves. A tool for the launch path's work (docs/kernel-notes.md, "Host cost").

Usage: PYTHONPATH=src python3 scripts/host_profile.py
"""

import cProfile
import pstats

import torch

import tpfuse
from tpfuse import select
from tpfuse.bench.host import _process_group, host_us, loopback_pair
from tpfuse.testing.cases import Case


def profile(name, fn, calls=3000, after=None):
    for _ in range(100):
        fn()
        if after is not None:
            after()
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    prof.enable()
    for i in range(calls):
        fn()
        if after is not None:
            after()
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
        from tpfuse.kernels.launch import kept_plan
        from tpfuse.kernels.local import _local_plan, _plans, local_add_rmsnorm
        from tpfuse.ops.allreduce_add_rmsnorm import check_inputs

        call = case.fused_call(inputs, 0)
        op = lambda: tpfuse.allreduce_add_rmsnorm(x, r, w, 1e-6)  # noqa: E731
        local_add_rmsnorm(call)
        plan = kept_plan(_plans, (call.x.device, call.n_tokens, call.kernel_key()), _local_plan, call)
        launcher = next(iter(plan.compiled.values()))
        tensors = call.kernel_tensors()
        addresses = call.kernel_addresses()
        stream = torch.cuda.current_stream().cuda_stream
        from tpfuse.blockend.call import FusedCall
        from tpfuse.ops.allreduce_add_rmsnorm import _through_the_op
        from tpfuse.ops.route import group_name_of, route_of

        parts = {
            "op, world size 1": op,
            "local_add_rmsnorm (plan kept, compiled launcher)": lambda: local_add_rmsnorm(call),
            "the compiled launcher alone, arguments ready": lambda: launcher(stream, addresses),
            "the JIT's launch (kernel[grid](...))": lambda: plan.kernel[(plan.grid,)](
                *tensors, call.hidden, call.eps, **plan.constexprs, **plan.options),
            "check_inputs": lambda: check_inputs(x, r, w, 1e-6),
            "two torch.empty_like": lambda: (torch.empty_like(x), torch.empty_like(x)),
            "group_name_of + _through_the_op + route_of": lambda: (
                _through_the_op(x), route_of(group_name_of(None))),
            "FusedCall + kernel_key + kernel_tensors": lambda: (
                lambda c: (c.kernel_key(), c.kernel_tensors()))(FusedCall(x, r, w, 1e-6, call.y, call.h)),
            "torch add + rms_norm": lambda: torch.nn.functional.rms_norm(x + r, (x.shape[-1],), w, 1e-6),
            "torch.cuda.is_current_stream_capturing()": torch.cuda.is_current_stream_capturing,
            "torch._C._cuda_getCurrentRawStream(0)": lambda: torch._C._cuda_getCurrentRawStream(0),
            "torch.compiler.is_compiling()": torch.compiler.is_compiling,
            "x.data_ptr()": x.data_ptr,
            "x.device": lambda: x.device,
            "x.device == w.device": lambda: x.device == w.device,
        }
        for name, fn in parts.items():
            print(f"{host_us(fn):8.2f} us  {name}")
        profile("op at world size 1", op)
        with loopback_pair(1, 4096, device) as pair:
            own, peer, loopback_op = pair.own, pair.peer, pair.op
            one_shot_us = host_us(own(select.ONESHOT), after=peer(select.ONESHOT))
            print(f"{one_shot_us:8.2f} us  launch, one-shot, 2 ranks")
            with loopback_op(select.ONESHOT) as op2:
                print(f"{host_us(op2, after=peer(select.ONESHOT)):8.2f} us  op, one-shot, 2 ranks")
                profile("op, one-shot, 2 ranks (rank 1's launch after each)", op2, after=peer(select.ONESHOT))
            profile("launch, one-shot, 2 ranks (rank 1's after each)", own(select.ONESHOT),
                    after=peer(select.ONESHOT))


if __name__ == "__main__":
    main()
