"""What a fused call does with the sum of a row, shared by the one-shot and two-shot kernels.

For each row, in fp32, with every step but the sum optional::

    x = sum over k of topk_weights[k] * x[k] + shared_expert   # a MoE block's finalize, on each rank,
                                                    #   rounded to x's dtype (x [T, K, H]: the top-k
                                                    #   experts' outputs)
    s = sum over ranks of x
    s = s + bias                                    # a row-parallel layer's bias, added once after the sum
    s = rmsnorm(s) * sum_weight                     # Gemma 2/3's post-norm, before the residual add
    h = s + residual
    y = rmsnorm(h) * weight                         # or LayerNorm: (h - mean) * rstd * weight + norm_bias
                                                    #   (none: a plain all-reduce ends at h)
    y = fp8(y / scale)                              # static: one scale for all
      | fp8(y / s_g), s_g = max(amax_g / 448, 1 / (448 * 512))    # dynamic: per token or per group

fp8 is the device's (``vendor.fp8_format``): float8_e4m3fn, or float8_e4m3fnuz on gfx942 (MI300), where
240 takes 448's place; the kernels take their compile target's (``vendor.fp8_max``).

:class:`Epilogue` carries the optional steps; ``kernels.reference`` is the same in torch, and the
descriptor flags (``flags``) make every rank's kernel refuse a peer whose call does something else.
The kernels take a block end as two values, its tensors (``steps``: :data:`StepTensors`) and its
compile-time switches (``STEPS``: :class:`Switches`), and hand them on to the Triton functions below,
which alone read them: a new step changes no kernel's signature (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

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
    """A call's block end: the optional steps around the sum, beyond the residual add and the norm. The
    default is the plain ``all-reduce (+ residual) -> RMSNorm``.

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
    normed : bool
        False: the call ends at ``h`` (a plain all-reduce, with the other steps before the norm if
        any): no norm, ``y`` is not written, the weight and eps are not read.
    experts : int
        A MoE block's finalize: x is [T, K, H], the outputs of each token's top-k experts (K =
        ``experts``), and each rank sums them before the all-reduce. 0: x is [T, H].
    topk_weights : Tensor [T, K] or None
        The finalize's weights of the experts' outputs (float32 or x's dtype); None: the outputs are
        weighted already.
    shared_expert : Tensor [T, H] or None
        Added to this rank's part before the all-reduce (a MoE block's shared expert, or any second
        partial sum), in x's dtype.
    """

    quant_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    sum_weight: torch.Tensor | None = None
    layer_norm: bool = False
    norm_bias: torch.Tensor | None = None
    scale_group: int = 0
    normed: bool = True
    experts: int = 0
    topk_weights: torch.Tensor | None = None
    shared_expert: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Nothing beyond the residual add, RMSNorm and a static scale (what every backend runs)."""
        return (self.bias is None and self.sum_weight is None and not self.layer_norm
                and self.scale_group == 0 and self.normed and self.experts == 0 and self.shared_expert is None)

    @property
    def fp8_output(self) -> bool:
        return self.quant_scale is not None or self.scale_group > 0

    @functools.cached_property  # asked once a launch; a block end never changes (PLAIN is shared)
    def signature(self) -> tuple:
        """What about this block end decides a compiled kernel: which steps, and their tensors' dtypes."""
        return (_dtype(self.quant_scale), _dtype(self.bias), _dtype(self.sum_weight), self.layer_norm,
                _dtype(self.norm_bias), self.scale_group, self.normed, self.experts, _dtype(self.topk_weights),
                _dtype(self.shared_expert))

    def rows(self, part: slice) -> Epilogue:
        """The block end of rows ``part`` of the call: the MoE finalize's tensors are per row."""
        if self.topk_weights is None and self.shared_expert is None:
            return self
        return dataclasses.replace(
            self, topk_weights=None if self.topk_weights is None else self.topk_weights[part],
            shared_expert=None if self.shared_expert is None else self.shared_expert[part])

    def flags(self, hidden: int) -> int:
        """The descriptor bits (``layout.FLAG_*``) that tell this block end from others."""
        return ((layout.FLAG_QUANT if self.quant_scale is not None else 0)
                | (layout.FLAG_BIAS if self.bias is not None else 0)
                | (layout.FLAG_SUM_NORM if self.sum_weight is not None else 0)
                | (layout.FLAG_LAYER_NORM if self.layer_norm else 0)
                | (layout.FLAG_NORM_BIAS if self.norm_bias is not None else 0)
                | (layout.FLAG_DYNAMIC_TOKEN if self.scale_group == hidden else 0)
                | (layout.FLAG_DYNAMIC_GROUP if 0 < self.scale_group < hidden else 0)
                | (0 if self.normed else layout.FLAG_NO_NORM)
                | (layout.FLAG_MOE_FINALIZE if self.experts or self.shared_expert is not None else 0))

    def switches(self, hidden: int) -> Switches:
        """The kernels' compile-time switches for this block end (their ``STEPS`` argument)."""
        dynamic = self.scale_group > 0
        return Switches(HAS_BIAS=self.bias is not None, SUM_NORM=self.sum_weight is not None,
                        LAYER_NORM=self.layer_norm, HAS_NORM_BIAS=self.norm_bias is not None,
                        QUANT=QUANT_DYNAMIC if dynamic else QUANT_STATIC if self.quant_scale is not None
                        else QUANT_NONE,
                        SCALE_GROUP=self.scale_group if dynamic and self.scale_group < hidden else 0,
                        NORMED=self.normed, EXPERTS=self.experts, TOPK_WEIGHTS=self.topk_weights is not None,
                        SHARED_EXPERT=self.shared_expert is not None)

    def step_tensors(self, stand_in: torch.Tensor, scales: torch.Tensor | None) -> StepTensors:
        """The kernels' ``steps`` argument: each tensor step (``stand_in``, never read, for an absent one),
        then where dynamic fp8 writes its scales."""
        return StepTensors(*[stand_in if (t := getattr(self, name)) is None else t for name in _TENSOR_STEPS],
                           stand_in if scales is None else scales)


