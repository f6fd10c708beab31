"""What the fp8 wire's conversions cost, on one GPU: the two-shot in a group of one (it quantises its own
x and the sum and decodes both; nothing travels), exact and on the wire, CUDA graphs of 10 calls, median
of 7 batches. Usage: PYTHONPATH=src python3 scripts/wire_cost.py (docs/kernel-notes.md has the numbers).
"""
import torch
from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
from tpfuse.testing import lone_launch_context

dev = torch.device("cuda")
for tokens, hidden in ((512, 8192), (4096, 4096), (8192, 4096), (8192, 8192)):
    ctx = lone_launch_context(dev, tokens * hidden)
    x = torch.randn(tokens, hidden, device=dev).bfloat16()
    r = torch.randn_like(x); w = torch.ones(hidden, device=dev).bfloat16()
    y, h = torch.empty_like(x), torch.empty_like(x)
    res = {}
    for wire in (False, True):
        f = lambda: twoshot_allreduce_add_rmsnorm(ctx, x, r, w, 1e-6, y, h, wire=wire)
        for _ in range(5): f()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(10): f()
        times = []
        for _ in range(7):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); [g.replay() for _ in range(5)]; b.record(); torch.cuda.synchronize()
            times.append(a.elapsed_time(b) * 1000 / 50)
        res[wire] = sorted(times)[3]
    print(f"{tokens} x {hidden}: exact {res[False]:.1f} us, fp8 wire {res[True]:.1f} us (one GPU, no peer)")
