"""The fused ops under autograd: the forward is the op itself (the same call, the same bits as without a
gradient), the backward ``blockend.gradient`` in fp32, row by row.

What each input receives follows tensor parallelism's contract (docs/training.md): the gradients reaching
``y`` and ``h`` are replicated across the group, and every rank's partial ``x`` receives the gradient of the
sum. The public functions (``tpfuse.allreduce_add_rmsnorm``, ``tpfuse.all_reduce``) come here when grad
mode is on and an input requires a gradient; a quantised output refuses one.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.blockend.epilogue import Epilogue
from tpfuse.blockend.gradient import block_end_backward, rmsnorm_weight_grad, sum_backward
from tpfuse.blockend.reference import rank_part
from tpfuse.comm import agreement
from tpfuse.comm.communicator import default_wait_timeout_s
from tpfuse.ops.route import group_by_name, sum_in_rank_order

#: The block end's tensors that can take a gradient, in the Function's argument order.
_STEP_TENSORS = ("bias", "sum_weight", "norm_bias", "topk_weights", "shared_expert")


def requires_grad(*tensors) -> bool:
    """Whether grad mode is on and any of ``tensors`` (None allowed) requires a gradient."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


class _BlockEnd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name, eps, layer_norm, y_grad_partial, x, residual, weight, *steps):
        named = dict(zip(_STEP_TENSORS, steps))
        epilogue = Epilogue(layer_norm=layer_norm, experts=x.shape[1] if x.dim() == 3 else 0, **named)
        y, h = torch.ops.tpfuse.allreduce_add_rmsnorm(x, residual, weight, eps, group_name,
                                                      **epilogue.kwargs())
        # x's values only where the backward reads them (the post-norm's sum made again, the MoE weights'
        # gradient); else its shape, not another [T, H] activation kept a block end
        reads_x = epilogue.stages.post_norm is not None or epilogue.topk_weights is not None
        ctx.save_for_backward(x if reads_x else None, h, weight, *steps)
        ctx.x_like = (x.shape, x.dtype)
        ctx.group_name, ctx.eps, ctx.layer_norm = group_name, eps, layer_norm
        ctx.y_grad_partial = y_grad_partial
        ctx.has_residual = residual is not None
        return y, h

    @staticmethod
    def backward(ctx, g_y, g_h):
        x, h, weight, *steps = ctx.saved_tensors
        if x is None:  # its shape is all the backward reads of it
            x = torch.empty(ctx.x_like[0], dtype=ctx.x_like[1], device="meta")
        named = dict(zip(_STEP_TENSORS, steps))
        epilogue = Epilogue(layer_norm=ctx.layer_norm, experts=x.shape[1] if x.dim() == 3 else 0, **named)
        post_norm_input = None
        if epilogue.stages.post_norm is not None:
            # The forward keeps no sum: it is made again, in x's dtype, on the same kernels and in the same
            # rank order (every rank runs the backward, so every rank makes this call).
            post_norm_input = torch.ops.tpfuse.all_reduce(rank_part(x, epilogue).contiguous(), ctx.group_name)
            post_norm_input = post_norm_input.float()
            if epilogue.bias is not None:
                post_norm_input = post_norm_input + epilogue.bias.float()
        if ctx.y_grad_partial:
            # g_y is this rank's part: its sum and the norm's backward (+ g_h) in one fused call
            g_rows, g_y_sum = torch.ops.tpfuse.allreduce_add_rmsnorm(
                g_y.to(x.dtype).contiguous(), None, weight, ctx.eps, ctx.group_name, norm_input=h,
                grad_h=g_h.to(x.dtype).contiguous())
            grads = {"weight": rmsnorm_weight_grad(h, g_y_sum, ctx.eps)}
            grads |= sum_backward(epilogue, x, g_rows.float(), ctx.eps, post_norm_input)
        else:
            grads = block_end_backward(epilogue, x, h, weight, ctx.eps, g_y, g_h, post_norm_input)
        if grads.get("topk_weights") is not None:
            # The weights are the same on every rank, each rank's experts' outputs its part of the sum: the
            # weights' gradient is the sum of every rank's part.
            grads["topk_weights"] = _summed_over_ranks(grads["topk_weights"], ctx.group_name,
                                                       "the MoE weights' gradient")
        # Each gradient in its input's dtype (the residual's is x's); none for an input the call had not.
        dtypes = {"x": x.dtype, "residual": x.dtype if ctx.has_residual else None, "weight": weight.dtype,
                  **{name: None if t is None else t.dtype for name, t in named.items()}}
        out = {name: None if dtype is None or grads.get(name) is None else grads[name].to(dtype)
               for name, dtype in dtypes.items()}
        return (None, None, None, None, out["x"], out["residual"], out["weight"],
                *(out[n] for n in _STEP_TENSORS))


def _summed_over_ranks(t: torch.Tensor, group_name: str, what: str) -> torch.Tensor:
    """The sum over the group's ranks of ``t`` (``what``, for an error), gathered and summed in rank order
    (``route.sum_in_rank_order``), the wait bounded as the reference path's."""
    parts = agreement.all_gather(t.contiguous(), group_by_name(group_name), default_wait_timeout_s(), what)
    return sum_in_rank_order(parts)


#: What the gradient reaching y is (``allreduce_add_rmsnorm``'s ``y_grad``): the same on every rank, or each
#: rank's part of it (the next column-parallel layer's input gradient, not yet summed).
Y_GRADS = ("replicated", "partial")


