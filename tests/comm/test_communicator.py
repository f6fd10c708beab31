"""Communicator lifecycle: one per group, registry-owned, explicit destroy, no files left behind."""

import os
import subprocess
import sys
import threading

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.comm import workspace as ws
from tpfuse.comm.communicator import lookup_communicator
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends

BACKENDS = rank_backends()


def _lifecycle(rank, world_size):
    report = {}
    a = tpfuse.get_communicator()
    report["same object"] = tpfuse.get_communicator() is a
    found = []
    threads = [threading.Thread(target=lambda: found.append(tpfuse.get_communicator())) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    report["same from threads"] = all(c is a for c in found)
    g1, g2 = dist.new_group(list(range(world_size))), dist.new_group(list(range(world_size)))
    c1, c2 = tpfuse.get_communicator(g1, max_tokens=4, hidden=64), tpfuse.get_communicator(g2)
    report["distinct groups"] = c1 is not c2 and c1 is not a and c2 is not a
    small = c1.workspace_bytes
    report["grows in place"] = tpfuse.get_communicator(g1, max_tokens=8, hidden=64) is c1 and (
        c1.workspace_bytes == 2 * small)
    dist.barrier()  # every rank has unlinked its file once all have mapped it
    report["no files while alive"] = ws.shm_files() == []
    c1.destroy()
    c1.destroy()  # harmless
    report["destroyed leaves registry"] = c1.destroyed and lookup_communicator(g1.group_name) is None
    try:
        c1.check_usable()
        report["destroyed raises when used"] = False
    except RuntimeError as exc:
        report["destroyed raises when used"] = "destroyed" in str(exc)
    fresh = tpfuse.get_communicator(g1)
    report["fresh after destroy"] = (fresh is not c1 and not fresh.destroyed
                                     and fresh.fused_backend is not None)
    tpfuse.destroy_all()
    report["destroy_all"] = all(c.destroyed for c in (a, c2, fresh))
    dist.barrier()
    report["no files after destroy_all"] = ws.shm_files() == []
    return report


@pytest.mark.parametrize("backend", ["gloo"])
def test_communicator_lifecycle(rank_pool, backend):
    for report in rank_pool(2, backend).run(_lifecycle):
        failed = [name for name, ok in report.items() if not ok]
        assert not failed, failed


def _not_member(rank, world_size):
    group = dist.new_group([0])
    if rank == 0:
        return "member"
    try:
        tpfuse.get_communicator(group)
    except ValueError as exc:
        return str(exc)
    return None


def test_group_this_process_is_not_in_is_refused(rank_pool):
    assert "not a member" in rank_pool(2).run(_not_member)[1]


def test_stale_shm_files_of_dead_processes_are_removed():
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                          capture_output=True, text=True, check=True)
    pid = int(dead.stdout)
    stale = os.path.join(ws.SHM_DIR, f"{ws.SHM_PREFIX}deadbeef-r0-p{pid}")
    live = os.path.join(ws.SHM_DIR, f"{ws.SHM_PREFIX}cafe-r0-p{os.getpid()}")
    for path in (stale, live):
        open(path, "wb").close()
    try:
        ws.remove_stale_shm_files()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)


def _capture_refuses_allocation(rank, world_size):
    import torch

    group = dist.new_group(list(range(world_size)))
    stream = torch.cuda.Stream()
    graph = torch.cuda.CUDAGraph()
    message = None
    with torch.cuda.stream(stream):
        try:
            with torch.cuda.graph(graph, stream=stream):
                try:
                    tpfuse.get_communicator(group)
                except RuntimeError as exc:
                    message = str(exc)
        except Exception:
            pass
    return message


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_workspace_allocation_during_graph_capture_raises(rank_pool):
    for message in rank_pool(2, "nccl").run(_capture_refuses_allocation):
        assert message and "capture" in message, message


def _backend_choice(rank, world_size):
    report = {}
    errors = (("nccl", "unknown backend 'nccl'"), ("flashinfer", "flashinfer backend needs CUDA"))
    for bad, expected in errors:
        try:
            tpfuse.get_communicator(dist.new_group(list(range(world_size))), backend=bad)
            report[bad] = "no error"
        except ValueError as exc:
            report[bad] = expected in str(exc) or str(exc)
    group = dist.new_group(list(range(world_size)))
    comm = tpfuse.get_communicator(group, backend="reference")
    report["reference has no workspace"] = (comm.workspace_bytes == 0
                                            and comm.max_token_num(4096, torch.bfloat16) == 0)
    report["same object without a backend"] = tpfuse.get_communicator(group) is comm
    try:
        tpfuse.get_communicator(group, backend="triton")
        report["mismatch"] = "no error"
    except ValueError as exc:
        report["mismatch"] = "already has a communicator with backend 'reference'" in str(exc) or str(exc)
    return report


