"""The kernels' protocol with AMD's choices, on CPU ranks: ``TPFUSE_INTERPRET_ARCH=gfx942``.

The interpreter then runs AMD's branch of every ``kernels/vendor.py`` helper: the ``s_memrealtime``
timer (served at the rate the host bounds waits with), ``.cv`` polls, ``.wt`` stores, the system-scope
arrival, and fp8 outputs in gfx942's float8_e4m3fnuz (largest 240), checked against float64 and torch's
float8_e4m3fnuz. One-shot and two-shot, 2 and 3 ranks, plain, static and dynamic fp8, the fp8 wire.
"""

import pytest
import torch

import tpfuse
from tpfuse.testing import forced_table
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import RankPool

pytestmark = pytest.mark.slow  # starts rank processes

AMD = {"TPFUSE_INTERPRET_ARCH": "gfx942"}
# (case, algorithm): a few tokens take the one-shot, the rest the two-shot (forced_table below).
CASES = [
    (Case(3, 512, torch.bfloat16, seed=1, cancelling=True), "oneshot"),
    (Case(2, 512, torch.float16, quant_scale=0.002, seed=2), "oneshot"),  # most of y clamps to +-240
    (Case(3, 256, torch.bfloat16, scale_group=128, seed=3), "oneshot"),
    (Case(9, 512, torch.bfloat16, seed=4, cancelling=True), "twoshot"),
    (Case(7, 256, torch.float16, quant_scale=0.008, seed=5), "twoshot"),  # part of y clamps
    (Case(8, 512, torch.bfloat16, scale_group=512, seed=6), "twoshot"),
]
ONESHOT_MAX = 4


def _calls(rank, world_size, cases, compress):
    from tpfuse import targets

    assert targets.interpreted_arch() == "gfx942" and targets.fp8_format("cpu").dtype == torch.float8_e4m3fnuz
    comm = tpfuse.get_communicator(max_tokens=16, hidden=512, compress=compress)
    tpfuse.reset_stats()
    out, chosen = [], []
    with forced_table(world_size, "cpu", ONESHOT_MAX, hiddens=(256, 512)):
        for case in cases:
            chosen.append(comm.choose_algorithm(case.tokens, case.hidden, case.dtype))
            out.append(tuple(t.cpu() for t in case.call(case.inputs(world_size), rank)))
    comm.check_errors()
    comm.destroy()  # the next test asks for another compression
    return {"outputs": out, "chosen": chosen, "stats": tpfuse.stats()}


# 2 ranks: extended in CI (its 10 minutes); 3 ranks there cover a rank that reads two peers.
@pytest.fixture(scope="module", params=[pytest.param(2, marks=pytest.mark.extended), 3])
def amd_pool(request):
    with RankPool(request.param, "gloo", env=AMD) as pool:
        yield pool


def test_kernels_with_amd_choices_match_float64_and_float8_e4m3fnuz(amd_pool, monkeypatch):
    monkeypatch.setenv("TPFUSE_INTERPRET_ARCH", "gfx942")  # the references here take gfx942's fp8 too
    world = amd_pool.world_size
    cases = [case for case, _ in CASES]
    results = amd_pool.run(_calls, cases, None)
    for i, (case, algorithm) in enumerate(CASES):
        per_rank = [res["outputs"][i] for res in results]
        assert all(res["chosen"][i] == algorithm for res in results), (case, results[0]["chosen"])
        check_results(case, world, per_rank)  # float64, every rank, bit-identical
        y = per_rank[0][0]
        if case.quant_scale is not None or case.scale_group:
            assert y.dtype == torch.float8_e4m3fnuz, y.dtype
            codes = y.view(torch.uint8)
            assert not (codes == 0x80).any(), "e4m3fnuz's NaN code in the output"
            assert y.float().abs().max() <= 240
        if case.quant_scale is not None:
            # Where float64 says y / scale is past 240, the kernel's code is torch's 240, exactly.
            inputs = case.inputs(world)
            y_ref = sum(x.double() for x in inputs["xs"]) + inputs["residual"].double()
            y_ref = y_ref * torch.rsqrt(y_ref.pow(2).mean(-1, keepdim=True)
                                        + case.eps) * inputs["weight"].double()
            far = (y_ref / case.quant_scale).abs() > 250
            assert far.any()
            expected = (y_ref[far] / case.quant_scale).clamp(-240, 240).to(torch.float8_e4m3fnuz)
            assert torch.equal(y[far].view(torch.uint8), expected.view(torch.uint8))
    stats = results[0]["stats"]
    assert stats == {"triton.oneshot": 3, "triton.twoshot": 3}, stats


def test_fp8_wire_with_amd_choices(amd_pool, monkeypatch):
    """The wire's codes are e4m3fnuz on gfx942, its words and values the same as on NVIDIA (wire.py)."""
    from tpfuse.kernels.wire import wire_error_bound, wire_sum

    monkeypatch.setenv("TPFUSE_INTERPRET_ARCH", "gfx942")
    world = amd_pool.world_size
    if world == 2:
        pytest.skip("3 ranks cover the wire's AMD path (CI time)")
    case = Case(9, 256, torch.bfloat16, residual=False, seed=7)
    results = amd_pool.run(_calls, [case], "fp8")
    assert all(res["stats"] == {"triton.twoshot": 1} for res in results), results[0]["stats"]
    h = [res["outputs"][0][1] for res in results]
    assert all(torch.equal(h[0], other) for other in h[1:])
    xs = case.inputs(world)["xs"]
    reduced = wire_sum(xs)  # the NVIDIA-format (e4m3fn) reference of the same words
    assert torch.equal(h[0], reduced.to(h[0].dtype)), (h[0] - reduced).abs().max()
    exact = sum(x.double() for x in xs)
    assert ((reduced.double() - exact).abs() <= wire_error_bound(xs, reduced)).all()
