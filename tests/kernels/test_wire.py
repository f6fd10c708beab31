"""The two-shot's opt-in fp8 wire: within its documented bound of float64, ranks bit-identical."""

import dataclasses

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.testing import forced_table
from tpfuse.testing.cases import Case
from tpfuse.testing.ranks import rank_backends, rank_device

BACKENDS = rank_backends()
HIDDENS = (512, 640, 1024)

# 640 is five blocks of 128 in a BLOCK_H of 1024 (masked blocks); rows over the CPU's 4 programs;
# values over many binades (the scale per block follows them); an epilogue step after the sum.
CASES = [
    Case(9, 512, seed=1),
    Case(6, 640, torch.float16, residual=False, seed=2),
    Case(13, 1024, seed=3, bias=True, layer_norm=True, norm_bias=True),
    Case(5, 512, seed=4, sum_norm=True),
]


def _scaled(case, inputs):
    """Inputs whose magnitudes span 2**-12 .. 2**6 from block to block."""
    spread = 2.0 ** torch.linspace(-12, 6, case.hidden // 128).repeat_interleave(128)
    inputs["xs"] = [(x.float() * spread.to(x.device)).to(case.dtype) for x in inputs["xs"]]
    return inputs


def _calls(rank, world_size, backend, cases):
    device = rank_device(backend, rank)
    group = dist.new_group(list(range(world_size)))
    comm = tpfuse.get_communicator(group, max_tokens=16, hidden=1024, compress="fp8")
    tpfuse.reset_stats()
    out = []
    with forced_table(world_size, device, oneshot_max=0, hiddens=HIDDENS):
        for case in cases:
            inputs = _scaled(case, case.inputs(world_size, device))
            out.append(tuple(t.cpu() for t in case.call(inputs, rank, group=group)))
    stats = tpfuse.stats()
    comm.destroy()
    return {"outputs": out, "stats": stats}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("world_size", [2, 3])
def test_fp8_wire_within_its_bound_and_bit_identical(rank_pool, backend, world_size):
    from tpfuse.blockend.reference import fused_reference_float64
    from tpfuse.kernels.wire import wire_error_bound, wire_sum

    results = rank_pool(world_size, backend).run(_calls, backend, CASES)
    for i, case in enumerate(CASES):
        inputs = _scaled(case, case.inputs(world_size))
        y_ref, h_ref = fused_reference_float64(inputs["xs"], inputs["residual"], inputs["weight"], case.eps,
                                               case.epilogue(inputs))
        reduced = torch.stack([x.double() for x in inputs["xs"]]).sum(0)
        y0, h0 = results[0]["outputs"][i]
        for res in results:  # every rank the same bits
            y, h = res["outputs"][i]
            assert torch.equal(y.view(torch.uint8), y0.view(torch.uint8))
            assert torch.equal(h.view(torch.uint8), h0.view(torch.uint8))
        # Exactly what the wire's definition gives (kernels.wire.wire_sum, then the epilogue in fp32).
        if not (case.sum_norm or case.layer_norm):
            expected = wire_sum(inputs["xs"]) + (inputs["residual"].float() if case.residual else 0)
            assert torch.equal(h0, expected.to(case.dtype)), case
        error = (h0.double() - h_ref).abs()
        if not case.sum_norm:  # h = sum (+ bias) (+ residual): the sum's error, then h's rounding
            bound = wire_error_bound(inputs["xs"], reduced) + h_ref.abs() * 2.0 ** -8
            assert (error <= bound).all(), (case, (error - bound).max().item())
        # The wire is in use: errors of fp8's size, far above the 16-bit path's (2**-8 relative).
        assert (error / h_ref.abs().clamp(min=1e-3)).max() > 2 ** -6, case
        # y is the norm of the h every rank holds, as in the exact two-shot.
        y_of_h, _ = fused_reference_float64([h0], None, inputs["weight"], case.eps,
                                            dataclasses.replace(case.epilogue(inputs), bias=None,
                                                                sum_weight=None))
        torch.testing.assert_close(y0.double(), y_of_h, atol=2.5e-2, rtol=1.6e-2)
    for res in results:
        assert res["stats"] == {"triton.twoshot": len(CASES)}


def _refused(rank, world_size):
    errors = []
    for kwargs in ({"compress": "fp4"}, {"compress": "fp8", "backend": "reference"}):
        try:
            tpfuse.get_communicator(dist.new_group(list(range(world_size))), **kwargs)
            errors.append(None)
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_compress_choices_are_checked(rank_pool):
    for errors in rank_pool(2).run(_refused):
        assert "unknown compress 'fp4'" in errors[0] and "needs the triton backend" in errors[1], errors


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_wire_encoding_compiled_on_one_gpu():
    # A group of one still quantises its own x and the sum: the wire's arithmetic as the GPU compiles
    # it (reshapes into blocks, code pairs split and joined), bit-exact with its definition.
    from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
    from tpfuse.kernels.wire import wire_sum
    from tpfuse.testing import local_launch_contexts

    device = torch.device("cuda")
    ctx = local_launch_contexts(device, 16 * 1024)[0]
    for case in CASES:
        inputs = _scaled(case, case.inputs(1, device))
        x = inputs["xs"][0]
        call = case.fused_call(inputs, 0)
        y, h = call.y, call.h
        twoshot_allreduce_add_rmsnorm(ctx, call, wire=True)
        if not (case.sum_norm or case.layer_norm):
            expected = wire_sum([x.cpu()]) + (inputs["residual"].float().cpu() if case.residual else 0)
            assert torch.equal(h.cpu(), expected.to(case.dtype)), case
        assert not h.isnan().any() and not y.isnan().any(), case
