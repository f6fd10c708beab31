"""Sequence parallel's block end as one fused call: reduce-scatter -> (bias, post-norm) -> + this rank's
residual rows -> norm -> (fp8) -> all-gather of y, and its backward in the same kernels.

With sequence parallelism (torchtitan's default layout, Megatron's ``--sequence-parallel``) the
row-parallel layer's partial sums are reduce-scattered over the rows, each rank adds its own rows of the
residual stream and normalises them, and the next column-parallel layer all-gathers the normed rows.
``tpfuse::reduce_scatter_add_rmsnorm_all_gather`` does all of it in one call of the two-shot kernel
(``kernels.twoshot``, ``SHARDED``): rank r owns rows ``r * T / W ... (r + 1) * T / W - 1``, as
``reduce_scatter_tensor`` over dim 0 gives them, sums them over the ranks in ascending rank order in
fp32, adds its residual rows and sends the rounded h to its peers, which norm it as the owner does. A
row's bits are those of ``tpfuse.allreduce_add_rmsnorm`` for the same row (docs/sequence-parallel.md).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import PLAIN, Epilogue, schema
from tpfuse.ops.allreduce_add_rmsnorm import (
    _CALL,
    QuantizedOutputs,
    _empty_y,
    _lib,
    _quantised_outputs,
    _run_quant,
    _through_the_op,
    check_inputs,
    quantised_block_end,
    quantised_result,
)
from tpfuse.ops.gradient import refusing_gradient, requires_grad, sharded_block_end_with_gradient
from tpfuse.ops.route import group_by_name, group_name_of, route_of

_lib.define(f"reduce_scatter_add_rmsnorm_all_gather({_CALL}, *, {schema()}) -> (Tensor, Tensor)")
_lib.define(f"reduce_scatter_add_rmsnorm_all_gather_quant({_CALL}, *, {schema()}) "
            "-> (Tensor, Tensor, Tensor, Tensor)")
_lib.define("reduce_scatter_rmsnorm_backward_all_gather(Tensor grad_y, Tensor norm_input, Tensor weight, "
            "float eps, str group_name, Tensor grad_h) -> (Tensor, Tensor, Tensor)")


def check_sharded_inputs(x, residual, weight, eps: float, epilogue: Epilogue, world_size: int) -> int:
    """The op's checks for a sharded call of ``world_size`` ranks (the residual and the norm backward's
    inputs hold this rank's rows); returns those rows, T / W."""
    if isinstance(x, torch.Tensor) and x.dim() != 2:
        raise ValueError(f"x has shape {tuple(x.shape)}: a sequence-parallel call takes x [T, H]")
    if isinstance(x, torch.Tensor) and x.shape[0] % world_size:
        raise ValueError(f"x has {x.shape[0]} rows: a sequence-parallel call shards them over the group's "
                         f"{world_size} ranks, so they must be a multiple of {world_size} (as "
                         "reduce_scatter_tensor's input)")
    own_rows = x.shape[0] // world_size if isinstance(x, torch.Tensor) else None
    check_inputs(x, residual, weight, eps, epilogue, own_rows=own_rows)
    return own_rows


def _world_size(group_name: str) -> int:
    return dist.get_world_size(group_by_name(group_name))


def _sharded_call(x, residual, weight, eps, group_name: str, epilogue: Epilogue, own_rows: int):
    """A checked sharded call (:func:`check_sharded_inputs` gave ``own_rows``): its outputs made, run by its
    group's route."""
    y, h = _empty_y(x, epilogue), x.new_empty((own_rows, x.shape[1]))
    route_of(group_name).run(FusedCall(x, residual, weight, eps, y, h, epilogue, sharded=True))
    return y, h


def _sharded(x, residual, weight, eps, group_name, **step_args):
    epilogue = Epilogue.of(step_args)
    own_rows = check_sharded_inputs(x, residual, weight, eps, epilogue, route_of(group_name).world_size)
    return _sharded_call(x, residual, weight, eps, group_name, epilogue, own_rows)


def _sharded_fake(x, residual, weight, eps, group_name, **step_args):
    own_rows = x.shape[0] // _world_size(group_name)
    return _empty_y(x, Epilogue.of(step_args)), x.new_empty((own_rows, x.shape[1]))


def _sharded_quant(x, residual, weight, eps, group_name, **step_args):
    epilogue = Epilogue.of(step_args)
    route = route_of(group_name)
    own_rows = check_sharded_inputs(x, residual, weight, eps, epilogue, route.world_size)
    return _run_quant(x, residual, weight, eps, group_name, epilogue, own_rows)


