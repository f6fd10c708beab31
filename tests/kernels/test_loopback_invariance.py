"""One token, one answer on a GPU: two ranks sharing one GPU (``testing.local_launch_contexts``) reduce the
same rows in batches of several sizes and places with the one-shot and the two-shot as compiled for the
GPU, and the gathered path (``ops.route.block_end_of_parts``: the local kernel on the rank-order sum);
every row's outputs must be the same bits everywhere and on both ranks (docs/determinism.md). The CPU
interpreter runs every reduction alike whatever the kernel; compiled, each kernel's code is its own."""

import dataclasses

import pytest
import torch

from tpfuse.testing.cases import Case, batch_inputs, row_outputs

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")

ROWS = 40
BATCHES = [(7, 1), (5, 3), (3, 8), (0, 40)]
BLOCK_ENDS = {
    "rmsnorm": {},
    "fp16": dict(dtype=torch.float16),
    "bias_post_norm": dict(bias=True, sum_norm=True),
    "layer_norm": dict(layer_norm=True, norm_bias=True, residual=False),
    "dynamic_fp8_group": dict(scale_group=128, normed_copy=True),
    "nvfp4": dict(fp4="nvfp4"),
    "mxfp4_shuffled": dict(fp4="mxfp4", scale_layout="shuffled"),
    "moe_finalize": dict(experts=2, topk_weighted=True, shared_expert=True),
}


def _run_both_ranks(contexts, calls, kernel):
    """Each rank's launch on a stream of its own (they wait for each other), then their errors checked.

    Loading a kernel waits for the GPU to be idle, so a rank's first launch of a kernel would wait out
    its peer's wait (see scripts/loopback_latency.py): each pair runs first with a short bound (it may
    fail), then on a fresh workspace with the real one."""
    from tpfuse.kernels import layout

    streams = [torch.cuda.Stream() for _ in calls]
    here = torch.cuda.current_stream()
    for bound in (10**6, 2 * 10**9):
        for ctx in contexts:
            ctx.wait_limit_ns = bound
            ctx.workspace.buffer.fill_(layout.SENTINEL)
            ctx.workspace.state.zero_()
        for ctx, call, stream in zip(contexts, calls, streams):
            stream.wait_stream(here)
            with torch.cuda.stream(stream):
                kernel(ctx, call)
        for stream in streams:
            here.wait_stream(stream)
        torch.cuda.synchronize()
    assert all(ctx.workspace.state[layout.STATE_ERROR].item() == 0 for ctx in contexts)


@pytest.mark.parametrize("hidden", [4096, 8192])
@pytest.mark.parametrize("name", list(BLOCK_ENDS))
def test_rows_are_the_same_bits_in_every_batch_and_kernel(name, hidden):
    from tpfuse.kernels.oneshot import oneshot_allreduce_add_rmsnorm
    from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
    from tpfuse.ops.route import block_end_of_parts, part_as_sent
    from tpfuse.testing import local_launch_contexts

    device = torch.device("cuda")
    contexts = local_launch_contexts(device, ROWS * hidden, 2)
    case = Case(ROWS, hidden, seed=hidden + len(name), **BLOCK_ENDS[name])
    inputs = case.inputs(2, device)
    seen = {}
    for first, rows in BATCHES:
        part = dataclasses.replace(case, tokens=rows)
        sliced = batch_inputs(inputs, first, rows)
        runs = {}
        for algorithm, kernel in (("oneshot", oneshot_allreduce_add_rmsnorm),
                                  ("twoshot", twoshot_allreduce_add_rmsnorm)):
            calls = [part.fused_call(sliced, rank) for rank in range(2)]
            _run_both_ranks(contexts, calls, kernel)
            runs.update({(algorithm, rank): call for rank, call in enumerate(calls)})
        gathered = part.fused_call(sliced, 0)
        block_end_of_parts(gathered, [part_as_sent(part.fused_call(sliced, r)) for r in range(2)])
        runs[("gathered", 0)] = gathered
        for where, call in runs.items():
            outputs = (call.y, call.h, call.scales, call.normed)
            for i, row in enumerate(row_outputs(part, sliced, outputs, rows)):
                first_where, first_row = seen.setdefault(first + i, ((where, first, rows), row))
                for out, bits in row.items():
                    assert torch.equal(bits, first_row[out]), (
                        f"{name} hidden {hidden}: row {first + i}'s {out} differs between {first_where} and "
                        f"{(where, first, rows)} ((kernel, rank), first row, rows)")
