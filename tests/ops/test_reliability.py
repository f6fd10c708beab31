"""Faults and edges: a stalled peer, mismatched calls, NaN/Inf/zero/huge values, many communicators.

docs/reliability.md lists each case with what happens and the test here that shows it.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.comm import workspace as ws
from tpfuse.kernels import layout
from tpfuse.kernels.reference import add_rmsnorm_reference
from tpfuse.testing import forced_table, fused_calls, rank_backends, rank_device
from tpfuse.testing.cases import Case, check_results

BACKENDS = rank_backends()


def _stall(rank, world_size, backend):
    device = rank_device(backend, rank)
    tpfuse.destroy_all()  # a fresh communicator: the message counts calls from its creation
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=1.0)
    case = Case(5, 512, seed=1)
    inp = case.inputs(world_size, device)
    report = {}
    if rank == 0:  # rank 1 never makes the call
        began = time.monotonic()
        try:
            tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
            tpfuse.check_errors()  # the documented point on a GPU (the CPU checks inside the call)
            report["raised"] = "no error"
        except RuntimeError as exc:
            report["raised"] = str(exc)
        report["seconds"] = time.monotonic() - began
        try:
            tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
            report["unusable after"] = "no error"
        except RuntimeError as exc:
            report["unusable after"] = str(exc)
    dist.barrier()
    tpfuse.destroy_all()
    return report


@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_peer_raises_instead_of_hanging(rank_pool, backend):
    report = rank_pool(2, backend).run(_stall, backend, timeout=300)[0]
    assert "fused call #1 (5 x 512) gave up after waiting 1 s for a peer" in report["raised"], report
    assert "group " in report["raised"] and "rank 0" in report["raised"]
    assert report["seconds"] < 60, report
    assert "gave up" in report["unusable after"], report


def _mismatch(rank, world_size, debug):
    tpfuse.destroy_all()
    # Rank 1 waits longer: the CPU interpreter runs rank 0's programs one after another, so the rows
    # rank 1 needs are pushed only after rank 0's first program has given up.
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=1.0 if rank == 0 else 30.0)
    case = Case(5 if rank == 0 else 3, 512, seed=2)
    inp = case.inputs(world_size)
    if debug:
        os.environ["TPFUSE_DEBUG"] = "1"
    try:
        tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
        raised = None
    except RuntimeError as exc:
        raised = str(exc)
    finally:
        os.environ.pop("TPFUSE_DEBUG", None)
    comm = tpfuse.get_communicator()
    region = comm.workspace._keep_alive[rank].view(layout.NUM_SLOTS, world_size, -1)[0, 1 - rank]
    untouched_past_calls = bool((region[5 * 512 :] == layout.SENTINEL).all())
    dist.barrier()
    tpfuse.destroy_all()
    return raised, untouched_past_calls


def test_mismatched_calls_are_named_in_debug_mode(rank_pool):
    for raised, _ in rank_pool(2).run(_mismatch, True):
        assert (
            "the ranks' fused calls differ (rank 0: 5 x 512 bfloat16 oneshot; rank 1: 3 x 512 bfloat16 "
            "oneshot)" in raised
        ), raised


def test_mismatched_calls_without_debug_time_out_and_stay_in_bounds(rank_pool):
    results = rank_pool(2).run(_mismatch, False)
    assert "fused call #1 (5 x 512) gave up" in results[0][0]  # rank 0 waits for rows rank 1 never sends
    assert results[1][0] is None  # rank 1 got every row it asked for
    assert all(untouched for _, untouched in results)  # nothing written past the larger call


def _edges(rank, world_size, backend, oneshot_max):
    device = rank_device(backend, rank)
    tpfuse.destroy_all()
    tpfuse.get_communicator(max_tokens=16, hidden=512)
    big = torch.finfo(torch.bfloat16).max / 4
    xs = [
        torch.randn(6, 512, generator=torch.Generator().manual_seed(r)).bfloat16() for r in range(world_size)
    ]
    xs[0][0, 7] = float("nan")
    xs[1][1, 9] = float("inf")
    xs[0][2, 3], xs[1][2, 3] = float("inf"), float("-inf")  # inf - inf
    for x in xs:
        x[3] = 0.0  # an all-zero row (the residual's row 3 is zero too)
        x[4] = big * torch.sign(x[4])  # near the bf16 maximum: the sum stays finite, its square does not
    residual = torch.randn(6, 512, generator=torch.Generator().manual_seed(9)).bfloat16()
    residual[3:5] = 0.0
    weight = torch.rand(512, generator=torch.Generator().manual_seed(10)).bfloat16() + 0.5
    with forced_table(world_size, device, oneshot_max):
        chosen = tpfuse.get_communicator().choose_algorithm(6, 512, torch.bfloat16)
        y, h = tpfuse.allreduce_add_rmsnorm(xs[rank].to(device), residual.to(device), weight.to(device), 1e-6)
    tpfuse.destroy_all()
    return chosen, y.cpu(), h.cpu(), xs, residual, weight


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("oneshot_max", [16, 0])
def test_nan_inf_zero_and_huge_values(rank_pool, backend, oneshot_max):
    results = rank_pool(2, backend).run(_edges, backend, oneshot_max)
    chosen, y, h, xs, residual, weight = results[0]
    assert chosen == ("oneshot" if oneshot_max else "twoshot")
    for _, y_r, h_r, *_ in results:  # identical on every rank, NaN payloads included
        assert torch.equal(y_r.view(torch.int16), y.view(torch.int16))
        assert torch.equal(h_r.view(torch.int16), h.view(torch.int16))
    total = xs[0].float() + xs[1].float()
    h_ref = (total + residual.float()).bfloat16()
    torch.testing.assert_close(h, h_ref, equal_nan=True, atol=0, rtol=0.01)
    assert h[0, 7].isnan() and h[1, 9].isinf() and h[2, 3].isnan()
    assert y[0].isnan().all()  # a NaN in a row makes its whole norm NaN, as in torch
    assert torch.equal(y[3], torch.zeros_like(y[3])) and torch.equal(h[3], torch.zeros_like(h[3]))
    assert h[4].isfinite().all()
    # The norm follows torch's fp32 RMSNorm exactly in kind: for the huge row, sum(h^2) overflows fp32
    # and y is 0 (an unfused model computes the same); for the inf row, y is NaN where h is inf.
    y_torch, _ = add_rmsnorm_reference(
        h.float() if chosen == "twoshot" else total,
        residual if chosen != "twoshot" else None,
        weight,
        1e-6,
        out_dtype=torch.bfloat16,
    )
    torch.testing.assert_close(y, y_torch, equal_nan=True, atol=0.02, rtol=0.02)
    assert torch.equal(y[4], torch.zeros_like(y[4]))


def _many_communicators(rank, world_size, backend):
    device = rank_device(backend, rank)
    groups = [dist.new_group(list(range(world_size))) for _ in range(2)]
    for g in groups:  # NCCL sets up each group's own buffers at its first collective: not ours to count
        dist.barrier(group=g)
    if device.type == "cuda":
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info(device)[0]
    x = torch.randn(4, 4096, device=device).bfloat16()
    weight = torch.ones(4096, device=device).bfloat16()
    for i in range(100):
        comms = [tpfuse.get_communicator(g, max_tokens=64, hidden=4096) for g in groups]  # two at once
        outs = [tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6, group=g)[1] for g in groups]
        assert torch.equal(outs[0], outs[1])
        for comm in comms:
            comm.destroy()
        if i == 0:
            try:
                comms[0].check_usable()
            except RuntimeError as exc:
                destroyed_raises = "destroyed" in str(exc)
    dist.barrier()
    report = {"destroyed raises when used": destroyed_raises, "no shm files": ws.shm_files() == []}
    with open("/proc/self/maps") as fh:
        report["no mappings left"] = not any(ws.SHM_PREFIX in line for line in fh)
    if device.type == "cuda":
        torch.cuda.synchronize()
        report["GPU memory kept"] = free_before - torch.cuda.mem_get_info(device)[0]
    report["stats"] = tpfuse.stats()
    return report


@pytest.mark.parametrize("backend", BACKENDS)
def test_hundred_communicators_leave_nothing_behind(rank_pool, backend):
    for report in rank_pool(2, backend).run(_many_communicators, backend, timeout=900):
        failed = {k: v for k, v in report.items() if k not in ("stats", "GPU memory kept") and v is not True}
        assert not failed, failed
        assert fused_calls(report["stats"], backends=("triton",)) >= 200


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_hundred_communicators_give_gpu_memory_back(rank_pool):
    for report in rank_pool(2, "nccl").run(_many_communicators, "nccl", timeout=900):
        assert report["GPU memory kept"] < 64 << 20, report["GPU memory kept"]


def _second_thread(rank, world_size):
    import threading

    tpfuse.destroy_all()
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=30.0)
    case = Case(5, 512, seed=3)
    inp = case.inputs(world_size, torch.device("cpu"))

    def call():
        return tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)

    out = {}
    if rank == 1:
        time.sleep(1.0)  # rank 0's first call is still waiting for this one when its second thread calls
        out["first"] = call()
    else:
        worker = threading.Thread(target=lambda: out.update(first=call()))
        worker.start()
        time.sleep(0.3)
        try:
            call()
            out["second"] = "no error"
        except RuntimeError as exc:
            out["second"] = str(exc)
        worker.join()
    out["after"] = call()  # the communicator still serves the ranks' next call
    return out


def test_a_call_from_a_second_thread_is_refused(rank_pool):
    results = rank_pool(2).run(_second_thread, timeout=300)
    assert "a fused call came from a second thread" in results[0]["second"], results[0]["second"]
    for key in ("first", "after"):  # the calls that ran: right on both ranks, bit-identical
        check_results(Case(5, 512, seed=3), 2, [r[key] for r in results])