class Switches(NamedTuple):
    """The kernels' compile-time ``STEPS`` argument: which of the block end's steps they compile in."""

    HAS_BIAS: bool
    SUM_NORM: bool
    LAYER_NORM: bool
    HAS_NORM_BIAS: bool
    QUANT: int  # QUANT_NONE, QUANT_STATIC or QUANT_DYNAMIC
    SCALE_GROUP: int  # dynamic fp8: elements a scale, or 0 for one scale a token
    NORMED: bool  # False: no norm, y not written (a plain all-reduce)
    EXPERTS: int  # K of a MoE finalize's x [T, K, H], or 0 (x [T, H])
    TOPK_WEIGHTS: bool  # the finalize weights the experts' outputs
    SHARED_EXPERT: bool  # a shared expert's output is added to this rank's part


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


_TENSOR = "torch.Tensor | None"
_SCHEMA_TYPES = {_TENSOR: "Tensor?", "bool": "bool", "int": "int"}


def schema() -> str:
    """The block end's steps as keyword-only arguments of an op schema, with their defaults."""
    return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}={f.default}" for f in dataclasses.fields(Epilogue))


def step_defaults() -> tuple[tuple[str, object], ...]:
    """(name, default) of the block end's arguments, in declaration order."""
    return tuple((f.name, f.default) for f in dataclasses.fields(Epilogue))


_TENSOR_STEPS = tuple(f.name for f in dataclasses.fields(Epilogue) if f.type == _TENSOR)
#: The kernels' ``steps`` argument, made from :class:`Epilogue`'s tensor fields (and the dynamic scales
#: a call writes), so that a new tensor step changes no kernel's signature: the kernels hand ``steps``
#: and ``STEPS`` on to the functions below, which alone read them.
StepTensors = NamedTuple("StepTensors", [(name, object) for name in _TENSOR_STEPS] + [("scales", object)])

PLAIN = Epilogue()


class Params(NamedTuple):
    """The rows a program loads once (:func:`_load_params`), as fp32; an absent step's are zeros."""

    weight: object
    bias: object
    sum_weight: object
    norm_bias: object


@triton.jit
def _load_params(weight_ptr, steps, cols, mask, STEPS: tl.constexpr):
    """The norm's weight and the steps' rows (:class:`Params`), loaded once a program."""
    zeros = tl.zeros(cols.shape, tl.float32)
    w = zeros
    if STEPS.NORMED:
        w = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    b = zeros
    sw = zeros
    nb = zeros
    if STEPS.HAS_BIAS:
        b = tl.load(steps.bias + cols, mask=mask, other=0.0).to(tl.float32)
    if STEPS.SUM_NORM:
        sw = tl.load(steps.sum_weight + cols, mask=mask, other=0.0).to(tl.float32)
    if STEPS.HAS_NORM_BIAS:
        nb = tl.load(steps.norm_bias + cols, mask=mask, other=0.0).to(tl.float32)
    return Params(w, b, sw, nb)


