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
                                                    #   (s_g rounded up to a power of two: UE8M0)
      | e2m1(y * g / s_g), s_g = e4m3(amax_16 / 6 * g)            # NVFP4 (g: the global scale)
      | e2m1(y / s_g), s_g = 2**(floor(log2(amax_32)) - 2)        # MXFP4 (s_g an e8m0 exponent)
    normed = y before quantisation, in x's dtype    # optional: the norm's output beside its quantised one

fp8 is the device's (``vendor.fp8_format``): float8_e4m3fn, or float8_e4m3fnuz on gfx942 (MI300), where
240 takes 448's place; the kernels take their compile target's (``vendor.fp8_max``).

Dynamic scales go where the next GEMM reads them (``scale_layout``): rows ``[T, G]`` float32;
columns (float32 ``[T, G]`` stored column-major, T padded to 4: DeepGEMM's fp8 GEMMs on Hopper); or
UE8M0 exponents packed four to an int32, column-major, T padded to 4 (DeepGEMM on Blackwell). fp4 ``y``
is two e2m1 codes a byte (the even column in the low nibble), ``[T, H / 2]`` uint8; NVFP4's e4m3 scales
are in the 128 x 4 tiles Blackwell's FP4 GEMMs read (``reference.swizzle_block_scales``), MXFP4's e8m0
scales row-major ``[T, H / 32]``. Every GPU converts to e2m1 and e8m0 here in integer arithmetic (the
same code the CPU interpreter runs); Blackwell (``cvt.rn.satfinite.e2m1x2.f32``) and gfx950 have
conversions of their own, which these kernels do not use.

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
from tpfuse.kernels.fp8 import e4m3_bits_to_fp32, fp32_to_e4m3_bits, to_fp8_bits
from tpfuse.kernels.vendor import fp8_max

# How a call quantises y: the kernels' QUANT constexpr.
QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC, QUANT_NVFP4, QUANT_MXFP4 = 0, 1, 2, 3, 4
#: Where dynamic fp8 scales go (``Epilogue.scale_layout``): see the module's docstring.
SCALES_ROWS, SCALES_COLUMNS, SCALES_PACKED_UE8M0 = 0, 1, 2
#: fp4 outputs (``Epilogue.fp4``) and their elements a scale.
FP4_NONE, FP4_NVFP4, FP4_MXFP4 = 0, 1, 2
FP4_GROUP = {FP4_NVFP4: 16, FP4_MXFP4: 32}


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
    normed_copy : bool
        A quantised ``y`` and the norm's output before quantisation, in x's dtype, both written
        (``FusedCall.normed``): a normed row that feeds a quantised GEMM and something else.
    ue8m0_scales : bool
        Dynamic fp8 scales rounded up to powers of two (what a UE8M0 exponent holds exactly).
    scale_layout : int
        Where dynamic fp8 scales go: ``SCALES_ROWS``, ``SCALES_COLUMNS`` or ``SCALES_PACKED_UE8M0``
        (which rounds as ``ue8m0_scales``).
    fp4 : int
        ``FP4_NVFP4`` or ``FP4_MXFP4``: ``y`` as e2m1 codes with a scale a 16 (e4m3) or 32 (e8m0)
        elements, written to ``FusedCall.scales``; ``FP4_NONE``: no fp4.
    global_scale : Tensor [1] float32 or None
        NVFP4's global scale ``g`` (``y`` is coded as ``y * g``; vLLM's ``input_global_scale``).
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
    normed_copy: bool = False
    ue8m0_scales: bool = False
    scale_layout: int = SCALES_ROWS
    fp4: int = FP4_NONE
    global_scale: torch.Tensor | None = None

    @property
    def plain(self) -> bool:
        """Nothing beyond the residual add, RMSNorm and a static scale (what every backend runs)."""
        return (self.bias is None and self.sum_weight is None and not self.layer_norm
                and self.scale_group == 0 and self.normed and self.experts == 0 and self.shared_expert is None
                and not self.normed_copy and self.fp4 == FP4_NONE)

    @property
    def fp8_output(self) -> bool:
        return self.quant_scale is not None or self.scale_group > 0

    @property
    def quantised(self) -> bool:
        """y is fp8 or fp4 codes, not x's dtype."""
        return self.fp8_output or self.fp4 != FP4_NONE

    @property
    def pow2_scales(self) -> bool:
        """Dynamic fp8 scales are powers of two."""
        return self.ue8m0_scales or self.scale_layout == SCALES_PACKED_UE8M0

    @functools.cached_property  # asked once a launch; a block end never changes (PLAIN is shared)
    def signature(self) -> tuple:
        """What about this block end decides a compiled kernel: which steps, and their tensors' dtypes."""
        return (_dtype(self.quant_scale), _dtype(self.bias), _dtype(self.sum_weight), self.layer_norm,
                _dtype(self.norm_bias), self.scale_group, self.normed, self.experts, _dtype(self.topk_weights),
                _dtype(self.shared_expert), self.normed_copy, self.pow2_scales, self.scale_layout, self.fp4)

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
                | (layout.FLAG_MOE_FINALIZE if self.experts or self.shared_expert is not None else 0)
                | (layout.FLAG_NORMED_COPY if self.normed_copy else 0)
                | (layout.FLAG_UE8M0 if self.scale_group and self.pow2_scales else 0)
                | (layout.FLAG_SCALES_COLUMNS if self.scale_layout == SCALES_COLUMNS else 0)
                | (layout.FLAG_SCALES_PACKED if self.scale_layout == SCALES_PACKED_UE8M0 else 0)
                | (layout.FLAG_NVFP4 if self.fp4 == FP4_NVFP4 else 0)
                | (layout.FLAG_MXFP4 if self.fp4 == FP4_MXFP4 else 0))

    def switches(self, hidden: int) -> Switches:
        """The kernels' compile-time switches for this block end (their ``STEPS`` argument)."""
        dynamic = self.scale_group > 0
        if self.fp4 != FP4_NONE:
            quant, group = (QUANT_NVFP4 if self.fp4 == FP4_NVFP4 else QUANT_MXFP4), FP4_GROUP[self.fp4]
        else:
            quant = QUANT_DYNAMIC if dynamic else QUANT_STATIC if self.quant_scale is not None else QUANT_NONE
            group = self.scale_group if dynamic and self.scale_group < hidden else 0
        return Switches(HAS_BIAS=self.bias is not None, SUM_NORM=self.sum_weight is not None,
                        LAYER_NORM=self.layer_norm, HAS_NORM_BIAS=self.norm_bias is not None,
                        QUANT=quant, SCALE_GROUP=group,
                        NORMED=self.normed, EXPERTS=self.experts, TOPK_WEIGHTS=self.topk_weights is not None,
                        SHARED_EXPERT=self.shared_expert is not None, NORMED_COPY=self.normed_copy,
                        POW2_SCALES=dynamic and self.pow2_scales, SCALE_LAYOUT=self.scale_layout)

    def step_tensors(self, stand_in: torch.Tensor, scales: torch.Tensor | None,
                     normed: torch.Tensor | None) -> StepTensors:
        """The kernels' ``steps`` argument: each tensor step (``stand_in``, never read, for an absent one),
        then where the call writes its scales and the norm's copy."""
        return StepTensors(*[stand_in if (t := getattr(self, name)) is None else t for name in _TENSOR_STEPS],
                           stand_in if scales is None else scales, stand_in if normed is None else normed)


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
    NORMED_COPY: bool  # the norm's output also stored in x's dtype (steps.normed)
    POW2_SCALES: bool  # dynamic fp8 scales rounded up to powers of two
    SCALE_LAYOUT: int  # SCALES_ROWS, SCALES_COLUMNS or SCALES_PACKED_UE8M0


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
#: The kernels' ``steps`` argument, made from :class:`Epilogue`'s tensor fields (and the scales and the
#: norm's copy a call writes), so that a new tensor step changes no kernel's signature: the kernels hand
#: ``steps`` and ``STEPS`` on to the functions below, which alone read them.
StepTensors = NamedTuple("StepTensors", [(name, object) for name in _TENSOR_STEPS]
                         + [("scales", object), ("normed", object)])

