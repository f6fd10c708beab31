"""The MoE finalize in the fused call (x [T, K, H] of the top-k experts' outputs, their weights, a shared
expert's part) against float64 on every rank: both kernels at 2 and 3 ranks, over the workspace, the
fp8 output, world size 1 (the local kernel), the reference path, ranks whose calls differ, bad input."""

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.testing import cases_on_a_fresh_group, error_of
from tpfuse.testing.cases import Case, check_case_runs

pytestmark = pytest.mark.slow

CASES = [Case(3, 4096, torch.bfloat16, experts=4, topk_weighted=True, shared_expert=True, seed=1),
         Case(3, 2880, torch.float16, residual=False, experts=8, topk_weighted=True, seed=2),
         Case(5, 512, torch.bfloat16, experts=2, seed=3),  # weighted already: no topk_weights
         Case(4, 1024, torch.bfloat16, shared_expert=True, seed=4),  # a shared expert alone (x [T, H])
         Case(3, 4096, torch.bfloat16, experts=6, topk_weighted=True, shared_expert=True, scale_group=128,
              seed=5),
         Case(40, 4096, torch.bfloat16, experts=2, topk_weighted=True, shared_expert=True,
              seed=6),  # > workspace
         Case(3, 64, torch.float32, experts=4, topk_weighted=True, shared_expert=True, seed=7)]  # reference
KERNEL_CASES = 6  # the others' dtype takes the reference path


def _moe_cases(rank, world_size, oneshot_max, with_communicator):
    return cases_on_a_fresh_group(rank, world_size, CASES, oneshot_max, with_communicator,
                                  hiddens=(64, 512, 1024, 2880, 4096))


# 3 ranks: the extended lane (CI's 10 minutes).
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extended)])
@pytest.mark.parametrize("algorithm, oneshot_max", [("oneshot", 4096), ("twoshot", 0)])
def test_moe_finalize_matches_float64_on_every_rank(rank_pool, world_size, algorithm, oneshot_max):
    results = rank_pool(world_size).run(_moe_cases, oneshot_max, True)
    check_case_runs(world_size, CASES, results, KERNEL_CASES, algorithm, chunked=(5,))  # the 40 rows in parts


@pytest.mark.parametrize("world_size", [1, 2])
def test_moe_finalize_without_a_communicator(rank_pool, world_size):
    """World size 1: the local kernel finalizes; 2 ranks: the group's own all-reduce of the parts."""
    results = rank_pool(world_size).run(_moe_cases, 4096, False)
    check_case_runs(world_size, CASES, results, KERNEL_CASES, "local" if world_size == 1 else "reference")


def _one_rank_finalizes(rank, world_size):
    comm = tpfuse.get_communicator(max_tokens=16, hidden=4096)
    weight = torch.ones(64, dtype=torch.bfloat16)
    x = torch.randn(2, 3, 64).to(torch.bfloat16) if rank == 0 else torch.randn(2, 64).to(torch.bfloat16)
    return error_of(lambda: tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6), comm)


def test_ranks_whose_calls_differ_get_an_error(rank_pool):
    errors = rank_pool(2).run(_one_rank_finalizes)
    assert all(e is not None and "does not match rank" in e and "MoE finalize" in e for e in errors), errors


def _bad_inputs(rank, world_size):
    tpfuse.get_communicator(max_tokens=16, hidden=4096)
    bf16 = dict(dtype=torch.bfloat16)
    x, weight = torch.randn(2, 4, 64, **bf16), torch.ones(64, **bf16)
    calls = {
        "4-D x": dict(x=torch.randn(2, 4, 1, 64, **bf16)),
        "weights of another K": dict(topk_weights=torch.ones(2, 3)),
        "int weights": dict(topk_weights=torch.ones(2, 4, dtype=torch.int32)),
        "weights without experts": dict(x=torch.randn(2, 64, **bf16), topk_weights=torch.ones(2, 4)),
        "shared expert of another shape": dict(shared_expert=torch.randn(2, 32, **bf16)),
        "fp16 shared expert": dict(shared_expert=torch.randn(2, 64, dtype=torch.float16)),
        "residual of the experts' shape": dict(residual=torch.randn(2, 4, 64, **bf16)),
    }
    found = {}
    for name, change in calls.items():
        args = dict(x=x, residual=None, topk_weights=None, shared_expert=None) | change
        try:
            tpfuse.allreduce_add_rmsnorm(args["x"], args["residual"], weight, 1e-6,
                                         topk_weights=args["topk_weights"],
                                         shared_expert=args["shared_expert"])
        except (TypeError, ValueError) as exc:
            found[name] = (type(exc), str(exc))
    try:  # the op itself, as a graph calls it, with a K that is not x's
        torch.ops.tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6, dist.group.WORLD.group_name, experts=2)
    except ValueError as exc:
        found["experts not x's K"] = (ValueError, str(exc))
    return found


