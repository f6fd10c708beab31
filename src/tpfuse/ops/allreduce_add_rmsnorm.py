"""All-reduce + residual add + RMSNorm (+ quantised outputs) as ``torch.library`` ops, with the optional
steps real models put around them: a MoE finalize before the sum, a bias after it, Gemma's post-norm
before the residual add, LayerNorm instead of RMSNorm, fp8 / fp4 output (``blockend.epilogue.Epilogue``,
whose fields are the ops' keyword-only arguments, declared there once).

The ops share one implementation: ``tpfuse::allreduce_add_rmsnorm`` (functional, what graphs and the
compiler pass use), ``tpfuse::allreduce_add_rmsnorm_out`` (writes preallocated outputs),
``tpfuse::allreduce_add_rmsnorm_quant`` (every quantised output with its scales, the norm's copy) and
``tpfuse::all_reduce`` (the sum alone). Each call is checked, made into one
:class:`tpfuse.blockend.call.FusedCall` and run by its group's route (``ops.route``): the local kernel
(a group of one rank), a fused kernel (the Triton one-shot or two-shot, or FlashInfer's) as the
communicator plans it, fused calls of the limit's rows, or the reference path (the group's own
all-reduce, then the same block end in torch).

The public functions call the implementation directly in eager code (a dispatcher round trip is
most of an eager call's host time) and the ops under ``torch.compile``, tensor subclasses and
dispatch modes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.distributed as dist

from tpfuse.blockend import bits
from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import PLAIN, Epilogue, schema
from tpfuse.blockend.stages import check_experts, check_like_rows, check_row
from tpfuse.ops.gradient import (
    all_reduce_with_gradient,
    block_end_with_gradient,
    refusing_gradient,
    requires_grad,
)
from tpfuse.ops.route import group_name_of, route_of
from tpfuse.targets import fp8_format

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _output_dtype(x: torch.Tensor, epilogue: Epilogue) -> torch.dtype:
    """y's dtype: x's, or the fp8 of x's device (float8_e4m3fnuz on gfx942, else float8_e4m3fn)."""
    return fp8_format(x.device).dtype if epilogue.fp8_output else x.dtype


