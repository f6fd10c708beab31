"""Sequence parallel's block end (ops.sequence_parallel, the two-shot's SHARDED rows) on 2, 3 and 4 CPU
ranks running the kernels: every block end against float64; a row's bits the same through the sharded
call, the all-reduce op, parts of a call over the workspace, the gathered path and in batches of other
sizes; the fused backward against float64 and the all-reduce backward's bits; autograd's gradients
against autograd of the unfused chain (reduce-scatter, add, norm, all-gather) in float64."""

import pytest
import torch

import tpfuse
from tpfuse.testing.cases import Case, check_results

pytestmark = pytest.mark.slow

#: Block ends through the sharded call: each step, fp16, no residual, static fp8, MoE-free.
CASES = [
    Case(12, 512, seed=1),
    Case(24, 2880, torch.float16, residual=False, seed=2),
    Case(12, 512, seed=3, bias=True, sum_norm=True),
    Case(12, 520, seed=4, layer_norm=True, norm_bias=True),
    Case(24, 512, seed=5, quant_scale=0.05, cancelling=True),
]


def _own(t, rank, world_size):
    rows = t.shape[0] // world_size
    return t[rank * rows:(rank + 1) * rows].contiguous()


def _step_kwargs(inputs, case):
    return dict(quant_scale=inputs["quant_scale"], bias=inputs["bias"], sum_weight=inputs["sum_weight"],
                layer_norm=case.layer_norm, norm_bias=inputs["norm_bias"])


def _forward(rank, world_size, cases, max_tokens, hidden=4096):
    tpfuse.get_communicator(max_tokens=max_tokens, hidden=hidden)
    tpfuse.reset_stats()
    out = []
    for case in cases:
        inp = case.inputs(world_size)
        residual = None if inp["residual"] is None else _own(inp["residual"], rank, world_size)
        kwargs = _step_kwargs(inp, case)
        y, h = tpfuse.reduce_scatter_add_rmsnorm_all_gather(inp["xs"][rank], residual, inp["weight"],
                                                            case.eps, **kwargs)
        y_ar, h_ar = tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps,
                                                  **kwargs)
        # The same rows in a smaller batch: the first row of every rank's shard, as a call of W rows.
        rows = case.tokens // world_size
        firsts = [x[::rows].contiguous() for x in inp["xs"]]
        first_residual = None if residual is None else residual[:1].contiguous()
        y_small, h_small = tpfuse.reduce_scatter_add_rmsnorm_all_gather(firsts[rank], first_residual,
                                                                        inp["weight"], case.eps, **kwargs)
        out.append(dict(y=y, h=h, y_ar=y_ar, h_ar=h_ar, y_small=y_small, h_small=h_small))
    return {"outputs": out, "stats": tpfuse.stats()}


def _check_forward(cases, world_size, results):
    for i, case in enumerate(cases):
        got = [res["outputs"][i] for res in results]
        h = torch.cat([g["h"] for g in got])
        check_results(case, world_size, [(g["y"], h) for g in got])
        rows = case.tokens // world_size
        for rank, g in enumerate(got):
            assert torch.equal(g["y"].view(torch.uint8), g["y_ar"].view(torch.uint8)), (case, rank)
            assert torch.equal(g["h"], _own(g["h_ar"], rank, world_size)), (case, rank)
            assert torch.equal(g["y_small"].view(torch.uint8), g["y"][::rows].view(torch.uint8)), (case, rank)
            assert torch.equal(g["h_small"], g["h"][:1]), (case, rank)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_every_block_end_sharded_against_float64_and_the_all_reduce_bits(rank_pool, world_size):
    cases = CASES if world_size == 2 else CASES[::2]
    results = rank_pool(world_size).run(_forward, cases, 64, timeout=900)
    _check_forward(cases, world_size, results)
    for res in results:  # every sharded call ran fused (two-shot), beside the all-reduce's calls
        assert res["stats"].get("triton.twoshot", 0) >= 2 * len(cases), res["stats"]
        assert not {"gathered", "reference"} & set(res["stats"]), res["stats"]


def test_calls_over_the_workspace_run_in_parts_with_the_same_bits(rank_pool):
    # A workspace of 8 rows of 512: 12 and 24 rows run as sharded parts of 4 rows of every rank's shard.
    cases = [CASES[0], CASES[4]]
    results = rank_pool(2).run(_forward, cases, 8, 512)
    _check_forward(cases, 2, results)
    for res in results:  # (12 + 24) / 8 parts sharded, as many all-reduce parts, 2 calls of 2 rows
        assert res["stats"]["triton.twoshot"] + res["stats"].get("triton.oneshot", 0) >= 2 * 5 + 2, res
        assert not {"gathered", "reference"} & set(res["stats"]), res["stats"]


def _gathered(rank, world_size, cases):
    """No communicator: every sharded call takes the gathered path, outside batch-invariant mode and in it."""
    tpfuse.reset_stats()
    out = []
    for invariant in (False, True):
        tpfuse.set_batch_invariant(invariant)
        for case in cases:
            inp = case.inputs(world_size)
            y, h = tpfuse.reduce_scatter_add_rmsnorm_all_gather(
                inp["xs"][rank], _own(inp["residual"], rank, world_size), inp["weight"], case.eps,
                **_step_kwargs(inp, case))
            out.append((y, h))
    tpfuse.set_batch_invariant(None)
    return {"outputs": out, "stats": tpfuse.stats()}


