"""The codes of the quantised outputs the next GEMM takes, in torch: values to codes and back, and the
orders their scales are placed in.

The output formats (``blockend.outputs``) quantise with these, the reference (``blockend.reference``)
and the tests decode with them; ``kernels/epilogue.py`` computes the same in Triton. The codes:

- UE8M0 scales: powers of two, each an exponent byte (``2**(e - 127)``), packed four to an int32
  (group ``4j + k`` in byte ``k`` of word ``j``), column-major with the tokens padded to 4:
  DeepGEMM's scale layout on Blackwell. Column-major float32 scales (the same padding) are its
  layout on Hopper.
- e2m1 (fp4): 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives; two codes a byte, the even column in
  the low nibble.
- NVFP4: e2m1 of ``y * g / s`` with an e4m3 scale ``s = e4m3(amax / 6 * g)`` a 16 elements and a
  global scale ``g`` (fp32, the caller's), the scales swizzled in 128 x 4 tiles
  (:func:`swizzle_block_scales`) as Blackwell's FP4 GEMMs (and vLLM's ``scaled_fp4_quant``) read them.
- MXFP4 (OCP): e2m1 of ``y / 2**e`` with an e8m0 scale ``2**e``, ``e = floor(log2(amax)) - 2``, a 32
  elements, row-major, or shuffled (:func:`shuffle_e8m0_scales`) as AITER's MXFP4 GEMMs read them.
"""

from __future__ import annotations

import torch

from tpfuse.blockend.bits import FP4_GROUP, FP4_MXFP4, FP4_NVFP4
from tpfuse.targets import Fp8Format, fp8_format

#: The e2m1 values by code (bit 3 the sign).
E2M1_VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0,
                            -1.5, -2.0, -3.0, -4.0, -6.0])
# |v| above each: one code more (ties to the even code: 0.25 -> 0, 0.75 -> 1.0, 1.25 -> 1.0, ...).
_E2M1_STEPS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False),
               (3.5, True), (5.0, False))


# --- codes ------------------------------------------------------------------------------------------

def pow2_at_least(scales: torch.Tensor) -> torch.Tensor:
    """The smallest power of two >= each (positive, normal) float32 scale, exactly."""
    bits = scales.float().view(torch.int32)
    return ((bits + 0x7FFFFF) & 0x7F800000).view(torch.float32)


