"""What the one-shot and two-shot kernels share: the sentinel protocol, the sum, the norm, the arguments.

A word of a slot that nobody has written since it was last cleared holds the sentinel (-0.0 in
bf16 and fp16). Writers make their own -0.0 words +0.0 before sending, so a reader knows a word
has arrived when it no longer holds the sentinel. Both kernels rotate the same three slots with the
same state vector, so calls of either algorithm may follow each other in any order.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import triton
import triton.language as tl

from tpfuse import targets
from tpfuse.blockend import bits
from tpfuse.blockend.call import FusedCall
from tpfuse.kernels import layout
from tpfuse.kernels.epilogue import _moe_partial
from tpfuse.kernels.layout import LaunchContext
from tpfuse.kernels.vendor import arrive, load_polled, now, pdl_start, store_shared

# Globals a jitted function reads must be constexpr objects.
_SENTINEL = tl.constexpr(layout.SENTINEL)
_NUM_SLOTS = tl.constexpr(layout.NUM_SLOTS)
_STATE_CALL = tl.constexpr(layout.STATE_CALL)
_STATE_ARRIVED = tl.constexpr(layout.STATE_ARRIVED)
_STATE_EXTENT = tl.constexpr(layout.STATE_EXTENT)
_STATE_ERROR = tl.constexpr(layout.STATE_ERROR)
_STATE_ERROR_PEER = tl.constexpr(layout.STATE_ERROR_PEER)
_STATE_ERROR_OWN = tl.constexpr(layout.STATE_ERROR_OWN)
_STATE_ERROR_SEEN = tl.constexpr(layout.STATE_ERROR_SEEN)
_DESC_WORDS = tl.constexpr(layout.DESC_WORDS)

# 16 warps of 32 threads, 8 elements a thread: a row of 4096 a pass. 32 warps (a row of 8192 over
# 1024 threads, FlashInfer's shape) measured the same on 2 x H200 (docs/kernel-notes.md).
MAX_WARPS = 16
#: 16-bit elements a thread moves in one 16-byte access.
_ELEMENTS_A_THREAD = 8


def launch_config(hidden: int, device: torch.device, pdl: bool = True,
                  max_warps: int = MAX_WARPS) -> tuple[int, int, bool]:
    """(BLOCK_H, num_warps, use_pdl) for rows of ``hidden`` on ``device``: 8 elements a thread, at most
    ``max_warps`` warps and never more than 1024 threads (AMD's wavefronts are 64 threads: half the
    warps); PDL (programmatic dependent launch) when asked for and the GPU has it (NVIDIA Hopper and
    newer: ``targets.Target.has_pdl``)."""
    target = targets.target(device)
    block_h = triton.next_power_of_2(hidden)
    num_warps = max(1, min(max_warps, target.max_warps, block_h // (_ELEMENTS_A_THREAD * target.warp_size)))
    return block_h, num_warps, pdl and target.has_pdl


def workspace_tensors(ctx: LaunchContext) -> tuple:
    """Both kernels' pointer arguments after the call's (``FusedCall.kernel_tensors``): the workspace's
    peer table and state vector."""
    return (ctx.workspace.peer_ptrs, ctx.workspace.state)


def call_scalars(ctx: LaunchContext, call: FusedCall, tail: tuple = ()) -> Callable[[FusedCall], tuple]:
    """Both kernels' runtime scalars for calls of ``call``'s kind (``LaunchPlan.scalars``): a function of a
    call giving its tokens, hidden, region, eps and wait bound, then ``tail`` (the kernel's own).

    The wait bound is in ticks of the kernels' timer (``vendor.now``: nanoseconds on NVIDIA, the
    device's wall clock on AMD). It is a duration on a GPU, where a launch may be captured in a CUDA
    graph and replayed later; on the CPU it is the launch's deadline, which every program shares (the
    interpreter runs programs one after another, so a per-program duration would add up). It follows
    ``ctx.wait_limit_ns`` as it is at each call.
    """
    n_tokens, hidden, region = call.n_tokens, call.hidden, ctx.workspace.region_elems
    device = call.x.device
    if device.type == "cuda":
        index = device.index
        return lambda call: (n_tokens, hidden, region, call.eps,
                             _gpu_wait_ticks(ctx.wait_limit_ns, index), *tail)
    return lambda call: (n_tokens, hidden, region, call.eps, targets.cpu_timer_ticks()
                         + targets.wait_ticks(device, ctx.wait_limit_ns / 1e9), *tail)


@functools.lru_cache(maxsize=64)
def _gpu_wait_ticks(wait_limit_ns: int, index: int) -> int:
    """``wait_limit_ns`` in ticks of GPU ``index``'s timer: decided once, not on every call."""
    return targets.wait_ticks(torch.device("cuda", index), wait_limit_ns / 1e9)


