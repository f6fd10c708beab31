"""What the one-shot and two-shot kernels share: the sentinel protocol, the sum, the norm, the arguments.

A word of a slot that nobody has written since it was last cleared holds the sentinel (-0.0 in
bf16 and fp16). Writers make their own -0.0 words +0.0 before sending, so a reader knows a word
has arrived when it no longer holds the sentinel. Both kernels rotate the same three slots with the
same state vector, so calls of either algorithm may follow each other in any order.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait, globaltimer

from tpfuse.kernels import layout
from tpfuse.kernels.fp8 import fp32_to_e4m3fn_bits
from tpfuse.kernels.layout import LaunchContext

# Globals a jitted function reads must be constexpr objects.
_SENTINEL = tl.constexpr(layout.SENTINEL)
_NUM_SLOTS = tl.constexpr(layout.NUM_SLOTS)
_STATE_CALL = tl.constexpr(layout.STATE_CALL)
_STATE_ARRIVED = tl.constexpr(layout.STATE_ARRIVED)
_STATE_EXTENT = tl.constexpr(layout.STATE_EXTENT)
_STATE_ERROR = tl.constexpr(layout.STATE_ERROR)
_STATE_ERROR_TOKENS = tl.constexpr(layout.STATE_ERROR_TOKENS)
_STATE_ERROR_HIDDEN = tl.constexpr(layout.STATE_ERROR_HIDDEN)

# Every wait is bounded. On a GPU the bound is time (the global nanosecond timer); the CPU
# interpreter has no timer, so there it is a number of polls, about this many a second.
CPU_POLLS_PER_SECOND = 5000
#: How long a kernel waits for a peer before it flags an error and returns (see docs/reliability.md).
DEFAULT_WAIT_TIMEOUT_S = 10.0


def wait_limit_for(timeout_s: float, on_gpu: bool) -> int:
    """The kernels' ``wait_limit`` argument for a timeout: nanoseconds on a GPU, polls on the CPU."""
    return int(timeout_s * 1e9) if on_gpu else max(1, int(timeout_s * CPU_POLLS_PER_SECOND))


# 16 warps of 32 threads, 8 elements a thread: a row of 4096 a pass. 32 warps (a row of 8192 over
# 1024 threads, FlashInfer's shape) measured the same on 2 x H200 (docs/kernel-notes.md).
MAX_WARPS = 16


