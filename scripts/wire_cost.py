"""What the fp8 wire's conversions cost, on one GPU: the two-shot in a group of one (it quantises its own
x and the sum and decodes both; nothing travels), exact and on the wire, CUDA graphs of 10 calls, median
of 7 batches. Usage: PYTHONPATH=src python3 scripts/wire_cost.py (docs/kernel-notes.md has the numbers).
"""

import torch

from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
from tpfuse.testing import lone_launch_context

CALLS_PER_GRAPH, REPLAYS, BATCHES = 10, 5, 7


def replay_us(call) -> float:
    """Median microseconds per call over batches of CUDA-graph replays."""
    for _ in range(5):
        call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(CALLS_PER_GRAPH):
            call()
    times = []
    for _ in range(BATCHES):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(REPLAYS):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1000 / (REPLAYS * CALLS_PER_GRAPH))
    return sorted(times)[BATCHES // 2]


def main() -> None:
    device = torch.device("cuda")
    for tokens, hidden in ((512, 8192), (4096, 4096), (8192, 4096), (8192, 8192)):
        ctx = lone_launch_context(device, tokens * hidden)
        x = torch.randn(tokens, hidden, device=device).bfloat16()
        residual, weight = torch.randn_like(x), torch.ones(hidden, device=device).bfloat16()
        y, h = torch.empty_like(x), torch.empty_like(x)
        def call(wire):
            twoshot_allreduce_add_rmsnorm(ctx, x, residual, weight, 1e-6, y, h, wire=wire)

        us = {wire: replay_us(lambda wire=wire: call(wire)) for wire in (False, True)}
        print(f"{tokens} x {hidden}: exact {us[False]:.1f} us, fp8 wire {us[True]:.1f} us (one GPU, no peer)")


if __name__ == "__main__":
    main()
