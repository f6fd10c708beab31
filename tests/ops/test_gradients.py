"""The fused ops under autograd (ops.gradient, blockend.gradient): every block end's gradients against
autograd of the unfused chain in float64, on 2 and 3 ranks running the kernels; the forward's bits the
same as without a gradient; a row's gradients the same bits in any batch; quantised outputs refuse a
gradient.

The upstream gradients of y and h are the same on every rank (tensor parallelism's contract,
docs/training.md), and every rank's x receives the gradient of the sum.
"""

import pytest
import torch

pytestmark = pytest.mark.slow

HIDDEN, ROWS, EPS = 64, 8, 1e-5
#: Every block end that has a gradient: each step alone and together.
BLOCK_ENDS = {
    "rmsnorm": {},
    "no_residual": dict(residual=False),
    "bias": dict(bias=True),
    "post_norm": dict(sum_weight=True),
    "layer_norm": dict(layer_norm=True, norm_bias=True),
    "moe_finalize": dict(experts=3, topk_weights=True, shared_expert=True),
    "combined": dict(bias=True, sum_weight=True, experts=2, topk_weights=True),
}


def _inputs(name, world_size, dtype=torch.bfloat16):
    """Every rank's x and the shared tensors of block end ``name``, made alike on every rank (seeded)."""
    steps = BLOCK_ENDS[name]
    g = torch.Generator().manual_seed(7)
    experts = steps.get("experts", 0)
    shape = (ROWS, experts, HIDDEN) if experts else (ROWS, HIDDEN)

    def randn(*size, scale=1.0):
        return (torch.randn(*size, generator=g) * scale).to(dtype)

    inputs = {"xs": [randn(*shape) for _ in range(world_size)], "weight": 1 + randn(HIDDEN, scale=0.1),
              "residual": None if steps.get("residual") is False else randn(ROWS, HIDDEN)}
    if steps.get("bias"):
        inputs["bias"] = randn(HIDDEN, scale=0.5)
    if steps.get("sum_weight"):
        inputs["sum_weight"] = 1 + randn(HIDDEN, scale=0.1)
    if steps.get("layer_norm"):
        inputs["layer_norm"] = True
        inputs["norm_bias"] = randn(HIDDEN, scale=0.5)
    if experts:
        inputs["topk_weights"] = torch.rand(ROWS, experts, generator=g)
    if steps.get("shared_expert"):
        inputs["shared_expert"] = [randn(ROWS, HIDDEN) for _ in range(world_size)]
    inputs["g_y"], inputs["g_h"] = randn(ROWS, HIDDEN), randn(ROWS, HIDDEN)
    return inputs


_LEAVES = ("residual", "weight", "bias", "sum_weight", "norm_bias", "topk_weights")


def _float64_gradients(inputs, rank):
    """Autograd of the unfused chain in float64 from every rank's inputs: rank ``rank``'s gradients."""
    leaves = {k: inputs[k].double().requires_grad_() for k in _LEAVES if inputs.get(k) is not None}
    xs = [x.double().requires_grad_() for x in inputs["xs"]]
    shared = [t.double().requires_grad_() for t in inputs.get("shared_expert") or []]
    parts = []
    for r, x in enumerate(xs):
        part = x
        if x.dim() == 3:
            part = (x * leaves["topk_weights"].unsqueeze(-1)).sum(1)
        if shared:
            part = part + shared[r]
        parts.append(part)
    s = torch.stack(parts).sum(0)
    if "bias" in leaves:
        s = s + leaves["bias"]
    if "sum_weight" in leaves:
        s = s * torch.rsqrt((s * s).mean(-1, keepdim=True) + EPS) * leaves["sum_weight"]
    h = s + leaves["residual"] if "residual" in leaves else s
    if inputs.get("layer_norm"):
        c = h - h.mean(-1, keepdim=True)
        y = c * torch.rsqrt((c * c).mean(-1, keepdim=True) + EPS) * leaves["weight"] + leaves["norm_bias"]
    else:
        y = h * torch.rsqrt((h * h).mean(-1, keepdim=True) + EPS) * leaves["weight"]
    (y * inputs["g_y"].double() + h * inputs["g_h"].double()).sum().backward()
    grads = {k: t.grad for k, t in leaves.items()} | {"x": xs[rank].grad}
    if shared:
        grads["shared_expert"] = shared[rank].grad
    return grads


def _call(inputs, rank, rows=slice(None)):
    """The op on rank ``rank``'s inputs (rows ``rows`` of the per-row ones), every input a leaf that takes a
    gradient: (y, h, {name: leaf})."""
    import tpfuse

    leaves = {"x": inputs["xs"][rank][rows]}
    for k in _LEAVES:
        if inputs.get(k) is not None:
            leaves[k] = inputs[k][rows] if k in ("residual", "topk_weights") else inputs[k]
    if inputs.get("shared_expert") is not None:
        leaves["shared_expert"] = inputs["shared_expert"][rank][rows]
    leaves = {k: t.clone().requires_grad_() for k, t in leaves.items()}
    args = {k: t for k, t in leaves.items() if k not in ("x", "residual", "weight")}
    y, h = tpfuse.allreduce_add_rmsnorm(leaves["x"], leaves.get("residual"), leaves["weight"], EPS,
                                        layer_norm=inputs.get("layer_norm", False), **args)
    return y, h, leaves


