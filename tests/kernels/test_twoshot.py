"""The two-shot kernel: uneven token counts, fewer tokens than ranks, mixing with the one-shot."""

import pytest
import torch

import tpfuse
from tpfuse.testing import forced_table, previous_slot_is_clear
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends, rank_device

BACKENDS = rank_backends()


def _sequence(rank, world_size, backend, cases, oneshot_max):
    device = rank_device(backend, rank)
    comm = tpfuse.get_communicator(max_tokens=40, hidden=4096)
    tpfuse.reset_stats()
    out, cleared, chosen = [], [], []
    with forced_table(world_size, device, oneshot_max):
        for case in cases:
            chosen.append(comm.choose_algorithm(case.tokens, case.hidden, case.dtype))
            inp = case.inputs(world_size, device)
            y, h = tpfuse.allreduce_add_rmsnorm(
                inp["xs"][rank], inp["residual"], inp["weight"], case.eps, quant_scale=inp["quant_scale"]
            )
            out.append((y.cpu(), h.cpu()))
            if device.type == "cpu":
                cleared.append(previous_slot_is_clear(comm))
    return {"outputs": out, "cleared": cleared, "chosen": chosen, "stats": tpfuse.stats()}


# Token counts not divisible by the world size, fewer tokens than ranks, more tokens than programs
# (4 on the CPU), hidden sizes that change every call (8 and 4104 are not multiples of 16).
SEQUENCE = [(5, 4096), (1, 512), (17, 4096), (3, 512), (2, 2880), (16, 8), (40, 4096), (9, 512), (7, 2880),
            (3, 4104)]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("oneshot_max, world_size", [(0, 2)]
                         + [pytest.param(*p, marks=pytest.mark.extended) for p in ((4, 2), (0, 3), (4, 3))])
def test_twoshot_sequences(rank_pool, backend, world_size, oneshot_max):
    cases = [
        Case(
            t,
            h,
            torch.bfloat16 if i % 2 else torch.float16,
            residual=i % 3 != 0,
            seed=i,
            quant_scale=0.05 if i == 4 else None,
            cancelling=i % 3 == 1,
        )
        for i, (t, h) in enumerate(SEQUENCE)
    ]
    results = rank_pool(world_size, backend).run(_sequence, backend, cases, oneshot_max)
    for i, case in enumerate(cases):
        check_results(case, world_size, [res["outputs"][i] for res in results])
    expected = ["oneshot" if t <= oneshot_max or t < world_size else "twoshot" for t, _ in SEQUENCE]
    for res in results:
        assert all(res["cleared"]), res["cleared"]
        assert res["chosen"] == expected
        assert res["stats"] == {f"triton.{a}": expected.count(a) for a in set(expected)}


def _wide(rank, world_size, cases):
    tpfuse.get_communicator(
        max_tokens=24, hidden=512, wait_timeout_s=300
    )  # 8 spinning processes share 2 cores
    out, chosen = [], []
    with forced_table(world_size, "cpu", oneshot_max=4, hiddens=(64, 512)):
        for case in cases:
            inp = case.inputs(world_size)
            chosen.append(tpfuse.get_communicator().choose_algorithm(case.tokens, case.hidden, case.dtype))
            y, h = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
            out.append((y, h))
    return {"outputs": out, "chosen": chosen}


@pytest.mark.parametrize("world_size", [4, pytest.param(8, marks=pytest.mark.extended)])
def test_both_kernels_at_four_and_eight_ranks(rank_pool, world_size):
    # Fewer tokens than ranks, one-shot sizes, two-shot sizes not divisible by the world size.
    cases = [
        Case(3, 512, seed=1, cancelling=True),
        Case(4, 64, residual=False, seed=2),
        Case(13, 512, seed=3, cancelling=True),
        Case(20, 64, seed=4),
    ]
    if world_size == 8:  # 8 processes on CI's 2 cores: one call of each kernel
        cases = cases[::2]
    results = rank_pool(world_size).run(_wide, cases, timeout=900)
    for i, case in enumerate(cases):
        check_results(case, world_size, [res["outputs"][i] for res in results])
    expected = ["oneshot" if c.tokens <= 4 or c.tokens < world_size else "twoshot" for c in cases]
    assert all(res["chosen"] == expected for res in results)


def _grouped(rank, world_size, backend, cases, group_rows):
    from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm

    device = rank_device(backend, rank)
    comm = tpfuse.get_communicator(max_tokens=40, hidden=4096)
    out = []
    for case in cases:
        call = case.fused_call(case.inputs(world_size, device), rank)
        twoshot_allreduce_add_rmsnorm(comm.fused_backend.launch, call, group_rows=group_rows)
        out.append((call.y.cpu(), call.h.cpu()))
    return out


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.parametrize("group_rows", [1, 3])
def test_twoshot_in_groups_of_rows(rank_pool, backend, world_size, group_rows):
    # Group sizes other than the default (GROUP_ROWS): a program scatters a group ahead of those it reduces.
    # 40 and 17 rows over 4 CPU programs: 10 and 4-5 rows a program, so several groups and a short last one.
    cases = [Case(t, h, seed=t, residual=t != 17) for t, h in ((40, 4096), (17, 512), (3, 2880))]
    results = rank_pool(world_size, backend).run(_grouped, backend, cases, group_rows)
    for i, case in enumerate(cases):
        check_results(case, world_size, [res[i] for res in results])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_thirty_two_warps_on_one_gpu():
    # max_warps=32 (a bench variant, docs/kernel-notes.md): the same op as the default, against float64.
    from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
    from tpfuse.testing import local_launch_contexts

    ctx = local_launch_contexts(torch.device("cuda"), 64 * 8192)[0]
    for case in (Case(64, 8192, seed=1), Case(33, 7168, seed=2, residual=False), Case(40, 4096, seed=3)):
        call = case.fused_call(case.inputs(1, "cuda"), 0)
        twoshot_allreduce_add_rmsnorm(ctx, call, max_warps=32)
        check_results(case, 1, [(call.y, call.h)])