def test_backend_choice_and_errors(rank_pool):
    for report in rank_pool(2).run(_backend_choice):
        failed = {name: ok for name, ok in report.items() if ok is not True}
        assert not failed, failed


def _kept_for_graphs(rank, world_size):
    """A communicator whose fused calls were captured keeps each workspace it lets go of (a growth, a
    destroy) until exit; one never captured frees them."""
    import gc
    import weakref

    from tpfuse.comm import communicator

    report = {}
    case = Case(3, 64)
    inputs = case.inputs(world_size)
    plain, captured = (tpfuse.get_communicator(dist.new_group(list(range(world_size))), max_tokens=4,
                                               hidden=64)
                       for _ in range(2))

    def call(comm, capturing: bool):
        real = communicator._capturing
        communicator._capturing = lambda device: capturing  # a CPU stand-in for a CUDA-graph capture
        try:
            return case.call(inputs, rank, group=comm.group)
        finally:
            communicator._capturing = real

    call(plain, False)
    call(captured, True)
    olds = [weakref.ref(c.fused_backend.workspace) for c in (plain, captured)]
    for comm in (plain, captured):
        tpfuse.get_communicator(comm.group, max_tokens=16, hidden=64)  # grows: a new workspace
    gc.collect()
    report["never captured: old workspace freed"] = olds[0]() is None
    report["captured: old workspace kept"] = olds[1]() is not None and olds[1]().buffer is not None
    report["captured: kept until exit"] = any(b.workspace is olds[1]() for b in communicator._kept_for_graphs)
    got = call(captured, False)  # the grown workspace serves calls as before
    current = weakref.ref(captured.fused_backend.workspace)
    captured.destroy()
    plain.destroy()
    gc.collect()
    report["captured: destroyed workspace kept"] = current() is not None
    communicator._release_kept_for_graphs()
    gc.collect()
    report["released at exit"] = olds[1]() is None and current() is None
    return report, [t.cpu() for t in got]


def test_workspaces_captured_graphs_may_use_are_kept(rank_pool):
    results = rank_pool(2, "gloo").run(_kept_for_graphs)
    for report, _ in results:
        failed = [name for name, ok in report.items() if not ok]
        assert not failed, failed
    check_results(Case(3, 64), 2, [got for _, got in results])


def _graph_outlives_workspace(rank, world_size):
    """On GPUs: a graph captured with a fused call, replayed after a growth and after a destroy, computes
    right and leaves a tensor allocated after those (a canary) as it was."""
    from tpfuse.testing.ranks import rank_device

    device = rank_device("nccl", rank)
    case = Case(3, 256)
    inputs = case.inputs(world_size, device)
    comm = tpfuse.get_communicator(max_tokens=4, hidden=256)
    out = [torch.empty(3, 256, dtype=torch.bfloat16, device=device) for _ in range(2)]
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        case.call(inputs, rank, out=out[0], residual_out=out[1])  # warm-up: compiles outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        case.call(inputs, rank, out=out[0], residual_out=out[1])
    results = []
    for step in ("grown", "destroyed"):
        if step == "grown":
            tpfuse.get_communicator(max_tokens=4096, hidden=8192)
        else:
            comm.destroy()
        canary = torch.full((1 << 22,), 7, dtype=torch.int16, device=device)  # where freed buffers would go
        for t in out:
            t.fill_(float("nan"))
        torch.cuda.synchronize()
        dist.barrier()
        graph.replay()
        torch.cuda.synchronize()
        results.append(((out[0].cpu(), out[1].cpu()), bool((canary == 7).all().item())))
    return results


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_a_graph_replayed_after_growth_and_destroy_is_right_and_harmless(rank_pool):
    per_rank = rank_pool(2, "nccl").run(_graph_outlives_workspace)
    for step in range(2):
        assert all(results[step][1] for results in per_rank), f"step {step}: a canary tensor changed"
        check_results(Case(3, 256), 2, [results[step][0] for results in per_rank])
