"""Faults and edges: a stalled peer, mismatched calls, NaN/Inf/zero/huge values, many communicators.

docs/reliability.md lists each case with what happens and the test here that shows it.
"""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.blockend.reference import add_rmsnorm_reference
from tpfuse.comm import workspace as ws
from tpfuse.select import AlgorithmTable, reload_tables
from tpfuse.testing import forced_table, fused_calls
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends, rank_device

BACKENDS = rank_backends()


def _stall(rank, world_size, backend):
    device = rank_device(backend, rank)
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=1.0)
    case = Case(13, 512, seed=1)  # more rows than the CPU's 4 programs: each waits, none adds to the bound
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
    return report


@pytest.mark.parametrize("backend", BACKENDS)
def test_stalled_peer_raises_instead_of_hanging(rank_pool, backend):
    report = rank_pool(2, backend).run(_stall, backend, timeout=300)[0]
    raised = report["raised"]
    assert "fused call #1 (13 x 512 bfloat16 oneshot, residual) gave up after waiting 1" in raised, report
    assert "(wait_timeout_s=1)" in raised and "group " in raised and "rank 0" in raised
    assert 1.0 <= report["seconds"] < 3.0, report  # the bound holds in wall time
    assert "gave up" in report["unusable after"], report


# Calls that differ between the ranks. Each runs on a group of its own: a rank that gives up in a
# collective leaves it pending there (the group is then out of step and is dropped, as
# docs/reliability.md tells users to do), and the pool's default group stays usable.
TIMEOUT_S = 3.0
LIMIT = 16  # tokens x 512 a fused call takes; larger calls run as fused calls of 16 rows
MISMATCHES = {
    # name: (rank 0's call, rank 1's call), each (tokens, hidden, dtype)
    "tokens": ((5, 512, torch.bfloat16), (3, 512, torch.bfloat16)),
    "hidden": ((4, 512, torch.bfloat16), (4, 256, torch.bfloat16)),
    "dtype": ((4, 512, torch.bfloat16), (4, 512, torch.float16)),
    "empty on one rank": ((0, 512, torch.bfloat16), (6, 512, torch.bfloat16)),
    "fused and chunked": ((4, 512, torch.bfloat16), (32, 512, torch.bfloat16)),  # 4 rows against 16
    # 16 + 4 rows against 16 + 8
    "chunked, different tokens": ((20, 512, torch.bfloat16), (24, 512, torch.bfloat16)),
    "fused and reference (fp32)": ((4, 512, torch.bfloat16), (4, 512, torch.float32)),
    "reference, different tokens": ((4, 512, torch.float32), (6, 512, torch.float32)),
}


BOTH_FUSED = ["tokens", "hidden", "dtype", "empty on one rank", "fused and chunked",
              "chunked, different tokens"]


def _failing_call(name: str, rank: int) -> str:
    """How the fused call that differs reads in the error: the first (or, chunked alike, the second) one."""
    tokens, hidden, dtype = MISMATCHES[name][rank]
    if name == "chunked, different tokens":
        tokens -= LIMIT  # the first chunks agree
    return f"{min(tokens, LIMIT)} x {hidden} {str(dtype)[6:]}"


def _disagree(rank, world_size, name, backend="gloo"):
    device = rank_device(backend, rank)
    group = dist.new_group(list(range(world_size)))
    comm = tpfuse.get_communicator(group, max_tokens=LIMIT, hidden=512, wait_timeout_s=TIMEOUT_S)
    tokens, hidden, dtype = MISMATCHES[name][rank]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype).to(device)
    y = torch.full_like(x, 7.0)
    h = torch.full_like(x, 7.0)
    began = time.monotonic()
    try:
        weight = torch.ones(hidden, dtype=dtype, device=device)
        tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6, group=group, out=y, residual_out=h)
        comm.check_errors()  # the documented point on a GPU (the CPU checks inside the call)
        error = None
    except RuntimeError as exc:
        error = str(exc)
    outputs = "untouched" if bool((h == 7.0).all()) else "NaN" if bool(h.isnan().all()) else "data"
    report = {"error": error, "seconds": time.monotonic() - began, "outputs": outputs}
    comm.destroy()
    return report


