"""Device functions the one-shot and two-shot kernels share: the sentinel protocol and the norm.

A word of a slot that nobody has written since it was last cleared holds the sentinel (-0.0 in
bf16 and fp16). Writers make their own -0.0 words +0.0 before sending, so a reader knows a word
has arrived when it no longer holds the sentinel. Both kernels rotate the same three slots with the
same state vector, so calls of either algorithm may follow each other in any order.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.comm.workspace import SENTINEL, STATE_ERROR
from tpfuse.kernels.fp8 import fp32_to_e4m3fn_bits

# Globals a jitted function reads must be constexpr objects.
_SENTINEL = tl.constexpr(SENTINEL)
_STATE_ERROR = tl.constexpr(STATE_ERROR)

# Polls of one peer row before a kernel gives up, flags STATE_ERROR and moves on (never hangs).
DEFAULT_MAX_SPINS = 1 << 30


@triton.jit
def _sendable(bits):
    """int16 words with -0.0 made +0.0: a -0.0 sent as-is would read as "not arrived"."""
    return tl.where(bits == _SENTINEL, 0, bits)


@triton.jit
def _sendable_bits(ptr, offs, mask):
    """A row of 16-bit floats loaded as sendable int16 words."""
    return _sendable(tl.load(ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True))


@triton.jit
def _peer_base(peer_ptrs_ptr, r):
    return tl.load(peer_ptrs_ptr + r).to(tl.pointer_type(tl.int16))


@triton.jit
def _wait_row(src, mask, spins, max_spins):
    """Poll a row of words until none holds the sentinel; stops early once ``spins`` runs out."""
    bits = tl.load(src, mask=mask, other=0, volatile=True)
    while (tl.max((bits == _SENTINEL).to(tl.int32), axis=0) > 0) & (spins < max_spins):
        bits = tl.load(src, mask=mask, other=0, volatile=True)
        spins += 1
    return bits, spins


@triton.jit
def _clear_slot(own, slot_base, region_elems, extent, first, step, cols,
                RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr):
    """Reset the peers' regions of a slot to the sentinel over ``extent`` words, strided by program.

    Our own region is never written by anyone (we keep our rows in x), so it stays clear.
    """
    sentinel = tl.full([BLOCK_H], _SENTINEL, tl.int16)
    for r in tl.static_range(WORLD):
        if r != RANK:
            start = first * BLOCK_H
            while start < extent:
                idx = start + cols
                tl.store(own + slot_base + r * region_elems + idx, sentinel, mask=idx < extent)
                start += step * BLOCK_H


@triton.jit
def _finish_call(state_ptr, call, slot, extent, spins, max_spins, n_programs, RELAXED_ARRIVE: tl.constexpr):
    """Flag a wait that ran out; the last program of the launch records the extent and advances the call.

    Every program has read the state by the time it arrives (its loads fed addresses it has already
    used), so the arrival itself needs no ordering.
    """
    if spins >= max_spins:
        tl.atomic_xchg(state_ptr + _STATE_ERROR, 1)
    if RELAXED_ARRIVE:
        arrived = tl.atomic_add(state_ptr + 1, 1, sem="relaxed")
    else:
        arrived = tl.atomic_add(state_ptr + 1, 1, sem="acq_rel")
    if arrived == n_programs - 1:
        tl.store(state_ptr + 2 + slot, extent)
        tl.store(state_ptr + 0, call + 1)
        tl.store(state_ptr + 1, 0)


@triton.jit
def _store_normed(h, w, y_ptr, scale_ptr, offs, mask, hidden, eps, HAS_QUANT: tl.constexpr):
    """y = h * rsqrt(mean(h*h) + eps) * w from an fp32 row, stored in y's dtype or as fp8 bits."""
    rstd = tl.rsqrt(tl.sum(h * h, axis=0) / hidden + eps)
    y = h * rstd * w
    if HAS_QUANT:  # y_ptr is the fp8 output viewed as uint8
        y = tl.clamp(y / tl.load(scale_ptr), -448.0, 448.0)
        tl.store(y_ptr + offs, fp32_to_e4m3fn_bits(y), mask=mask)
    else:
        tl.store(y_ptr + offs, y.to(y_ptr.dtype.element_ty), mask=mask)
