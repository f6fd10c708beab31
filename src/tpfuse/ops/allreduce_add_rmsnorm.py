"""All-reduce + residual add + RMSNorm (+ fp8) as ``torch.library`` custom ops, with the optional steps
real models put around them (``kernels/epilogue.py``): a bias after the all-reduce, Gemma's post-norm
before the residual add, LayerNorm instead of RMSNorm, fp8 output with a static or dynamic scale.

Three ops share one implementation: ``tpfuse::allreduce_add_rmsnorm`` (functional, what graphs and
the compiler pass use), ``tpfuse::allreduce_add_rmsnorm_out`` (writes preallocated outputs) and
``tpfuse::allreduce_add_rmsnorm_dynamic_fp8`` (fp8 ``y`` with scales per token or per group).
Each call picks where it runs: a fused kernel (the Triton one-shot or two-shot, or FlashInfer's,
as :func:`tpfuse.select.choose_algorithm` decides) when the group's communicator has a workspace
and the call fits :func:`tpfuse.select.max_token_num`, otherwise the reference path (the group's
own all-reduce, then the same norm in torch).
"""

from __future__ import annotations

import dataclasses
import os
import time

import torch
import torch.distributed as dist

from tpfuse import _stats, select
from tpfuse.comm import agreement
from tpfuse.comm.communicator import default_wait_timeout_s, group_device, lookup_communicator, resolve_group
from tpfuse.kernels.epilogue import PLAIN, Epilogue
from tpfuse.kernels.reference import add_rmsnorm_reference

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn


def _output_dtype(x: torch.Tensor, quant_scale: torch.Tensor | None,
                  epilogue: Epilogue = PLAIN) -> torch.dtype:
    return FP8_DTYPE if quant_scale is not None or epilogue.scale_group else x.dtype


def check_inputs(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quant_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
    epilogue: Epilogue = PLAIN,
) -> None:
    """Raise ``ValueError``/``TypeError`` naming the first problem with the op's arguments."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: bfloat16, float16, float32")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [tokens, hidden], got shape {tuple(x.shape)}")
    if not x.is_contiguous():
        raise ValueError("x must be contiguous")
    shape = tuple(x.shape)

    def same_place(t: torch.Tensor, name: str) -> None:
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")

    gains = (("weight", weight), ("bias", epilogue.bias), ("sum_weight", epilogue.sum_weight),
             ("norm_bias", epilogue.norm_bias))
    for name, t in (("residual", residual), ("quant_scale", quant_scale), ("out", out),
                    ("residual_out", residual_out)) + gains:
        if t is not None and not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a tensor{'' if name == 'weight' else ' or None'}, "
                            f"got {type(t).__name__}")
    if weight is None:
        raise TypeError("weight must be a tensor (the RMSNorm gain), got None")
    if residual is not None:
        if residual.dtype != x.dtype:
            raise TypeError(f"residual has dtype {residual.dtype} but x has {x.dtype}")
        if tuple(residual.shape) != shape:
            raise ValueError(f"residual has shape {tuple(residual.shape)} but x has {shape}")
        if not residual.is_contiguous():
            raise ValueError("residual must be contiguous")
        same_place(residual, "residual")
    for name, t in gains:  # a row of H that every token shares
        if t is None:
            continue
        if t.dim() != 1 or t.numel() != shape[1]:
            raise ValueError(f"{name} must have shape ({shape[1]},), got {tuple(t.shape)}")
        if t.dtype not in (x.dtype, torch.float32):
            raise TypeError(f"{name} has dtype {t.dtype}; expected {x.dtype} or float32")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        same_place(t, name)
    if epilogue.norm_bias is not None and not epilogue.layer_norm:
        raise ValueError("norm_bias is LayerNorm's bias: pass layer_norm=True with it")
    group = epilogue.scale_group
    power_of_two = group >= 8 and group & (group - 1) == 0
    if group and not (group == shape[1] or (power_of_two and shape[1] % group == 0)):
        raise ValueError(f"scale_group {group} must be the hidden size {shape[1]} (a scale per token) or a "
                         "power of two >= 8 that divides it")
    if group and quant_scale is not None:
        raise ValueError("quant_scale (static fp8) and a dynamic fp8 scale_group exclude each other")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if quant_scale is not None:
        if quant_scale.dtype != torch.float32 or quant_scale.numel() != 1:
            raise ValueError("quant_scale must be a float32 tensor of one element")
        same_place(quant_scale, "quant_scale")
    outputs = (("out", out, _output_dtype(x, quant_scale, epilogue)), ("residual_out", residual_out, x.dtype))
    for name, t, dtype in outputs:
        if t is None:
            continue
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape}")
        if t.dtype != dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype}")
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
        same_place(t, name)
    if out is not None and residual_out is not None and _overlap(out, residual_out):
        raise ValueError("out and residual_out share memory; y and h must go to separate tensors")


def _overlap(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two contiguous tensors share any byte."""
    a0, b0 = a.data_ptr(), b.data_ptr()
    return a.numel() > 0 and b.numel() > 0 and a0 < b0 + b.numel() * b.element_size() and \
        b0 < a0 + a.numel() * a.element_size()