def _gradients(rank, world_size, names):
    """Per block end: the relative difference of each gradient from float64's, the gradients' bytes (to
    compare across ranks), and whether the forward and a part of the rows gave the same bits."""
    import tpfuse

    tpfuse.get_communicator(max_tokens=16, hidden=HIDDEN)
    out = {}
    for name in names:
        inputs = _inputs(name, world_size)
        y, h, leaves = _call(inputs, rank)
        (y.float() * inputs["g_y"].float() + h.float() * inputs["g_h"].float()).sum().backward()
        expected = _float64_gradients(inputs, rank)
        assert set(expected) == set(leaves), (name, set(expected), set(leaves))
        difference = {k: ((leaves[k].grad.double() - e).abs().max() / e.abs().max()).item()
                      for k, e in expected.items()}
        with torch.no_grad():  # the inference op: the same bits as the forward under autograd
            y0, h0, _ = _call(inputs, rank)
        part = slice(2, 5)  # rows 2-4 alone: their outputs and per-row gradients, the same bits
        yp, hp, part_leaves = _call(inputs, rank, part)
        (yp.float() * inputs["g_y"][part].float() + hp.float() * inputs["g_h"][part].float()).sum().backward()
        per_row = [k for k in ("x", "residual", "topk_weights", "shared_expert") if k in leaves]
        out[name] = {
            "difference": difference,
            "grads": {k: t.grad.float().numpy().tobytes() for k, t in leaves.items()},
            "forward_same": torch.equal(y, y0) and torch.equal(h, h0),
            # what of the part differs from the same rows in the whole batch (nothing)
            "part_differs": [k for k, got, whole in [("y", yp, y[part]), ("h", hp, h[part])]
                             + [(k, part_leaves[k].grad, leaves[k].grad[part]) for k in per_row]
                             if not torch.equal(got, whole)],
        }
    return out


def _check(results, names):
    for name in names:
        per_rank = [r[name] for r in results]
        for rank, got in enumerate(per_rank):
            assert all(d < 1e-2 for d in got["difference"].values()), (name, rank, got["difference"])
            assert got["forward_same"] and not got["part_differs"], (name, rank, got["part_differs"])
        # x's gradient is the sum's on every rank; the replicated inputs' are each rank's own, the same
        for k in per_rank[0]["grads"]:
            if k not in ("x", "shared_expert") or "topk_weights" not in per_rank[0]["grads"]:
                assert len({r["grads"][k] for r in per_rank}) == 1, (name, k)


@pytest.mark.parametrize("names", [list(BLOCK_ENDS), ["moe_finalize"]])
def test_every_block_end_has_its_float64_gradient_on_two_ranks(rank_pool, names):
    _check(rank_pool(2).run(_gradients, names), names)


def test_gradients_on_three_ranks(rank_pool):
    names = ["rmsnorm", "post_norm", "moe_finalize"]
    _check(rank_pool(3).run(_gradients, names), names)


