"""The fused op against float64, on every rank, through the kernel and the reference path."""

import itertools

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends, rank_device

BACKENDS = rank_backends()

HIDDENS = [8, 64, 2880, 4096, 5120, 7168]


def accuracy_cases(hiddens: list[int] = HIDDENS) -> list[Case]:
    cases = []
    for seed, (dtype, residual, hidden, tokens) in enumerate(itertools.product(
            [torch.bfloat16, torch.float16, torch.float32], [True, False], hiddens, [1, 3])):
        cases.append(Case(tokens, hidden, dtype, residual, seed=seed))
    cases += [
        Case(5, 4096, torch.bfloat16, True, quant_scale=0.05, seed=100),
        Case(1, 7168, torch.float16, False, quant_scale=0.05, seed=101),
        Case(3, 2880, torch.bfloat16, True, quant_scale=0.004, seed=102),  # many values clamp at 448
        Case(7, 5120, torch.bfloat16, True, weight_fp32=True, seed=103, eps=1e-5),
        Case(9, 64, torch.float32, True, quant_scale=0.05, seed=104),
    ]
    return cases


def _run_cases(rank, world_size, backend, cases, path):
    device = rank_device(backend, rank)
    if path == "kernel":
        group = dist.group.WORLD
        tpfuse.get_communicator(group, max_tokens=16, hidden=8192)
    else:  # a fresh group has no communicator: every call takes the reference path
        group = dist.new_group(list(range(world_size)))
    tpfuse.reset_stats()
    out = []
    for case in cases:
        inp = case.inputs(world_size, device)
        y, h = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps,
                                            group=group, quant_scale=inp["quant_scale"])
        out.append((y.cpu(), h.cpu()))
    return {"outputs": out, "stats": tpfuse.stats()}


@pytest.mark.parametrize("backend", BACKENDS)
# 3 ranks: extended in CI (the two-shot, block-end, fp8-wire and AMD tests keep 3 ranks there).
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extended)])
@pytest.mark.parametrize("path", ["kernel", "reference"])
def test_matches_float64_on_every_rank(rank_pool, backend, world_size, path):
    # 3 ranks: half the hidden sizes (a row that fills the block, one that does not, the smallest), for
    # CI's time; 2 ranks take them all.
    cases = accuracy_cases(HIDDENS if world_size == 2 else [8, 4096, 7168])
    results = rank_pool(world_size, backend).run(_run_cases, backend, cases, path)
    for i, case in enumerate(cases):
        check_results(case, world_size, [res["outputs"][i] for res in results])
    n_kernel = sum(c.dtype != torch.float32 for c in cases)
    expected = ({"triton.oneshot": n_kernel, "reference": len(cases) - n_kernel} if path == "kernel"
                else {"reference": len(cases)})
    assert all(res["stats"] == expected for res in results), [res["stats"] for res in results]


def _poisoned_no_residual(rank, world_size, backend, case, poison):
    device = rank_device(backend, rank)
    comm = tpfuse.get_communicator(max_tokens=16, hidden=8192)
    inp = case.inputs(world_size, device)
    y = torch.full((case.tokens, case.hidden), poison, dtype=case.dtype, device=device)
    h = torch.full_like(y, poison)
    if comm.fused_backend is not None and backend == "gloo":
        # Our own region of every slot is never read: fill it with garbage too.
        buf = comm.fused_backend.workspace.regions()
        buf[:, rank].fill_(0x3C00)
    tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], None, inp["weight"], case.eps, out=y, residual_out=h)
    return y.cpu(), h.cpu()


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_residual_never_reads_uninitialised_memory(rank_pool, backend):
    case = Case(5, 2880, torch.bfloat16, residual=False, seed=7)
    pool = rank_pool(2, backend)
    first = pool.run(_poisoned_no_residual, backend, case, float("nan"))
    second = pool.run(_poisoned_no_residual, backend, case, 12345.0)
    check_results(case, 2, first)
    for (y1, h1), (y2, h2) in zip(first, second):
        assert torch.equal(y1, y2) and torch.equal(h1, h2)


def _bad_calls(rank, world_size, backend):
    device = rank_device(backend, rank)
    tpfuse.get_communicator(max_tokens=16, hidden=8192)
    x = torch.randn(4, 64, device=device).bfloat16()
    w = torch.ones(64, device=device, dtype=torch.bfloat16)
    not_member = dist.new_group([0])  # on rank 1 this is the non-member sentinel
    calls = {
        "integer x": lambda: tpfuse.allreduce_add_rmsnorm(x.to(torch.int32), None, w, 1e-6),
        "residual dtype": lambda: tpfuse.allreduce_add_rmsnorm(x, x.half(), w, 1e-6),
        "residual shape": lambda: tpfuse.allreduce_add_rmsnorm(x, x[:2], w, 1e-6),
        "weight length": lambda: tpfuse.allreduce_add_rmsnorm(x, None, w[:32], 1e-6),
        "non-contiguous x": lambda: tpfuse.allreduce_add_rmsnorm(x.t(), None, w[:4], 1e-6),
        "1-D x": lambda: tpfuse.allreduce_add_rmsnorm(x[0], None, w, 1e-6),
        "out shape": lambda: tpfuse.allreduce_add_rmsnorm(x, None, w, 1e-6, out=torch.empty_like(x[:3])),
        "out dtype with fp8": lambda: tpfuse.allreduce_add_rmsnorm(
            x, None, w, 1e-6, out=torch.empty_like(x),
            quant_scale=torch.ones(1, device=device)),
        "quant_scale dtype": lambda: tpfuse.allreduce_add_rmsnorm(
            x, None, w, 1e-6, quant_scale=torch.ones(1, device=device, dtype=torch.float16)),
    }
    if rank == 1:
        calls["group not a member"] = lambda: tpfuse.allreduce_add_rmsnorm(x, None, w, 1e-6, group=not_member)
    found = {}
    for name, call in calls.items():
        try:
            call()
            found[name] = None
        except (TypeError, ValueError) as exc:
            found[name] = str(exc)
    return found


@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_input_gets_an_error_naming_the_problem(rank_pool, backend):
    words = {
        "integer x": "dtype", "residual dtype": "residual has dtype", "residual shape": "residual has shape",
        "weight length": "weight must have shape", "non-contiguous x": "contiguous", "1-D x": "2-D",
        "out shape": "out has shape", "out dtype with fp8": "float8_e4m3fn",
        "quant_scale dtype": "quant_scale", "group not a member": "not a member",
    }
    results = rank_pool(2, backend).run(_bad_calls, backend)
    assert "group not a member" in results[1]
    for found in results:
        for name, message in found.items():
            assert message is not None, f"{name}: no error raised"
            assert words[name] in message, f"{name}: {message!r}"