def _debug() -> bool:
    """``TPFUSE_DEBUG=1``: on a GPU, check every eager call for errors after it (it synchronises)."""
    return os.environ.get("TPFUSE_DEBUG") == "1"


def _group_by_name(group_name: str) -> dist.ProcessGroup:
    try:
        return dist.distributed_c10d._resolve_process_group(group_name)
    except Exception as exc:  # the private resolver raises several types across torch versions
        raise ValueError(f"tpfuse: unknown process group {group_name!r}") from exc


def _run_fused(comm, x, residual, weight, eps, quant_scale, y, h, epilogue, checking) -> None:
    """One fused call of ``comm``'s backend, with the algorithm its table gives for these rows."""
    n_tokens, hidden = x.shape
    algorithm = comm.choose_algorithm(n_tokens, hidden, x.dtype, quant_scale is not None, epilogue)
    if checking and not comm.fused.compares_calls:
        comm.check_call_matches(n_tokens, hidden, x.dtype, algorithm)
    started = time.monotonic()
    _stats.record(comm.run_fused(algorithm, x, residual, weight, eps, y, h, quant_scale, epilogue))
    if checking:
        comm.check_errors(waited_s=time.monotonic() - started)


def _run(x, residual, weight, eps, group_name, quant_scale, y, h, epilogue=PLAIN) -> None:
    check_inputs(x, residual, weight, eps, quant_scale, y, h, epilogue)
    n_tokens, hidden = x.shape
    # Checks that wait for the host: always on the CPU, on a GPU only in debug mode and never in capture.
    checking = x.device.type == "cpu" or (_debug() and not torch.cuda.is_current_stream_capturing())
    comm = lookup_communicator(group_name)
    if comm is not None and comm.device == x.device:
        comm.check_usable()
        quantized = quant_scale is not None
        rows = max(n_tokens, 1)  # an empty call is a fused call too: it exchanges descriptors
        if comm.choose_algorithm(n_tokens, hidden, x.dtype, quantized, epilogue) == select.REFERENCE:
            rows = comm.chunk_rows(n_tokens, hidden, x.dtype, quantized, epilogue)
        if rows:
            # Calls over the workspace run as fused calls of `rows` rows each (rows are independent),
            # so the ranks' calls stay compared and every wait bounded (docs/reliability.md).
            try:
                for start in range(0, max(n_tokens, 1), rows):
                    part = slice(start, min(start + rows, n_tokens))
                    scales = epilogue.scales[part] if epilogue.scales is not None else None
                    rows_epilogue = dataclasses.replace(epilogue, scales=scales)
                    _run_fused(comm, x[part], residual[part] if residual is not None else None, weight, eps,
                               quant_scale, y[part], h[part], rows_epilogue, checking)
            except RuntimeError:
                for out in (y, h, epilogue.scales):  # a failed call returns none of its rows, not even
                    if out is not None and rows < n_tokens:  # those of chunks that went through
                        out.fill_(float("nan"))
                raise
            return
    group = _group_by_name(group_name)
    checking = checking and dist.get_world_size(group) > 1
    timeout = comm.wait_timeout_s if comm is not None else default_wait_timeout_s()
    if checking:  # the kernels' comparison of calls does not cover the group's all-reduce: compare here
        agreement.check_reference_call(group, group_device(group), n_tokens, hidden, x.dtype,
                                       residual is not None, quant_scale is not None,
                                       epilogue.flags(hidden), timeout)
    if n_tokens == 0:
        return
    reduced = x.to(torch.float32, copy=True)
    agreement.all_reduce(reduced, group, timeout if checking else None, "a reference-path all-reduce")
    y_ref, h_ref, scales = add_rmsnorm_reference(reduced, residual, weight, eps, quant_scale, x.dtype,
                                                 epilogue)
    y.copy_(y_ref)
    h.copy_(h_ref)
    if scales is not None:
        epilogue.scales.copy_(scales)
    _stats.record("reference")


@torch.library.custom_op("tpfuse::allreduce_add_rmsnorm", mutates_args=())
def _allreduce_add_rmsnorm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    quant_scale: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=_output_dtype(x, quant_scale), device=x.device)
    h = torch.empty_like(x)
    _run(x, residual, weight, eps, group_name, quant_scale, y, h,
         Epilogue(bias, sum_weight, layer_norm, norm_bias))
    return y, h


@_allreduce_add_rmsnorm_op.register_fake
def _(x, residual, weight, eps, group_name, quant_scale, bias=None, sum_weight=None, layer_norm=False,
      norm_bias=None):
    return torch.empty(x.shape, dtype=_output_dtype(x, quant_scale), device=x.device), torch.empty_like(x)


@torch.library.custom_op("tpfuse::allreduce_add_rmsnorm_out", mutates_args=("y", "h"))
def _allreduce_add_rmsnorm_out_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    quant_scale: torch.Tensor | None,
    y: torch.Tensor,
    h: torch.Tensor,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
) -> None:
    _run(x, residual, weight, eps, group_name, quant_scale, y, h,
         Epilogue(bias, sum_weight, layer_norm, norm_bias))


