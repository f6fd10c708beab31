"""Pure-torch reference of the fused op: the reference backend's math and the kernels' oracle.

The steps are those of ``kernels/block_end.py``: a MoE finalize, sum, + bias, post-norm, + residual,
RMSNorm or LayerNorm, fp8 with a static or dynamic scale, NVFP4 or MXFP4 (``kernels.formats``).
"""

from __future__ import annotations

import dataclasses

import torch

from tpfuse.kernels import formats
from tpfuse.kernels.block_end import FP4_NONE, PLAIN, SCALES_ROWS, Epilogue
from tpfuse.kernels.targets import Fp8Format, fp8_format

__all__ = ["add_rmsnorm_reference", "dynamic_fp8", "fused_reference_float64", "norm_of", "rank_part",
           "round_h", "unquantised"]


def rank_part(x: torch.Tensor, epilogue: Epilogue = PLAIN,
              accumulate: torch.dtype = torch.float32) -> torch.Tensor:
    """What one rank contributes to the sum: x [T, H] itself, or a MoE finalize's
    ``sum_k topk_weights[:, k] * x[:, k] + shared_expert`` (x [T, K, H]) computed in ``accumulate``
    (float32 as the kernels, float64 for the oracle) and rounded to x's dtype, as the kernels send it
    (and as a model's unfused MoE block hands its output to the all-reduce).
    """
    if x.dim() == 2 and epilogue.shared_expert is None:
        return x
    part = x.to(accumulate)
    if x.dim() == 3:
        if epilogue.topk_weights is not None:
            part = part * epilogue.topk_weights.to(accumulate).unsqueeze(-1)
        experts = part.unbind(1)
        part = experts[0]
        for expert in experts[1:]:  # in the kernels' order: one rounding can move a dynamic fp8 code
            part = part + expert
    if epilogue.shared_expert is not None:
        part = part + epilogue.shared_expert.to(accumulate)
    return part.to(x.dtype)


#: The row reductions' chunk: torch's CPU reductions split one long row over threads (a row of 65536
#: alone summed otherwise than in a batch), never a reduction of this many elements.
_CHUNK = 2048


def row_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean over the last dim, kept, in two stages of at most :data:`_CHUNK` elements (the rest zero
    padding), so that a row's result does not depend on the rows beside it."""
    hidden = t.shape[-1]
    if hidden > _CHUNK:
        t = torch.nn.functional.pad(t, (0, -hidden % _CHUNK)).unflatten(-1, (-1, _CHUNK)).sum(-1)
    return t.sum(-1, keepdim=True) / hidden


def _rmsnorm(s: torch.Tensor, eps: float) -> torch.Tensor:
    return s * torch.rsqrt(row_mean(s * s) + eps)


def _sum_steps(s: torch.Tensor, residual: torch.Tensor | None, eps: float,
               epilogue: Epilogue) -> torch.Tensor:
    """h before its rounding: the sum's own steps (+ bias, post-norm) and + residual, in ``s``'s floating
    type (fp32 or float64)."""
    dtype = s.dtype
    if epilogue.bias is not None:
        s = s + epilogue.bias.to(dtype)
    if epilogue.sum_weight is not None:
        s = _rmsnorm(s, eps) * epilogue.sum_weight.to(dtype)
    if residual is not None:
        s = s + residual.to(dtype)
    return s


