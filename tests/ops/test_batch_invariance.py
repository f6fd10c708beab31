"""One token, one answer: a row's outputs never depend on the other rows of its call, its position, the
algorithm or the path (docs/determinism.md).

The same rows are reduced in batches of several sizes and positions that take the one-shot, the two-shot,
fused calls of the workspace's rows (a batch over it) and, in batch-invariant mode without a
communicator, the gathered path; every row's outputs (y, its scales, h, the norm's copy) must be the
same bits in every batch and on every rank, for every block end. And y must be the norm of the h the op
returns, within the norm's own rounding: a y normed from the unrounded sum is up to a step further off.
"""

import pytest
import torch

from tpfuse.blockend.reference import norm_of
from tpfuse.testing.cases import Case, batch_inputs, row_outputs

pytestmark = pytest.mark.slow

HIDDEN = 512
ROWS = 40
WORKSPACE_ROWS = 16  # the communicator's rows at HIDDEN: batches above it run in parts
ONESHOT_MAX = 4  # the forced algorithm table: the one-shot up to 4 rows, the two-shot above
#: (first row, rows): one-shot (1, 3), two-shot (8, 16), over the workspace (30, 40), at several positions.
BATCHES = [(7, 1), (5, 3), (3, 8), (0, 16), (2, 30), (0, 40)]
ROUTES = {1: "oneshot", 3: "oneshot", 8: "twoshot", 16: "twoshot", 30: "chunked", 40: "chunked"}

#: Every block end: each step alone, combined, every quantised output and layout, the MoE finalize, the
#: norm's copy, the plain all-reduce, both 16-bit dtypes.
BLOCK_ENDS = {
    "rmsnorm": {},
    "fp16": dict(dtype=torch.float16),
    "no_residual": dict(residual=False),
    "bias": dict(bias=True),
    "post_norm": dict(sum_norm=True),
    "layer_norm": dict(layer_norm=True, norm_bias=True),
    "static_fp8": dict(quant_scale=0.02),
    "dynamic_fp8_token": dict(scale_group=HIDDEN),
    "dynamic_fp8_group": dict(scale_group=128, normed_copy=True),
    "ue8m0_columns": dict(scale_group=128, ue8m0_scales=True, scale_layout="columns"),
    "packed_ue8m0": dict(scale_group=128, scale_layout="packed_ue8m0"),
    "nvfp4": dict(fp4="nvfp4", normed_copy=True),
    "mxfp4": dict(fp4="mxfp4"),
    "mxfp4_shuffled": dict(fp4="mxfp4", scale_layout="shuffled"),
    "moe_finalize": dict(experts=2, topk_weighted=True, shared_expert=True),
    "all_reduce": dict(normed=False, residual=False),
    "combined": dict(bias=True, sum_norm=True, experts=2, topk_weighted=True, scale_group=128,
                     normed_copy=True),
}
#: What 3 and 4 ranks run in the multi-process lane (all of them in the extended lane).
AT_MORE_RANKS = ("rmsnorm", "post_norm", "dynamic_fp8_group", "nvfp4", "moe_finalize", "all_reduce")


def _rows_in_batches(rank, world_size, names, gathered):
    """Every block end of ``names``, its rows in :data:`BATCHES`, through the public API on a new group:
    with a communicator (``gathered`` False: the kernels), or in batch-invariant mode without one (the
    gathered path). Returns {name: {"rows": {(first, rows): [per-row bytes]}, "stats": [...],
    "calls": ...}}."""
    import torch.distributed as dist

    import tpfuse
    from tpfuse.testing import forced_table

    group = dist.new_group(list(range(world_size)))
    comm = None
    if gathered:
        tpfuse.set_batch_invariant(True)
    else:
        comm = tpfuse.get_communicator(group, max_tokens=WORKSPACE_ROWS, hidden=HIDDEN)
        assert comm.max_token_num(HIDDEN, torch.bfloat16) == WORKSPACE_ROWS
    results = {}
    with forced_table(world_size, "cpu", oneshot_max=ONESHOT_MAX, hiddens=(HIDDEN,)):
        for name in names:
            case = Case(ROWS, HIDDEN, seed=len(name), **BLOCK_ENDS[name])
            inputs = case.inputs(world_size)
            batches, stats = {}, []
            for first, rows in BATCHES:
                sliced = batch_inputs(inputs, first, rows)
                tpfuse.reset_stats()
                outputs = case.call(sliced, rank, group=group)
                stats.append(tpfuse.stats())
                batches[(first, rows)] = row_outputs(case, sliced, outputs, rows)
            results[name] = {"rows": batches, "stats": stats, "calls": [_call_outputs(case, inputs)]}
    if comm is not None:
        comm.destroy()
    tpfuse.set_batch_invariant(None)
    return results


def _call_outputs(case: Case, inputs: dict) -> dict:
    """What the main process needs to check y against the norm of h: the norm's inputs."""
    return {"weight": inputs["weight"], "epilogue_norm": (case.layer_norm, inputs["norm_bias"]),
            "eps": case.eps, "normed": case.normed,
            "quantised": bool(case.fp4 or case.scale_group or case.quant_scale)}