@triton.jit
def _moe_partial(x_ptr, steps, row, cols, mask, hidden, STEPS: tl.constexpr):
    """This rank's part of row ``row`` made by a MoE finalize, in fp32: the top-k experts' outputs
    (x [T, K, H]; or x [T, H]) weighted and summed, plus the shared expert's."""
    EXPERTS: tl.constexpr = STEPS.EXPERTS
    offs = row.to(tl.int64) * hidden + cols
    if EXPERTS == 0:
        part = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    else:
        part = tl.zeros(cols.shape, tl.float32)
        at = row.to(tl.int64) * (EXPERTS * hidden) + cols
        for k in tl.static_range(EXPERTS):
            expert = tl.load(x_ptr + at + k * hidden, mask=mask, other=0.0).to(tl.float32)
            if STEPS.TOPK_WEIGHTS:
                expert = expert * tl.load(steps.topk_weights + row.to(tl.int64) * EXPERTS + k).to(tl.float32)
            part += expert
    if STEPS.SHARED_EXPERT:
        part += tl.load(steps.shared_expert + offs, mask=mask, other=0.0).to(tl.float32)
    return part


@triton.jit
def _partial_row(x_ptr, steps, row, cols, mask, hidden, STEPS: tl.constexpr):
    """This rank's part of row ``row`` in fp32: x's row, or a MoE finalize's (:func:`_moe_partial`)
    rounded to x's dtype, as ``protocol._partial_bits`` sends it (the fp8 wire's and the local
    kernel's input)."""
    if STEPS.EXPERTS == 0 and not STEPS.SHARED_EXPERT:
        return tl.load(x_ptr + row.to(tl.int64) * hidden + cols, mask=mask, other=0.0).to(tl.float32)
    part = _moe_partial(x_ptr, steps, row, cols, mask, hidden, STEPS)
    return part.to(x_ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def _rmsnorm(s, hidden, eps):
    return s * tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)


@triton.jit
def _before_residual(s, params, hidden, eps, STEPS: tl.constexpr):
    """The sum's own steps: + bias, then the post-norm (Gemma). Masked columns stay zero."""
    if STEPS.HAS_BIAS:
        s += params.bias
    if STEPS.SUM_NORM:
        s = _rmsnorm(s, hidden, eps) * params.sum_weight
    return s


@triton.jit
def _store_normed(h, params, y_ptr, steps, row, offs, mask, hidden, eps, STEPS: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """The norm of an fp32 row ``h`` (masked columns zero), stored in y's dtype or as fp8 bits.

    Dynamic fp8 (QUANT_DYNAMIC) also stores the row's scales: one (SCALE_GROUP 0) or one a group of
    SCALE_GROUP elements.
    """
    QUANT: tl.constexpr = STEPS.QUANT
    SCALE_GROUP: tl.constexpr = STEPS.SCALE_GROUP
    if not STEPS.NORMED:
        return
    if STEPS.LAYER_NORM:
        centred = tl.where(mask, h - tl.sum(h, axis=0) / hidden, 0.0)
        y = _rmsnorm(centred, hidden, eps) * params.weight + params.norm_bias
    else:
        y = _rmsnorm(h, hidden, eps) * params.weight
    if QUANT == 0:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:  # y_ptr is the fp8 output viewed as uint8
        FP8_LIMIT: tl.constexpr = fp8_max()
        MIN_SCALE: tl.constexpr = 1.0 / (FP8_LIMIT * 512)
        if QUANT == 1:
            y = tl.clamp(y / tl.load(steps.quant_scale), -FP8_LIMIT, FP8_LIMIT)
        elif SCALE_GROUP == 0:
            scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_LIMIT, MIN_SCALE)
            tl.store(steps.scales + row, scale)
            y = tl.clamp(y / scale, -FP8_LIMIT, FP8_LIMIT)
        else:
            groups = tl.reshape(y, [BLOCK_H // SCALE_GROUP, SCALE_GROUP])
            scale = tl.maximum(tl.max(tl.abs(groups), axis=1) / FP8_LIMIT, MIN_SCALE)
            g = tl.arange(0, BLOCK_H // SCALE_GROUP)
            per_row = hidden // SCALE_GROUP
            tl.store(steps.scales + row.to(tl.int64) * per_row + g, scale, mask=g < per_row)
            y = tl.reshape(tl.clamp(groups / scale[:, None], -FP8_LIMIT, FP8_LIMIT), [BLOCK_H])
        tl.store(y_ptr + offs, to_fp8_bits(y), mask=mask)
