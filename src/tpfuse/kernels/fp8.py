"""float32 -> float8_e4m3fn bit conversion in integer arithmetic.

Triton's CPU interpreter converts to fp8 incorrectly (no carry into the exponent, no round-to-even,
subnormals flushed), so the kernels convert by hand, identically on GPU and CPU: round to nearest
even, subnormals kept. The input must already be clamped to [-448, 448].
"""

import triton
import triton.language as tl


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
    tl.store(q_ptr + c, fp32_to_e4m3fn_bits(y), mask=c < n)


@triton.jit
def _from_e4m3fn_kernel(q_ptr, x_ptr, n, BLOCK: tl.constexpr):
    c = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(x_ptr + c, e4m3fn_bits_to_fp32(tl.load(q_ptr + c, mask=c < n)), mask=c < n)


def from_e4m3fn(q):
    """float8_e4m3fn -> float32 through :func:`e4m3fn_bits_to_fp32` (checks it against torch)."""
    import torch

    flat = q.contiguous().view(-1).view(torch.uint8)
    x = torch.empty(flat.numel(), dtype=torch.float32, device=q.device)
    _from_e4m3fn_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, x, flat.numel(), BLOCK=4096)
    return x.view(q.shape)


def to_e4m3fn(x):
    """Saturating float32 -> float8_e4m3fn through :func:`fp32_to_e4m3fn_bits` (checks it against torch)."""
    import torch

    flat = x.contiguous().view(-1)
    q = torch.empty(flat.numel(), dtype=torch.uint8, device=x.device)
    _to_e4m3fn_kernel[(triton.cdiv(flat.numel(), 4096),)](flat, q, flat.numel(), BLOCK=4096)
    return q.view(torch.float8_e4m3fn).view(x.shape)