def _check_invariant(world_size: int, names, kernel_runs: list[dict], gathered_runs: list[dict] | None):
    """Every row's outputs: one set of bits over every batch, rank and path."""
    for name in names:
        first_seen: dict[int, tuple] = {}
        runs = [("kernels", r, run[name]) for r, run in enumerate(kernel_runs)]
        if gathered_runs is not None:
            runs += [("gathered", r, run[name]) for r, run in enumerate(gathered_runs)]
        for path, rank, result in runs:
            for (first, rows), per_row in result["rows"].items():
                for i, outputs in enumerate(per_row):
                    where = (path, rank, first, rows)
                    seen = first_seen.setdefault(first + i, (where, outputs))
                    for out, bits in outputs.items():
                        if not torch.equal(bits, seen[1][out]):
                            raise AssertionError(
                                f"{name}, {world_size} ranks: row {first + i}'s {out} differs between "
                                f"{seen[0]} and {where} (path, rank, first row, rows)")


def _check_y_is_the_norm_of_h(names, runs: list[dict]):
    """Unquantised y (and the norm's copy) against the float64 norm of the returned h: within half a
    step of the output (plus fp32's error), where a y normed from the unrounded sum is up to 1.5 off."""
    from tpfuse.blockend.epilogue import Epilogue

    for name in names:
        result = runs[0][name]
        norm = result["calls"][0]
        if not norm["normed"]:
            continue
        case = Case(ROWS, HIDDEN, **BLOCK_ENDS[name])
        layer_norm, norm_bias = norm["epilogue_norm"]
        epilogue = Epilogue(layer_norm=layer_norm, norm_bias=norm_bias)
        for (first, rows), per_row in result["rows"].items():
            for i, outputs in enumerate(per_row):
                h = outputs["h"].view(case.dtype).double()
                wanted = norm_of(h.unsqueeze(0), norm["weight"], norm["eps"], epilogue)[0]
                got = outputs.get("normed") if norm["quantised"] else outputs.get("y")
                if got is None:
                    continue
                got = got.view(case.dtype).double()
                info = torch.finfo(case.dtype)  # half a step of the output, subnormals' fixed step below
                half_step = torch.maximum(2.0 ** torch.floor(torch.log2(wanted.abs().clamp(min=info.tiny))),
                                          torch.tensor(info.tiny, dtype=torch.float64)) * info.eps / 2
                bad = (got - wanted).abs() > half_step * (1 + 2.0 ** -10) + 1e-30
                assert not bad.any(), (
                    f"{name}: row {first + i} (batch {first}:{first + rows}): y is not the norm of the "
                    f"returned h at {bad.sum().item()} places, e.g. {got[bad][0].item()} vs "
                    f"{wanted[bad][0].item()}")


def _routes(stats: list[dict]) -> list[str]:
    """The route each batch took, from its stats (``tpfuse.stats()``): several fused calls are a call run
    in parts of the workspace's rows."""
    taken = []
    for counts in stats:
        calls = {name: n for name, n in counts.items() if n}
        taken.append("chunked" if sum(calls.values()) > 1 else ",".join(n.split(".")[-1] for n in calls))
    return taken


def _run(rank_pool, world_size: int, names) -> None:
    pool = rank_pool(world_size)
    kernel_runs = pool.run(_rows_in_batches, names, False)
    gathered_runs = pool.run(_rows_in_batches, names, True)
    for name in names:  # the batches took the routes they were made for
        assert _routes(kernel_runs[0][name]["stats"]) == [ROUTES[rows] for _, rows in BATCHES], (
            name, kernel_runs[0][name]["stats"])
        assert _routes(gathered_runs[0][name]["stats"]) == ["gathered"] * len(BATCHES), (
            name, gathered_runs[0][name]["stats"])
    _check_invariant(world_size, names, kernel_runs, gathered_runs)
    _check_y_is_the_norm_of_h(names, kernel_runs)


def test_every_block_end_is_batch_invariant_at_two_ranks(rank_pool):
    _run(rank_pool, 2, list(BLOCK_ENDS))


@pytest.mark.parametrize("world_size", [3, 4])
def test_block_ends_are_batch_invariant_at_more_ranks(rank_pool, world_size):
    _run(rank_pool, world_size, AT_MORE_RANKS)


@pytest.mark.extended
@pytest.mark.parametrize("world_size", [3, 4])
def test_every_block_end_is_batch_invariant_at_more_ranks(rank_pool, world_size):
    _run(rank_pool, world_size, [n for n in BLOCK_ENDS if n not in AT_MORE_RANKS])


@pytest.mark.extended
def test_block_ends_are_batch_invariant_at_eight_ranks(rank_pool):
    _run(rank_pool, 8, ("rmsnorm", "dynamic_fp8_group", "moe_finalize"))
