"""Where a decode step's GPU time goes, per provider: the kernels of a few CUDA-graph replays, summed.

Run under torchrun on 2+ GPUs (rank 0 prints):
    torchrun --nproc_per_node=2 scripts/profile_e2e.py --batches 32,64 --layers 8
Built to explain an end-to-end result (the fused model slower than the unfused one at batch 32-64
while each fused kernel is faster than NCCL + norm): which kernels differ between the providers.
"""

from __future__ import annotations

import argparse
import collections

import torch
import torch.distributed as dist

from tpfuse.bench.e2e import _compiled, _fill_caches
from tpfuse.bench.kernel import finish_torchrun, init_torchrun


def _kernel_times(fn, steps: int) -> tuple[collections.Counter, float]:
    """Device microseconds per step by kernel name, and the step's time measured with CUDA events."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(steps):
            fn()
        end.record()
        torch.cuda.synchronize()
    per_kernel = collections.Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_kernel[event.name[:90]] += event.device_time / steps
    return per_kernel, start.elapsed_time(end) * 1000 / steps


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama-3-8b")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--batches", default="32,64")
    parser.add_argument("--providers", default="unfused,tpfuse,flashinfer")
    parser.add_argument("--prefill", type=int, default=2048)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--mode", default="reduce-overhead", help="torch.compile mode of every provider")
    args = parser.parse_args()
    if not init_torchrun():
        return
    from tpfuse.models import Transformer

    rank, device = dist.get_rank(), torch.device("cuda", torch.cuda.current_device())
    batches = [int(b) for b in args.batches.split(",")]
    model = Transformer.build(args.preset, device=device, n_layers=args.layers)
    model.setup_caches(max_batch=max(batches), max_seq=args.prefill + 1)
    try:
        for provider in args.providers.split(","):
            try:
                fn = _compiled(provider, model, args.prefill, args.mode)
            except (ImportError, ValueError) as exc:
                if rank == 0:
                    print(f"{provider}: {exc}")
                continue
            for batch in batches:
                tokens = torch.randint(0, model.args.vocab_size, (batch, 1), device=device)
                pos = torch.tensor([args.prefill], device=device)
                with torch.no_grad():
                    _fill_caches(model, device)
                    per_kernel, step_us = _kernel_times(lambda: fn(tokens, pos), args.steps)
                if rank == 0:
                    total = sum(per_kernel.values())
                    print(f"\n== {provider} decode b{batch} ({args.mode}): step {step_us:.1f} us (events), "
                          f"kernels {total:.1f} us")
                    for name, us in per_kernel.most_common(14):
                        print(f"{us:9.1f}  {name}")
    finally:
        finish_torchrun()


if __name__ == "__main__":
    main()