def launch_config(hidden: int, device: torch.device, pdl: bool = True) -> tuple[int, int, bool]:
    """(BLOCK_H, num_warps, use_pdl) for rows of ``hidden`` on ``device``: 8 elements a thread; PDL
    (programmatic dependent launch) when asked for and the GPU has it (Hopper and newer)."""
    block_h = triton.next_power_of_2(hidden)
    num_warps = max(1, min(MAX_WARPS, block_h // 256))
    use_pdl = pdl and device.type == "cuda" and torch.cuda.get_device_capability(device)[0] >= 9
    return block_h, num_warps, use_pdl


def kernel_arguments(
    ctx: LaunchContext,
    x: torch.Tensor,
    residual: torch.Tensor | None,
    weight: torch.Tensor,
    eps: float,
    y: torch.Tensor,
    h: torch.Tensor,
    quant_scale: torch.Tensor | None,
) -> tuple[tuple, dict]:
    """Both kernels' leading positional arguments, in order, and the flags that follow from them.

    An absent residual or scale is passed as a stand-in pointer the kernel never reads; an fp8 ``y``
    is written as bytes.
    """
    n_tokens, hidden = x.shape
    workspace = ctx.workspace
    assert n_tokens * hidden <= workspace.region_elems and workspace.state.numel() == layout.STATE_LEN
    # The kernels take both for multiples of 8 (16-byte rows); select.kernel_supports admits no others.
    assert hidden % 8 == 0 and workspace.region_elems % 8 == 0, (hidden, workspace.region_elems)
    args = (x, residual if residual is not None else x, weight,
            y.view(torch.uint8) if quant_scale is not None else y, h,
            quant_scale if quant_scale is not None else weight,
            workspace.peer_ptrs, workspace.state,
            n_tokens, hidden, workspace.region_elems, eps, ctx.wait_limit)
    flags = dict(HAS_RESIDUAL=residual is not None, HAS_QUANT=quant_scale is not None,
                 USE_CLOCK=x.device.type == "cuda")
    return args, flags


@triton.jit
def _sendable(bits):
    """int16 words with -0.0 made +0.0: a -0.0 sent as-is would read as "not arrived"."""
    return tl.where(bits == _SENTINEL, 0, bits)


@triton.jit
def _sendable_bits(ptr, offs, mask):
    """A row of 16-bit floats loaded as sendable int16 words."""
    return _sendable(tl.load(ptr + offs, mask=mask, other=0.0).to(tl.int16, bitcast=True))


@triton.jit
def _multiple_of_8(n):
    """``n``, which is a multiple of 8, written so that the compiler knows it: rows and regions then
    start on 16-byte boundaries and move in 16-byte accesses, also without Triton's own
    divisibility-by-16 hint (a hidden size of 4104, say). tl.multiple_of on an argument did not
    do it (triton 3.6)."""
    return n // 8 * 8


@triton.jit
def _peer_base(peer_ptrs_ptr, r):
    """Rank r's workspace buffer, said to be 16-byte aligned (allocate_cuda checks it) so that rows move
    in 16-byte accesses: without the hint the compiler cannot know the alignment of a pointer read
    from memory, and pushes, polls and clears went 2 bytes at a time."""
    return tl.multiple_of(tl.load(peer_ptrs_ptr + r).to(tl.pointer_type(tl.int16)), 16)


@triton.jit
def _slots(state_ptr, region_elems, WORLD: tl.constexpr, USE_PDL: tl.constexpr):
    """(call, slot, slot_base, prev_base, prev_extent): this call's number and slot, where the slot
    and the previous call's slot start, and how many words a rank wrote into the previous one.

    Every kernel starts here. With programmatic dependent launch (USE_PDL) it was launched early, so
    it first waits until the previous kernel's writes, the state vector and x included, are visible,
    and then lets the next kernel launch early too.
    """
    if USE_PDL:
        gdc_wait()
        gdc_launch_dependents()
    call = tl.load(state_ptr + _STATE_CALL)
    slot = call % _NUM_SLOTS
    prev_slot = (call + _NUM_SLOTS - 1) % _NUM_SLOTS
    slot_base = slot.to(tl.int64) * WORLD * region_elems
    prev_base = prev_slot.to(tl.int64) * WORLD * region_elems
    prev_extent = tl.load(state_ptr + _STATE_EXTENT + prev_slot)
    return call, slot, slot_base, prev_base, prev_extent


@triton.jit
def _start_clock(wait_limit, USE_CLOCK: tl.constexpr):
    """The bound every wait of this program shares: a timer deadline, or the polls allowed."""
    if USE_CLOCK:
        return globaltimer() + wait_limit
    else:
        return wait_limit.to(tl.int64)


@triton.jit
def _time_left(limit, USE_CLOCK: tl.constexpr):
    if USE_CLOCK:
        return globaltimer() < limit
    else:
        return limit > 0


@triton.jit
def _wait_row(src, mask, limit, USE_CLOCK: tl.constexpr):
    """Poll a row of words until none holds the sentinel or the bound ``limit`` runs out.

    Returns the row, the updated bound and 1 if words are still missing (0 when it all arrived).
    Once the bound has run out, every later wait returns after one look.
    """
    bits = tl.load(src, mask=mask, other=0, volatile=True)
    missing = tl.max((bits == _SENTINEL).to(tl.int32), axis=0)
    while (missing > 0) & _time_left(limit, USE_CLOCK):
        bits = tl.load(src, mask=mask, other=0, volatile=True)
        missing = tl.max((bits == _SENTINEL).to(tl.int32), axis=0)
        if not USE_CLOCK:
            limit -= 1
    return bits, limit, (missing > 0).to(tl.int32)


@triton.jit
def _sum_in_rank_order(x_ptr, own_bits, slot_ptr, region_elems, offs, mask, limit, failed, RANK: tl.constexpr,
                       WORLD: tl.constexpr, BLOCK_H: tl.constexpr, USE_CLOCK: tl.constexpr):
    """fp32 sum of one row over the ranks, in rank order: ours from ``own_bits``, each peer's from its
    region of our slot (``slot_ptr``) once it has arrived. Returns (sum, bound left, failed)."""
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            bits = own_bits
        else:
            bits, limit, missing = _wait_row(slot_ptr + r * region_elems + offs, mask, limit, USE_CLOCK)
            failed |= missing
        acc += bits.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    return acc, limit, failed


@triton.jit
def _clear_slot(
    own,
    slot_base,
    region_elems,
    extent,
    first,
    step,
    cols,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Reset the peers' regions of a slot to the sentinel over ``extent`` words, strided by program.

    Our own region is never written by anyone (we keep our rows in x), so it stays clear.
    """
    sentinel = tl.full([BLOCK_H], _SENTINEL, tl.int16)
    extent = _multiple_of_8(extent)  # tokens x hidden
    for r in tl.static_range(WORLD):
        if r != RANK:
            start = first * BLOCK_H
            while start < extent:
                idx = start + cols
                tl.store(own + slot_base + r * region_elems + idx, sentinel, mask=idx < extent)
                start += step * BLOCK_H


@triton.jit
def _finish_call(state_ptr, call, slot, n_tokens, hidden, failed, n_programs, RELAXED_ARRIVE: tl.constexpr):
    """Record a wait that ran out; the last program of the launch records the extent and advances the call.

    The error entry holds the failed call's number (1-based) and shape, for the host to report.
    Every program has read the state by the time it arrives (its loads fed addresses it has already
    used), so the arrival itself needs no ordering.
    """
    if failed > 0:
        tl.atomic_xchg(state_ptr + _STATE_ERROR, call + 1)
        tl.store(state_ptr + _STATE_ERROR_TOKENS, n_tokens)
        tl.store(state_ptr + _STATE_ERROR_HIDDEN, hidden)
    if RELAXED_ARRIVE:
        arrived = tl.atomic_add(state_ptr + _STATE_ARRIVED, 1, sem="relaxed")
    else:
        arrived = tl.atomic_add(state_ptr + _STATE_ARRIVED, 1, sem="acq_rel")
    if arrived == n_programs - 1:
        tl.store(state_ptr + _STATE_EXTENT + slot, n_tokens * hidden)
        tl.store(state_ptr + _STATE_CALL, call + 1)
        tl.store(state_ptr + _STATE_ARRIVED, 0)


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