# On GPUs only calls that both ranks fuse: a reference-path call there (float32) is NCCL's all-reduce as
# it is (bounded by the process group's timeout, not ours; docs/reliability.md).
@pytest.mark.parametrize("name,backend", [(name, "gloo") for name in MISMATCHES] +
                         [(name, "nccl") for name in BOTH_FUSED if "nccl" in BACKENDS])
def test_calls_that_differ_raise_on_every_rank_within_the_bound(rank_pool, name, backend):
    reports = rank_pool(2, backend).run(_disagree, name, backend, timeout=120)
    compile_s = 30 if backend == "nccl" else 0  # a GPU compiles the kernel for a new dtype first
    for rank, report in enumerate(reports):
        assert report["error"] is not None, (rank, report)
        assert report["seconds"] < TIMEOUT_S + 5 + compile_s, (rank, report)  # never a hang
        assert report["outputs"] != "data", (rank, report)  # no rank returns data of a mismatched call
    if name in BOTH_FUSED:  # the kernels compare call descriptors: each rank names both calls, at once
        for rank, report in enumerate(reports):
            ours, theirs = _failing_call(name, rank), _failing_call(name, 1 - rank)
            assert f"({ours} " in report["error"] and f"does not match rank {1 - rank}'s call ({theirs} " in \
                report["error"], report["error"]
            assert report["seconds"] < TIMEOUT_S + compile_s, report  # found by the comparison, not the bound
    elif name.startswith("fused and reference"):  # rank 0 fused, rank 1 in the group's all-reduce
        assert "gave up after waiting" in reports[0]["error"], reports[0]["error"]
        assert "no answer from a peer within 3 s at reference-path call #1" in reports[1]["error"]
    else:  # both on the reference path: the exchange before the all-reduce names the field
        for report in reports:
            assert "the ranks differ at reference-path call #1" in report["error"], report["error"]
            assert "tokens (rank 0: 4, rank 1: 6)" in report["error"], report["error"]


def _recreated_after_mismatch(rank, world_size):
    """After a fused call that differed: destroy, create again, and the same group serves right calls."""
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=TIMEOUT_S)
    x = torch.randn(5 if rank == 0 else 3, 512).bfloat16()
    try:
        tpfuse.allreduce_add_rmsnorm(x, None, torch.ones(512).bfloat16(), 1e-6)
    except RuntimeError as exc:
        first = str(exc)
    try:
        tpfuse.allreduce_add_rmsnorm(x, None, torch.ones(512).bfloat16(), 1e-6)
    except RuntimeError as exc:
        refused = str(exc)
    tpfuse.destroy_all()
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=TIMEOUT_S)
    case = Case(5, 512, seed=4)
    inp = case.inputs(world_size)
    result = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
    return {"first error": first, "next call": refused, "after creating again": result}


def test_a_communicator_created_again_after_a_mismatch_is_right(rank_pool):
    results = rank_pool(2).run(_recreated_after_mismatch)
    for res in results:  # unusable until created again
        assert "does not match" in res["first error"] and res["next call"] == res["first error"], res
    check_results(Case(5, 512, seed=4), 2, [res["after creating again"] for res in results])


def _both_empty(rank, world_size):
    tpfuse.get_communicator(max_tokens=16, hidden=512, wait_timeout_s=TIMEOUT_S)
    weight = torch.ones(512).bfloat16()
    tpfuse.reset_stats()
    y, h = tpfuse.allreduce_add_rmsnorm(torch.empty(0, 512).bfloat16(), None, weight, 1e-6)
    case = Case(3, 512, seed=5)
    inp = case.inputs(world_size)
    after = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
    return {"shape": tuple(y.shape), "stats": tpfuse.stats(), "next call": after}


def test_an_empty_batch_on_every_rank_is_a_call_like_any_other(rank_pool):
    results = rank_pool(2).run(_both_empty)
    for res in results:
        assert res["shape"] == (0, 512) and res["stats"] == {"triton.oneshot": 2}, res
    check_results(Case(3, 512, seed=5), 2, [res["next call"] for res in results])


SETUP_DIFFERENCES = {"max_tokens": ({"max_tokens": 16}, {"max_tokens": 32}),
                     "algorithm table": ({}, {"table": True})}


