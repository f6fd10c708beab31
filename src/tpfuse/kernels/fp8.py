"""float32 <-> fp8 e4m3 codes: the GPU's own conversions, and the same in integer arithmetic.

The fp8 format of the fused op's outputs depends on the GPU (``targets.Fp8Format``): float8_e4m3fn
(largest 448) on NVIDIA and gfx950, float8_e4m3fnuz (largest 240, exponent bias 8, no negative zero,
one NaN code 0x80) on gfx942. :func:`to_fp8_bits` and :func:`from_fp8_bits` convert to and from the
format of the architecture a kernel is compiled for (``vendor.fp8_fnuz``).

Triton's CPU interpreter converts to fp8 incorrectly (no carry into the exponent, no round-to-even,
subnormals flushed), so there the kernels convert by hand: round to nearest even, subnormals kept,
exact decoding, for either format. On a GPU they are the hardware's conversions (Hopper's
``cvt.rn.satfinite.e4m3x2.f32``, CDNA3's FNUZ ``v_cvt_pk_fp8_f32``), which give the same codes and
values (``tests/kernels/test_fp8.py`` checks both against torch). Inputs to fp8 must already be
clamped to the format's largest value (``vendor.fp8_max``).
"""

import os

import triton
import triton.language as tl

from tpfuse.kernels.vendor import fp8_fnuz
from tpfuse.targets import E4M3FN, E4M3FNUZ, Fp8Format

# Decided at import, as Triton decides between compiling and interpreting.
_GPU = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def to_fp8_bits(y):
    """Clamped float32 -> codes (uint8) of the target's fp8 format."""
    if _GPU:
        if fp8_fnuz():
            return y.to(tl.float8e4b8).to(tl.uint8, bitcast=True)
        else:
            return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return fp32_to_e4m3_bits(y, fp8_fnuz())


@triton.jit
def from_fp8_bits(bits):
    """Codes (any integer type) of the target's fp8 format -> float32, exactly."""
    if _GPU:
        if fp8_fnuz():
            return bits.to(tl.uint8).to(tl.float8e4b8, bitcast=True).to(tl.float32)
        else:
            return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3_bits_to_fp32(bits, fp8_fnuz())


@triton.jit
def fp32_to_e4m3_bits(y, FNUZ: tl.constexpr):
    """Clamped float32 -> e4m3fn codes (FNUZ False) or e4m3fnuz codes (True), in integer arithmetic."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal numbers (|y| >= 2**(1 - BIAS)): keep 3 of 23 mantissa bits, round half to even, rebias.
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - ((127 - BIAS) << 3)
    # Subnormals are multiples of 2**(-BIAS - 2): adding 2**23 rounds |y| * 2**(BIAS + 2) to an integer
    # (half to even), and a result of 8 is exactly the smallest normal's code.
    shifted = tl.abs(y) * (2.0 ** (BIAS + 2)) + 8388608.0
    subnormal = shifted.to(tl.int32, bitcast=True) & 0xF
    code = tl.where(magnitude >= ((128 - BIAS) << 23), normal, subnormal)  # 2**(1 - BIAS)
    if FNUZ:
        sign = tl.where(code == 0, 0, sign)  # no negative zero: 0x80 is the NaN code
        return tl.where(y != y, 0x80, sign | code).to(tl.uint8)
    else:
        return tl.where(y != y, 0x7F, sign | code).to(tl.uint8)


@triton.jit
def e4m3_bits_to_fp32(bits, FNUZ: tl.constexpr):
    """e4m3fn (FNUZ False) or e4m3fnuz codes (any integer type) -> float32, exactly, in integer
    arithmetic (the interpreter's own conversion cannot be trusted; see above). NaN codes give NaN."""
    BIAS: tl.constexpr = 8 if FNUZ else 7
    code = bits.to(tl.int32) & 0xFF
    sign = (code & 0x80) << 24
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = sign | ((exponent + 127 - BIAS) << 23) | (mantissa << 20)
    subnormal = sign | (mantissa.to(tl.float32) * (2.0 ** (-BIAS - 2))).to(tl.int32, bitcast=True)
    value = tl.where(exponent == 0, subnormal, normal).to(tl.float32, bitcast=True)
    if FNUZ:
        return tl.where(code == 0x80, float("nan"), value)
    else:
        return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _to_fp8_kernel(x_ptr, q_ptr, n, LIMIT: tl.constexpr, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.clamp(tl.load(x_ptr + c, mask=c < n), -LIMIT, LIMIT)
    tl.static_assert(FNUZ == fp8_fnuz(), "this target's fp8 format is the other one")
    tl.store(q_ptr + c, to_fp8_bits(y), mask=c < n)


@triton.jit
def _from_fp8_kernel(q_ptr, x_ptr, n, FNUZ: tl.constexpr, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.static_assert(FNUZ == fp8_fnuz(), "this target's fp8 format is the other one")
    tl.store(x_ptr + c, from_fp8_bits(tl.load(q_ptr + c, mask=c < n)), mask=c < n)


def from_fp8(q, fmt: Fp8Format = E4M3FN):
    """fp8 of ``fmt`` -> float32 through :func:`from_fp8_bits` (checks it against torch). The kernel
    must be built for ``fmt`` (on the CPU: ``$TPFUSE_INTERPRET_ARCH``)."""
    import torch

    flat = q.contiguous().view(-1).view(torch.uint8)
    x = torch.empty(flat.numel(), dtype=torch.float32, device=q.device)
    _from_fp8_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, x, flat.numel(), FNUZ=fmt is E4M3FNUZ,
                                                         BLOCK=4096)
    return x.view(q.shape)


def to_fp8(x, fmt: Fp8Format = E4M3FN):
    """Saturating float32 -> fp8 of ``fmt`` through :func:`to_fp8_bits` (checks it against torch)."""
    import torch

    flat = x.contiguous().view(-1)
    q = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    _to_fp8_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, q, flat.numel(), LIMIT=fmt.max,
                                                       FNUZ=fmt is E4M3FNUZ, BLOCK=4096)
    return q.view(fmt.dtype).view(x.shape)


__all__ = ["E4M3FN", "E4M3FNUZ", "to_fp8_bits", "from_fp8_bits", "to_fp8", "from_fp8",
           "fp32_to_e4m3_bits", "e4m3_bits_to_fp32"]
