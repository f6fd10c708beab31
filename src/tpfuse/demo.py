"""``python -m tpfuse demo``: run the fused op on several ranks and check it against float64."""

from __future__ import annotations

import torch

from tpfuse.testing import RankPool
from tpfuse.testing.cases import Case, check_results

DEMO_CASES = [
    Case(1, 4096, torch.bfloat16, seed=1),
    Case(7, 5120, torch.bfloat16, residual=False, seed=2),
    Case(16, 7168, torch.float16, seed=3),
    Case(5, 8192, torch.bfloat16, quant_scale=0.05, seed=4),
    Case(3, 4096, torch.float32, seed=5),
]


def _demo_rank(rank, world_size, backend, cases):
    import tpfuse

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    comm = tpfuse.get_communicator(max_tokens=16, hidden=8192)
    out = []
    for case in cases:
        inp = case.inputs(world_size, device)
        tpfuse.reset_stats()
        y, h = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps,
                                            quant_scale=inp["quant_scale"])
        out.append(((y.cpu(), h.cpu()), ",".join(tpfuse.stats())))
    return repr(comm), out


def run_demo(world_size: int | None = None) -> int:
    """Run the demo cases on all GPUs (2 or more) or on 2 CPU processes; return an exit code."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    backend = "nccl" if gpus >= 2 else "gloo"
    world_size = world_size or (gpus if backend == "nccl" else 2)
    where = f"{world_size} GPUs (NCCL)" if backend == "nccl" else \
        f"{world_size} CPU processes (gloo, Triton interpreter)"
    print(f"tpfuse demo: all-reduce + residual add + RMSNorm on {where}")
    with RankPool(world_size, backend) as pool:
        results = pool.run(_demo_rank, backend, DEMO_CASES)
    print(f"rank 0: {results[0][0]}")
    print(f"{'tokens':>6} {'hidden':>6} {'dtype':>9} {'residual':>8} {'output':>13} {'backend':>15}  check")
    failures = 0
    for i, case in enumerate(DEMO_CASES):
        per_rank = [res[1][i][0] for res in results]
        try:
            check_results(case, world_size, per_rank)
            verdict = "matches float64 on every rank, ranks bit-identical"
        except AssertionError as exc:
            failures += 1
            verdict = f"FAILED: {exc}"
        y_dtype = str(per_rank[0][0].dtype).replace("torch.", "")
        print(f"{case.tokens:>6} {case.hidden:>6} {str(case.dtype).replace('torch.', ''):>9} "
              f"{str(case.residual):>8} {y_dtype:>13} {results[0][1][i][1]:>15}  {verdict}")
    print("demo: OK" if not failures else f"demo: {failures} case(s) FAILED")
    return 1 if failures else 0
