"""The one-shot kernel's protocol: slot rotation, clearing, sentinel values, capacity."""

import collections
import dataclasses

import pytest
import torch

import tpfuse
from tpfuse.testing import previous_slot_is_clear
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends, rank_device

BACKENDS = rank_backends()

# Token counts and hidden sizes that change from call to call, in an order that makes every slot
# be cleared after calls of other shapes. Hidden 8 and 4104 are not multiples of 16: on a GPU the
# kernel then relies on its own alignment reasoning, not on Triton's divisibility hint.
SEQUENCE = [(5, 4096), (1, 512), (17, 4096), (3, 512), (2, 2880), (16, 8), (3, 4104), (1, 4096), (9, 512)]


def _sequence(rank, world_size, backend, cases, check_clear):
    device = rank_device(backend, rank)
    comm = tpfuse.get_communicator(max_tokens=24, hidden=4096)
    tpfuse.reset_stats()
    out, cleared = [], []
    for case in cases:
        inp = case.inputs(world_size, device)
        y, h = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
        out.append((y.cpu(), h.cpu()))
        if check_clear:
            cleared.append(previous_slot_is_clear(comm))
    return {"outputs": out, "cleared": cleared, "stats": tpfuse.stats()}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2] + [pytest.param(n, marks=pytest.mark.extended) for n in (3, 4)])
def test_changing_shapes_rotate_and_clear_slots(rank_pool, backend, world_size):
    cases = [Case(t, h, torch.bfloat16 if i % 2 else torch.float16, residual=i % 3 != 0, seed=i,
                  cancelling=i % 3 == 1)
             for i, (t, h) in enumerate(SEQUENCE * (2 if world_size < 4 else 1))]  # 4 ranks: CI's time
    results = rank_pool(world_size, backend).run(_sequence, backend, cases, backend == "gloo")
    for i, case in enumerate(cases):
        check_results(case, world_size, [res["outputs"][i] for res in results])
    for res in results:
        assert all(res["cleared"]), res["cleared"]
        assert res["stats"] == {"triton.oneshot": len(cases)}


