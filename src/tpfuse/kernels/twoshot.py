"""Two-shot fused all-reduce + residual add + RMSNorm (+ fp8) over the one-shot's workspace.

For many tokens a one-shot sends every row to every peer; the two-shot sends each row once and the
result once (reduce-scatter, then all-gather), still without a barrier round trip:

    rows:    dealt round-robin to the programs as in the one-shot; row j belongs to rank
             owner(j) = (j + j // programs) % W, so each program owns rows on every rank
             (``_row_and_owner``)
    scatter: every program stores its rows of x that another rank owns into region RANK of that
             owner's slot
    clear:   the previous slot, as in the one-shot
    reduce:  for the rows it owns, a program waits for every peer's x, sums in rank order in fp32,
             applies the epilogue's steps before the residual (bias, post-norm), adds the residual,
             rounds h to the output dtype and stores that h into region RANK of
             every peer's slot
    gather:  for the rows others own, it waits for the owner's h in region owner(j) of its own slot
    norm:    y is computed from the rounded h by every rank alike, so all ranks agree bit for bit
             and only h travels (the same bytes per rank as a one-shot at W = 2, 2(W-1)/W of a row
             instead of W-1 rows above)

With the fp8 wire (``WIRE``, opt-in: ``kernels/wire.py``) x and the reduced sum travel as fp8 codes
with a scale per block of 128, about half the bytes: the owner quantises its own x as well, sends the
sum (before bias, post-norm and residual) and decodes it as the peers do, and every rank applies the
rest of the epilogue to the decoded sum, so all ranks still agree bit for bit.

Sequence parallel (``SHARDED``, ``FusedCall.sharded``): the same protocol with rows owned as a
reduce-scatter over dim 0 gives them (row j belongs to rank j // (T / W)), a program taking its rows
from the ranks' shards in turn; the residual, h and the norm backward's inputs are the owner's rows
only. The owner sends h and every rank norms it as above; for RMSNorm's backward, whose inputs only the
owner holds, the owner sends y instead, and its peers store what they receive. A row's bits are those
of the all-reduce path (docs/sequence-parallel.md).

Words in our slot come from peers of the same call only (x rows we own, h rows they own), so the
slot rotation, clearing and extent of the one-shot hold unchanged, and calls of the two kernels
may follow each other in any order. A program waits only for the same program of its peers, which
pushed before its first wait.
"""

from __future__ import annotations

import triton
import triton.language as tl

from tpfuse.blockend.call import FusedCall
from tpfuse.kernels.epilogue import (
    _before_residual,
    _load_params,
    _norm_of,
    _partial_row,
    _store_h_and_normed,
    _store_normed,
)
from tpfuse.kernels.launch import LaunchPlan, kept_plan, launch
from tpfuse.kernels.layout import LaunchContext
from tpfuse.kernels.protocol import (
    MAX_WARPS,
    _check_peers,
    _clear_slot,
    _descriptors,
    _finish_call,
    _multiple_of_8,
    _nan_bits,
    _partial_bits,
    _peer_base,
    _poisoned,
    _send_to_peers,
    _sendable,
    _slots,
    _start_clock,
    _sum_in_rank_order,
    _wait_row,
    call_constexprs,
    call_scalars,
    launch_config,
    workspace_tensors,
)
from tpfuse.kernels.vendor import round_to, store_shared
from tpfuse.kernels.wire import _WIRE_BLOCK, _decode, _encode, wire_supported


