"""One-shot fused all-reduce + residual add + RMSNorm (+ fp8 quantisation) over a peer-mapped workspace.

Protocol (no barrier round trip, graph-safe; see docs/kernel-notes.md):

    call c uses slot s = c % 3 of every rank's buffer; rank r's rows go to region r of that slot
    rows:   dealt round-robin to min(T, max_programs) programs (at least one), the same on every rank
    tell:   program 0 stores this call's descriptor (tokens, hidden, flags, call number, region size)
            into descriptor RANK of slot s of every peer, before anything else
    push:   every program stores its rows of x (with -0.0 made +0.0) into region RANK of slot s of
            every peer; a few large rows are pushed instead by programs of their own, one chunk each,
            with lower program ids than the rows' (split_push_programs)
    clear:  the programs together reset slot (c - 1) % 3 to the sentinel, over the extent the
            previous call wrote (kept on the device, never recomputed from this call's shape),
            while the pushed data is in flight
    check:  every program waits for each peer's descriptor of slot s and compares it with its own; a
            peer whose call differs fails the call at once (recorded, every wait then gives up)
    wait:   it polls region r of its own slot s (``vendor.load_polled``) until no word holds the sentinel
            (-0.0), for each peer r, until the deadline; its own rows it reads from x
    reduce: fp32 sum in rank order, the epilogue (kernels/epilogue.py: bias, post-norm, + residual,
            RMSNorm or LayerNorm, optional fp8; NaN once failed)
    count:  the last program to finish records this call's extent (and a failure) and advances c

A peer can be at most one call ahead (it needs our data to finish each call), so it only ever
writes slot (c + 1) % 3, which the call before this one cleared: three slots suffice. Programs
never wait on programs of the same launch, and the grid never exceeds what is resident at once.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from tpfuse.blockend.call import FusedCall
from tpfuse.kernels.epilogue import _before_residual, _load_params, _store_h_and_normed
from tpfuse.kernels.launch import LaunchPlan, kept_plan, launch
from tpfuse.kernels.layout import LaunchContext
from tpfuse.kernels.protocol import (
    MAX_WARPS,
    _check_peers,
    _clear_slot,
    _descriptors,
    _finish_call,
    _multiple_of_8,
    _partial_bits,
    _peer_base,
    _send_to_peers,
    _slots,
    _start_clock,
    _sum_in_rank_order,
    call_constexprs,
    call_scalars,
    launch_config,
    workspace_tensors,
)
from tpfuse.kernels.vendor import pdl_start


@triton.jit
def _chunk_place(chunk, hidden, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr):
    """(row, columns, mask) of chunk ``chunk``: a row is CHUNKS chunks of BLOCK_C words."""
    cols = (chunk % CHUNKS) * BLOCK_C + tl.arange(0, BLOCK_C)
    return chunk // CHUNKS, cols, cols < hidden


@triton.jit
def _push_chunks(x_ptr, steps, peer_ptrs_ptr, dst_base, hidden, n_tokens, first, step, first_bits,
                 RANK: tl.constexpr, WORLD: tl.constexpr, CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr,
                 PRELOADED: tl.constexpr, STEPS: tl.constexpr):
    """Store chunks first, first + step, ... of x into every peer's buffer (not our own).

    A row is CHUNKS chunks of BLOCK_C words, numbered row by row; with CHUNKS = 1 a chunk is a row.
    PRELOADED: ``first_bits`` already holds chunk ``first`` (loaded before the state vector).
    """
    chunk = first
    if PRELOADED:
        if chunk < n_tokens * CHUNKS:
            row, cols, mask = _chunk_place(chunk, hidden, CHUNKS, BLOCK_C)
            _send_to_peers(peer_ptrs_ptr, dst_base + row.to(tl.int64) * hidden + cols, first_bits, mask, RANK,
                           WORLD)
        chunk += step
    while chunk < n_tokens * CHUNKS:
        row, cols, mask = _chunk_place(chunk, hidden, CHUNKS, BLOCK_C)
        _send_to_peers(peer_ptrs_ptr, dst_base + row.to(tl.int64) * hidden + cols,
                       _partial_bits(x_ptr, steps, row, cols, mask, hidden, STEPS), mask, RANK, WORLD)
        chunk += step


@triton.jit
def _oneshot_allreduce_add_rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, h_ptr, steps,
    peer_ptrs_ptr, state_ptr,
    n_tokens, hidden, region_elems, eps, wait_limit, pushers,
    RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, STEPS: tl.constexpr,
    USE_PDL: tl.constexpr, DEADLINE_GIVEN: tl.constexpr, DESC_FLAGS: tl.constexpr,
    CLEAR_FIRST: tl.constexpr, RELAXED_ARRIVE: tl.constexpr,
    SPLIT_PUSH: tl.constexpr, PUSH_CHUNKS: tl.constexpr, BLOCK_C: tl.constexpr, X_FIRST: tl.constexpr,
):
    hidden = _multiple_of_8(hidden)  # both checked by call_constexprs
    region_elems = _multiple_of_8(region_elems)
    pid = tl.program_id(0)
    if X_FIRST:
        # The push's data does not depend on the state vector, only its destination does: load this
        # program's first chunk of x before the state, so the two latencies overlap.
        pdl_start(USE_PDL)
        pushes = n_tokens * PUSH_CHUNKS
        if SPLIT_PUSH:
            pushes = tl.minimum(pushes, pushers)
        first_row, first_cols, first_mask = _chunk_place(pid, hidden, PUSH_CHUNKS, BLOCK_C)
        first_bits = _partial_bits(x_ptr, steps, first_row, first_cols, first_mask & (pid < pushes), hidden,
                                   STEPS)
        call, slot, slot_base, prev_slot, prev_extent = _slots(state_ptr, region_elems, WORLD, False)
    else:
        first_bits = tl.zeros([BLOCK_C], tl.int16)
        call, slot, slot_base, prev_slot, prev_extent = _slots(state_ptr, region_elems, WORLD, USE_PDL)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    own = _peer_base(peer_ptrs_ptr, RANK)
    desc, desc_slot = _descriptors(peer_ptrs_ptr, slot, region_elems, n_tokens, hidden, call, pid, RANK,
                                   WORLD, DESC_FLAGS)

    dst_base = slot_base + RANK * region_elems
    if SPLIT_PUSH:
        # A few large rows (split_push_programs): the first `pushers` programs only push, one chunk
        # each, and the others only reduce. Pushers come first, so the CPU interpreter, which runs
        # programs in order, has pushed everything before any program waits.
        first_row = pid - pushers
        if first_row < 0:
            _push_chunks(x_ptr, steps, peer_ptrs_ptr, dst_base, hidden, n_tokens, pid, pushers, first_bits,
                         RANK, WORLD, PUSH_CHUNKS, BLOCK_C, X_FIRST, STEPS)
            first_row = n_tokens  # nothing to reduce
        row_step = n_programs - pushers
    else:
        # Rows are dealt to programs round-robin, identically on every rank (same grid everywhere), so
        # a program only ever waits for rows that the same program of a peer pushes. Push all our rows
        # first: everything is in flight before the first wait.
        _push_chunks(x_ptr, steps, peer_ptrs_ptr, dst_base, hidden, n_tokens, pid, n_programs, first_bits,
                     RANK, WORLD, PUSH_CHUNKS, BLOCK_C, X_FIRST, STEPS)
        first_row = pid
        row_step = n_programs
    if CLEAR_FIRST:  # the previous slot is ours alone until our next call: clear it while data flies
        _clear_slot(own, prev_slot, region_elems, prev_extent, pid, n_programs, cols, RANK, WORLD, BLOCK_H)

    params = _load_params(weight_ptr, steps, cols, mask, n_tokens, STEPS)
    deadline = _start_clock(wait_limit, DEADLINE_GIVEN)
    deadline, failed = _check_peers(desc, own, desc_slot, state_ptr, deadline, RANK, WORLD)
    row = first_row
    while row < n_tokens:
        offs = row.to(tl.int64) * hidden + cols
        # Everything that does not depend on peers is loaded before the wait.
        if HAS_RESIDUAL:
            res = tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x_bits = _partial_bits(x_ptr, steps, row, cols, mask, hidden, STEPS)
        h, failed = _sum_in_rank_order(x_ptr, x_bits, own + slot_base, region_elems, offs, mask, deadline,
                                       failed, RANK, WORLD, BLOCK_H)
        h = _before_residual(h, params, hidden, eps, STEPS)
        if HAS_RESIDUAL:
            h += res
        _store_h_and_normed(h, params, y_ptr, h_ptr, steps, row, offs, offs, mask, hidden, eps, STEPS,
                            BLOCK_H)
        row += row_step
    if not CLEAR_FIRST:
        _clear_slot(own, prev_slot, region_elems, prev_extent, pid, n_programs, cols, RANK, WORLD, BLOCK_H)
    _finish_call(state_ptr, call, slot, n_tokens, hidden, desc, failed, n_programs, RELAXED_ARRIVE)


class OneShotVariant(NamedTuple):
    """Launch choices of the one-shot kernel, measured side by side in docs/kernel-notes.md (a named
    tuple: part of every launch plan's key, and a tuple hashes at C speed)."""

    pdl: bool = True  # programmatic dependent launch (Hopper and newer)
    clear_first: bool = True  # clear the previous slot before waiting instead of after
    relaxed_arrive: bool = True  # relaxed instead of acq_rel atomic for the arrival count
    split_push_words: int = 2048  # > 0: where split_push_programs allows, chunks of this many words
    x_first: bool = False  # load the first chunk of x to push before the state vector (loopback: no gain)
    max_warps: int = MAX_WARPS  # fewer warps: more of a row a thread, cheaper block-wide reductions


DEFAULT_VARIANT = OneShotVariant()


def split_push_programs(n_tokens: int, hidden: int, programs: int, max_programs: int, words: int) -> int:
    """Programs that only push x, one a chunk of ``words``, or 0 when the push stays with the row programs.

    A few large rows are pushed faster by several SMs than by the one that reduces each row (2 x H200:
    8192 x 8 tokens 5.6 instead of 6.4 us). Only when every chunk has a program of its own and the
    whole grid is resident: pushers that loop over chunks while row programs spin were slower from 32
    tokens on, up to 14x at 128-256 tokens (docs/kernel-notes.md). A row of one chunk keeps
    its push (splitting it was not measured).
    """
    chunks = triton.cdiv(hidden, words) if words else 1
    if chunks < 2 or n_tokens * chunks + programs > max_programs:
        return 0
    return n_tokens * chunks


def oneshot_allreduce_add_rmsnorm(ctx: LaunchContext, call: FusedCall,
                                  variant: OneShotVariant = DEFAULT_VARIANT) -> None:
    """Launch the one-shot kernel for ``call``: writes its outputs. Inputs are checked by the caller.

    ``ctx.max_programs`` must be the same on every rank and small enough that all programs are resident
    at once (a program waits for the same program of its peers).
    """
    launch(oneshot_plan(ctx, call, variant), call)


def oneshot_plan(ctx: LaunchContext, call: FusedCall,
                 variant: OneShotVariant = DEFAULT_VARIANT) -> LaunchPlan:
    """The one-shot's launch plan for calls of ``call``'s kind (kept in ``ctx``): ``launch(plan, call)``."""
    return kept_plan(ctx.plans, ("oneshot", variant, call.n_tokens, call.kernel_key()),
                     _oneshot_plan, ctx, call,
                     variant)


def _oneshot_plan(ctx: LaunchContext, call: FusedCall, variant: OneShotVariant) -> LaunchPlan:
    n_tokens, hidden = call.n_tokens, call.hidden
    block_h, num_warps, use_pdl = launch_config(hidden, call.x.device, variant.pdl, variant.max_warps)
    # One row a program, at most max_programs (the grid must be resident). Two large rows a program
    # from 65 tokens on stopped paying once rows moved 16 bytes an access: one row a program
    # made 7168/8192 x 80-128 tokens 12-18% shorter on 2 x H200 (docs/kernel-notes.md). An empty
    # call still takes one program: it exchanges descriptors, so the peers' calls are checked.
    programs = max(1, min(n_tokens, ctx.max_programs))
    pushers = split_push_programs(n_tokens, hidden, programs, ctx.max_programs, variant.split_push_words)
    block_c = variant.split_push_words if pushers else block_h  # a split row is wider than a chunk
    return LaunchPlan(
        _oneshot_allreduce_add_rmsnorm_kernel, pushers + programs, call_scalars(ctx, call, (pushers,)),
        dict(RANK=ctx.rank, WORLD=ctx.world_size, BLOCK_H=block_h, USE_PDL=use_pdl,
             **call_constexprs(ctx, call, twoshot=False), CLEAR_FIRST=variant.clear_first,
             RELAXED_ARRIVE=variant.relaxed_arrive, SPLIT_PUSH=pushers > 0,
             PUSH_CHUNKS=triton.cdiv(hidden, block_c), BLOCK_C=block_c, X_FIRST=variant.x_first),
        dict(num_warps=num_warps, launch_pdl=use_pdl), workspace_tensors(ctx))
