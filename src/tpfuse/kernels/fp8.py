"""float32 <-> float8_e4m3fn codes: the GPU's own conversions, and the same in integer arithmetic.

Triton's CPU interpreter converts to fp8 incorrectly (no carry into the exponent, no round-to-even,
subnormals flushed), so there the kernels convert by hand: round to nearest even, subnormals kept,
exact decoding. On a GPU :func:`to_e4m3fn_bits` and :func:`from_e4m3fn_bits` are Hopper's conversion
instructions (``cvt.rn.satfinite.e4m3x2.f32`` and back), which give the same codes and values
(``tests/kernels/test_fp8.py`` checks both against torch). Inputs to fp8 must already be clamped to
[-448, 448].
"""

import os

import triton
import triton.language as tl

# Decided at import, as Triton decides between compiling and interpreting.
_GPU = tl.constexpr(os.environ.get("TRITON_INTERPRET") != "1")


@triton.jit
def to_e4m3fn_bits(y):
    """Clamped float32 -> float8_e4m3fn codes (uint8)."""
    if _GPU:
        return y.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return fp32_to_e4m3fn_bits(y)


@triton.jit
def from_e4m3fn_bits(bits):
    """float8_e4m3fn codes (any integer type) -> float32, exactly."""
    if _GPU:
        return bits.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
    else:
        return e4m3fn_bits_to_fp32(bits)


@triton.jit
def fp32_to_e4m3fn_bits(y):
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 24) & 0x80
    magnitude = bits & 0x7FFFFFFF
    # Normal e4m3 numbers (|y| >= 2**-6): keep 3 of 23 mantissa bits, round half to even, rebias 127 -> 7.
    rounded = magnitude + 0x7FFFF + ((magnitude >> 20) & 1)
    normal = (rounded >> 20) - ((127 - 7) << 3)
    # Subnormals are multiples of 2**-9: adding 2**23 rounds |y| * 2**9 to an integer (half to even),
    # and a result of 8 is exactly the smallest normal's code.
    shifted = tl.abs(y) * 512.0 + 8388608.0
    subnormal = shifted.to(tl.int32, bitcast=True) & 0xF
    code = tl.where(magnitude >= 0x3C800000, normal, subnormal)  # 0x3C800000 is 2**-6
    code = tl.where(y != y, 0x7F, code)  # NaN
    return (sign | code).to(tl.uint8)


@triton.jit
def e4m3fn_bits_to_fp32(bits):
    """float8_e4m3fn codes (any integer type) -> float32, exactly, in integer arithmetic (the
    interpreter's own conversion cannot be trusted; see above). NaN codes give NaN."""
    code = bits.to(tl.int32) & 0xFF
    sign = (code & 0x80) << 24
    exponent = (code >> 3) & 0xF
    mantissa = code & 0x7
    normal = sign | ((exponent + 120) << 23) | (mantissa << 20)
    subnormal = sign | (mantissa.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True)  # mantissa * 2**-9
    value = tl.where(exponent == 0, subnormal, normal).to(tl.float32, bitcast=True)
    return tl.where((code & 0x7F) == 0x7F, float("nan"), value)


@triton.jit
def _to_e4m3fn_kernel(x_ptr, q_ptr, n, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    y = tl.clamp(tl.load(x_ptr + c, mask=c < n), -448.0, 448.0)
    tl.store(q_ptr + c, to_e4m3fn_bits(y), mask=c < n)


@triton.jit
def _from_e4m3fn_kernel(q_ptr, x_ptr, n, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + c, from_e4m3fn_bits(tl.load(q_ptr + c, mask=c < n)), mask=c < n)


def from_e4m3fn(q):
    """float8_e4m3fn -> float32 through :func:`from_e4m3fn_bits` (checks it against torch)."""
    import torch

    flat = q.contiguous().view(-1).view(torch.uint8)
    x = torch.empty(flat.numel(), dtype=torch.float32, device=q.device)
    _from_e4m3fn_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, x, flat.numel(), BLOCK=4096)
    return x.view(q.shape)


def to_e4m3fn(x):
    """Saturating float32 -> float8_e4m3fn through :func:`to_e4m3fn_bits` (checks it against torch)."""
    import torch

    flat = x.contiguous().view(-1)
    q = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    _to_e4m3fn_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, q, flat.numel(), BLOCK=4096)
    return q.view(torch.float8_e4m3fn).view(x.shape)