def _setup_differs(rank, world_size, name, tmp):
    group = dist.new_group(list(range(world_size)))
    options = SETUP_DIFFERENCES[name][rank]
    if options.pop("table", False):  # a tuned table on this rank's node only
        path = f"{tmp}/table-rank{rank}.json"
        with open(path, "w") as fh:
            json.dump(AlgorithmTable("cpu", world_size, {512: (1, 8)}).to_json(), fh)
        os.environ["TPFUSE_TUNE_TABLE"] = path
        reload_tables()
    try:
        tpfuse.get_communicator(group, hidden=512, wait_timeout_s=TIMEOUT_S, **{"max_tokens": 16, **options})
        return "no error"
    except RuntimeError as exc:
        return str(exc)
    finally:
        os.environ.pop("TPFUSE_TUNE_TABLE", None)
        reload_tables()


@pytest.mark.parametrize("name", list(SETUP_DIFFERENCES))
def test_ranks_that_differ_at_set_up_are_named(rank_pool, name, tmp_path):
    for error in rank_pool(2).run(_setup_differs, name, str(tmp_path)):
        assert "the ranks differ at the set-up of the communicator of group" in error, error
        assert f": {name} (rank 0: " in error, error
    assert "max_tokens (rank 0: 16, rank 1: 32)" in error or name != "max_tokens"


def _edges(rank, world_size, backend, oneshot_max):
    device = rank_device(backend, rank)
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
    return {"chosen": chosen, "y": y.cpu(), "h": h.cpu(), "xs": xs, "residual": residual, "weight": weight}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("oneshot_max", [16, 0])
def test_nan_inf_zero_and_huge_values(rank_pool, backend, oneshot_max):
    results = rank_pool(2, backend).run(_edges, backend, oneshot_max)
    chosen, y, h, xs, residual, weight = (results[0][key]
                                          for key in ("chosen", "y", "h", "xs", "residual", "weight"))
    assert chosen == ("oneshot" if oneshot_max else "twoshot")
    for res in results:  # identical on every rank, NaN payloads included
        assert torch.equal(res["y"].view(torch.int16), y.view(torch.int16))
        assert torch.equal(res["h"].view(torch.int16), h.view(torch.int16))
    total = xs[0].float() + xs[1].float()
    h_ref = (total + residual.float()).bfloat16()
    torch.testing.assert_close(h, h_ref, equal_nan=True, atol=0, rtol=0.01)
    assert h[0, 7].isnan() and h[1, 9].isinf() and h[2, 3].isnan()
    assert y[0].isnan().all()  # a NaN in a row makes its whole norm NaN, as in torch
    assert torch.equal(y[3], torch.zeros_like(y[3])) and torch.equal(h[3], torch.zeros_like(h[3]))
    assert h[4].isfinite().all()
    # The norm follows torch's fp32 RMSNorm exactly in kind: for the huge row, sum(h^2) overflows fp32
    # and y is 0 (an unfused model computes the same); for the inf row, y is NaN where h is inf.
    y_torch, _, _ = add_rmsnorm_reference(
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
        if i == 0 and device.type == "cpu":  # what "no mappings left" looks for: every rank's file, per group
            mapped_while_alive = len(ws.mapped_shm_files()) == len(groups) * world_size
        for comm in comms:
            comm.destroy()
        if i == 0:
            try:
                comms[0].check_usable()
            except RuntimeError as exc:
                destroyed_raises = "destroyed" in str(exc)
    dist.barrier()
    # Workspace files only: earlier tasks of the pool leave other mappings with "tpfuse-" in their path
    # (shared objects Inductor compiled into tpfuse.bench.e2e's /tmp/tpfuse-e2e-cache-*), kept until exit.
    report = {"destroyed raises when used": destroyed_raises, "no shm files": ws.shm_files() == [],
              "no mappings left": ws.mapped_shm_files() == []}
    if device.type == "cpu":
        report["workspace mappings seen while alive"] = mapped_while_alive
    if device.type == "cuda":
        torch.cuda.synchronize()
        report["GPU memory kept"] = free_before - torch.cuda.mem_get_info(device)[0]
    report["stats"] = tpfuse.stats()
    return report


@pytest.mark.extended  # CI time (32 s); the lifecycle test covers one communicator's release
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
