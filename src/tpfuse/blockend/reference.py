"""Pure-torch reference of the fused op: the reference backend's math and the kernels' oracle.

The steps are the block end's stages (``blockend.stages``), each with its own torch step: a MoE finalize,
sum, + bias, post-norm, + residual, RMSNorm or LayerNorm, fp8 with a static or dynamic scale, NVFP4 or
MXFP4 (``blockend.outputs``). Nothing in the package imports it.
"""

from __future__ import annotations

import dataclasses

import torch

from tpfuse.blockend.bits import FP4_NONE, SCALES_ROWS
from tpfuse.blockend.epilogue import PLAIN, Epilogue
from tpfuse.targets import Fp8Format, fp8_format

__all__ = ["add_rmsnorm_reference", "fused_reference_float64", "norm_of", "rank_part", "round_h",
           "unquantised"]


def rank_part(x: torch.Tensor, epilogue: Epilogue = PLAIN,
              accumulate: torch.dtype = torch.float32) -> torch.Tensor:
    """What one rank contributes to the sum: x [T, H] itself, or its MoE finalize
    (``stages.Finalize.reference``) computed in ``accumulate`` (float32 as the kernels, float64 for the
    oracle) and rounded to x's dtype, as the kernels send it (and as a model's unfused MoE block hands
    its output to the all-reduce).
    """
    finalize = epilogue.stages.finalize
    if finalize is None:
        return x
    return finalize.reference(x, accumulate).to(x.dtype)


def _sum_steps(s: torch.Tensor, residual: torch.Tensor | None, eps: float,
               epilogue: Epilogue) -> torch.Tensor:
    """h before its rounding: the sum's own stages (+ bias, post-norm) and + residual, in ``s``'s floating
    type (fp32 or float64)."""
    stages = epilogue.stages
    for stage in (stages.bias, stages.post_norm):
        if stage is not None:
            s = stage.reference(s, eps)
    if residual is not None:
        s = s + residual.to(s.dtype)
    return s


def round_h(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``h`` rounded to ``dtype`` once, with -0.0 made +0.0 (as every kernel returns it: the two-shot
    cannot send -0.0, its sentinel)."""
    h = h.to(dtype)
    return torch.where(h == 0, torch.zeros_like(h), h)


def norm_of(h: torch.Tensor, weight: torch.Tensor, eps: float, epilogue: Epilogue) -> torch.Tensor:
    """y from the (rounded) ``h``: the block end's norm stage (RMSNorm or LayerNorm) in ``h``'s floating
    type (fp32 or float64), before any quantisation."""
    return epilogue.stages.norm.reference(h, weight, eps)


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
    or the device's fp8 (``tpfuse.targets.fp8_format``: float8_e4m3fn, float8_e4m3fnuz on gfx942) when the
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
