"""Eager soak on GPUs: random token counts and hidden sizes for TPFUSE_SOAK_SECONDS, checked as it goes."""

import os
import random
import time

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.testing.ranks import rank_backends

BACKENDS = rank_backends()

SOAK_SECONDS = float(os.environ.get("TPFUSE_SOAK_SECONDS", "10"))


def _soak(rank, world_size, seconds):
    from tpfuse.blockend.reference import fused_reference_float64
    from tpfuse.testing.cases import TOLERANCE

    device = torch.device("cuda", rank)
    tpfuse.get_communicator(max_tokens=2048, hidden=8192)
    tpfuse.reset_stats()
    rng = random.Random(0)  # the same sequence of calls on every rank
    gen = torch.Generator(device).manual_seed(0)  # and the same inputs, made on the GPU
    calls, checked, worst = 0, 0, 0.0
    deadline = time.monotonic() + seconds  # rank 0's clock decides when every rank stops
    stop = torch.zeros(1, device=device)
    next_report = time.monotonic() + 60
    while True:
        tokens = rng.choice([1, 2, 3, 7, 64, 100, 255, 256, 257, 511, 1000, 2048])
        hidden = rng.choice([2048, 4096, 7168, 8192])
        dtype = rng.choice([torch.bfloat16, torch.float16])
        if tokens * hidden > 2048 * 8192:
            continue
        def rows():
            return torch.randn(tokens, hidden, generator=gen, device=device).to(dtype)

        xs = [rows() for _ in range(world_size)]
        residual = rows() if rng.random() < 0.8 else None
        weight = (1 + 0.5 * torch.randn(hidden, generator=gen, device=device)).to(dtype)
        y, h = tpfuse.allreduce_add_rmsnorm(xs[rank], residual, weight, 1e-6)
        calls += 1
        if calls % 50 == 0:  # check one call in 50: float64 reference and bit-identity across ranks
            y_ref, _ = fused_reference_float64(xs, residual, weight, 1e-6)
            atol, rtol = TOLERANCE[dtype]
            err = ((y.double() - y_ref).abs() - rtol * y_ref.abs()).max().item()
            worst = max(worst, err)
            assert err <= atol, (tokens, hidden, dtype, err)
            gathered = [torch.empty_like(y) for _ in range(world_size)]
            dist.all_gather(gathered, y)
            assert all(torch.equal(g.view(torch.int16), y.view(torch.int16)) for g in gathered)
            checked += 1
            if rank == 0 and time.monotonic() > next_report:  # a run cut short still says how far it got
                print(f"soak progress: {calls} calls, {checked} checked, no error", flush=True)
                next_report += 60
            stop.fill_(float(time.monotonic() > deadline) if rank == 0 else 0.0)
            dist.broadcast(stop, src=0)
            if stop.item():
                break
    tpfuse.check_errors()
    stats = tpfuse.stats()
    return {"calls": calls, "checked": checked, "worst": worst, "stats": stats}


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_eager_soak_random_shapes(rank_pool):
    results = rank_pool(2, "nccl").run(_soak, SOAK_SECONDS, timeout=SOAK_SECONDS + 600)
    calls, checked, worst, stats = (results[0][key] for key in ("calls", "checked", "worst", "stats"))
    print(
        f"soak: {calls} calls in {SOAK_SECONDS:g} s, {checked} checked, "
        f"worst excess error {worst:.2e}, {stats}"
    )
    assert checked >= 1 and stats.get("triton.oneshot", 0) > 0 and stats.get("triton.twoshot", 0) > 0
