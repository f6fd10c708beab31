"""The ``floor`` provider's exchange (issue 17): every call pairs with the peers', none waits forever."""

import time

import pytest
import torch
import torch.distributed as dist

from tpfuse.bench.floor import FloorKernels


def _exchanges(rank, world_size, calls_by_rank, timeout_s):
    floor = FloorKernels(dist.group.WORLD, torch.device("cpu"), wait_timeout_s=timeout_s)
    began = time.monotonic()
    for _ in range(calls_by_rank[rank]):
        floor.floor(512)
    floor.launch(512)  # the empty kernel runs too
    seconds = time.monotonic() - began
    dist.barrier()
    calls, failed = floor.counts()
    floor.release()
    return {"calls": calls, "failed": failed, "seconds": seconds}


@pytest.mark.extended  # a bench harness: CI leaves it to scripts/gpu_check.sh tests
def test_floor_exchanges_pair_up_on_every_rank(rank_pool):
    for report in rank_pool(3).run(_exchanges, [40, 40, 40], 30.0):
        assert report == {**report, "calls": 40, "failed": 0}, report


@pytest.mark.extended  # a bench harness: CI leaves it to scripts/gpu_check.sh tests
def test_floor_exchange_without_a_peer_gives_up_at_the_bound(rank_pool):
    reports = rank_pool(2).run(_exchanges, [1, 0], 1.0)
    assert reports[0]["calls"] == 1 and reports[0]["failed"] == 1, reports[0]
    assert 1.0 <= reports[0]["seconds"] < 5.0, reports[0]