def ue8m0_bytes(scales: torch.Tensor) -> torch.Tensor:
    """Powers of two (float32) as their biased exponents (uint8 codes of e8m0)."""
    return ((scales.float().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)


def e8m0_values(codes: torch.Tensor) -> torch.Tensor:
    """e8m0 codes (uint8) -> float32 ``2**(code - 127)`` (0xFF, NaN, is not expected)."""
    ones = torch.ones(codes.shape, dtype=torch.float64, device=codes.device)
    return torch.ldexp(ones, codes.to(torch.int64) - 127).float()


def e2m1_codes(v: torch.Tensor) -> torch.Tensor:
    """float32 -> e2m1 codes (uint8, 0..15): nearest, ties to even, saturated at 6, the sign kept."""
    a = v.float().abs()
    code = torch.zeros(v.shape, dtype=torch.int32, device=v.device)
    for edge, inclusive in _E2M1_STEPS:
        code += (a >= edge if inclusive else a > edge).to(torch.int32)
    sign = (v.float().view(torch.int32) < 0).to(torch.int32)
    return (code | sign << 3).to(torch.uint8)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Codes [..., H] -> bytes [..., H / 2], the even column in the low nibble."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def e2m1_values(packed: torch.Tensor) -> torch.Tensor:
    """Bytes [..., H / 2] of two e2m1 codes -> float32 [..., H]."""
    table = E2M1_VALUES.to(packed.device)
    low, high = table[(packed & 0xF).long()], table[(packed >> 4).long()]
    return torch.stack([low, high], dim=-1).flatten(-2)


# --- NVFP4's swizzled scales --------------------------------------------------------------------------

def swizzle_block_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[M, G]`` scales (M a multiple of 128, G of 4) in the 128 x 4 tiles Blackwell's FP4 GEMMs read:
    tile (m // 128, g // 4) holds 512 entries, entry (m, g) at ``(m % 32) * 16 + (m % 128) // 32 * 4 +
    g % 4``; tiles row-major. Returned as ``[M, G]`` in that memory order."""
    m, g = scales.shape
    tiles = scales.reshape(m // 128, 4, 32, g // 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(m, g)


def unswizzle_block_scales(swizzled: torch.Tensor, m: int, g: int) -> torch.Tensor:
    """The inverse of :func:`swizzle_block_scales`: ``[M, G]`` scales by row and group."""
    tiles = swizzled.reshape(m // 128, g // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return tiles.contiguous().reshape(m, g)


# --- MXFP4's shuffled scales (AITER) -----------------------------------------------------------------

def shuffle_e8m0_scales(scales: torch.Tensor) -> torch.Tensor:
    """``[M, G]`` scales (M a multiple of 32, G of 8) in the order AITER's MXFP4 GEMMs read them (its
    ``e8m0_shuffle``): rows in blocks of 32 (two halves of 16), groups in blocks of 8 (two halves of
    4); entry (m, g) at ``(m // 32) * 32 * G + (g // 8) * 256 + (g % 4) * 64 + (m % 16) * 4 +
    (g % 8) // 4 * 2 + (m % 32) // 16``. Returned as ``[M, G]`` in that memory order."""
    m, g = scales.shape
    blocks = scales.reshape(m // 32, 2, 16, g // 8, 2, 4).permute(0, 3, 5, 2, 4, 1)
    return blocks.contiguous().reshape(m, g)


def unshuffle_e8m0_scales(shuffled: torch.Tensor, m: int, g: int) -> torch.Tensor:
    """The inverse of :func:`shuffle_e8m0_scales`: ``[M, G]`` scales by row and group."""
    blocks = shuffled.reshape(m // 32, g // 8, 4, 16, 2, 2).permute(0, 5, 3, 1, 4, 2)
    return blocks.contiguous().reshape(m, g)


# --- quantising a row ------------------------------------------------------------------------------

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
        scales = pow2_at_least(scales)
    q = (groups / scales).clamp(-fmt.max, fmt.max).to(fmt.dtype)
    return q.flatten(-2), scales.squeeze(-1)


def nvfp4(y: torch.Tensor, global_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``y`` [T, H] as NVFP4, in the kernels' operations and order: (codes [T, H / 2] uint8, e4m3
    scales [T, H / 16] by row; ``outputs.NvFp4`` places them in their tiles)."""
    groups = y.float().unflatten(-1, (-1, FP4_GROUP[FP4_NVFP4]))
    g = global_scale.float()
    scales = (groups.abs().amax(-1) / 6.0 * g).clamp(max=448.0).to(torch.float8_e4m3fn)
    decoded = scales.float()
    factor = torch.where(decoded > 0, g / decoded, torch.zeros_like(decoded))
    return pack_e2m1(e2m1_codes((groups * factor.unsqueeze(-1)).flatten(-2))), scales


def mxfp4(y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``y`` [T, H] as MXFP4: (codes [T, H / 2] uint8, e8m0 scales [T, H / 32] by row;
    ``outputs.MxFp4`` places them, shuffled or not)."""
    groups = y.float().unflatten(-1, (-1, FP4_GROUP[FP4_MXFP4]))
    amax_exponent = (groups.abs().amax(-1).view(torch.int32) >> 23) & 0xFF
    exponent = (amax_exponent - 2).clamp(min=0)
    factor = ((254 - exponent) << 23).view(torch.float32)
    codes = pack_e2m1(e2m1_codes((groups * factor.unsqueeze(-1)).flatten(-2)))
    return codes, exponent.to(torch.uint8).view(torch.float8_e8m0fnu)


__all__ = ["E2M1_VALUES", "dynamic_fp8", "e2m1_codes", "e2m1_values", "e8m0_values", "mxfp4", "nvfp4",
           "pack_e2m1", "pow2_at_least", "shuffle_e8m0_scales", "swizzle_block_scales", "ue8m0_bytes",
           "unshuffle_e8m0_scales", "unswizzle_block_scales"]