def _sharded_quant_fake(x, residual, weight, eps, group_name, **step_args):
    return _quantised_outputs(x, Epilogue.of(step_args), x.shape[0] // _world_size(group_name))


def _backward(grad_y, norm_input, weight, eps, group_name, grad_h):
    epilogue = Epilogue(norm_input=norm_input, grad_h=grad_h)
    own_rows = check_sharded_inputs(grad_y, None, weight, eps, epilogue, route_of(group_name).world_size)
    return _backward_call(grad_y, weight, eps, group_name, epilogue, own_rows)


def _backward_call(grad_y, weight, eps, group_name: str, epilogue: Epilogue, own_rows: int):
    """A checked sharded backward (``epilogue``: its ``RmsNormBackward``): the gathered gradient, this
    rank's rows of it, the summed g."""
    grad_input, g = _sharded_call(grad_y, None, weight, eps, group_name, epilogue, own_rows)
    rank = dist.get_rank(group_by_name(group_name))
    return grad_input, grad_input[rank * own_rows:(rank + 1) * own_rows].clone(), g


def _backward_fake(grad_y, norm_input, weight, eps, group_name, grad_h):
    return torch.empty_like(grad_y), torch.empty_like(norm_input), torch.empty_like(norm_input)


_OPS = (("reduce_scatter_add_rmsnorm_all_gather", _sharded, _sharded_fake),
        ("reduce_scatter_add_rmsnorm_all_gather_quant", _sharded_quant, _sharded_quant_fake),
        ("reduce_scatter_rmsnorm_backward_all_gather", _backward, _backward_fake))
for _name, _impl, _fake in _OPS:
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tpfuse::{_name}", _fake, lib=_lib)


def _run(x, residual, weight, eps, group_name: str, epilogue: Epilogue, own_rows: int):
    if _through_the_op(x):
        return torch.ops.tpfuse.reduce_scatter_add_rmsnorm_all_gather(x, residual, weight, eps, group_name,
                                                                       **epilogue.kwargs())
    return _sharded_call(x, residual, weight, eps, group_name, epilogue, own_rows)


def reduce_scatter_add_rmsnorm_all_gather(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    group: dist.ProcessGroup | None = None,
    quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence parallel's block end in one fused call: reduce-scatter ``x`` over the rows, add this
    rank's ``residual`` rows, normalise them, all-gather the normalised rows.

    With W ranks and T rows, rank r owns rows ``r * T / W ... (r + 1) * T / W - 1`` (as
    ``reduce_scatter_tensor`` over dim 0 gives them): ``h = (sum over ranks of x)[own rows] + residual``
    and ``y = rmsnorm(h of every rank)``, all T rows, bit-identical on every rank. Every sum is in
    ascending rank order in fp32, and a row's ``y`` and ``h`` have the bits
    :func:`tpfuse.allreduce_add_rmsnorm` gives the same row (docs/sequence-parallel.md). The optional
    steps (``bias``, ``sum_weight``, ``layer_norm`` and ``norm_bias``, static fp8 with ``quant_scale``) as
    there.

    Parameters
    ----------
    x : Tensor [T, H]
        This rank's partial result (a row-parallel layer's output for all T rows); bfloat16, float16
        or float32, contiguous. T a multiple of W.
    residual : Tensor [T / W, H] or None
        This rank's rows of the residual stream; None means zero.
    weight : Tensor [H]
        The norm's gain.
    eps : float
    group : ProcessGroup, optional
        The default group when None. The fused kernel runs when ``tpfuse.get_communicator(group)`` was
        called beforehand; calls larger than its workspace run as fused calls of whole rows of every
        rank; without a communicator the ranks' parts are all-gathered and summed in rank order.

    Returns
    -------
    (y, h) : tuple of Tensor
        ``y`` [T, H]: the normalised rows of every rank (fp8 with ``quant_scale``); ``h`` [T / W, H]: this
        rank's rows of the new residual stream.

    Under autograd (RMSNorm, with or without ``bias``), y's gradient is taken as each rank's part (the
    next column-parallel layer's input gradient), as the all-gather's backward takes it: the backward is
    :func:`reduce_scatter_rmsnorm_backward_all_gather`, one fused call (docs/training.md).
    """
    if quant_scale is None and bias is None and sum_weight is None and not layer_norm and norm_bias is None:
        epilogue = PLAIN
    else:
        epilogue = Epilogue(quant_scale, bias, sum_weight, layer_norm, norm_bias)
    group_name = group_name_of(group)
    own_rows = check_sharded_inputs(x, residual, weight, eps, epilogue, route_of(group_name).world_size)
    inputs = (x, residual, weight, bias, sum_weight, norm_bias)
    if not requires_grad(*inputs):
        return _run(x, residual, weight, eps, group_name, epilogue, own_rows)
    if epilogue.quantised:
        return refusing_gradient(lambda: _run(x, residual, weight, eps, group_name, epilogue, own_rows),
                                 *inputs)
    return sharded_block_end_with_gradient(x, residual, weight, eps, group_name, epilogue)


def reduce_scatter_add_rmsnorm_all_gather_quant(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    output: str = "fp8",
    group: dist.ProcessGroup | None = None,
    quant_scale: torch.Tensor | None = None,
    scale_group: int | None = None,
    ue8m0_scales: bool = False,
    scale_layout: str = "rows",
    global_scale: torch.Tensor | None = None,
    normed_copy: bool = False,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
) -> QuantizedOutputs:
    """:func:`reduce_scatter_add_rmsnorm_all_gather` with ``y`` quantised as
    :func:`tpfuse.allreduce_add_rmsnorm_quant` quantises it (``output``: ``"fp8"`` static or dynamic,
    ``"nvfp4"``, ``"mxfp4"``; the scales' form and layout; the norm's copy), in the same call.

    Returns
    -------
    QuantizedOutputs
        ``(y, scales, h, normed)``: ``y``, its ``scales`` and ``normed`` for all T rows (gathered, every rank
        the same bits), ``h`` this rank's T / W rows. A gradient reaching them raises (quantised outputs
        have none).
    """
    epilogue = quantised_block_end(x, output, quant_scale, scale_group, ue8m0_scales, scale_layout,
                                   global_scale, normed_copy, bias=bias, sum_weight=sum_weight,
                                   layer_norm=layer_norm, norm_bias=norm_bias)
    group_name = group_name_of(group)
    own_rows = check_sharded_inputs(x, residual, weight, eps, epilogue, route_of(group_name).world_size)

    def run():
        if _through_the_op(x):
            op = torch.ops.tpfuse.reduce_scatter_add_rmsnorm_all_gather_quant
            return op(x, residual, weight, eps, group_name, **epilogue.kwargs())
        return _run_quant(x, residual, weight, eps, group_name, epilogue, own_rows)

    return quantised_result(run, (x, residual, weight, bias, sum_weight, norm_bias), normed_copy)


def reduce_scatter_rmsnorm_backward_all_gather(
    grad_y: torch.Tensor,
    norm_input: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    grad_h: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward of :func:`reduce_scatter_add_rmsnorm_all_gather` in one fused call: reduce-scatter
    ``grad_y``, RMSNorm's backward on this rank's rows plus ``grad_h``, all-gather of the result.

    With ``g = (sum over ranks of grad_y)[own rows]`` (fp32, in rank order, rounded once) and
    ``r = rsqrt(mean(a * a) + eps)`` for ``a = norm_input``:
    ``grad_input = grad_h + r * (g * w - a * mean(g * w * a) * r * r)`` for this rank's rows, gathered
    from every rank. A row's bits are those of :func:`tpfuse.allreduce_rmsnorm_backward`.

    Parameters
    ----------
    grad_y : Tensor [T, H]
        This rank's part of the gradient of the gathered y (a column-parallel layer's input gradient).
    norm_input : Tensor [T / W, H]
        This rank's rows of the norm's input: the ``h`` the forward returned; grad_y's dtype.
    weight : Tensor [H]
    eps : float
    grad_h : Tensor [T / W, H]
        The gradient reaching this rank's ``norm_input`` rows by the residual stream.
    group : ProcessGroup, optional

    Returns
    -------
    (grad_input, own_grad_input, grad_y_sum) : tuple of Tensor
        ``grad_input`` [T, H]: the gradient of every rank's ``norm_input`` rows (grad_h included), which
        is the gradient of the reduce-scattered sum, gathered: what each rank's partial x receives;
        ``own_grad_input`` [T / W, H]: this rank's rows of it (the residual stream's gradient);
        ``grad_y_sum`` [T / W, H]: ``g``, for the weight's gradient.
    """
    group_name = group_name_of(group)
    epilogue = Epilogue(norm_input=norm_input, grad_h=grad_h)
    own_rows = check_sharded_inputs(grad_y, None, weight, eps, epilogue, route_of(group_name).world_size)
    if _through_the_op(grad_y):
        return torch.ops.tpfuse.reduce_scatter_rmsnorm_backward_all_gather(grad_y, norm_input, weight, eps,
                                                                           group_name, grad_h)
    return _backward_call(grad_y, weight, eps, group_name, epilogue, own_rows)
