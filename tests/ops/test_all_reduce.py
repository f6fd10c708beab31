"""``tpfuse.all_reduce``, the plain all-reduce on tpfuse's kernels, against float64 on every rank: both
kernels, over the workspace, the reference path, bit-identical ranks, and bad input named."""

import pytest
import torch

import tpfuse
from tpfuse.testing import error_of, forced_table, fused_calls
from tpfuse.testing.cases import Case, check_results

pytestmark = pytest.mark.slow

CASES = [Case(1, 4096, torch.bfloat16, residual=False, normed=False, seed=1),
         Case(5, 2880, torch.float16, residual=False, normed=False, seed=2),
         Case(7, 64, torch.bfloat16, residual=False, normed=False, cancelling=True, seed=3),
         Case(40, 4096, torch.bfloat16, residual=False, normed=False, seed=4),  # over a 16-row workspace
         Case(3, 512, torch.float32, residual=False, normed=False, seed=5)]  # float32: the reference path


def _all_reduce_cases(rank, world_size, oneshot_max):
    comm = tpfuse.get_communicator(max_tokens=16, hidden=4096)
    outputs, stats = [], []
    with forced_table(world_size, "cpu", oneshot_max=oneshot_max, hiddens=(64, 512, 2880, 4096)):
        for case in CASES:
            inputs = case.inputs(world_size)
            x = inputs["xs"][rank].clone()
            tpfuse.reset_stats()
            outputs.append(case.call(inputs, rank))
            assert torch.equal(x, inputs["xs"][rank]), "all_reduce changed its input"
            stats.append(tpfuse.stats())
        # [batch, seq, hidden]: the leading dims are tokens; the shape comes back.
        three_d = CASES[0].inputs(world_size)["xs"][rank].reshape(1, 1, -1)
        shaped = tpfuse.all_reduce(three_d).shape
    comm.check_errors()
    # A communicator the pool's earlier tests grew holds more rows than the 16 asked for.
    return {"outputs": outputs, "stats": stats, "shape": shaped,
            "limit": comm.max_token_num(4096, torch.bfloat16)}


@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extended)])
@pytest.mark.parametrize("algorithm, oneshot_max", [("oneshot", 4096), ("twoshot", 0)])
def test_all_reduce_matches_float64_on_every_rank(rank_pool, world_size, algorithm, oneshot_max):
    results = rank_pool(world_size).run(_all_reduce_cases, oneshot_max)
    for i, case in enumerate(CASES):
        check_results(case, world_size, [res["outputs"][i] for res in results])
    for res in results:
        # one fused call each, the 40 rows as calls of the workspace's rows, the reference for float32
        chunks = -(-40 // res["limit"])
        assert [fused_calls(s) for s in res["stats"]] == [1, 1, 1, chunks, 0], res["stats"]
        assert all(set(s) == {f"triton.{algorithm}"} for s in res["stats"][1:4]), res["stats"]
        assert res["stats"][4] == {"reference": 1}
        assert res["shape"] == (1, 1, 4096)


def _mismatched(rank, world_size):
    comm = tpfuse.get_communicator(max_tokens=16, hidden=4096)
    x = torch.randn(2 + rank, 64, dtype=torch.bfloat16)  # the ranks' calls differ in tokens
    return error_of(lambda: tpfuse.all_reduce(x), comm)


def test_ranks_whose_calls_differ_get_an_error(rank_pool):
    errors = rank_pool(2).run(_mismatched)
    assert all(e is not None and "does not match rank" in e and "no norm" in e for e in errors), errors


BAD = [("int32", TypeError, "x has dtype torch.int32"), ("transposed", ValueError, "x must be contiguous"),
       ("not a tensor", TypeError, "x must be a tensor")]


def _bad_inputs(rank, world_size):
    tpfuse.get_communicator(max_tokens=16, hidden=4096)
    inputs = {"int32": torch.zeros(4, 64, dtype=torch.int32),
              "transposed": torch.zeros(64, 8, dtype=torch.bfloat16).t(), "not a tensor": "x"}
    found = {}
    for name, x in inputs.items():
        try:
            tpfuse.all_reduce(x)
        except (TypeError, ValueError) as exc:
            found[name] = (type(exc), str(exc))
    return found


def test_bad_input_is_named(rank_pool):
    for found in rank_pool(2).run(_bad_inputs):
        for name, error, message in BAD:
            assert (name in found and found[name][0] is error
                    and message in found[name][1]), (name, found.get(name))