PLAIN = Epilogue()


class Params(NamedTuple):
    """What a program loads or works out once (:func:`_load_params`): the rows as fp32 (an absent
    step's are zeros), and the column stride of column-major scales."""

    weight: object
    bias: object
    sum_weight: object
    norm_bias: object
    scale_columns: object  # rows of a column of column-major scales: tokens rounded up to 4


_QUANT_STATIC: tl.constexpr = tl.constexpr(QUANT_STATIC)
_QUANT_DYNAMIC: tl.constexpr = tl.constexpr(QUANT_DYNAMIC)
_QUANT_NVFP4: tl.constexpr = tl.constexpr(QUANT_NVFP4)
_SCALES_ROWS: tl.constexpr = tl.constexpr(SCALES_ROWS)
_SCALES_PACKED: tl.constexpr = tl.constexpr(SCALES_PACKED_UE8M0)


@triton.jit
def _load_params(weight_ptr, steps, cols, mask, n_tokens, STEPS: tl.constexpr):
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
    return Params(w, b, sw, nb, (n_tokens + 3) // 4 * 4)


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
    """The norm of an fp32 row ``h`` (masked columns zero), stored in y's dtype or quantised (y_ptr then
    bytes): static or dynamic fp8 (:func:`_store_fp8`), NVFP4 or MXFP4 (:func:`_store_fp4`); with
    NORMED_COPY also unquantised in ``steps.normed``."""
    QUANT: tl.constexpr = STEPS.QUANT
    if not STEPS.NORMED:
        return
    if STEPS.LAYER_NORM:
        centred = tl.where(mask, h - tl.sum(h, axis=0) / hidden, 0.0)
        y = _rmsnorm(centred, hidden, eps) * params.weight + params.norm_bias
    else:
        y = _rmsnorm(h, hidden, eps) * params.weight
    if QUANT == 0:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if STEPS.NORMED_COPY:
            tl.store(steps.normed + offs, y.to(steps.normed.dtype.element_ty), mask=mask)
        if QUANT >= _QUANT_NVFP4:
            _store_fp4(y, y_ptr, steps, row, hidden, STEPS, BLOCK_H)
        else:
            _store_fp8(y, params, y_ptr, steps, row, offs, mask, hidden, STEPS, BLOCK_H)


@triton.jit
def _pow2_at_least(scale):
    """The smallest power of two >= ``scale`` (positive, normal), exactly: mantissa bits carry into the
    exponent."""
    return ((scale.to(tl.int32, bitcast=True) + 0x7FFFFF) & 0x7F800000).to(tl.float32, bitcast=True)


@triton.jit
def _store_fp8(y, params, y_ptr, steps, row, offs, mask, hidden, STEPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp8 codes of y with the static scale, or scaled dynamically per row or per group of SCALE_GROUP
    (POW2_SCALES: scales rounded up to powers of two), the scales stored as SCALE_LAYOUT says."""
    QUANT: tl.constexpr = STEPS.QUANT
    SCALE_GROUP: tl.constexpr = STEPS.SCALE_GROUP
    FP8_LIMIT: tl.constexpr = fp8_max()
    MIN_SCALE: tl.constexpr = 1.0 / (FP8_LIMIT * 512)
    if QUANT == _QUANT_STATIC:
        y = tl.clamp(y / tl.load(steps.quant_scale), -FP8_LIMIT, FP8_LIMIT)
    elif SCALE_GROUP == 0:
        scale = tl.maximum(tl.max(tl.abs(y), axis=0) / FP8_LIMIT, MIN_SCALE)
        if STEPS.POW2_SCALES:
            scale = _pow2_at_least(scale)
        if STEPS.SCALE_LAYOUT == _SCALES_PACKED:  # one group: its exponent in the low byte of its word
            tl.store(steps.scales + row, (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF)
        else:  # [T, 1]: every layout puts row r at r
            tl.store(steps.scales + row, scale)
        y = tl.clamp(y / scale, -FP8_LIMIT, FP8_LIMIT)
    else:
        groups = tl.reshape(y, [BLOCK_H // SCALE_GROUP, SCALE_GROUP])
        scale = tl.maximum(tl.max(tl.abs(groups), axis=1) / FP8_LIMIT, MIN_SCALE)
        if STEPS.POW2_SCALES:
            scale = _pow2_at_least(scale)
        _store_group_scales(scale, params, steps, row, hidden, STEPS, BLOCK_H)
        y = tl.reshape(tl.clamp(groups / scale[:, None], -FP8_LIMIT, FP8_LIMIT), [BLOCK_H])
    tl.store(y_ptr + offs, to_fp8_bits(y), mask=mask)


@triton.jit
def _store_group_scales(scale, params, steps, row, hidden, STEPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """A row's group scales (fp32, one a group): row-major, column-major, or their exponents packed four
    to an int32 word (group 4j + k in byte k of word j), column-major."""
    GROUPS: tl.constexpr = BLOCK_H // STEPS.SCALE_GROUP
    per_row = hidden // STEPS.SCALE_GROUP
    g = tl.arange(0, GROUPS)
    if STEPS.SCALE_LAYOUT == _SCALES_ROWS:
        tl.store(steps.scales + row.to(tl.int64) * per_row + g, scale, mask=g < per_row)
    elif STEPS.SCALE_LAYOUT == _SCALES_PACKED:
        WORDS: tl.constexpr = (GROUPS + 3) // 4
        exponents = tl.where(g < per_row, (scale.to(tl.int32, bitcast=True) >> 23) & 0xFF, 0).to(tl.uint32)
        w = tl.arange(0, WORDS)
        in_word = (g[None, :] // 4) == w[:, None]
        words = tl.sum(tl.where(in_word, exponents[None, :] << ((g[None, :] % 4) * 8).to(tl.uint32), 0), axis=1)
        tl.store(steps.scales + row + w.to(tl.int64) * params.scale_columns, words.to(tl.int32, bitcast=True),
                 mask=w < (per_row + 3) // 4)
    else:
        tl.store(steps.scales + row + g.to(tl.int64) * params.scale_columns, scale, mask=g < per_row)


@triton.jit
def _e2m1_codes(v):
    """fp32 -> e2m1 codes (sign in bit 3; 0, 0.5, 1, 1.5, 2, 3, 4, 6), rounded to nearest even and
    saturated at 6: the ties (0.25, 0.75, ..., 5) go to the even code."""
    a = tl.abs(v)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32)
            + (a > 5.0).to(tl.int32))
    return code | (((v.to(tl.int32, bitcast=True) >> 31) & 1) << 3)


@triton.jit
def _store_fp4(y, y_ptr, steps, row, hidden, STEPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """y as e2m1 codes, two a byte, with a scale a group of SCALE_GROUP elements: NVFP4 (16, e4m3
    scales of ``amax / 6 * g``, in the 128 x 4 tiles of ``reference.swizzle_block_scales``) or MXFP4
    (32, e8m0 scales ``2**(floor(log2(amax)) - 2)``, row-major)."""
    GROUP: tl.constexpr = STEPS.SCALE_GROUP
    GROUPS: tl.constexpr = BLOCK_H // GROUP
    groups = tl.reshape(y, [GROUPS, GROUP])
    amax = tl.max(tl.abs(groups), axis=1)
    g = tl.arange(0, GROUPS)
    per_row = hidden // GROUP
    if STEPS.QUANT == _QUANT_NVFP4:
        global_scale = tl.load(steps.global_scale)
        scale_bits = fp32_to_e4m3_bits(tl.minimum(amax / 6.0 * global_scale, 448.0), False)
        scale = e4m3_bits_to_fp32(scale_bits, False)
        factor = tl.where(scale > 0, global_scale / tl.where(scale > 0, scale, 1.0), 0.0)
        tile_cols = (per_row + 3) // 4
        place = (((row // 128) * tile_cols + g // 4) * 512 + (row % 32) * 16 + ((row % 128) // 32) * 4 + g % 4)
        tl.store(steps.scales + place.to(tl.int64), scale_bits, mask=g < per_row)
    else:
        # The scale's biased exponent: amax's less 2 (e2m1's largest is 1.5 * 2**2); 0 for amax 0.
        exponent = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 2, 0)
        factor = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(127 - exponent), exactly
        tl.store(steps.scales + row.to(tl.int64) * per_row + g, exponent.to(tl.uint8), mask=g < per_row)
    codes = tl.reshape(_e2m1_codes(groups * factor[:, None]), [BLOCK_H // 2, 2])
    low, high = tl.split(codes)
    c = tl.arange(0, BLOCK_H // 2)
    tl.store(y_ptr + row.to(tl.int64) * (hidden // 2) + c, (low | (high << 4)).to(tl.uint8), mask=c < hidden // 2)