def round_h(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h`` rounded to ``dtype`` once, with -0.0 made +0.0 (as every kernel returns it: the two-shot
    cannot send -0.0, its sentinel)."""
    h = h.to(dtype)
    return torch.where(h == 0, torch.zeros_like(h), h)


def norm_of(h: torch.Tensor, weight: torch.Tensor, eps: float, epilogue: Epilogue) -> torch.Tensor:
    """y from the (rounded) ``h``: the block end's RMSNorm or LayerNorm in ``h``'s floating type (fp32 or
    float64), before any quantisation."""
    dtype = h.dtype
    if epilogue.layer_norm:
        y = _rmsnorm(h - row_mean(h), eps) * weight.to(dtype)
        if epilogue.norm_bias is not None:
            y = y + epilogue.norm_bias.to(dtype)
        return y
    return _rmsnorm(h, eps) * weight.to(dtype)


def dynamic_fp8(y: torch.Tensor, group: int, fmt: Fp8Format | None = None,
                pow2: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` [..., H] as fp8 of ``fmt`` (default: ``y``'s device's, ``targets.fp8_format``) with one scale
    per ``group`` elements of a row (a group of H: one scale a token), and the scales [..., H // group]
    (float32): ``scale = max(amax / fp8_max, fmt.min_dynamic_scale)``, ``q = clamp(y / scale, -fp8_max,
    fp8_max)`` with fp8_max 448 (e4m3fn) or 240 (e4m3fnuz); ``pow2``: each scale rounded up to a power of
    two (UE8M0). Also the form the compiler's dynamic fp8 pattern finds in a model
    (``compiler.matchers``)."""
    fmt = fmt or fp8_format(y.device)
    groups = y.float().unflatten(-1, (-1, group))
    scales = (groups.abs().amax(-1, keepdim=True) / fmt.max).clamp(min=fmt.min_dynamic_scale)
    if pow2:
        scales = formats.pow2_at_least(scales)
    q = (groups / scales).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return q.flatten(-2), scales.squeeze(-1)


def add_rmsnorm_reference(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype | None = None,
    epilogue: Epilogue = PLAIN,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The block end of an already all-reduced ``reduced`` [T, H], in fp32.

    Returns ``(y, h, scales)``: ``h`` in ``out_dtype`` (default ``reduced.dtype``), ``y`` in that dtype
    or the device's fp8 (``targets.fp8_format``: float8_e4m3fn, float8_e4m3fnuz on gfx942) when the
    block end quantises (dynamic fp8: then ``scales``, else None). ``y`` is computed from the rounded
    ``h`` it returns, as every kernel computes it (docs/determinism.md). The row reductions are
    torch's, so the bits can differ from the kernels' in the last place: the batch-invariant
    fallback (``ops.route``) runs the local kernel where the kernels run.
    """
    out_dtype = out_dtype or reduced.dtype
    h = round_h(_sum_steps(reduced.float(), residual, eps, epilogue), out_dtype)
    if not epilogue.normed:
        return h, h, None
    y = norm_of(h.float(), weight, eps, epilogue)
    y, scales = epilogue.output.quantise(y, epilogue, out_dtype)
    return y, h, scales


def unquantised(epilogue: Epilogue) -> Epilogue:
    """``epilogue`` with y left in x's dtype: what a quantising call's norm copy holds."""
    return dataclasses.replace(epilogue, quant_scale=None, scale_group=0, fp4=FP4_NONE, global_scale=None,
                               normed_copy=False, ue8m0_scales=False, scale_layout=SCALES_ROWS)


def fused_reference_float64(
    xs: list[torch.Tensor],
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    epilogue: Epilogue = PLAIN,
    fmt: Fp8Format | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole op in float64 from every rank's part (after a MoE finalize: :func:`rank_part` in
    float64; ``epilogue``'s finalize tensors are not read): the oracle tests compare against.

    Returns float64 ``(y, h)``: ``h`` unrounded, ``y`` the norm of ``h`` rounded to the inputs' dtype
    (the contract: y is the norm of the h the op returns); with a static scale ``y`` is divided by it
    and clamped to the largest value of ``fmt`` (default: the fp8 format of ``xs``' device,
    ``targets.fp8_format``), but not rounded to fp8; a dynamic fp8 block end does not change ``y``
    (compare ``q * scales`` with it).
    """
    h = _sum_steps(torch.stack([x.double() for x in xs]).sum(0), residual, eps, epilogue)
    if not epilogue.normed:
        return h, h
    y = norm_of(round_h(h, xs[0].dtype).double(), weight, eps, epilogue)
    if epilogue.quant_scale is not None:
        fp8_max = (fmt or fp8_format(xs[0].device)).max
        y = (y / epilogue.quant_scale.double()).clamp(-fp8_max, fp8_max)
    return y, h