def test_without_a_communicator_the_gathered_path_gives_the_kernels_bits(rank_pool):
    cases = [CASES[0], CASES[2]]
    fused = rank_pool(2).run(_forward, cases, 64)
    gathered = rank_pool(2).run(_gathered, cases)
    for res in gathered:
        assert res["stats"] == {"gathered": 2 * len(cases)}, res["stats"]
    for rank in range(2):
        for i, (y, h) in enumerate(gathered[rank]["outputs"]):  # each case twice: outside the mode, in it
            want = fused[rank]["outputs"][i % len(cases)]
            assert torch.equal(y, want["y"]) and torch.equal(h, want["h"]), (i, rank)


#: Quantised outputs through the sharded call: dynamic fp8 with UE8M0 scales, NVFP4, MXFP4 with the
#: norm's copy.
QUANTISED = [Case(12, 512, seed=6, scale_group=128, ue8m0_scales=True), Case(12, 512, seed=7, fp4="nvfp4"),
             Case(24, 512, seed=8, fp4="mxfp4", normed_copy=True, bias=True)]


def _quantised(rank, world_size, cases):
    tpfuse.get_communicator(max_tokens=64, hidden=4096)
    out = []
    for case in cases:
        inp = case.inputs(world_size)
        words = dict(output=case.fp4 or "fp8", scale_group=case.scale_group or None,
                     ue8m0_scales=case.ue8m0_scales, global_scale=inp["global_scale"],
                     normed_copy=case.normed_copy, bias=inp["bias"])
        sharded = tpfuse.reduce_scatter_add_rmsnorm_all_gather_quant(
            inp["xs"][rank], _own(inp["residual"], rank, world_size), inp["weight"], case.eps, **words)
        reduced = tpfuse.allreduce_add_rmsnorm_quant(inp["xs"][rank], inp["residual"], inp["weight"],
                                                     case.eps, **words)
        out.append((tuple(sharded), tuple(reduced)))
    return out


def test_quantised_outputs_sharded_against_float64_and_the_all_reduce_bits(rank_pool):
    results = rank_pool(2).run(_quantised, QUANTISED)
    for i, case in enumerate(QUANTISED):
        h = torch.cat([res[i][0][2] for res in results])
        sharded = [res[i][0] for res in results]
        check_results(case, 2, [(y, h, scales, normed) for y, scales, _, normed in sharded])
        for rank, res in enumerate(results):
            (y, scales, h_own, normed), (y_ar, scales_ar, h_ar, normed_ar) = res[i]
            assert torch.equal(y.view(torch.uint8), y_ar.view(torch.uint8)), (case, rank)
            assert torch.equal(scales.view(torch.uint8), scales_ar.view(torch.uint8)), (case, rank)
            assert torch.equal(h_own, _own(h_ar, rank, 2)), (case, rank)
            assert normed is None or torch.equal(normed, normed_ar), (case, rank)


HIDDEN, EPS = 512, 1e-5


def _grad_inputs(world_size, rows, bias):
    g = torch.Generator().manual_seed(11 + rows)
    bf = torch.bfloat16
    return dict(xs=[torch.randn(rows, HIDDEN, generator=g).to(bf) for _ in range(world_size)],
                residual=torch.randn(rows, HIDDEN, generator=g).to(bf),
                weight=(1 + 0.1 * torch.randn(HIDDEN, generator=g)).to(bf),
                bias=(0.5 * torch.randn(HIDDEN, generator=g)).to(bf) if bias else None,
                g_ys=[torch.randn(rows, HIDDEN, generator=g).to(bf) for _ in range(world_size)],
                g_h=torch.randn(rows, HIDDEN, generator=g).to(bf))


def _backward(rank, world_size, rows, bias):
    tpfuse.get_communicator(max_tokens=64, hidden=4096)
    inp = _grad_inputs(world_size, rows, bias)
    own = {k: _own(inp[k], rank, world_size) for k in ("residual", "g_h")}
    # the fused backward alone, beside the all-reduce backward of the same rows
    a = inp["residual"]
    grad_in, own_grad_in, g_sum = tpfuse.reduce_scatter_rmsnorm_backward_all_gather(
        inp["g_ys"][rank], _own(a, rank, world_size), inp["weight"], EPS, own["g_h"])
    grad_in_ar, g_sum_ar = tpfuse.allreduce_rmsnorm_backward(inp["g_ys"][rank], a, inp["weight"], EPS,
                                                             inp["g_h"])
    # autograd through the op
    x = inp["xs"][rank].clone().requires_grad_()
    residual = own["residual"].clone().requires_grad_()
    weight = inp["weight"].clone().requires_grad_()
    b = None if inp["bias"] is None else inp["bias"].clone().requires_grad_()
    y, h = tpfuse.reduce_scatter_add_rmsnorm_all_gather(x, residual, weight, EPS, bias=b)
    torch.autograd.backward((y, h), (inp["g_ys"][rank], own["g_h"]))
    assert torch.equal(own_grad_in, _own(grad_in, rank, world_size))
    return dict(grad_in=grad_in, g_sum=g_sum, grad_in_ar=grad_in_ar, g_sum_ar=g_sum_ar, x=x.grad,
                residual=residual.grad, weight=weight.grad, bias=None if b is None else b.grad)