def check_inputs(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    epilogue: Epilogue = PLAIN,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    own_rows: int | None = None,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first problem with the op's arguments. ``own_rows``: a
    sharded call's rows of this rank (sequence parallel), which the residual and the norm backward's
    inputs have.

    Every eager call pays for these checks (a few microseconds of host): the common call (no block-end
    step, no preallocated outputs) reads each tensor's properties once and nothing else.
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    dtype, shape = x.dtype, x.shape
    if dtype not in INPUT_DTYPES:
        raise TypeError(f"x has dtype {dtype}; supported: bfloat16, float16, float32")
    if len(shape) != 2:
        check_experts(x, epilogue.experts)
        shape = torch.Size((shape[0], shape[2]))  # the rows a MoE finalize makes of x [T, K, H]
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    device = x.device
    own_shape = shape if own_rows is None else torch.Size((own_rows, shape[1]))
    # One condition a tensor for arguments that pass (the common case); the helpers name what failed.
    if residual is not None and not (isinstance(residual, torch.Tensor) and residual.dtype is dtype and
                                     residual.shape == own_shape and residual.is_contiguous() and
                                     residual.device == device):
        check_like_rows("residual", residual, own_shape, device, dtype)
    if epilogue.normed and not (isinstance(weight, torch.Tensor) and weight.dim() == 1
                                and weight.shape[0] == shape[1]
                                and (weight.dtype is dtype or weight.dtype is torch.float32)
                                and weight.is_contiguous() and weight.device == device):
        if weight is None:
            raise TypeError("weight must be a tensor (the RMSNorm gain), got None")
        check_row("weight", weight, shape, dtype, device)
    if epilogue is not PLAIN:
        epilogue.check(x, shape, device, own_shape)
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if out is None and residual_out is None:
        return
    if out is not None:
        y_dtype = dtype if epilogue is PLAIN else _output_dtype(x, epilogue)
        if not (isinstance(out, torch.Tensor) and out.dtype is y_dtype and out.shape == shape and out.is_contiguous()
                and out.device == device):
            check_like_rows("out", out, shape, device, y_dtype,
                          " (the fp8 format of this device)" if epilogue.fp8_output else "")
    if residual_out is not None and not (isinstance(residual_out, torch.Tensor) and residual_out.dtype is dtype
                                         and residual_out.shape == shape and residual_out.is_contiguous()
                                         and residual_out.device == device):
        check_like_rows("residual_out", residual_out, shape, device, dtype)
    if out is not None and residual_out is not None and _overlap(out, residual_out):
        raise ValueError("out and residual_out share memory; y and h must go to separate tensors")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    a0, b0, a_bytes, b_bytes = a.data_ptr(), b.data_ptr(), a.nbytes, b.nbytes
    return a_bytes > 0 and b_bytes > 0 and a0 < b0 + b_bytes and b0 < a0 + a_bytes


def _quantised_outputs(x: torch.Tensor, epilogue: Epilogue,
                       h_rows: int | None = None) -> tuple[torch.Tensor, ...]:
    """(y, scales, h, normed) of a quantising call, empty: y fp8 [T, H] or fp4 codes [T, H / 2] (uint8),
    the scales in their format and layout (float32 [T, 0] where there are none), h [T, H] (or ``h_rows``
    of a sharded call), normed in x's dtype ([T, 0] without ``normed_copy``)."""
    n_tokens, hidden = x.shape[0], x.shape[-1]
    y = epilogue.output.empty_y(x, n_tokens, hidden)
    scales = epilogue.output.empty_scales(n_tokens, hidden, x.device)
    if scales is None:
        scales = x.new_empty((n_tokens, 0), dtype=torch.float32)
    normed = _empty_rows(x) if epilogue.normed_copy else x.new_empty((n_tokens, 0))
    return y, scales, _empty_rows(x) if h_rows is None else x.new_empty((h_rows, hidden)), normed


def _outputs(x: torch.Tensor, epilogue: Epilogue) -> tuple[torch.Tensor, torch.Tensor]:
    """(y, h), empty."""
    return _empty_y(x, epilogue), _empty_rows(x)


def _empty_y(x: torch.Tensor, epilogue: Epilogue) -> torch.Tensor:
    """y, empty: in x's dtype, or fp8 (an fp8 block end)."""
    return _empty_rows(x, _output_dtype(x, epilogue) if epilogue.fp8_output else None)


def _empty_rows(x: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An empty [T, H] output beside x (x [T, H], or a MoE finalize's [T, K, H]), in ``dtype`` or x's."""
    if x.dim() == 3:
        return x.new_empty((x.shape[0], x.shape[2]), dtype=dtype)
    if dtype is None:  # empty_like with a dtype argument costs twice the host time
        return torch.empty_like(x)
    return torch.empty_like(x, dtype=dtype)


# The ops, on the cheapest registration that keeps a fake implementation for torch.compile: a Library
# with a CompositeExplicitAutograd kernel (a torch.library.custom_op costs about twice the host time a
# call). The block end's steps are keyword-only arguments, from Epilogue's fields.
_lib = torch.library.Library("tpfuse", "DEF")
_CALL = "Tensor x, Tensor? residual, Tensor weight, float eps, str group_name"
_STEPS = schema()
_lib.define(f"allreduce_add_rmsnorm({_CALL}, *, {_STEPS}) -> (Tensor, Tensor)")
_lib.define(f"allreduce_add_rmsnorm_out({_CALL}, Tensor(a!) y, Tensor(b!) h, *, {_STEPS}) -> ()")
_lib.define(f"allreduce_add_rmsnorm_quant({_CALL}, *, {_STEPS}) -> (Tensor, Tensor, Tensor, Tensor)")
_lib.define("all_reduce(Tensor x, str group_name) -> Tensor")
#: A plain all-reduce's block end: the sum, nothing after it.
SUM_ONLY = Epilogue(normed=False)


def _functional(x, residual, weight, eps, group_name, **step_args):
    epilogue = Epilogue.of(step_args)
    check_inputs(x, residual, weight, eps, epilogue)
    y, h = _outputs(x, epilogue)
    route_of(group_name).run(FusedCall(x, residual, weight, eps, y, h, epilogue))
    return y, h


def _out(x, residual, weight, eps, group_name, y, h, **step_args):
    epilogue = Epilogue.of(step_args)
    check_inputs(x, residual, weight, eps, epilogue, y, h)
    route_of(group_name).run(FusedCall(x, residual, weight, eps, y, h, epilogue))


def _quant(x, residual, weight, eps, group_name, **step_args):
    epilogue = Epilogue.of(step_args)
    check_inputs(x, residual, weight, eps, epilogue)
    return _run_quant(x, residual, weight, eps, group_name, epilogue)


def _run_quant(x, residual, weight, eps, group_name, epilogue: Epilogue, own_rows: int | None = None):
    """A checked quantising call: its outputs made, run by its group's route. ``own_rows``: a sharded
    call's (sequence parallel), whose h holds this rank's rows."""
    if not epilogue.quantised:
        raise ValueError("allreduce_add_rmsnorm_quant quantises y: pass quant_scale, scale_group or fp4")
    y, scales, h, normed = _quantised_outputs(x, epilogue, own_rows)
    route_of(group_name).run(FusedCall(x, residual, weight, eps, y, h, epilogue,
                                       scales if scales.shape[1] else None,
                                       normed if epilogue.normed_copy else None, own_rows is not None))
    return y, scales, h, normed


def _all_reduce(x, group_name):
    check_inputs(x, None, None, 0.0, SUM_ONLY)
    h = torch.empty_like(x)
    route_of(group_name).run(FusedCall(x, None, x, 0.0, h, h, SUM_ONLY))  # no norm: no weight read, no y written
    return h


def _all_reduce_fake(x, group_name):
    return torch.empty_like(x)


def _functional_fake(x, residual, weight, eps, group_name, **step_args):
    return _outputs(x, Epilogue.of(step_args))


def _out_fake(x, residual, weight, eps, group_name, y, h, **step_args):
    return None


def _quant_fake(x, residual, weight, eps, group_name, **step_args):
    return _quantised_outputs(x, Epilogue.of(step_args))


for _name, _impl, _fake in (("allreduce_add_rmsnorm", _functional, _functional_fake),
                            ("allreduce_add_rmsnorm_out", _out, _out_fake),
                            ("allreduce_add_rmsnorm_quant", _quant, _quant_fake),
                            ("all_reduce", _all_reduce, _all_reduce_fake)):
    _lib.impl(_name, _impl, "CompositeExplicitAutograd")
    torch.library.register_fake(f"tpfuse::{_name}", _fake, lib=_lib)


def _through_the_op(x: torch.Tensor) -> bool:
    """Whether a public call must go through the dispatcher: while torch.compile traces, for tensor
    subclasses (fake, functional, DTensor) and under dispatch modes; plain eager calls run directly."""
    return (type(x) is not torch.Tensor or torch.compiler.is_compiling()
            or torch._C._len_torch_dispatch_stack() > 0)


def allreduce_add_rmsnorm(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    group: dist.ProcessGroup | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    quant_scale: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    shared_expert: torch.Tensor | None = None,
    y_grad: str = "replicated",
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``x`` over the ranks of ``group``, add ``residual``, apply RMSNorm: one fused call.

    Computes ``h = sum_ranks(x) + residual`` and ``y = h * rsqrt(mean(h**2, -1) + eps) * weight``
    with fp32 accumulation; every rank gets bit-identical ``y`` and ``h``. The optional steps, in
    order: a MoE block's finalize before the sum (x [T, K, H] of the top-k experts' outputs, weighted
    by ``topk_weights`` and summed, ``+ shared_expert``), ``+ bias`` right after the sum,
    ``rmsnorm(.) * sum_weight`` before the residual add (Gemma 2/3), LayerNorm instead of RMSNorm for
    ``y`` (``layer_norm``, ``norm_bias``), fp8 ``y`` (every quantised form:
    :func:`allreduce_add_rmsnorm_quant`).

    Parameters
    ----------
    x : Tensor [T, H] or [T, K, H]
        This rank's partial result; bfloat16, float16 or float32, contiguous. [T, K, H]: the outputs
        of each token's K experts (a MoE block's, before its finalize), summed first on each rank.
    residual : Tensor [T, H] or None
        Added after the reduction; None means zero.
    weight : Tensor [H]
        The norm's gain, in x's dtype or float32.
    eps : float
        The norms' epsilon.
    group : ProcessGroup, optional
        The default group when None. The fused kernel runs when
        ``tpfuse.get_communicator(group)`` was called beforehand and the call fits its workspace
        (``tpfuse.select.max_token_num``); otherwise the group's own all-reduce does the reduction.
        A group of one rank runs the block end as one kernel, with or without a communicator.
    out, residual_out : Tensor [T, H], optional
        Preallocated outputs for ``y`` and ``h``.
    quant_scale : Tensor, optional
        float32 of one element: ``y`` becomes float8_e4m3fn ``clamp(y / scale, -448, 448)``
        (on gfx942, MI300: float8_e4m3fnuz, clamped to +-240).
    bias : Tensor [H], optional
        Added to the sum before anything else (a row-parallel layer's bias).
    sum_weight : Tensor [H], optional
        RMSNorm of the sum with this gain before the residual add (Gemma's post-norm: pass ``1 + w``).
    layer_norm : bool
        ``y = (h - mean) * rsqrt(var + eps) * weight + norm_bias`` instead of RMSNorm.
    norm_bias : Tensor [H], optional
        LayerNorm's bias.
    topk_weights : Tensor [T, K], optional
        With x [T, K, H]: each expert output's weight (float32 or x's dtype), applied before the
        experts' sum. None: x's outputs are weighted already.
    shared_expert : Tensor [T, H], optional
        This rank's part of a shared expert's output (or any second partial sum), added to its part of
        x before the all-reduce; x's dtype.
    y_grad : {"replicated", "partial"}
        Under autograd, what the gradient reaching ``y`` is: the same on every rank (the next layer has
        summed it), or each rank's part of it (the next column-parallel layer's input gradient, not yet
        summed): then the backward sums it in one fused call with the norm's backward
        (:func:`allreduce_rmsnorm_backward`). Every input's gradient: docs/training.md.

    Returns
    -------
    (y, h) : tuple of Tensor [T, H]
        The normalised output and the new residual stream.
    """
    if (quant_scale is None and bias is None and sum_weight is None and not layer_norm and norm_bias is None
            and topk_weights is None and shared_expert is None and _experts(x) == 0):
        epilogue = PLAIN  # the common call: no block end to build
    else:
        epilogue = Epilogue(quant_scale, bias, sum_weight, layer_norm, norm_bias, experts=_experts(x),
                            topk_weights=topk_weights, shared_expert=shared_expert)
    check_inputs(x, residual, weight, eps, epilogue, out, residual_out)
    group_name = group_name_of(group)
    # Attribute reads first: the plain eager call (no gradient) pays no more than these.
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad
                                    or (residual is not None and residual.requires_grad)
                                    or (epilogue is not PLAIN and requires_grad(bias, sum_weight, norm_bias,
                                                                                topk_weights, shared_expert))):
        if out is not None or residual_out is not None:
            raise ValueError("out and residual_out take no gradient: leave them out where the call trains")
        return block_end_with_gradient(x, residual, weight, eps, group_name, epilogue, y_grad)
    if out is None and residual_out is None:
        if _through_the_op(x):
            return torch.ops.tpfuse.allreduce_add_rmsnorm(x, residual, weight, eps, group_name,
                                                          **epilogue.kwargs())
        y, h = _outputs(x, epilogue)
    else:
        y = out if out is not None else _empty_y(x, epilogue)
        h = residual_out if residual_out is not None else _empty_rows(x)
        if _through_the_op(x):
            torch.ops.tpfuse.allreduce_add_rmsnorm_out(x, residual, weight, eps, group_name, y, h,
                                                       **epilogue.kwargs())
            return y, h
    route_of(group_name).run(FusedCall(x, residual, weight, eps, y, h, epilogue))
    return y, h


def allreduce_rmsnorm_backward(
    grad_y: torch.Tensor,
    norm_input: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    grad_h: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A block end's backward in one fused call: sum ``grad_y`` over the ranks, RMSNorm's backward, add
    ``grad_h``.

    With ``g = sum_ranks(grad_y)`` (fp32, in rank order, rounded once) and ``r = rsqrt(mean(a * a) + eps)``
    for ``a = norm_input``: ``grad_input = grad_h + r * (g * w - a * mean(g * w * a) * r * r)``. The same
    kernels, workspace and rules as :func:`allreduce_add_rmsnorm` (every rank gets the same bits; a row's
    results do not depend on the other rows).

    Parameters
    ----------
    grad_y : Tensor [T, H]
        This rank's part of the gradient of the norm's output (bfloat16, float16 or float32,
        contiguous): what a column-parallel layer's backward gives for its input.
    norm_input : Tensor [T, H]
        The norm's input: the ``h`` the forward returned; grad_y's dtype.
    weight : Tensor [H]
        The norm's gain.
    eps : float
    grad_h : Tensor [T, H]
        The gradient reaching ``norm_input`` by the residual stream (the same on every rank).
    group : ProcessGroup, optional
        The default group when None.

    Returns
    -------
    (grad_input, grad_y_sum) : tuple of Tensor [T, H]
        The gradient of ``norm_input`` (grad_h included) and ``g``, the summed gradient of the norm's
        output (for the weight's gradient: ``sum over rows of g * a * r``).
    """
    epilogue = Epilogue(norm_input=norm_input, grad_h=grad_h)
    check_inputs(grad_y, None, weight, eps, epilogue)
    group_name = group_name_of(group)
    if _through_the_op(grad_y):
        return torch.ops.tpfuse.allreduce_add_rmsnorm(grad_y, None, weight, eps, group_name, **epilogue.kwargs())
    y, h = _outputs(grad_y, epilogue)
    route_of(group_name).run(FusedCall(grad_y, None, weight, eps, y, h, epilogue))
    return y, h


def allreduce_add_rmsnorm_dynamic_fp8(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    *,
    group: dist.ProcessGroup | None = None,
    scale_group: int | None = None,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
    topk_weights: torch.Tensor | None = None,
    shared_expert: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`allreduce_add_rmsnorm` with ``y`` in float8_e4m3fn scaled dynamically, in the same call: a
    thin form of :func:`allreduce_add_rmsnorm_quant` (``output="fp8"``), which takes every quantised output.

    ``scale_group`` elements share a scale: None (or H) for one scale a token (``scales`` [T, 1]),
    128 for DeepSeek-V3 / Llama-4 style groups (``scales`` [T, H / 128]). Each scale is
    ``max(amax / 448, 1 / (448 * 512))`` over its elements and ``y8 = clamp(y / scale, -448, 448)``,
    so ``y8 * scale`` approximates ``y`` (on gfx942, MI300: float8_e4m3fnuz and 240 for 448). x, a
    MoE finalize's ``topk_weights`` and ``shared_expert`` as for :func:`allreduce_add_rmsnorm`.

    Returns
    -------
    (y8, scales, h) : tuple of Tensor
    """
    y, scales, h, _ = allreduce_add_rmsnorm_quant(
        x, residual, weight, eps, output="fp8", group=group, scale_group=scale_group, bias=bias,
        sum_weight=sum_weight, layer_norm=layer_norm, norm_bias=norm_bias, topk_weights=topk_weights,
        shared_expert=shared_expert)
    return y, scales, h


class QuantizedOutputs(NamedTuple):
    """What :func:`allreduce_add_rmsnorm_quant` returns.

    Attributes
    ----------
    y : Tensor
        fp8 [T, H] (the device's format), or fp4 codes [T, H / 2] uint8 (two e2m1 codes a byte, the
        even column in the low nibble).
    scales : Tensor or None
        Dynamic fp8's float32 [T, H / scale_group] (column-major or packed UE8M0 int32 [T, ceil(G / 4)]
        as ``scale_layout`` says), NVFP4's float8_e4m3fn [T rounded up to 128, H / 16 rounded up to 4]
        in the 128 x 4 tiles of Blackwell's FP4 GEMMs, MXFP4's float8_e8m0fnu [T, H / 32] (shuffled:
        padded, in AITER's order); None for static fp8.
    h : Tensor [T, H]
        The new residual stream.
    normed : Tensor [T, H] or None
        The norm's output before quantisation, in x's dtype (``normed_copy=True``).
    """

    y: torch.Tensor
    scales: torch.Tensor | None
    h: torch.Tensor
    normed: torch.Tensor | None


#: ``allreduce_add_rmsnorm_quant``'s ``output`` and ``scale_layout`` words.
OUTPUTS = {"fp8": bits.FP4_NONE, "nvfp4": bits.FP4_NVFP4, "mxfp4": bits.FP4_MXFP4}
SCALE_LAYOUTS = {"rows": bits.SCALES_ROWS, "columns": bits.SCALES_COLUMNS,
                 "packed_ue8m0": bits.SCALES_PACKED_UE8M0, "shuffled": bits.SCALES_SHUFFLED}


def allreduce_add_rmsnorm_quant(
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
    topk_weights: torch.Tensor | None = None,
    shared_expert: torch.Tensor | None = None,
) -> QuantizedOutputs:
    """:func:`allreduce_add_rmsnorm` with ``y`` in the quantised form the next GEMM takes, in the same call.

    ``output``:

    - ``"fp8"``: static with ``quant_scale``, else dynamic with a scale a ``scale_group`` elements
      (None: one a token: ``scales`` [T, 1]); ``ue8m0_scales`` rounds each
      scale up to a power of two; ``scale_layout`` ``"rows"`` (float32 [T, G]), ``"columns"`` (float32
      [T, G] stored column-major with T padded to 4: DeepGEMM's fp8 GEMMs on Hopper) or
      ``"packed_ue8m0"`` (the exponents, four to an int32, column-major, T padded to 4: DeepGEMM on
      Blackwell; rounds as ``ue8m0_scales``).
    - ``"nvfp4"``: e2m1 of ``y * g / s`` with ``s = e4m3(amax / 6 * g)`` a 16 elements, ``g`` the float32
      ``global_scale`` (vLLM's ``input_global_scale``, e.g. ``448 * 6 / amax(y)``).
    - ``"mxfp4"``: e2m1 of ``y / 2**e`` with ``e = floor(log2(amax)) - 2`` a 32 elements (OCP MX); the
      e8m0 scales ``[T, H / 32]`` row-major, or with ``scale_layout="shuffled"`` padded to
      ``[T rounded up to 256, H / 32 rounded up to 8]`` (zeros) in the order AITER's MXFP4 GEMMs read
      (its ``e8m0_shuffle``).

    ``normed_copy=True`` also returns the norm's output in x's dtype (a normed row that feeds a
    quantised GEMM and something else). The other keywords as for :func:`allreduce_add_rmsnorm`.

    Returns
    -------
    QuantizedOutputs
        ``(y, scales, h, normed)``.
    """
    epilogue = quantised_block_end(x, output, quant_scale, scale_group, ue8m0_scales, scale_layout, global_scale,
                                   normed_copy, bias=bias, sum_weight=sum_weight, layer_norm=layer_norm,
                                   norm_bias=norm_bias, topk_weights=topk_weights, shared_expert=shared_expert)
    check_inputs(x, residual, weight, eps, epilogue)
    group_name = group_name_of(group)

    def run():
        if _through_the_op(x):
            return torch.ops.tpfuse.allreduce_add_rmsnorm_quant(x, residual, weight, eps, group_name,
                                                                **epilogue.kwargs())
        return _run_quant(x, residual, weight, eps, group_name, epilogue)

    inputs = (x, residual, weight, bias, sum_weight, norm_bias, topk_weights, shared_expert)
    return quantised_result(run, inputs, normed_copy)


def quantised_result(run, inputs: tuple, normed_copy: bool) -> QuantizedOutputs:
    """A quantising call's :class:`QuantizedOutputs` from ``run()`` (its op's four outputs), run so that a
    gradient reaching them raises where any of ``inputs`` requires one; absent scales and copy as None."""
    y, scales, h, normed = refusing_gradient(run, *inputs) if requires_grad(*inputs) else run()
    return QuantizedOutputs(y, scales if scales.shape[-1] else None, h, normed if normed_copy else None)


def quantised_block_end(x, output: str, quant_scale, scale_group, ue8m0_scales: bool, scale_layout: str,
                        global_scale, normed_copy: bool, **steps) -> Epilogue:
    """The block end of a quantising call from :func:`allreduce_add_rmsnorm_quant`'s words (``output``,
    the scales' form and layout, the steps' tensors), checked: ValueError naming a word it does not
    know or a combination the formats do not have."""
    if output not in OUTPUTS:
        raise ValueError(f"output must be one of {sorted(OUTPUTS)}, got {output!r}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {sorted(SCALE_LAYOUTS)}, got {scale_layout!r}")
    fp4 = OUTPUTS[output]
    if fp4 == bits.FP4_NONE and quant_scale is None:
        scale_group = x.shape[-1] if scale_group is None and isinstance(x, torch.Tensor) else scale_group
        if isinstance(scale_group, bool) or not isinstance(scale_group, int) or scale_group <= 0:
            raise ValueError(f"scale_group must be a positive int (elements per scale), got {scale_group!r}")
    elif scale_group is not None:
        raise ValueError("scale_group is dynamic fp8's: static fp8 (quant_scale) and fp4 have their own scales")
    return Epilogue(quant_scale=quant_scale, scale_group=scale_group or 0, experts=_experts(x),
                    normed_copy=normed_copy, ue8m0_scales=ue8m0_scales, scale_layout=SCALE_LAYOUTS[scale_layout],
                    fp4=fp4, global_scale=global_scale, **steps)


def _experts(x) -> int:
    """K of a MoE finalize's x [T, K, H], else 0 (the checks name any other shape)."""
    return x.shape[1] if isinstance(x, torch.Tensor) and x.dim() == 3 else 0


def all_reduce(x: torch.Tensor, *, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """Sum ``x`` over the ranks of ``group``: a plain all-reduce on tpfuse's kernels.

    The same kernels, workspace, fusion limit, call comparison, bounded waits and rank-order fp32 sum
    as :func:`allreduce_add_rmsnorm`, with no block end after the sum; every rank gets bit-identical
    results. Larger calls than the workspace holds run as fused calls of its rows; without a
    communicator (or for float32) the group's own all-reduce does it, in fp32.

    Parameters
    ----------
    x : Tensor [..., H]
        This rank's part, contiguous; bfloat16, float16 (the kernels) or float32. H a multiple of 8.
    group : ProcessGroup, optional
        The default group when None.

    Returns
    -------
    Tensor
        The sum, x's shape and dtype (a new tensor; x is not changed).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dim() != 2 and x.dim() >= 1:
        return all_reduce(x.reshape(-1, x.shape[-1]), group=group).reshape(x.shape)
    group_name = group_name_of(group)
    if torch.is_grad_enabled() and x.requires_grad:
        return all_reduce_with_gradient(x, group_name)
    if _through_the_op(x):
        return torch.ops.tpfuse.all_reduce(x, group_name)
    return _all_reduce(x, group_name)