def _refusals(rank, world_size):
    """Quantised calls with inputs that require a gradient run (inference with grad mode on), and a
    gradient that reaches their outputs raises; out= refuses at once; the plain all-reduce's gradient."""
    import tpfuse

    tpfuse.get_communicator(max_tokens=16, hidden=HIDDEN)
    x = torch.randn(4, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    weight = torch.ones(HIDDEN, dtype=torch.bfloat16)
    said = []
    out = torch.empty_like(x.detach())
    for call in (lambda: tpfuse.allreduce_add_rmsnorm(x, None, weight, EPS, quant_scale=torch.ones(1))[1],
                 lambda: tpfuse.allreduce_add_rmsnorm_quant(x, None, weight, EPS, output="fp8").h,
                 lambda: tpfuse.allreduce_add_rmsnorm(x, None, weight, EPS, out=out)[1]):
        try:
            call().float().sum().backward()
            said.append(None)
        except ValueError as e:
            said.append(str(e))
    # the plain all-reduce: each rank's x receives the sum's gradient
    x.grad = None
    g = torch.arange(4 * HIDDEN, dtype=torch.float32).reshape(4, HIDDEN).bfloat16()
    total = tpfuse.all_reduce(x)
    total.backward(g)
    with torch.no_grad():
        same = torch.equal(total, tpfuse.all_reduce(x))
    return said, torch.equal(x.grad, g), same


def test_quantised_outputs_refuse_a_gradient_and_the_all_reduce_has_one(rank_pool):
    for said, grad_right, same in rank_pool(2).run(_refusals):
        assert said[0] is not None and "no gradient" in said[0], said
        assert said[1] is not None and "no gradient" in said[1], said
        assert said[2] is not None and "out and residual_out take no gradient" in said[2], said
        assert grad_right and same


# --- The backward's own block end: y's gradient summed over the ranks, fused with RMSNorm's backward -------

#: (first row, rows): the one-shot (1, 3), the two-shot (8, 16) and calls over the workspace (30, 40).
BATCHES = [(7, 1), (5, 3), (3, 8), (0, 16), (2, 30), (0, 40)]


def _fused_backward(rank, world_size):
    """``allreduce_rmsnorm_backward`` on rows of every batch of :data:`BATCHES` (the one-shot up to 4 rows,
    the two-shot above, fused calls of the workspace's 16 rows above that): per batch, each row's outputs'
    bytes, and the largest difference from float64 of the whole call's."""
    import torch.distributed as dist

    import tpfuse
    from tpfuse.testing import forced_table

    group = dist.new_group(list(range(world_size)))
    comm = tpfuse.get_communicator(group, max_tokens=16, hidden=HIDDEN)
    g = torch.Generator().manual_seed(11)
    rows = 40
    grad_ys = [torch.randn(rows, HIDDEN, generator=g).bfloat16() for _ in range(world_size)]
    norm_input = torch.randn(rows, HIDDEN, generator=g).bfloat16()
    grad_h = torch.randn(rows, HIDDEN, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(HIDDEN, generator=g)).bfloat16()
    # float64: autograd of RMSNorm at norm_input, the gradient the ranks' parts sum to
    a = norm_input.double().requires_grad_()
    (a * torch.rsqrt((a * a).mean(-1, keepdim=True) + EPS) * weight.double()).backward(
        torch.stack([t.double() for t in grad_ys]).sum(0))
    expected = a.grad + grad_h.double()
    per_row, differences, stats = {}, [], []
    with forced_table(world_size, "cpu", oneshot_max=4, hiddens=(HIDDEN,)):
        for first, n in BATCHES:
            part = slice(first, first + n)
            tpfuse.reset_stats()
            grad_input, grad_y_sum = tpfuse.allreduce_rmsnorm_backward(
                grad_ys[rank][part].contiguous(), norm_input[part].contiguous(), weight, EPS,
                grad_h[part].contiguous(), group=group)
            stats.append(tpfuse.stats())
            per_row[(first, n)] = [(grad_input[i].view(torch.int16).numpy().tobytes(),
                                    grad_y_sum[i].view(torch.int16).numpy().tobytes()) for i in range(n)]
            differences.append(((grad_input.double() - expected[part]).abs().max()
                                 / expected[part].abs().max()).item())
    comm.destroy()
    return per_row, differences, stats


@pytest.mark.parametrize("world_size", [2, 3])
def test_the_fused_backward_against_float64_and_the_same_bits_in_any_batch(rank_pool, world_size):
    seen = {}
    for rank, (per_row, differences, stats) in enumerate(rank_pool(world_size).run(_fused_backward)):
        assert all(d < 1e-2 for d in differences), (rank, differences)
        # the kernels ran every batch: one-shot, two-shot, and fused calls of the workspace's rows
        assert [next(iter(s)) for s in stats[:2]] == ["triton.oneshot"] * 2, stats
        assert all("reference" not in s for s in stats), stats
        for (first, n), rows in per_row.items():
            for i, bits in enumerate(rows):
                assert seen.setdefault(first + i, bits) == bits, (rank, first, n, i)


def _partial_y_grad(rank, world_size):
    """The op under autograd with y's gradient each rank's part (``y_grad="partial"``) against the same
    call given the summed gradient (``y_grad="replicated"``), and against float64."""
    import torch.distributed as dist

    import tpfuse

    tpfuse.get_communicator(max_tokens=16, hidden=HIDDEN)
    inputs = _inputs("bias", world_size)
    g = torch.Generator().manual_seed(5)
    parts = [torch.randn(ROWS, HIDDEN, generator=g).bfloat16() for _ in range(world_size)]
    total = torch.stack([p.float() for p in parts]).sum(0).bfloat16()
    got = {}
    for y_grad, g_y in (("partial", parts[rank]), ("replicated", total)):
        leaves = {k: t.clone().requires_grad_() for k, t in
                  (("x", inputs["xs"][rank]), ("residual", inputs["residual"]), ("weight", inputs["weight"]),
                   ("bias", inputs["bias"]))}
        y, h = tpfuse.allreduce_add_rmsnorm(leaves["x"], leaves["residual"], leaves["weight"], EPS,
                                            bias=leaves["bias"], y_grad=y_grad)
        torch.autograd.backward([y, h], [g_y, inputs["g_h"]])
        got[y_grad] = {k: t.grad.float() for k, t in leaves.items()}
    inputs = dict(inputs, g_y=total)
    expected = _float64_gradients(inputs, rank)
    difference = {k: ((got["partial"][k].double() - e).abs().max() / e.abs().max()).item()
                  for k, e in expected.items()}
    dist.barrier()
    return difference, {k: t.numpy().tobytes() for k, t in got["partial"].items()}


def test_a_partial_y_gradient_is_summed_in_the_fused_backward(rank_pool):
    results = rank_pool(2).run(_partial_y_grad)
    for difference, _ in results:
        assert all(d < 1e-2 for d in difference.values()), difference
    assert results[0][1] == results[1][1]  # every rank the same gradients
