"""CUDA-graph replays of the one-shot kernel on GPUs (skipped without 2 GPUs)."""

import os

import pytest
import torch
from conftest import BACKENDS

import tpfuse
from tpfuse.testing.cases import Case, check_results

REPLAYS = int(os.environ.get("TPFUSE_GRAPH_REPLAYS", "300"))
# One graph holds calls of several shapes, so every replay rotates slots through changing extents.
GRAPH_CASES = [Case(8, 4096, seed=1), Case(1, 7168, seed=2), Case(33, 4096, residual=False, seed=3),
               Case(2, 8192, quant_scale=0.05, seed=4)]


def _replay(rank, world_size, replays):
    device = torch.device("cuda", rank)
    tpfuse.get_communicator(max_tokens=64, hidden=8192)
    tpfuse.reset_stats()
    calls = []
    for case in GRAPH_CASES:
        inp = case.inputs(world_size, device)
        x = inp["xs"][rank].clone()
        y = torch.empty(x.shape, dtype=torch.float8_e4m3fn if case.quant_scale else x.dtype, device=device)
        calls.append((case, inp, x, y, torch.empty_like(x)))

    def step():
        for case, inp, x, y, h in calls:
            tpfuse.allreduce_add_rmsnorm(x, inp["residual"], inp["weight"], case.eps, out=y, residual_out=h,
                                         quant_scale=inp["quant_scale"])

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    checks = []
    for phase in range(2):
        for _, _, _, y, h in calls:
            y.view(torch.uint8).fill_(0xFF)  # poison: NaN in every output dtype
            h.fill_(float("nan"))
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        checks.append([(y.cpu(), h.cpu()) for _, _, _, y, h in calls])
        for case, inp, x, _, _ in calls:  # fresh inputs for the second phase
            x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(phase + rank + 17)))
            inp["xs"][rank] = x.clone()
    return checks, tpfuse.stats()


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_graph_replays_stay_correct(rank_pool):
    results = rank_pool(2, "nccl").run(_replay, REPLAYS, timeout=600)
    for phase in range(2):
        for i, case in enumerate(GRAPH_CASES):
            inputs = case.inputs(2)
            if phase == 1:
                inputs["xs"] = [torch.randn((case.tokens, case.hidden),
                                            generator=torch.Generator().manual_seed(0 + r + 17)).to(case.dtype)
                                for r in range(2)]
            check_results(case, 2, [res[0][phase][i] for res in results], inputs)
    assert all(res[1] == {"triton.oneshot": 2 * len(GRAPH_CASES)} for res in results)
