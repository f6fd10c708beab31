"""What the kernels' own arithmetic costs, on one GPU: a group of one has no peer, so nothing travels and
what is left is loads, stores and math. Two tables: the epilogue's steps (``bench kernel --epilogue``
names) in the one-shot and the two-shot, and the two-shot exact against the fp8 wire (which quantises
its own x and the sum and decodes both even alone). CUDA graphs of 10 calls, median of 7 batches
(``bench.timing.graph_replay_us``).

Usage: PYTHONPATH=src python3 scripts/compute_cost.py (docs/kernel-notes.md has the numbers).
"""

import torch

from tpfuse.bench.providers import EPILOGUES, epilogue_case
from tpfuse.bench.timing import graph_replay_us
from tpfuse.kernels.oneshot import oneshot_allreduce_add_rmsnorm
from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
from tpfuse.testing import local_launch_contexts


def timed(launch, ctx, case, **kwargs) -> float:
    call = case.fused_call(case.inputs(1, ctx.workspace.buffer.device), 0)
    return graph_replay_us(lambda: launch(ctx, call, **kwargs))


def main() -> None:
    device = torch.device("cuda")
    ctx = local_launch_contexts(device, 8192 * 8192)[0]
    names = [name for name in EPILOGUES if name != "two_branches"]  # its kernel is "layernorm"'s
    print("epilogue steps, us (one GPU, no peer): " + " ".join(f"{n:>12}" for n in names))
    for launch, tokens in ((oneshot_allreduce_add_rmsnorm, (1, 8, 64)),
                           (twoshot_allreduce_add_rmsnorm, (1024, 4096))):
        for hidden in (4096, 8192):
            for n in tokens:
                times = [timed(launch, ctx, epilogue_case(name, n, hidden)) for name in names]
                cells = " ".join(f"{t:>12.2f}" for t in times)
                print(f"{launch.__name__[:7]:>8} {n:>5} x {hidden:<5} {cells}")
    print("\nthe fp8 wire, us (one GPU, no peer)")
    for tokens, hidden in ((512, 8192), (4096, 4096), (8192, 4096), (8192, 8192)):
        case = epilogue_case("plain", tokens, hidden)
        exact, wire = (timed(twoshot_allreduce_add_rmsnorm, ctx, case, wire=w) for w in (False, True))
        print(f"{tokens} x {hidden}: exact {exact:.1f}, fp8 wire {wire:.1f}")


if __name__ == "__main__":
    main()