@_allreduce_add_rmsnorm_out_op.register_fake
def _(x, residual, weight, eps, group_name, quant_scale, y, h, bias=None, sum_weight=None, layer_norm=False,
      norm_bias=None):
    return None


@torch.library.custom_op("tpfuse::allreduce_add_rmsnorm_dynamic_fp8", mutates_args=())
def _allreduce_add_rmsnorm_dynamic_fp8_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    scale_group: int,
    bias: torch.Tensor | None = None,
    sum_weight: torch.Tensor | None = None,
    layer_norm: bool = False,
    norm_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    y, scales, h = _dynamic_fp8_outputs(x, scale_group)
    _run(x, residual, weight, eps, group_name, None, y, h,
         Epilogue(bias, sum_weight, layer_norm, norm_bias, scale_group, scales))
    return y, scales, h


def _dynamic_fp8_outputs(x: torch.Tensor, scale_group: int) -> tuple[torch.Tensor, ...]:
    """(y8, scales, h), empty."""
    n_tokens, hidden = x.shape
    groups = hidden // scale_group if scale_group > 0 else 0
    return (torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device),
            torch.empty((n_tokens, groups), dtype=torch.float32, device=x.device), torch.empty_like(x))


@_allreduce_add_rmsnorm_dynamic_fp8_op.register_fake
def _(x, residual, weight, eps, group_name, scale_group, bias=None, sum_weight=None, layer_norm=False,
      norm_bias=None):
    return _dynamic_fp8_outputs(x, scale_group)


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``x`` over the ranks of ``group``, add ``residual``, apply RMSNorm: one fused call.

    Computes ``h = sum_ranks(x) + residual`` and ``y = h * rsqrt(mean(h**2, -1) + eps) * weight``
    with fp32 accumulation; every rank gets bit-identical ``y`` and ``h``. The optional steps, in
    order: ``+ bias`` right after the sum, ``rmsnorm(.) * sum_weight`` before the residual add
    (Gemma 2/3), LayerNorm instead of RMSNorm for ``y`` (``layer_norm``, ``norm_bias``).

    Parameters
    ----------
    x : Tensor [T, H]
        This rank's partial result; bfloat16, float16 or float32, contiguous.
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
    out, residual_out : Tensor [T, H], optional
        Preallocated outputs for ``y`` and ``h``.
    quant_scale : Tensor, optional
        float32 of one element: ``y`` becomes float8_e4m3fn ``clamp(y / scale, -448, 448)``.
    bias : Tensor [H], optional
        Added to the sum before anything else (a row-parallel layer's bias).
    sum_weight : Tensor [H], optional
        RMSNorm of the sum with this gain before the residual add (Gemma's post-norm: pass ``1 + w``).
    layer_norm : bool
        ``y = (h - mean) * rsqrt(var + eps) * weight + norm_bias`` instead of RMSNorm.
    norm_bias : Tensor [H], optional
        LayerNorm's bias.

    Returns
    -------
    (y, h) : tuple of Tensor
        The normalised output and the new residual stream.
    """
    epilogue = Epilogue(bias, sum_weight, layer_norm, norm_bias)
    check_inputs(x, residual, weight, eps, quant_scale, out, residual_out, epilogue)
    group_name = resolve_group(group).group_name
    extras = (bias, sum_weight, layer_norm, norm_bias)
    if out is None and residual_out is None:
        return torch.ops.tpfuse.allreduce_add_rmsnorm(x, residual, weight, eps, group_name, quant_scale,
                                                      *extras)
    y = out if out is not None else torch.empty(x.shape, dtype=_output_dtype(x, quant_scale), device=x.device)
    h = residual_out if residual_out is not None else torch.empty_like(x)
    torch.ops.tpfuse.allreduce_add_rmsnorm_out(x, residual, weight, eps, group_name, quant_scale, y, h,
                                               *extras)
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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """:func:`allreduce_add_rmsnorm` with ``y`` in float8_e4m3fn scaled dynamically, in the same call.

    ``scale_group`` elements share a scale: None (or H) for one scale a token (``scales`` [T, 1]),
    128 for DeepSeek-V3 / Llama-4 style groups (``scales`` [T, H / 128]). Each scale is
    ``max(amax / 448, 1 / (448 * 512))`` over its elements and ``y8 = clamp(y / scale, -448, 448)``,
    so ``y8 * scale`` approximates ``y``.

    Returns
    -------
    (y8, scales, h) : tuple of Tensor
    """
    scale_group = x.shape[-1] if scale_group is None and x.dim() == 2 else scale_group
    if not isinstance(scale_group, int) or scale_group <= 0:
        raise ValueError(f"scale_group must be a positive int (elements per scale), got {scale_group!r}")
    epilogue = Epilogue(bias, sum_weight, layer_norm, norm_bias, scale_group)
    check_inputs(x, residual, weight, eps, None, epilogue=epilogue)
    return torch.ops.tpfuse.allreduce_add_rmsnorm_dynamic_fp8(
        x, residual, weight, eps, resolve_group(group).group_name, scale_group, bias, sum_weight, layer_norm,
        norm_bias)
