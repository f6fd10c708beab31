"""What a fused call does with the sum of a row, shared by the one-shot and two-shot kernels.

For each row, in fp32, with every step but the sum optional::

    s = sum over ranks of x
    s = s + bias                                    # a row-parallel layer's bias, added once after the sum
    s = rmsnorm(s) * sum_weight                     # Gemma 2/3's post-norm, before the residual add
    h = s + residual
    y = rmsnorm(h) * weight                         # or LayerNorm: (h - mean) * rstd * weight + norm_bias
    y = fp8(y / scale)                              # static: one scale for all
      | fp8(y / s_g), s_g = max(amax_g / 448, 1 / (448 * 512))    # dynamic: per token or per group

fp8 is the device's (``vendor.fp8_format``): float8_e4m3fn, or float8_e4m3fnuz on gfx942 (MI300), where
240 takes 448's place; the kernels take their compile target's (``vendor.fp8_max``).

:class:`Epilogue` carries the optional tensors; ``kernels.reference`` is the same in torch, and the
descriptor flags (``flags``) make every rank's kernel refuse a peer whose call does something else.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from tpfuse.kernels import layout
from tpfuse.kernels.fp8 import to_fp8_bits
from tpfuse.kernels.vendor import fp8_max

# How a call quantises y: the kernels' QUANT constexpr.
QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC = 0, 1, 2


@dataclass(frozen=True, eq=False)
class Epilogue:
    """A call's block end: the optional steps between the sum and the norm's output, beyond the residual
    add. The default is the plain ``all-reduce (+ residual) -> RMSNorm``.

    The fields are declared once, here: the ops' schemas (:func:`schema`), their Python signatures and
    the compiler's replacement all come from them, in this order.

    Attributes
    ----------
    quant_scale : Tensor [1] float32 or None
        Static fp8 ``y``: ``fp8(clamp(y / quant_scale))``.
    bias : Tensor [H] or None
        Added to the sum first (a row-parallel layer's bias), in x's dtype or float32.
    sum_weight : Tensor [H] or None
        RMSNorm of the (biased) sum with this gain before the residual add: Gemma 2/3's post-norm
        (pass Gemma's ``1 + w``). The same eps as the second norm.
    layer_norm : bool
        LayerNorm (mean subtracted) instead of RMSNorm for ``y``.
    norm_bias : Tensor [H] or None
        LayerNorm's bias (only with ``layer_norm``).
    scale_group : int
        Dynamic fp8 ``y``: 0 for none; else the elements per scale (H: one scale a token). The scales
        are an output of the call (``FusedCall.scales``).
    """

    quant_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    sum_weight: torch.Tensor | None = None
    layer_norm: bool = False
    norm_bias: torch.Tensor | None = None
    scale_group: int = 0

    @property
    def plain(self) -> bool:
        """Nothing beyond the residual add, RMSNorm and a static scale (what every backend runs)."""
        return (self.bias is None and self.sum_weight is None and not self.layer_norm
                and self.scale_group == 0)

    @property
    def fp8_output(self) -> bool:
        return self.quant_scale is not None or self.scale_group > 0

    @functools.cached_property  # asked once a launch; a block end never changes (PLAIN is shared)
    def signature(self) -> tuple:
        """What about this block end decides a compiled kernel: which steps, and their tensors' dtypes."""
        return (_dtype(self.quant_scale), _dtype(self.bias), _dtype(self.sum_weight), self.layer_norm,
                _dtype(self.norm_bias), self.scale_group)

    def flags(self, hidden: int) -> int:
        """The descriptor bits (``layout.FLAG_*``) that tell this block end from others."""
        return ((layout.FLAG_QUANT if self.quant_scale is not None else 0)
                | (layout.FLAG_BIAS if self.bias is not None else 0)
                | (layout.FLAG_SUM_NORM if self.sum_weight is not None else 0)
                | (layout.FLAG_LAYER_NORM if self.layer_norm else 0)
                | (layout.FLAG_NORM_BIAS if self.norm_bias is not None else 0)
                | (layout.FLAG_DYNAMIC_TOKEN if self.scale_group == hidden else 0)
                | (layout.FLAG_DYNAMIC_GROUP if 0 < self.scale_group < hidden else 0))

    def constexprs(self, hidden: int) -> dict:
        """The kernels' compile-time switches for this block end."""
        dynamic = self.scale_group > 0
        return dict(HAS_BIAS=self.bias is not None, SUM_NORM=self.sum_weight is not None,
                    LAYER_NORM=self.layer_norm, HAS_NORM_BIAS=self.norm_bias is not None,
                    QUANT=QUANT_DYNAMIC if dynamic else QUANT_STATIC if self.quant_scale is not None
                    else QUANT_NONE,
                    SCALE_GROUP=self.scale_group if dynamic and self.scale_group < hidden else 0)


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


_TENSOR = "torch.Tensor | None"
_SCHEMA_TYPES = {_TENSOR: "Tensor?", "bool": "bool", "int": "int"}


def schema() -> str:
    """The block end's steps as keyword-only arguments of an op schema, with their defaults."""
    return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}={f.default}" for f in dataclasses.fields(Epilogue))


def step_names() -> tuple[str, ...]:
    """The block end's argument names, in declaration order."""
    return tuple(f.name for f in dataclasses.fields(Epilogue))


PLAIN = Epilogue()


@triton.jit
def _load_params(weight_ptr, bias_ptr, sum_weight_ptr, norm_bias_ptr, cols, mask, HAS_BIAS: tl.constexpr,
                 SUM_NORM: tl.constexpr, HAS_NORM_BIAS: tl.constexpr):
    """(weight, bias, sum_weight, norm_bias) as fp32 rows, loaded once a program; absent ones are zeros."""
    w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    zeros = tl.zeros(w.shape, tl.float32)
    b = zeros
    sw = zeros
    nb = zeros
    if HAS_BIAS:
        b = tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if SUM_NORM:
        sw = tl.load(sum_weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_NORM_BIAS:
        nb = tl.load(norm_bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    return w, b, sw, nb


@triton.jit
def _rmsnorm(s, hidden, eps):
    return s * tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)


@triton.jit
def _before_residual(s, b, sw, hidden, eps, HAS_BIAS: tl.constexpr, SUM_NORM: tl.constexpr):
    """The sum's own steps: + bias, then the post-norm (Gemma). Masked columns stay zero."""
    if HAS_BIAS:
        s += b
    if SUM_NORM:
        s = _rmsnorm(s, hidden, eps) * sw
    return s


@triton.jit
def _store_normed(h, w, nb, y_ptr, scale_ptr, scales_ptr, row, offs, mask, hidden, eps,
                  LAYER_NORM: tl.constexpr, QUANT: tl.constexpr, SCALE_GROUP: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """The norm of an fp32 row ``h`` (masked columns zero), stored in y's dtype or as fp8 bits.

    Dynamic fp8 (QUANT_DYNAMIC) also stores the row's scales: one (SCALE_GROUP 0) or one a group of
    SCALE_GROUP elements.
    """
    if LAYER_NORM:
        centred = tl.where(mask, h - tl.sum(h, axis=0) / hidden, 0.0)
        y = _rmsnorm(centred, hidden, eps) * w + nb
    else:
        y = _rmsnorm(h, hidden, eps) * w
    if QUANT == 0:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # y_ptr is the fp8 output viewed as uint8
        FP8_LIMIT: tl.constexpr = fp8_max()
        MIN_SCALE: tl.constexpr = 1.0 / (FP8_LIMIT * 512)
        if QUANT == 1:
            y = tl.clamp(y / tl.load(scale_ptr), -FP8_LIMIT, FP8_LIMIT)
        elif SCALE_GROUP == 0:
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_LIMIT, MIN_SCALE)
            tl.store(scales_ptr + row, scale)
            y = tl.clamp(y / scale, -FP8_LIMIT, FP8_LIMIT)
        else:
            groups = tl.reshape(y, [BLOCK_H // SCALE_GROUP, SCALE_GROUP])
            scale = tl.maximum(tl.max(tl.abs(groups), axis=1) / FP8_LIMIT, MIN_SCALE)
            g = tl.arange(0, BLOCK_H // SCALE_GROUP)
            per_row = hidden // SCALE_GROUP
            tl.store(scales_ptr + row.to(tl.int64) * per_row + g, scale, mask=g < per_row)
            y = tl.reshape(tl.clamp(groups / scale[:, None], -FP8_LIMIT, FP8_LIMIT), [BLOCK_H])
        tl.store(y_ptr + offs, to_fp8_bits(y), mask=mask)