@triton.jit
def _row_and_owner(i, pid, n_programs, n_tokens, WORLD: tl.constexpr, SHARDED: tl.constexpr):
    """Row ``i`` of program ``pid`` (its own numbering) and the rank that owns it. Sharded, the program's
    rows come from each rank's shard in turn (its k-th is row k // W of rank k % W's shard): a group of
    rows has rows of every owner, so no rank waits while another reduces (the shards are contiguous)."""
    k = pid + i * n_programs
    if SHARDED:
        owner = k % WORLD
        return owner * (n_tokens // WORLD) + k // WORLD, owner
    return k, (k + k // n_programs) % WORLD


@triton.jit
def _own_offs(row, offs, cols, n_tokens, hidden, RANK: tl.constexpr, WORLD: tl.constexpr,
              SHARDED: tl.constexpr):
    """Where a row of ours sits in h, the residual and the norm backward's inputs: ``offs``, or in a
    sharded call its place among this rank's rows."""
    if SHARDED:
        return (row - RANK * (n_tokens // WORLD)).to(tl.int64) * hidden + cols
    return offs


@triton.jit
def _as_h(h_bits, h_ptr):
    """A rounded h row that travelled as 16-bit words, as h's dtype."""
    return h_bits.to(h_ptr.dtype.element_ty, bitcast=True)


@triton.jit
def _wire_places(row, hidden, BLOCK_H: tl.constexpr):
    """Where a row's code words and exponent words sit in a region on the fp8 wire, and their masks
    (``wire.wire_row_words``). Written so that the compiler sees multiples of 8 words: 16-byte accesses
    (hidden is a multiple of 128 here)."""
    half = hidden // 16 * 8
    blocks = hidden // _WIRE_BLOCK
    base = row.to(tl.int64) * (half + (blocks + 7) // 8 * 8)
    w = tl.arange(0, BLOCK_H // 2)
    g = tl.arange(0, BLOCK_H // _WIRE_BLOCK)
    return base + w, w < half, base + half + g, g < blocks


@triton.jit
def _send_wire(region, row, hidden, words, exponents, BLOCK_H: tl.constexpr):
    word_at, word_mask, exp_at, exp_mask = _wire_places(row, hidden, BLOCK_H)
    store_shared(region + word_at, words, word_mask)
    store_shared(region + exp_at, exponents, exp_mask)


@triton.jit
def _wait_wire(region, row, hidden, deadline, BLOCK_H: tl.constexpr):
    """A row on the fp8 wire, decoded, once it has arrived (or the deadline passed): (row, missing)."""
    word_at, word_mask, exp_at, exp_mask = _wire_places(row, hidden, BLOCK_H)
    words, missing = _wait_row(region + word_at, word_mask, deadline)
    exponents, missing_exp = _wait_row(region + exp_at, exp_mask, deadline)
    return _decode(words, exponents, BLOCK_H), missing | missing_exp


@triton.jit
def _scatter(x_ptr, steps, peer_ptrs_ptr, send_base, n_tokens, hidden, pid, n_programs, first, last, cols,
             mask, RANK: tl.constexpr, WORLD: tl.constexpr, WIRE: tl.constexpr, BLOCK_H: tl.constexpr,
             STEPS: tl.constexpr, SHARDED: tl.constexpr):
    """Send this program's rows first..last-1 (its own numbering) that another rank owns, to that owner."""
    i = first
    while i < last:
        row, owner = _row_and_owner(i, pid, n_programs, n_tokens, WORLD, SHARDED)
        if owner != RANK:
            if WIRE:
                words, exponents = _encode(_partial_row(x_ptr, steps, row, cols, mask, hidden, STEPS),
                                           BLOCK_H)
                _send_wire(_peer_base(peer_ptrs_ptr, owner) + send_base, row, hidden, words, exponents,
                           BLOCK_H)
            else:
                store_shared(_peer_base(peer_ptrs_ptr, owner) + send_base + row.to(tl.int64) * hidden + cols,
                             _partial_bits(x_ptr, steps, row, cols, mask, hidden, STEPS), mask)
        i += 1


@triton.jit
def _sum_wire_in_rank_order(x_ptr, steps, cols, mask, own_slot, region_elems, row, hidden, deadline, failed,
                            RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr,
                            STEPS: tl.constexpr):
    """fp32 sum of one row over the ranks, in rank order, each rank's x as the fp8 wire carries it (ours
    quantised here too); NaN once the call failed. Returns (sum, failed)."""
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            words, exponents = _encode(_partial_row(x_ptr, steps, row, cols, mask, hidden, STEPS), BLOCK_H)
            part = _decode(words, exponents, BLOCK_H)
        else:
            part, missing = _wait_wire(own_slot + r * region_elems, row, hidden, deadline, BLOCK_H)
            failed |= missing
        acc += part
    return _poisoned(acc, failed), failed


@triton.jit
def _store_from_sum(s, residual_ptr, params, y_ptr, h_ptr, steps, row, offs, mask, hidden, eps,
                    HAS_RESIDUAL: tl.constexpr, STEPS: tl.constexpr, BLOCK_H: tl.constexpr):
    """From the decoded sum of a row on the fp8 wire: the rest of the epilogue, h and y (every rank alike)."""
    h = _before_residual(s, params, hidden, eps, STEPS)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _store_h_and_normed(h, params, y_ptr, h_ptr, steps, row, offs, offs, mask, hidden, eps, STEPS, BLOCK_H)


@triton.jit
def _reduce_owned(x_ptr, residual_ptr, y_ptr, h_ptr, steps, peer_ptrs_ptr, own_slot, send_base, params,
                  n_tokens, hidden, region_elems, eps, n_programs, pid, first, last, cols, mask, deadline,
                  failed, RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK_H: tl.constexpr,
                  HAS_RESIDUAL: tl.constexpr, STEPS: tl.constexpr, WIRE: tl.constexpr, SHARDED: tl.constexpr):
    """For the rows among first..last-1 we own: wait for the peers' x, reduce, send the rounded h to all
    (on the fp8 wire: the sum, as codes; RMSNorm's backward of a sharded call: y)."""
    i = first
    while i < last:
        row, owner = _row_and_owner(i, pid, n_programs, n_tokens, WORLD, SHARDED)
        if owner == RANK:
            offs = row.to(tl.int64) * hidden + cols
            own_offs = _own_offs(row, offs, cols, n_tokens, hidden, RANK, WORLD, SHARDED)
            if WIRE:
                acc, failed = _sum_wire_in_rank_order(x_ptr, steps, cols, mask, own_slot, region_elems, row,
                                                      hidden, deadline, failed, RANK, WORLD, BLOCK_H, STEPS)
                words, exponents = _encode(acc, BLOCK_H)
                for r in tl.static_range(WORLD):
                    if r != RANK:
                        _send_wire(_peer_base(peer_ptrs_ptr, r) + send_base, row, hidden, words, exponents,
                                   BLOCK_H)
                _store_from_sum(_decode(words, exponents, BLOCK_H), residual_ptr, params, y_ptr, h_ptr, steps,
                                row, offs, mask, hidden, eps, HAS_RESIDUAL, STEPS, BLOCK_H)
            else:
                if HAS_RESIDUAL:
                    res = tl.load(residual_ptr + own_offs, mask=mask, other=0.0).to(tl.float32)
                acc, failed = _sum_in_rank_order(x_ptr,
                                                 _partial_bits(x_ptr, steps, row, cols, mask, hidden, STEPS),
                                                 own_slot,
                                                 region_elems, offs, mask, deadline, failed, RANK, WORLD,
                                                 BLOCK_H)
                acc = _before_residual(acc, params, hidden, eps, STEPS)
                if HAS_RESIDUAL:
                    acc += res
                if SHARDED and STEPS.NORM_BACKWARD:  # only we hold the row's norm_input and grad_h
                    h, h32 = round_to(acc, h_ptr.dtype.element_ty)
                    tl.store(h_ptr + own_offs, h, mask=mask)
                    y, _ = round_to(_norm_of(h32, params, steps, own_offs, mask, hidden, eps, STEPS),
                                    y_ptr.dtype.element_ty)
                    _send_to_peers(peer_ptrs_ptr, send_base + offs, y.to(tl.int16, bitcast=True), mask, RANK,
                                   WORLD)
                    tl.store(y_ptr + offs, y, mask=mask)
                else:
                    # Peers receive h with -0.0 made +0.0; we keep exactly what they receive.
                    h_bits = _sendable(acc.to(h_ptr.dtype.element_ty).to(tl.int16, bitcast=True))
                    _send_to_peers(peer_ptrs_ptr, send_base + offs, h_bits, mask, RANK, WORLD)
                    _store_h_and_normed(_as_h(h_bits, h_ptr), params, y_ptr, h_ptr, steps, row, offs,
                                        own_offs, mask, hidden, eps, STEPS, BLOCK_H)
        i += 1
    return failed


@triton.jit
def _gather_others(residual_ptr, y_ptr, h_ptr, steps, own_slot, params, n_tokens, hidden, region_elems, eps,
                   n_programs, pid, first, last, cols, mask, deadline, failed, WORLD: tl.constexpr,
                   RANK: tl.constexpr, BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STEPS: tl.constexpr,
                   WIRE: tl.constexpr, SHARDED: tl.constexpr):
    """For the rows among first..last-1 others own: wait for the owner's h (on the fp8 wire: its sum),
    then store h and y; in a sharded call y alone (RMSNorm's backward: the owner's y, as it came)."""
    i = first
    while i < last:
        row, owner = _row_and_owner(i, pid, n_programs, n_tokens, WORLD, SHARDED)
        if owner != RANK:
            offs = row.to(tl.int64) * hidden + cols
            if WIRE:
                s, missing = _wait_wire(own_slot + owner * region_elems, row, hidden, deadline, BLOCK_H)
                failed |= missing
                _store_from_sum(_poisoned(s, failed), residual_ptr, params, y_ptr, h_ptr, steps, row, offs,
                                mask, hidden, eps, HAS_RESIDUAL, STEPS, BLOCK_H)
            else:
                h_bits, missing = _wait_row(own_slot + owner * region_elems + offs, mask, deadline)
                failed |= missing
                h_bits = tl.where(failed > 0, _nan_bits(h_ptr), h_bits)  # as _poisoned, for words
                if not SHARDED:
                    _store_h_and_normed(_as_h(h_bits, h_ptr), params, y_ptr, h_ptr, steps, row, offs, offs,
                                        mask, hidden, eps, STEPS, BLOCK_H)
                elif STEPS.NORM_BACKWARD:
                    tl.store(y_ptr + offs, h_bits.to(y_ptr.dtype.element_ty, bitcast=True), mask=mask)
                else:
                    _store_normed(_as_h(h_bits, h_ptr).to(tl.float32), params, y_ptr, steps, row, offs, offs,
                                  mask, hidden, eps, STEPS, BLOCK_H)
        i += 1
    return failed


@triton.jit
def _twoshot_allreduce_add_rmsnorm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    y_ptr,
    h_ptr,
    steps,
    peer_ptrs_ptr,
    state_ptr,
    n_tokens,
    hidden,
    region_elems,
    eps,
    wait_limit,
    group_rows,
    RANK: tl.constexpr,
    WORLD: tl.constexpr,
    BLOCK_H: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    STEPS: tl.constexpr,
    USE_PDL: tl.constexpr,
    DEADLINE_GIVEN: tl.constexpr,
    DESC_FLAGS: tl.constexpr,
    GROUPED: tl.constexpr,
    WIRE: tl.constexpr,
    SHARDED: tl.constexpr,
):
    hidden = _multiple_of_8(hidden)  # both checked by call_constexprs
    region_elems = _multiple_of_8(region_elems)
    call, slot, slot_base, prev_slot, prev_extent = _slots(state_ptr, region_elems, WORLD, USE_PDL)
    pid = tl.program_id(0)
    n_programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    own = _peer_base(peer_ptrs_ptr, RANK)
    desc, desc_slot = _descriptors(peer_ptrs_ptr, slot, region_elems, n_tokens, hidden, call, pid, RANK,
                                   WORLD, DESC_FLAGS)
    own_slot = own + slot_base
    send_base = slot_base + RANK * region_elems  # where our words go in a peer's slot
    my_rows = (n_tokens - pid + n_programs - 1) // n_programs  # rows pid, pid + programs, ...

    # A program takes its rows in groups of group_rows (GROUPED): it scatters group g + 1 before it
    # reduces and gathers group g, so its next rows are on the wire while it works on local memory.
    # Every wait of group g is for words the same program of a peer sent before its own waits of
    # group g: no deadlock. Not grouped: scatter all, reduce all, gather all.
    first = 0
    last = my_rows
    if GROUPED:
        last = tl.minimum(group_rows, my_rows)
    _scatter(x_ptr, steps, peer_ptrs_ptr, send_base, n_tokens, hidden, pid, n_programs, first, last, cols,
             mask, RANK, WORLD, WIRE, BLOCK_H, STEPS, SHARDED)
    _clear_slot(own, prev_slot, region_elems, prev_extent, pid, n_programs, cols, RANK, WORLD, BLOCK_H)

    params = _load_params(weight_ptr, steps, cols, mask, n_tokens, STEPS)
    deadline = _start_clock(wait_limit, DEADLINE_GIVEN)
    deadline, failed = _check_peers(desc, own, desc_slot, state_ptr, deadline, RANK, WORLD)
    while first < my_rows:
        after = my_rows
        if GROUPED:
            after = tl.minimum(last + group_rows, my_rows)
            _scatter(x_ptr, steps, peer_ptrs_ptr, send_base, n_tokens, hidden, pid, n_programs, last, after,
                     cols, mask, RANK, WORLD, WIRE, BLOCK_H, STEPS, SHARDED)
        failed = _reduce_owned(x_ptr, residual_ptr, y_ptr, h_ptr, steps, peer_ptrs_ptr, own_slot, send_base,
                               params, n_tokens, hidden, region_elems, eps, n_programs, pid, first, last,
                               cols, mask, deadline, failed, RANK, WORLD, BLOCK_H, HAS_RESIDUAL, STEPS, WIRE,
                               SHARDED)
        failed = _gather_others(residual_ptr, y_ptr, h_ptr, steps, own_slot, params, n_tokens, hidden,
                                region_elems, eps, n_programs, pid, first, last, cols, mask, deadline, failed,
                                WORLD, RANK, BLOCK_H, HAS_RESIDUAL, STEPS, WIRE, SHARDED)
        first = last
        last = after
    _finish_call(state_ptr, call, slot, n_tokens, hidden, desc, failed, n_programs, True)


#: ``group_rows`` that takes all of a program's rows as one group: scatter all, reduce all, gather all.
ALL_ROWS = 0
#: Rows a program scatters ahead by default. On 2 x H200 groups of 4 rows made 2048-8192 tokens
#: 6-18% shorter than one group (8192 x 4096: 257.5 -> 228.9 us), groups of 2 and 8 no better; at 1024
#: tokens the difference is within 4% either way (docs/kernel-notes.md).
GROUP_ROWS = 4


def twoshot_allreduce_add_rmsnorm(ctx: LaunchContext, call: FusedCall, group_rows: int = GROUP_ROWS,
                                  wire: bool = False, max_warps: int = MAX_WARPS) -> None:
    """Launch the two-shot kernel for ``call``: writes its outputs. Same contract as the one-shot launcher.

    ``group_rows``: rows a program scatters ahead of the ones it reduces and gathers; programs with
    no more rows than that, and :data:`ALL_ROWS`, take all of their rows as one group. ``wire``: the
    fp8 wire (``kernels/wire.py``; hidden a multiple of 128). ``max_warps``: 32 gives rows of 8192 one
    16-byte access a thread per tensor (one H200 without a peer: 4096 x 8192 in 78.9 instead of 94.3 us;
    docs/kernel-notes.md); the default stays until two GPUs measure it.
    """
    launch(twoshot_plan(ctx, call, group_rows, wire, max_warps), call)


def twoshot_plan(ctx: LaunchContext, call: FusedCall, group_rows: int = GROUP_ROWS, wire: bool = False,
                 max_warps: int = MAX_WARPS) -> LaunchPlan:
    """The two-shot's launch plan for calls of ``call``'s kind (kept in ``ctx``): ``launch(plan, call)``."""
    return kept_plan(ctx.plans, ("twoshot", group_rows, wire, max_warps, call.n_tokens, call.kernel_key()),
                     _twoshot_plan, ctx, call, group_rows, wire, max_warps)


def _twoshot_plan(ctx: LaunchContext, call: FusedCall, group_rows: int, wire: bool,
                  max_warps: int) -> LaunchPlan:
    n_tokens, hidden = call.n_tokens, call.hidden
    assert not wire or wire_supported(hidden), hidden
    # The wire sends the sum before the residual, which only a sharded row's owner holds.
    assert not (wire and call.sharded) and (not call.sharded or n_tokens % ctx.world_size == 0), n_tokens
    block_h, num_warps, use_pdl = launch_config(hidden, call.x.device, max_warps=max_warps)
    programs = min(n_tokens, ctx.max_programs)
    return LaunchPlan(
        _twoshot_allreduce_add_rmsnorm_kernel, programs, call_scalars(ctx, call, (group_rows,)),
        dict(RANK=ctx.rank, WORLD=ctx.world_size, BLOCK_H=block_h, USE_PDL=use_pdl,
             **call_constexprs(ctx, call, twoshot=True, wire=wire),
             GROUPED=group_rows != ALL_ROWS and n_tokens > group_rows * programs, WIRE=wire,
             SHARDED=call.sharded),
        dict(num_warps=num_warps, launch_pdl=use_pdl), workspace_tensors(ctx))
