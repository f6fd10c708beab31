"""Two ranks on one GPU: the one-shot's whole protocol (descriptors, push, polls, clear, arrival) with the
peers' buffers in the same GPU's memory instead of across NVLink, for comparing launch variants where
only one GPU is lent. Both ranks' kernels run at once (two streams; ``bench.timing.graph_replay_us``:
one CUDA graph of 10 steps, median of 7 batches); each step's outputs are checked against float64 and
across the ranks first. A step also holds the graph's fork and join of the two streams, so absolute
times are not a 2-GPU call's: only the difference between variants carries over, and that still wants
confirming on two GPUs.

Usage: PYTHONPATH=src python3 scripts/loopback_latency.py
"""

import torch

from tpfuse.bench.providers import ONESHOT_VARIANTS
from tpfuse.bench.timing import graph_replay_us
from tpfuse.kernels import layout
from tpfuse.kernels.oneshot import OneShotVariant, oneshot_allreduce_add_rmsnorm
from tpfuse.testing import compile_then_start_afresh, local_launch_contexts, on_rank_streams
from tpfuse.testing.cases import Case, check_results

WORLD = 2


def main() -> None:
    device = torch.device("cuda")
    contexts = local_launch_contexts(device, 64 * 8192, WORLD)
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    variants = {"default": OneShotVariant(), **{k: OneShotVariant(**v) for k, v in ONESHOT_VARIANTS.items()}}
    print(f"{'tokens x hidden':>16} " + " ".join(f"{name:>14}" for name in variants))
    for hidden in (4096, 8192):
        for tokens in (1, 8, 64):
            case = Case(tokens, hidden, seed=tokens)
            inputs = case.inputs(WORLD, device)
            calls = [case.fused_call(inputs, r) for r in range(WORLD)]
            outputs = [(call.y, call.h) for call in calls]
            cells = []
            for name, variant in variants.items():
                def step(variant=variant):
                    on_rank_streams(streams, lambda r: oneshot_allreduce_add_rmsnorm(contexts[r], calls[r],
                                                                                     variant=variant))

                compile_then_start_afresh(contexts, step)
                for y, h in outputs:
                    y.fill_(float("nan"))
                    h.fill_(float("nan"))
                step()
                torch.cuda.synchronize()
                states = [c.workspace.state.tolist() for c in contexts]
                assert all(state[layout.STATE_ERROR] == 0 for state in states), (name, case, states)
                check_results(case, WORLD, [(y.cpu(), h.cpu()) for y, h in outputs], inputs)
                cells.append(graph_replay_us(step))
            print(f"{tokens:>7} x {hidden:<6} " + " ".join(f"{t:>14.2f}" for t in cells))


if __name__ == "__main__":
    main()