def _float64_gradients(inp, world_size):
    """Autograd of reduce-scatter -> (+ bias) -> + residual rows -> RMSNorm -> all-gather in float64, every
    rank's y gradient its part (summed by the all-gather's backward)."""
    xs = [x.double().requires_grad_() for x in inp["xs"]]
    residual = inp["residual"].double().requires_grad_()
    weight = inp["weight"].double().requires_grad_()
    bias = None if inp["bias"] is None else inp["bias"].double().requires_grad_()
    s = torch.stack(xs).sum(0)
    if bias is not None:
        s = s + bias
    h = s + residual
    y = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + EPS) * weight
    g_y = torch.stack([g.double() for g in inp["g_ys"]]).sum(0)
    torch.autograd.backward((y, h), (g_y, inp["g_h"].double()))
    return dict(x=xs[0].grad, residual=residual.grad, weight=weight.grad,
                bias=None if bias is None else bias.grad)


@pytest.mark.parametrize("world_size, rows, bias", [(2, 8, True), (3, 12, True), (2, 8, False)])
def test_the_fused_backward_and_autograd_against_float64(rank_pool, world_size, rows, bias):
    results = rank_pool(world_size).run(_backward, rows, bias)
    inp = _grad_inputs(world_size, rows, bias)
    ref = _float64_gradients(inp, world_size)
    for rank, res in enumerate(results):
        # a row's bits: the all-reduce backward's
        assert torch.equal(res["grad_in"], res["grad_in_ar"])
        assert torch.equal(res["g_sum"], _own(res["g_sum_ar"], rank, world_size))
        assert torch.equal(res["x"], results[0]["x"]) and torch.equal(res["weight"], results[0]["weight"])
        assert (res["bias"] is None) is not bias
        checked = (("x", 1), ("residual", 1), ("weight", rows)) + ((("bias", rows),) if bias else ())
        for name, scale in checked:
            expected = ref[name] if name != "residual" else _own(ref[name], rank, world_size)
            torch.testing.assert_close(res[name].double(), expected, atol=2e-2 * scale, rtol=2e-2,
                                       msg=f"rank {rank}: {name}")


def _backward_paths(rank, world_size, rows):
    """The fused backward of the same rows through the fused call, parts over a workspace of 4 rows and
    the gathered path (no communicator)."""
    inp = _grad_inputs(world_size, rows, False)
    args = (inp["g_ys"][rank], _own(inp["residual"], rank, world_size), inp["weight"], EPS,
            _own(inp["g_h"], rank, world_size))
    out, stats = [], []
    for max_tokens in (64, 4, None):
        tpfuse.destroy_all()
        if max_tokens is not None:
            tpfuse.get_communicator(max_tokens=max_tokens, hidden=HIDDEN)
        tpfuse.reset_stats()
        out.append(tpfuse.reduce_scatter_rmsnorm_backward_all_gather(*args))
        stats.append(tpfuse.stats())
    return out, stats


def test_the_fused_backward_has_the_same_bits_in_parts_and_on_the_gathered_path(rank_pool):
    for out, stats in rank_pool(2).run(_backward_paths, 8):
        assert stats == [{"triton.twoshot": 1}, {"triton.twoshot": 2}, {"gathered": 1}], stats
        for path in out[1:]:
            assert all(torch.equal(a, b) for a, b in zip(path, out[0], strict=True))


def _mismatched(rank, world_size):
    tpfuse.get_communicator(max_tokens=16, hidden=4096, wait_timeout_s=20)
    x, weight = torch.randn(8, 64).bfloat16(), torch.ones(64).bfloat16()
    errors = []
    for call in (lambda: tpfuse.reduce_scatter_add_rmsnorm_all_gather(torch.randn(7, 64).bfloat16(), None,
                                                                       weight, 1e-5),
                 lambda: tpfuse.reduce_scatter_add_rmsnorm_all_gather(x, torch.randn(8, 64).bfloat16(),
                                                                       weight, 1e-5)):
        try:
            call()
        except ValueError as e:
            errors.append(str(e))
    try:  # one rank sharded, the other an all-reduce of the same rows: the kernels compare the calls
        if rank == 0:
            tpfuse.reduce_scatter_add_rmsnorm_all_gather(x, None, weight, 1e-5)
        else:
            tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-5)
    except RuntimeError as e:
        errors.append(str(e))
    return errors


def test_bad_calls_are_named(rank_pool):
    for errors in rank_pool(2).run(_mismatched):
        assert "7 rows" in errors[0] and "multiple of 2" in errors[0], errors
        assert "residual" in errors[1] and "(4, 64)" in errors[1], errors
        assert len(errors) == 3 and "rows sharded (sequence parallel)" in errors[2], errors