def _special_values(rank, world_size, backend, case):
    device = rank_device(backend, rank)
    tpfuse.get_communicator(max_tokens=24, hidden=4096)
    inp = case.inputs(world_size, device)
    xs = [x.clone() for x in inp["xs"]]
    for r, x in enumerate(xs):  # -0.0 is the sentinel's bit pattern; subnormals must pass unchanged
        x[:, ::3] = -0.0
        x[:, 1::7] = torch.finfo(x.dtype).tiny / (2 + r)
        x[0, :] = -0.0  # a whole row of -0.0 from every rank
    y, h = tpfuse.allreduce_add_rmsnorm(xs[rank], inp["residual"], inp["weight"], case.eps)
    return {"outputs": (y.cpu(), h.cpu()), "xs": [x.cpu() for x in xs]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_negative_zero_and_subnormal_inputs(rank_pool, backend, dtype):
    case = Case(4, 512, dtype, residual=False, seed=3)
    results = rank_pool(2, backend).run(_special_values, backend, case)
    inputs = case.inputs(2)
    inputs["xs"] = results[0]["xs"]
    check_results(case, 2, [res["outputs"] for res in results], inputs)
    h = results[0]["outputs"][1]
    assert torch.equal(h[0], torch.zeros_like(h[0]))  # all -0.0 sums to zero, not a hang or NaN


def _over_capacity(rank, world_size, backend):
    device = rank_device(backend, rank)
    comm = tpfuse.get_communicator(max_tokens=24, hidden=4096)
    limit = comm.max_token_num(4096, torch.bfloat16)
    # The pool's communicator may be larger than asked for here (an earlier test grew it), so the call
    # at the limit may take either kernel: the one the table gives.
    fused = comm.choose_algorithm(limit, 4096, torch.bfloat16)
    tpfuse.reset_stats()
    out = []
    calls = ((limit, torch.bfloat16), (2 * limit + 1, torch.bfloat16), (limit + 1, torch.float32))
    for tokens, dtype in calls:
        case = Case(tokens, 4096, dtype, seed=tokens)
        inp = case.inputs(world_size, device)
        y, h = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
        out.append((y.cpu(), h.cpu()))
    return {"limit": limit, "outputs": out, "stats": tpfuse.stats(), "fused": fused}


@pytest.mark.parametrize("backend", BACKENDS)
def test_calls_over_the_workspace_run_fused_in_chunks(rank_pool, backend):
    # 2 x limit + 1 rows: two fused calls of the limit and a one-row one-shot, every wait bounded;
    # float32, which the kernels do not take, takes the reference path (the group's all-reduce).
    results = rank_pool(2, backend).run(_over_capacity, backend)
    limit, fused = results[0]["limit"], results[0]["fused"]
    assert limit >= 24
    for i, (tokens, dtype) in enumerate(((limit, torch.bfloat16), (2 * limit + 1, torch.bfloat16),
                                         (limit + 1, torch.float32))):
        check_results(Case(tokens, 4096, dtype, seed=tokens), 2, [res["outputs"][i] for res in results])
    assert fused in ("oneshot", "twoshot"), fused
    expected = collections.Counter({f"triton.{fused}": 3, "reference": 1})
    expected["triton.oneshot"] += 1
    assert all(res["stats"] == dict(expected) for res in results)


# Programs enough for every chunk of a few rows to get a pusher, as on a GPU (the interpreter runs
# programs one after another, so any grid runs).
SPARE_PROGRAMS = 16


def _variants(rank, world_size, backend, case, names):
    """name -> (y, h) of one call of the one-shot kernel, for each of the benchmark's variants ``names``."""
    from tpfuse.bench.providers import ONESHOT_VARIANTS
    from tpfuse.kernels.oneshot import OneShotVariant, oneshot_allreduce_add_rmsnorm

    device = rank_device(backend, rank)
    comm = tpfuse.get_communicator(max_tokens=case.tokens, hidden=case.hidden)
    inp = case.inputs(world_size, device)
    out = {}
    for name in names:
        call = case.fused_call(inp, rank)
        launch = dataclasses.replace(comm.fused_backend.launch, max_programs=SPARE_PROGRAMS, plans={})
        oneshot_allreduce_add_rmsnorm(launch, call, variant=OneShotVariant(**ONESHOT_VARIANTS[name]))
        out[name] = (call.y.cpu(), call.h.cpu())
    return out


@pytest.mark.extended  # the bench's launch variants (a harness): CI leaves it to scripts/gpu_check.sh tests
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("tokens, hidden", [(20, 8192), (1, 7168), (2, 4096)])
def test_benchmark_launch_variants_compute_the_same_op(rank_pool, backend, tokens, hidden):
    # 20 rows of 16 KiB: some programs take two rows (16 programs), no split push. A row or two: the
    # default splits the push (7168 = 3.5 chunks of 2048 words) and the no_split_push variant does not.
    from tpfuse.bench.providers import ONESHOT_VARIANTS

    case, names = Case(tokens, hidden, seed=11), sorted(ONESHOT_VARIANTS)
    results = rank_pool(2, backend).run(_variants, backend, case, names)
    for name in names:
        check_results(case, 2, [res[name] for res in results])


def test_split_push_only_where_every_chunk_has_a_resident_program():
    from tpfuse.kernels.oneshot import split_push_programs

    def pushers(tokens, hidden, sms=132, words=2048):  # the launcher's grid: one program a row
        return split_push_programs(tokens, hidden, min(tokens, sms), sms, words)

    # The sizes measured on 2 x H200 (docs/kernel-notes.md): split where it won, not elsewhere.
    assert [pushers(t, 8192) for t in (1, 8, 16, 32, 64)] == [4, 32, 64, 0, 0]
    assert [pushers(t, 7168) for t in (1, 16, 32)] == [4, 64, 0]
    assert [pushers(t, 4096) for t in (1, 32, 64)] == [2, 64, 0]
    assert pushers(1, 2048) == 0  # a row of one chunk keeps its push
    assert pushers(8, 8192, sms=32) == 0  # a smaller GPU: the grid would not be resident
    assert pushers(8, 8192, words=0) == 0  # the no_split_push variant
