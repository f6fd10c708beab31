"""The block end in Triton: what the one-shot, two-shot and local kernels do with a row around its sum.

``blockend.epilogue`` describes the steps (``Epilogue``) and gives the kernels their ``steps`` and
``STEPS`` arguments; the functions here alone read them (docs/architecture.md).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tpfuse.blockend.bits import QUANT_NVFP4, QUANT_STATIC, SCALES_PACKED_UE8M0, SCALES_ROWS, SCALES_SHUFFLED
from tpfuse.kernels.fp8 import e4m3_bits_to_fp32, fp32_to_e4m3_bits, to_fp8_bits
from tpfuse.kernels.vendor import fp8_max, round_to


class Params(NamedTuple):
    """What a program loads or works out once (:func:`_load_params`): the rows as fp32 (an absent
    step's are zeros), and the column stride of column-major scales."""

    weight: object
    bias: object
    sum_weight: object
    norm_bias: object
    scale_columns: object  # rows of a column of column-major scales: tokens rounded up to 4


_QUANT_STATIC: tl.constexpr = tl.constexpr(QUANT_STATIC)
_QUANT_NVFP4: tl.constexpr = tl.constexpr(QUANT_NVFP4)
_SCALES_ROWS: tl.constexpr = tl.constexpr(SCALES_ROWS)
_SCALES_PACKED: tl.constexpr = tl.constexpr(SCALES_PACKED_UE8M0)
_SCALES_SHUFFLED: tl.constexpr = tl.constexpr(SCALES_SHUFFLED)


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
def _norm_of(h, params, steps, own_offs, mask, hidden, eps, STEPS: tl.constexpr):
    """The norm of an fp32 row ``h`` (masked columns zero) in fp32: RMSNorm or LayerNorm; with
    NORM_BACKWARD, RMSNorm's backward (``stages.RmsNormBackward``) at the row's ``norm_input`` plus its
    ``grad_h``, which sit at ``own_offs`` (where the row's h goes: a sharded call's rows of this rank)."""
    if STEPS.NORM_BACKWARD:  # h: the summed gradient of a norm's output; y: the gradient of its input
        a = tl.load(steps.norm_input + own_offs, mask=mask, other=0.0).to(tl.float32)
        r = tl.rsqrt(tl.sum(a * a, axis=0) / hidden + eps)
        gw = h * params.weight
        y = tl.load(steps.grad_h + own_offs, mask=mask, other=0.0).to(tl.float32) + r * (
            gw - a * (tl.sum(gw * a, axis=0) / hidden) * r * r)
    elif STEPS.LAYER_NORM:
        centred = tl.where(mask, h - tl.sum(h, axis=0) / hidden, 0.0)
        y = _rmsnorm(centred, hidden, eps) * params.weight + params.norm_bias
    else:
        y = _rmsnorm(h, hidden, eps) * params.weight
    return y


@triton.jit
def _store_normed(h, params, y_ptr, steps, row, offs, own_offs, mask, hidden, eps, STEPS: tl.constexpr,
                  BLOCK_H: tl.constexpr):
    """The norm of an fp32 row ``h`` (:func:`_norm_of`), stored in y's dtype or quantised (y_ptr then
    bytes): static or dynamic fp8 (:func:`_store_fp8`), NVFP4 or MXFP4 (:func:`_store_fp4`); with
    NORMED_COPY also unquantised in ``steps.normed``. RMSNorm's backward is stored with -0.0 made +0.0,
    as a sharded call's owner sends it to its peers, so that its bits never depend on the layout."""
    QUANT: tl.constexpr = STEPS.QUANT
    if not STEPS.NORMED:
        return
    y = _norm_of(h, params, steps, own_offs, mask, hidden, eps, STEPS)
    if QUANT == 0:
        if STEPS.NORM_BACKWARD:
            y, _ = round_to(y, y_ptr.dtype.element_ty)
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        if STEPS.NORMED_COPY:
            tl.store(steps.normed + offs, y.to(steps.normed.dtype.element_ty), mask=mask)
        if QUANT >= _QUANT_NVFP4:
            _store_fp4(y, y_ptr, steps, row, hidden, STEPS, BLOCK_H)
        else:
            _store_fp8(y, params, y_ptr, steps, row, offs, mask, hidden, STEPS, BLOCK_H)


@triton.jit
def _store_h_and_normed(h, params, y_ptr, h_ptr, steps, row, offs, own_offs, mask, hidden, eps,
                        STEPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """Store the row's h rounded to h's dtype once (-0.0 made +0.0) at ``own_offs`` (``offs`` but in a
    sharded call), and the norm of that rounded h at ``offs`` (:func:`_store_normed`): every kernel
    computes y from the h it returns, so a row's y never depends on the algorithm
    (docs/determinism.md)."""
    h, h32 = round_to(h, h_ptr.dtype.element_ty)
    tl.store(h_ptr + own_offs, h, mask=mask)
    _store_normed(h32, params, y_ptr, steps, row, offs, own_offs, mask, hidden, eps, STEPS, BLOCK_H)


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
        words = tl.sum(tl.where(in_word, exponents[None, :] << ((g[None, :] % 4) * 8).to(tl.uint32), 0),
                       axis=1)
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
    scales of ``amax / 6 * g``, in the 128 x 4 tiles of ``codecs.swizzle_block_scales``) or MXFP4
    (32, e8m0 scales ``2**(floor(log2(amax)) - 2)``, row-major or in ``codecs.shuffle_e8m0_scales``'
    order)."""
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
        place = (((row // 128) * tile_cols + g // 4) * 512 + (row % 32) * 16
                 + ((row % 128) // 32) * 4 + g % 4)
        tl.store(steps.scales + place.to(tl.int64), scale_bits, mask=g < per_row)
    else:
        # The scale's biased exponent: amax's less 2 (e2m1's largest is 1.5 * 2**2); 0 for amax 0.
        exponent = tl.maximum(((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 2, 0)
        factor = ((254 - exponent) << 23).to(tl.float32, bitcast=True)  # 2**(127 - exponent), exactly
        if STEPS.SCALE_LAYOUT == _SCALES_SHUFFLED:  # rows by 32 (two 16s), groups by 8 (two 4s)
            place = ((row // 32) * 32 * ((per_row + 7) // 8 * 8) + (g // 8) * 256
                     + (g % 4) * 64 + (row % 16) * 4
                     + ((g % 8) // 4) * 2 + (row % 32) // 16)
        else:
            place = row.to(tl.int64) * per_row + g
        tl.store(steps.scales + place.to(tl.int64), exponent.to(tl.uint8), mask=g < per_row)
    codes = tl.reshape(_e2m1_codes(groups * factor[:, None]), [BLOCK_H // 2, 2])
    low, high = tl.split(codes)
    c = tl.arange(0, BLOCK_H // 2)
    tl.store(y_ptr + row.to(tl.int64) * (hidden // 2) + c,
             (low | (high << 4)).to(tl.uint8), mask=c < hidden // 2)
