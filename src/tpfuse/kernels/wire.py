"""The two-shot's opt-in fp8 wire: rows travel as float8_e4m3fn codes with a power-of-two scale per block.

On gfx942, whose fp8 is e4m3fnuz (a code there is worth half the e4m3fn code), each block's scale is
twice as large, so the words on the wire and the values decoded from them are the same on every GPU
(and :func:`wire_roundtrip`, in e4m3fn, stays exact for both).

A row of H values takes H / 2 words of two fp8 codes each, then H / WIRE_BLOCK words that each hold a
block's scale exponent (``value = code * 2**e``), padded to a multiple of 8 so that every row starts on
16 bytes and moves in 16-byte accesses. The exponent makes the block's largest magnitude less
than 256 (e4m3 reaches 448), so no code saturates, and a power of two scales exactly, on every rank.
A code of -0.0 (0x80) is sent as +0.0, so no word is the sentinel (0x8000 would need a high byte of
0x80), and exponent words are small positive numbers: arrival is detected from the data, as for bf16.

Error: each quantisation changes a value by at most half a unit in e4m3's last place (2**-4 of it,
relative) or, below the block's normal range, by 2**(e - 10); the two-shot quantises each rank's x
and the reduced sum, so ``|h - h_exact| <= 2**-4 * (sum_r |x_r| + |s|) + 2**(e_x - 10) * W + 2**(e_s -
10)`` before h is rounded to its dtype (``wire_error_bound`` computes it).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from tpfuse.kernels.fp8 import from_fp8_bits, to_fp8_bits
from tpfuse.kernels.vendor import fp8_fnuz, fp8_max

#: Elements that share a scale.
WIRE_BLOCK = 128
_WIRE_BLOCK = tl.constexpr(WIRE_BLOCK)
_EXPONENT_BIAS = tl.constexpr(512)  # exponent words are e + 512: 386..639, never the sentinel


def wire_supported(hidden: int) -> bool:
    """Whether rows of ``hidden`` can travel as fp8 (whole blocks only)."""
    return hidden % WIRE_BLOCK == 0


def wire_row_words(hidden: int) -> int:
    """16-bit words one row takes on the fp8 wire (the kernels' ``_wire_places``)."""
    return hidden // 2 + (hidden // WIRE_BLOCK + 7) // 8 * 8


def block_exponents(v: torch.Tensor) -> torch.Tensor:
    """The scale exponent of each block of ``v`` [..., H] (float32 in, int32 out): as the kernels pick it."""
    amax = v.float().abs().unflatten(-1, (-1, WIRE_BLOCK)).amax(-1)
    exponent = ((amax.view(torch.int32) >> 23) & 0xFF) - 127 - 7
    return exponent.clamp(-120, 120)


def wire_roundtrip(v: torch.Tensor) -> torch.Tensor:
    """What a float32 row [..., H] becomes on the fp8 wire, exactly (the kernels' ``_encode`` then
    ``_decode``, in torch)."""
    v = v.float()
    scale = torch.pow(2.0, block_exponents(v).float()).repeat_interleave(WIRE_BLOCK, dim=-1)
    return (v / scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn).float() * scale


def wire_sum(xs: list[torch.Tensor]) -> torch.Tensor:
    """The reduced sum every rank decodes on the fp8 wire: each x through the wire, summed in rank order
    in float32, the sum through the wire again. Bit-exact with the kernels."""
    total = torch.zeros_like(xs[0], dtype=torch.float32)
    for x in xs:
        total = total + wire_roundtrip(x)
    return wire_roundtrip(total)


def wire_error_bound(xs: list[torch.Tensor], reduced: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on |sum - exact sum| of the fp8 wire (see the module's docstring), float64."""
    total = sum(x.double().abs() for x in xs) * 2.0 ** -4 + reduced.double().abs() * 2.0 ** -4

    def floor_term(v):  # below the normal range a code moves by 2**(e - 10)
        return (2.0 ** (block_exponents(v).double() - 10)).repeat_interleave(WIRE_BLOCK, dim=-1)

    return total + sum(floor_term(x) for x in xs) + floor_term(reduced)


@triton.jit
def _FNUZ_SHIFT():
    """1 where fp8 is e4m3fnuz (its codes are worth half), else 0: what the wire adds to a block's
    exponent."""
    if fp8_fnuz():
        return 1
    else:
        return 0


@triton.jit
def _encode(v, BLOCK_H: tl.constexpr):
    """An fp32 row [BLOCK_H] (masked columns zero) as (code words [BLOCK_H // 2], exponent words
    [BLOCK_H // WIRE_BLOCK]), both int16."""
    blocks = tl.reshape(v, [BLOCK_H // _WIRE_BLOCK, _WIRE_BLOCK])
    amax = tl.max(tl.abs(blocks), axis=1)
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127 - 7  # amax / 2**e < 256
    exponent = tl.minimum(tl.maximum(exponent, -120), 120)  # 2**e and 2**-e stay normal floats
    # An e4m3fnuz code is worth half the same e4m3fn code: scaled by 2**(e + 1) instead, the block
    # gets the same codes on gfx942, and the wire the same words and values on every GPU.
    inverse = ((127 - exponent - _FNUZ_SHIFT()) << 23).to(tl.float32, bitcast=True)
    codes = to_fp8_bits(tl.clamp(blocks * inverse[:, None], -fp8_max(), fp8_max())).to(tl.int32)
    codes = tl.where(codes == 0x80, 0, codes)  # -0.0 as +0.0: no word can be the sentinel
    low, high = tl.split(tl.reshape(codes, [BLOCK_H // 2, 2]))
    words = (low | (high << 8)).to(tl.int16)
    return words, (exponent + _EXPONENT_BIAS).to(tl.int16)


@triton.jit
def _decode(words, exponents, BLOCK_H: tl.constexpr):
    """The fp32 row of :func:`_encode`'s words, exactly. Exponent words of masked blocks may be 0."""
    w = words.to(tl.int32) & 0xFFFF
    codes = tl.reshape(tl.join(w & 0xFF, w >> 8), [BLOCK_H])
    exponent = tl.minimum(tl.maximum(exponents.to(tl.int32) - _EXPONENT_BIAS, -126),
                          127 - _FNUZ_SHIFT()) + _FNUZ_SHIFT()
    scale = ((exponent + 127) << 23).to(tl.float32, bitcast=True)
    values = tl.reshape(from_fp8_bits(codes), [BLOCK_H // _WIRE_BLOCK, _WIRE_BLOCK])
    return tl.reshape(values * scale[:, None], [BLOCK_H])