def block_end_with_gradient(x, residual, weight, eps, group_name: str, epilogue: Epilogue,
                            y_grad: str = "replicated"):
    """``(y, h)`` of a checked call whose inputs require a gradient: differentiable in x, the residual, the
    weight and the block end's tensors. ``y_grad="partial"``: the backward sums y's gradient over the
    ranks, fused with the norm's backward. ValueError for a quantised block end, or a partial gradient
    through LayerNorm."""
    if y_grad not in Y_GRADS:
        raise ValueError(f"y_grad must be one of {Y_GRADS}, got {y_grad!r}")
    if y_grad == "partial" and epilogue.layer_norm:
        raise ValueError("y_grad='partial' fuses RMSNorm's backward: LayerNorm's is not fused; sum y's "
                         "gradient before the block end (y_grad='replicated')")
    steps = [getattr(epilogue, name) for name in _STEP_TENSORS]
    if epilogue.quantised:  # static fp8 (quant_scale): outputs that refuse a gradient
        return refusing_gradient(lambda: torch.ops.tpfuse.allreduce_add_rmsnorm(
            x, residual, weight, eps, group_name, **epilogue.kwargs()), x, residual, weight, *steps)
    return _BlockEnd.apply(group_name, eps, epilogue.layer_norm, y_grad == "partial", x, residual, weight,
                           *steps)


class _Refused(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, *inputs):
        outputs = tuple(run())
        ctx.mark_non_differentiable(*[t for t in outputs if t.dtype not in _DIFFERENTIABLE])
        return outputs

    @staticmethod
    def backward(ctx, *grads):
        raise ValueError("tpfuse: a quantised y has no gradient: call the block end unquantised "
                         "(allreduce_add_rmsnorm without quant_scale) where it trains")


_DIFFERENTIABLE = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def refusing_gradient(run, *inputs) -> tuple:
    """``run()``'s outputs (a quantising call's), connected to ``inputs`` so that a gradient reaching them
    raises a clear error instead of vanishing: a quantised output has no gradient. Calls that no
    backward reaches (inference with grad mode on) run as without autograd."""
    return _Refused.apply(run, *inputs)


class _AllReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name, x):
        return torch.ops.tpfuse.all_reduce(x, group_name)

    @staticmethod
    def backward(ctx, g):
        return None, g  # a replicated gradient of the sum is every part's


def all_reduce_with_gradient(x: torch.Tensor, group_name: str) -> torch.Tensor:
    """The sum of ``x`` over the group, differentiable: each rank's ``x`` receives the (replicated) gradient
    of the sum, as a row-parallel layer's input does in tensor parallelism."""
    return _AllReduce.apply(group_name, x)


class _ShardedBlockEnd(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group_name, eps, x, residual, weight, bias):
        epilogue = Epilogue(bias=bias)
        y, h = torch.ops.tpfuse.reduce_scatter_add_rmsnorm_all_gather(x, residual, weight, eps, group_name,
                                                                       **epilogue.kwargs())
        ctx.save_for_backward(h, weight)
        ctx.group_name, ctx.eps = group_name, eps
        ctx.dtypes = (x.dtype, None if residual is None else residual.dtype, weight.dtype,
                      None if bias is None else bias.dtype)
        return y, h

    @staticmethod
    def backward(ctx, g_y, g_h):
        h, weight = ctx.saved_tensors
        rows = h.shape[0]
        g_y = torch.zeros((rows * dist.get_world_size(group_by_name(ctx.group_name)), h.shape[1]),
                          dtype=h.dtype, device=h.device) if g_y is None else g_y.to(h.dtype).contiguous()
        g_h = torch.zeros_like(h) if g_h is None else g_h.to(h.dtype).contiguous()
        # g_y is this rank's part of the gathered y's gradient: reduce-scattered, the norm's backward
        # (+ g_h) on our rows and the result all-gathered, in one fused call
        g_rows, own, g_y_sum = torch.ops.tpfuse.reduce_scatter_rmsnorm_backward_all_gather(
            g_y, h, weight, ctx.eps, ctx.group_name, g_h)
        x_dtype, residual_dtype, weight_dtype, bias_dtype = ctx.dtypes
        # Each rank's rows give their part of the weight's gradient: summed over the ranks in rank order,
        # the same on every rank (a replicated parameter's). The bias's comes from every row, gathered.
        g_weight = _summed_over_ranks(rmsnorm_weight_grad(h, g_y_sum, ctx.eps), ctx.group_name,
                                      "a sharded norm weight's gradient")
        g_residual = None if residual_dtype is None else own.to(residual_dtype)
        g_bias = None if bias_dtype is None else g_rows.float().sum(0).to(bias_dtype)
        return None, None, g_rows.to(x_dtype), g_residual, g_weight.to(weight_dtype), g_bias


def sharded_block_end_with_gradient(x, residual, weight, eps, group_name: str, epilogue: Epilogue):
    """``(y, h)`` of a checked sharded call (sequence parallel) whose inputs require a gradient:
    differentiable in x, the residual, the weight and the bias; y's gradient is each rank's part.
    ValueError for a block end whose backward is not fused sharded (post-norm, LayerNorm)."""
    if epilogue.sum_weight is not None or epilogue.layer_norm:
        raise ValueError("a sequence-parallel block end trains with RMSNorm (and a bias): its post-norm and "
                         "LayerNorm have no sharded backward")
    return _ShardedBlockEnd.apply(group_name, eps, x, residual, weight, epilogue.bias)