def call_constexprs(ctx: LaunchContext, call: FusedCall, twoshot: bool, wire: bool = False) -> dict:
    """The switches both kernels compile in for this kind of call (decided once per kind: a plan)."""
    n_tokens, hidden = call.n_tokens, call.hidden
    workspace = ctx.workspace
    assert n_tokens * hidden <= workspace.region_elems and workspace.state.numel() == layout.STATE_LEN
    # The kernels take both for multiples of 8 (16-byte rows); select.kernel_supports admits no others.
    assert hidden % 8 == 0 and workspace.region_elems % 8 == 0, (hidden, workspace.region_elems)
    return dict(HAS_RESIDUAL=call.residual is not None, STEPS=call.epilogue.switches(hidden),
                DEADLINE_GIVEN=call.x.device.type != "cuda",
                DESC_FLAGS=call.describe().flags | (bits.FLAG_TWOSHOT if twoshot else 0)
                | (bits.FLAG_FP8_WIRE if wire else 0))


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
def _send_to_peers(peer_ptrs_ptr, at, bits, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Store ``bits`` at offset ``at`` of every peer's buffer (not our own)."""
    for r in tl.static_range(WORLD):
        if r != RANK:
            store_shared(_peer_base(peer_ptrs_ptr, r) + at, bits, mask)


@triton.jit
def _slot_base(slot, region_elems, WORLD: tl.constexpr):
    """Where a slot's regions start in a rank's buffer."""
    return slot.to(tl.int64) * WORLD * region_elems


@triton.jit
def _desc_base(slot, region_elems, WORLD: tl.constexpr):
    """Where a slot's descriptors start in a rank's buffer: after all slots (``Workspace.descriptors``)."""
    return tl.full([], _NUM_SLOTS * WORLD, tl.int64) * region_elems + slot.to(tl.int64) * WORLD * _DESC_WORDS


@triton.jit
def _slots(state_ptr, region_elems, WORLD: tl.constexpr, USE_PDL: tl.constexpr):
    """(call, slot, slot_base, prev_slot, prev_extent): this call's number and slot, where the slot
    starts, the previous call's slot and how many words a rank wrote into it.

    Every kernel starts here (after ``vendor.pdl_start`` when it does so itself: USE_PDL False then).
    """
    pdl_start(USE_PDL)
    call = tl.load(state_ptr + _STATE_CALL)
    slot = call % _NUM_SLOTS
    prev_slot = (call + _NUM_SLOTS - 1) % _NUM_SLOTS
    prev_extent = tl.load(state_ptr + _STATE_EXTENT + prev_slot)
    return call, slot, _slot_base(slot, region_elems, WORLD), prev_slot, prev_extent


@triton.jit
def _start_clock(wait_limit, DEADLINE_GIVEN: tl.constexpr):
    """The deadline every wait of this program shares, in ticks of ``vendor.now``: given (CPU), or the
    bound from now (GPU)."""
    if DEADLINE_GIVEN:
        return wait_limit.to(tl.int64)
    else:
        return now() + wait_limit


@triton.jit
def _wait_row(src, mask, deadline):
    """Poll a row of words until none holds the sentinel or the ``deadline`` passes.

    Returns the row and 1 if words are still missing (0 when it all arrived). Once the deadline has
    passed, every later wait returns after one look. Every look reads memory (``vendor.load_polled``),
    past the caches on AMD: a peer's words may arrive at any time.
    """
    bits = load_polled(src, mask)
    missing = tl.max((bits == _SENTINEL).to(tl.int32), axis=0)
    while (missing > 0) & (now() < deadline):
        bits = load_polled(src, mask)
        missing = tl.max((bits == _SENTINEL).to(tl.int32), axis=0)
    return bits, (missing > 0).to(tl.int32)


@triton.jit
def _describe_call(n_tokens, hidden, call, region_elems, FLAGS: tl.constexpr):
    """This call's descriptor: ``bits.describe_call`` as a vector of DESC_WORDS int16 words."""
    i = tl.arange(0, _DESC_WORDS)
    words = tl.where(i == 0, n_tokens, tl.where(i == 1, n_tokens >> 15, tl.where(i == 2, hidden, tl.where(
        i == 3, FLAGS, tl.where(i == 4, call, tl.where(i == 5, region_elems, tl.where(
            i == 6, region_elems >> 15, ((region_elems >> 30) & 1) | (FLAGS >> 15) << 1)))))))
    return (words & 0x7FFF).to(tl.int16)


@triton.jit
def _descriptors(peer_ptrs_ptr, slot, region_elems, n_tokens, hidden, call, pid, RANK: tl.constexpr,
                 WORLD: tl.constexpr, FLAGS: tl.constexpr):
    """(descriptor, where the slot's descriptors start): program 0 sends this call's descriptor to every
    peer, first thing, so that it is on its way before anyone waits."""
    desc = _describe_call(n_tokens, hidden, call, region_elems, FLAGS)
    desc_slot = _desc_base(slot, region_elems, WORLD)
    if pid == 0:
        i = tl.arange(0, _DESC_WORDS)
        _send_to_peers(peer_ptrs_ptr, desc_slot + RANK * _DESC_WORDS + i, desc, i < _DESC_WORDS, RANK, WORLD)
    return desc, desc_slot


@triton.jit
def _check_peers(desc, own, desc_slot, state_ptr, deadline, RANK: tl.constexpr, WORLD: tl.constexpr):
    """Wait for every peer's descriptor of this call and compare it with ours. Returns (deadline, failed).

    A peer whose call differs is recorded in the state vector (every program that sees it writes the
    same words) and the deadline is made past, so no wait of this call blocks further: the rows such
    a peer sends may never come, or be of another shape.
    """
    i = tl.arange(0, _DESC_WORDS)
    failed = 0
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen, missing = _wait_row(own + desc_slot + r * _DESC_WORDS + i, i < _DESC_WORDS, deadline)
            differs = tl.max((seen != desc).to(tl.int32), axis=0) * (1 - missing)
            if differs > 0:
                tl.store(state_ptr + _STATE_ERROR_SEEN + i, seen.to(tl.int32))
                tl.store(state_ptr + _STATE_ERROR_PEER, r + 1)
                deadline = deadline * 0  # past
            failed |= missing | differs
    return deadline, failed


@triton.jit
def _poisoned(h, failed):
    """NaN for the rows of a call that failed: whatever a rank returns from it is never plausible data."""
    return tl.where(failed > 0, float("nan"), h)


@triton.jit
def _nan_bits(ptr):
    """A quiet NaN of ``ptr``'s 16-bit float type, as an int16 word."""
    if ptr.dtype.element_ty == tl.bfloat16:
        return tl.full([], 0x7FC0, tl.int16)
    else:
        return tl.full([], 0x7E00, tl.int16)


@triton.jit
def _partial_bits(x_ptr, steps, row, cols, mask, hidden, STEPS: tl.constexpr):
    """This rank's part of row ``row`` as the sendable 16-bit words the kernels exchange: x's row, or a
    MoE finalize's (``epilogue._moe_partial``) rounded to x's dtype, which the peers sum as they sum x."""
    if STEPS.EXPERTS == 0 and not STEPS.SHARED_EXPERT:
        return _sendable_bits(x_ptr, row.to(tl.int64) * hidden + cols, mask)
    part = _moe_partial(x_ptr, steps, row, cols, mask, hidden, STEPS).to(x_ptr.dtype.element_ty)
    return _sendable(part.to(tl.int16, bitcast=True))


@triton.jit
def _sum_in_rank_order(x_ptr, own_bits, slot_ptr, region_elems, offs, mask, deadline, failed,
                       RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr):
    """fp32 sum of one row over the ranks, in rank order: ours from ``own_bits``, each peer's from its
    region of our slot (``slot_ptr``) once it has arrived; NaN once the call failed. Returns (sum, failed)."""
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            bits = own_bits
        else:
            bits, missing = _wait_row(slot_ptr + r * region_elems + offs, mask, deadline)
            failed |= missing
        acc += bits.to(x_ptr.dtype.element_ty, bitcast=True).to(tl.float32)
    return _poisoned(acc, failed), failed


@triton.jit
def _clear_slot(
    own,
    slot,
    region_elems,
    extent,
    first,
    step,
    cols,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """Reset the peers' regions of a slot to the sentinel over ``extent`` words, strided by program,
    and (program 0) the peers' descriptors of that slot.

    Our own region and descriptor are never written by anyone (we keep our rows in x), so they stay
    clear. The sentinel is written through to memory (``vendor.store_shared``): on AMD a clear left in
    a cache could be written back after a peer's next data and overwrite it.
    """
    sentinel = tl.full([BLOCK_H], _SENTINEL, tl.int16)
    extent = _multiple_of_8(extent)  # tokens x hidden
    slot_base = _slot_base(slot, region_elems, WORLD)
    desc_slot = _desc_base(slot, region_elems, WORLD)
    i = tl.arange(0, _DESC_WORDS)
    for r in tl.static_range(WORLD):
        if r != RANK:
            start = first * BLOCK_H
            while start < extent:
                idx = start + cols
                store_shared(own + slot_base + r * region_elems + idx, sentinel, idx < extent)
                start += step * BLOCK_H
            if first == 0:
                store_shared(own + desc_slot + r * _DESC_WORDS + i,
                             tl.full([_DESC_WORDS], _SENTINEL, tl.int16))


@triton.jit
def _finish_call(state_ptr, call, slot, n_tokens, hidden, desc, failed, n_programs,
                 RELAXED_ARRIVE: tl.constexpr):
    """Record a failed call; the last program of the launch records the extent and advances the call.

    The error entries hold the failed call's number (1-based) and descriptor, for the host to report
    (with the differing peer's, which ``_check_peers`` recorded). Every program has read the state by
    the time it arrives (its loads fed addresses it has already used), so on NVIDIA the arrival itself
    needs no ordering (RELAXED_ARRIVE); on AMD it releases this program's clears at system scope
    (``vendor.arrive``).
    """
    if failed > 0:
        tl.store(state_ptr + _STATE_ERROR_OWN + tl.arange(0, _DESC_WORDS), desc.to(tl.int32))
        tl.atomic_xchg(state_ptr + _STATE_ERROR, call + 1)
    arrived = arrive(state_ptr + _STATE_ARRIVED, RELAXED_ARRIVE)
    if arrived == n_programs - 1:
        tl.store(state_ptr + _STATE_EXTENT + slot, n_tokens * hidden)
        tl.store(state_ptr + _STATE_CALL, call + 1)
        tl.store(state_ptr + _STATE_ARRIVED, 0)
