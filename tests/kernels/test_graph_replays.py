"""CUDA-graph replays of both kernels on GPUs (skipped without 2 GPUs); a soak with more phases.

TPFUSE_GRAPH_REPLAYS replays per phase, TPFUSE_GRAPH_PHASES phases: inputs are refreshed and
outputs poisoned before each phase and checked after it (10 x 100,000 is the soak of
docs/reliability.md).
"""

import os

import pytest
import torch

import tpfuse
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends

BACKENDS = rank_backends()

REPLAYS = int(os.environ.get("TPFUSE_GRAPH_REPLAYS", "300"))
PHASES = int(os.environ.get("TPFUSE_GRAPH_PHASES", "2"))
# One graph holds calls of several shapes, so every replay rotates slots through changing extents.
GRAPH_CASES = [Case(8, 4096, seed=1), Case(1, 7168, seed=2), Case(33, 4096, residual=False, seed=3),
               Case(2, 8192, quant_scale=0.05, seed=4), Case(600, 4096, seed=5)]  # the last: two-shot on H200


def _phase_inputs(case: Case, phase: int, world_size: int) -> dict:
    inputs = case.inputs(world_size)
    if phase:
        inputs["xs"] = [torch.randn((case.tokens, case.hidden), generator=torch.Generator().manual_seed(
            1000 * phase + r)).to(case.dtype) for r in range(world_size)]
    return inputs


def _replay(rank, world_size, replays, phases):
    device = torch.device("cuda", rank)
    comm = tpfuse.get_communicator(max_tokens=1024, hidden=8192)
    algorithms = [comm.choose_algorithm(case.tokens, case.hidden, case.dtype) for case in GRAPH_CASES]
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
    for phase in range(phases):
        for case, _, x, _, _ in calls:  # fresh inputs for every phase
            x.copy_(_phase_inputs(case, phase, world_size)["xs"][rank])
        for _, _, _, y, h in calls:
            y.view(torch.uint8).fill_(0xFF)  # poison: NaN in every output dtype
            h.fill_(float("nan"))
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
        checks.append([(y.cpu(), h.cpu()) for _, _, _, y, h in calls])
    tpfuse.check_errors()
    return {"outputs by phase": checks, "algorithms": algorithms, "stats": tpfuse.stats()}


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_graph_replays_stay_correct(rank_pool):
    results = rank_pool(2, "nccl").run(_replay, REPLAYS, PHASES, timeout=3000)
    for phase in range(PHASES):
        for i, case in enumerate(GRAPH_CASES):
            check_results(case, 2, [res["outputs by phase"][phase][i] for res in results],
                          _phase_inputs(case, phase, 2))
    algorithms = results[0]["algorithms"]
    assert "twoshot" in algorithms and "oneshot" in algorithms, algorithms
    expected = {f"triton.{a}": 2 * algorithms.count(a) for a in set(algorithms)}  # eager warm-up + capture
    assert all(res["stats"] == expected for res in results)
