"""All-reduce + residual add + RMSNorm (+ static fp8) as ``torch.library`` custom ops.

Two ops share one implementation: ``tpfuse::allreduce_add_rmsnorm`` (functional, what graphs and
the compiler pass use) and ``tpfuse::allreduce_add_rmsnorm_out`` (writes preallocated outputs).
Each call picks where it runs: a fused kernel (the Triton one-shot or two-shot, or FlashInfer's,
as :func:`tpfuse.select.choose_algorithm` decides) when the group's communicator has a workspace
and the call fits :func:`tpfuse.select.max_token_num`, otherwise the reference path (the group's
own all-reduce, then the same norm in torch).
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tpfuse import _stats, select
from tpfuse.comm import agreement
from tpfuse.comm.communicator import default_wait_timeout_s, group_device, lookup_communicator, resolve_group
from tpfuse.kernels.reference import add_rmsnorm_reference

INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
FP8_DTYPE = torch.float8_e4m3fn


def _output_dtype(x: torch.Tensor, quant_scale: torch.Tensor | None) -> torch.dtype:
    return FP8_DTYPE if quant_scale is not None else x.dtype


def check_inputs(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quant_scale: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None,
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

    for name, t in (("residual", residual), ("weight", weight), ("quant_scale", quant_scale), ("out", out),
                    ("residual_out", residual_out)):
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
    if weight.dim() != 1 or weight.numel() != shape[1]:
        raise ValueError(f"weight must have shape ({shape[1]},), got {tuple(weight.shape)}")
    if weight.dtype not in (x.dtype, torch.float32):
        raise TypeError(f"weight has dtype {weight.dtype}; expected {x.dtype} or float32")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    same_place(weight, "weight")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    if quant_scale is not None:
        if quant_scale.dtype != torch.float32 or quant_scale.numel() != 1:
            raise ValueError("quant_scale must be a float32 tensor of one element")
        same_place(quant_scale, "quant_scale")
    outputs = (("out", out, _output_dtype(x, quant_scale)), ("residual_out", residual_out, x.dtype))
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


def _run(x, residual, weight, eps, group_name, quant_scale, y, h) -> None:
    check_inputs(x, residual, weight, eps, quant_scale, y, h)
    n_tokens, hidden = x.shape
    # Checks that wait for the host: always on the CPU, on a GPU only in debug mode and never in capture.
    checking = x.device.type == "cpu" or (_debug() and not torch.cuda.is_current_stream_capturing())
    comm = lookup_communicator(group_name)
    if comm is not None and comm.device == x.device:
        comm.check_usable()
        algorithm = comm.choose_algorithm(n_tokens, hidden, x.dtype, quantized=quant_scale is not None)
        if algorithm != select.REFERENCE:
            if checking and not comm.fused.compares_calls:
                comm.check_call_matches(n_tokens, hidden, x.dtype, algorithm)
            started = time.monotonic()
            _stats.record(comm.run_fused(algorithm, x, residual, weight, eps, y, h, quant_scale))
            if checking:
                comm.check_errors(waited_s=time.monotonic() - started)
            return
    group = _group_by_name(group_name)
    checking = checking and dist.get_world_size(group) > 1
    timeout = comm.wait_timeout_s if comm is not None else default_wait_timeout_s()
    if checking:  # the kernels' comparison of calls does not cover the group's all-reduce: compare here
        agreement.check_reference_call(group, group_device(group), n_tokens, hidden, x.dtype,
                                       residual is not None, quant_scale is not None, timeout)
    if n_tokens == 0:
        return
    reduced = x.to(torch.float32, copy=True)
    agreement.all_reduce(reduced, group, timeout if checking else None, "a reference-path all-reduce")
    y_ref, h_ref = add_rmsnorm_reference(reduced, residual, weight, eps, quant_scale, out_dtype=x.dtype)
    y.copy_(y_ref)
    h.copy_(h_ref)
    _stats.record("reference")


@torch.library.custom_op("tpfuse::allreduce_add_rmsnorm", mutates_args=())
def _allreduce_add_rmsnorm_op(
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    group_name: str,
    quant_scale: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    y = torch.empty(x.shape, dtype=_output_dtype(x, quant_scale), device=x.device)
    h = torch.empty_like(x)
    _run(x, residual, weight, eps, group_name, quant_scale, y, h)
    return y, h


@_allreduce_add_rmsnorm_op.register_fake
def _(x, residual, weight, eps, group_name, quant_scale):
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
) -> None:
    _run(x, residual, weight, eps, group_name, quant_scale, y, h)


@_allreduce_add_rmsnorm_out_op.register_fake
def _(x, residual, weight, eps, group_name, quant_scale, y, h):
    return None


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
) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum ``x`` over the ranks of ``group``, add ``residual``, apply RMSNorm: one fused call.

    Computes ``h = sum_ranks(x) + residual`` and ``y = h * rsqrt(mean(h**2, -1) + eps) * weight``
    with fp32 accumulation; every rank gets bit-identical ``y`` and ``h``.

    Parameters
    ----------
    x : Tensor [T, H]
        This rank's partial result; bfloat16, float16 or float32, contiguous.
    residual : Tensor [T, H] or None
        Added after the reduction; None means zero.
    weight : Tensor [H]
        RMSNorm gain, in x's dtype or float32.
    eps : float
        RMSNorm epsilon.
    group : ProcessGroup, optional
        The default group when None. The fused kernel runs when
        ``tpfuse.get_communicator(group)`` was called beforehand and the call fits its workspace
        (``tpfuse.select.max_token_num``); otherwise the group's own all-reduce does the reduction.
    out, residual_out : Tensor [T, H], optional
        Preallocated outputs for ``y`` and ``h``.
    quant_scale : Tensor, optional
        float32 of one element: ``y`` becomes float8_e4m3fn ``clamp(y / scale, -448, 448)``.

    Returns
    -------
    (y, h) : tuple of Tensor
        The normalised output and the new residual stream.
    """
    check_inputs(x, residual, weight, eps, quant_scale, out, residual_out)
    group_name = resolve_group(group).group_name
    if out is None and residual_out is None:
        return torch.ops.tpfuse.allreduce_add_rmsnorm(x, residual, weight, eps, group_name, quant_scale)
    y = out if out is not None else torch.empty(x.shape, dtype=_output_dtype(x, quant_scale), device=x.device)
    h = residual_out if residual_out is not None else torch.empty_like(x)
    torch.ops.tpfuse.allreduce_add_rmsnorm_out(x, residual, weight, eps, group_name, quant_scale, y, h)
    return y, h