BAD = {"4-D x": (ValueError, "[tokens, K, hidden] for a MoE finalize"),
       "weights of another K": (ValueError, "topk_weights has shape (2, 3); expected (2, 4)"),
       "int weights": (TypeError, "topk_weights has dtype torch.int32"),
       "weights without experts": (ValueError, "x must be [tokens, K, hidden]"),
       "shared expert of another shape": (ValueError, "shared_expert has shape (2, 32); expected (2, 64)"),
       "fp16 shared expert": (TypeError, "shared_expert has dtype torch.float16; expected torch.bfloat16"),
       "residual of the experts' shape": (ValueError, "residual has shape (2, 4, 64); expected (2, 64)"),
       "experts not x's K": (ValueError, "pass experts=4 (got 2)")}


def test_bad_input_is_named(rank_pool):
    for found in rank_pool(2).run(_bad_inputs):
        for name, (error, message) in BAD.items():
            assert name in found and found[name][0] is error and message in found[name][1], \
                (name, found.get(name))


# Finalizes that differ between the ranks in what the block end's flags alone did not tell apart: the
# weights (one rank weights its experts' outputs, the other takes them as weighted), K, the shared expert.
FINALIZE_DIFFERENCES = {
    # name: (rank 0's (K, weighted, shared expert), rank 1's), and the words each rank's call is named by
    "weighted on one rank": (((3, True, False), (3, False, False)), ("3 experts a token, topk_weights",
                                                                    "3 experts a token")),
    "K = 3 and K = 2": (((3, False, False), (2, False, False)), ("3 experts a token", "2 experts a token")),
    "shared expert on one rank": (((2, True, True), (2, True, False)), ("topk_weights, shared expert",
                                                                       "2 experts a token, topk_weights")),
}


def _finalizes_differ(rank, world_size, name, with_communicator):
    """Each rank's call of the named difference: the error it raised, or None. A group of its own: after a
    difference the group's collectives may be out of step (docs/reliability.md)."""
    group = dist.new_group(list(range(world_size)))
    comm = tpfuse.get_communicator(group, max_tokens=16, hidden=512, wait_timeout_s=3.0) \
        if with_communicator else None
    experts, weighted, shared = FINALIZE_DIFFERENCES[name][0][rank]
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(2, experts, 64, generator=gen).to(torch.bfloat16)
    topk_weights = torch.rand(2, experts, generator=gen) if weighted else None
    shared_expert = torch.randn(2, 64, generator=gen).to(torch.bfloat16) if shared else None

    def call():
        tpfuse.allreduce_add_rmsnorm(x, None, torch.ones(64, dtype=torch.bfloat16), 1e-6, group=group,
                                     topk_weights=topk_weights, shared_expert=shared_expert)
        if comm is not None:
            comm.check_errors()

    return error_of(call, comm)


@pytest.mark.parametrize("name", list(FINALIZE_DIFFERENCES))
def test_finalizes_that_differ_raise_on_every_rank_in_the_kernels(rank_pool, name):
    """The kernels compare the call descriptors: each rank names both calls' finalize."""
    words = FINALIZE_DIFFERENCES[name][1]
    errors = rank_pool(2).run(_finalizes_differ, name, True, timeout=120)
    for rank, error in enumerate(errors):
        assert error is not None and f"does not match rank {1 - rank}'s call" in error, (rank, error)
        ours, theirs = error.split("does not match")
        assert words[rank] in ours and words[1 - rank] in theirs, (rank, error)


@pytest.mark.parametrize("name", list(FINALIZE_DIFFERENCES))
def test_finalizes_that_differ_raise_on_every_rank_on_the_reference_path(rank_pool, name):
    """No communicator: the exchange before the group's all-reduce (``comm.agreement``) names the flags."""
    words = FINALIZE_DIFFERENCES[name][1]
    for error in rank_pool(2).run(_finalizes_differ, name, False, timeout=120):
        assert error is not None and "the ranks differ at reference-path call #1 (" in error, error
        assert ": flags (rank 0: (" in error, error
        rank0, rank1 = error.split(": flags (")[1].split("rank 1: ")
        assert words[0] in rank0 and words[1] in rank1, error
