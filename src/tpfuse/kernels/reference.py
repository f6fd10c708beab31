"""Pure-torch reference of the fused op: the reference backend's math and the kernels' oracle."""

from __future__ import annotations

import torch

FP8_MAX = 448.0  # largest finite float8_e4m3fn


def add_rmsnorm_reference(
    reduced: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quant_scale: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Residual add and RMSNorm of an already all-reduced ``reduced`` [T, H], in fp32.

    Returns ``(y, h)``: ``h`` in ``out_dtype`` (default ``reduced.dtype``), ``y`` in that dtype or
    float8_e4m3fn when ``quant_scale`` is given. ``y`` is computed from the fp32 ``h``, as the
    one-shot kernel does (the two-shot computes it from the rounded ``h`` that travels).
    """
    out_dtype = out_dtype or reduced.dtype
    h = reduced.float()
    if residual is not None:
        h = h + residual.float()
    rstd = torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps)
    y = h * rstd * weight.float()
    if quant_scale is not None:
        y = (y / quant_scale.float()).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    else:
        y = y.to(out_dtype)
    return y, h.to(out_dtype)


def fused_reference_float64(
    xs: list[torch.Tensor],
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    quant_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The whole op in float64 from every rank's input: the oracle tests compare against.

    Returns float64 ``(y, h)``; ``y`` is divided by the scale and clamped, but not rounded to fp8.
    """
    h = torch.stack([x.double() for x in xs]).sum(0)
    if residual is not None:
        h = h + residual.double()
    y = h * torch.rsqrt(h.pow(2).mean(dim=-1, keepdim=True) + eps) * weight.double()
    if quant_scale is not None:
        y = (y / quant_scale.double()).clamp(-FP8_MAX, FP8_MAX)
    return y, h
