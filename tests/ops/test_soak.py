"""Eager soak on GPUs: random token counts and hidden sizes for TPFUSE_SOAK_SECONDS, checked as it goes."""

import os
import random
import time

import pytest
import torch
import torch.distributed as dist
from conftest import BACKENDS

import tpfuse
from tpfuse.testing.cases import Case

SOAK_SECONDS = float(os.environ.get("TPFUSE_SOAK_SECONDS", "10"))


def _soak(rank, world_size, seconds):
    from tpfuse.kernels.reference import fused_reference_float64
    from tpfuse.testing.cases import TOLERANCE

    device = torch.device("cuda", rank)
    tpfuse.get_communicator(max_tokens=2048, hidden=8192)
    tpfuse.reset_stats()
    rng = random.Random(0)  # the same sequence of calls on every rank
    calls, checked, worst = 0, 0, 0.0
    deadline = time.monotonic() + seconds  # rank 0's clock decides when every rank stops
    stop = torch.zeros(1, device=device)
    while True:
        case = Case(
            rng.choice([1, 2, 3, 7, 64, 100, 255, 256, 257, 511, 1000, 2048]),
            rng.choice([4096, 7168, 8192, 2048]),
            rng.choice([torch.bfloat16, torch.float16]),
            residual=rng.random() < 0.8,
            seed=calls,
        )
        if case.tokens * case.hidden > 2048 * 8192:
            continue
        inp = case.inputs(world_size, device)
        y, h = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
        calls += 1
        if calls % 50 == 0:  # check one call in 50: float64 reference and bit-identity across ranks
            y_ref, _ = fused_reference_float64(
                [x.cpu() for x in inp["xs"]],
                None if inp["residual"] is None else inp["residual"].cpu(),
                inp["weight"].cpu(),
                case.eps,
            )
            atol, rtol = TOLERANCE[case.dtype]
            err = ((y.cpu().double() - y_ref).abs() - rtol * y_ref.abs()).max().item()
            worst = max(worst, err)
            assert err <= atol, (case, err)
            gathered = [torch.empty_like(y) for _ in range(world_size)]
            dist.all_gather(gathered, y)
            assert all(torch.equal(g.view(torch.int16), y.view(torch.int16)) for g in gathered), case
            checked += 1
            stop.fill_(float(time.monotonic() > deadline) if rank == 0 else 0.0)
            dist.broadcast(stop, src=0)
            if stop.item():
                break
    tpfuse.check_errors()
    stats = tpfuse.stats()
    tpfuse.destroy_all()
    return calls, checked, worst, stats


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_eager_soak_random_shapes(rank_pool):
    results = rank_pool(2, "nccl").run(_soak, SOAK_SECONDS, timeout=SOAK_SECONDS + 600)
    calls, checked, worst, stats = results[0]
    print(
        f"soak: {calls} calls in {SOAK_SECONDS:g} s, {checked} checked, "
        f"worst excess error {worst:.2e}, {stats}"
    )
    assert checked >= 1 and stats.get("triton.oneshot", 0) > 0 and stats.get("triton.twoshot", 0) > 0
