"""The workspace's layout: what the kernels and the host that allocates the buffers agree on.

A rank's buffer holds ``NUM_SLOTS`` slots, each with one region of ``region_elems`` 16-bit words per
rank, and after them one call descriptor of ``DESC_WORDS`` words per slot and rank (what each peer
says its call is: see ``describe_call``); a word nobody has written since it was last cleared holds
``SENTINEL``. A small private state vector (int32, ``STATE_LEN`` entries at the ``STATE_*``
positions) rotates the slots and records a call that failed: a wait that ran out, or a peer whose
call differs. ``tpfuse.comm.workspace`` allocates buffers of this layout; the kernels
(``protocol.py``) read it through these names only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpfuse.select import MAX_KERNEL_HIDDEN

#: -0.0 in bf16 and fp16: marks a word nobody has written since it was last cleared.
SENTINEL = -32768
NUM_SLOTS = 3
#: Words of a call descriptor: one 16-byte access. Every word is in 0..32767, never the sentinel.
DESC_WORDS = 8
# state vector layout (int32): the kernel and the host agree on these positions.
STATE_CALL = 0  # calls completed: selects the slot (call % NUM_SLOTS)
STATE_ARRIVED = 1  # programs of the running call that have finished
STATE_EXTENT = 2  # NUM_SLOTS entries: elements per rank written into each slot by its last call
STATE_ERROR = 5  # 0, or the number (1-based) of a call that failed
STATE_ERROR_PEER = 6  # 0 when it failed by a wait that ran out; 1 + the rank whose call differed
STATE_ERROR_OWN = 7  # DESC_WORDS entries: the failed call's descriptor
STATE_ERROR_SEEN = STATE_ERROR_OWN + DESC_WORDS  # DESC_WORDS entries: the differing peer's descriptor
STATE_LEN = STATE_ERROR_SEEN + DESC_WORDS

#: Bits of a descriptor's flags word. Bits from 15 on travel in the descriptor's last word, above the
#: region's top bit (``describe_call``).
FLAG_BF16, FLAG_FP16, FLAG_RESIDUAL, FLAG_TWOSHOT = 1, 2, 4, 16
#: A float32 call: only the host compares such calls (the reference path); no kernel takes one.
FLAG_FP32 = 8
#: Epilogue bits (``kernels.block_end.Epilogue.flags``).
FLAG_BIAS, FLAG_SUM_NORM, FLAG_LAYER_NORM, FLAG_NORM_BIAS = 32, 64, 128, 256
#: The two-shot's fp8 wire (``kernels.wire``).
FLAG_FP8_WIRE = 2048
#: A plain all-reduce: the call ends at h (``Epilogue.normed`` False).
FLAG_NO_NORM = 4096
#: A MoE finalize before the sum (``Epilogue.experts`` / ``topk_weights`` / ``shared_expert``, x [T, K, H]),
#: and what it is beyond that: ranks that differ in its weights, its shared expert or its K (the experts a
#: token, ``FLAGS_EXPERTS``: bits 24-28) make calls that differ.
FLAG_MOE_FINALIZE = 8192
FLAG_TOPK_WEIGHTS, FLAG_SHARED_EXPERT = 512, 1024
#: The norm's output beside a quantised y (``Epilogue.normed_copy``).
FLAG_NORMED_COPY = 1 << 14
#: The output format (``kernels.outputs``: a code a format and variant, bits 15-18) and dynamic fp8's group
#: size (log2 - 2, bits 19-22; 0 for one scale a token).
OUTPUT_SHIFT, SCALE_GROUP_SHIFT = 15, 19
FLAGS_OUTPUT, FLAGS_SCALE_GROUP = 0xF << OUTPUT_SHIFT, 0xF << SCALE_GROUP_SHIFT
EXPERTS_SHIFT = 24
#: The largest K the descriptor holds: its flags end at bit 28 (15 bits in word 3, 14 beside the region's
#: top bit in the last word). Bit 23 is free.
MAX_EXPERTS = 31
FLAGS_EXPERTS = MAX_EXPERTS << EXPERTS_SHIFT
#: The last bit a descriptor carries.
MAX_FLAG_BIT = 28
_FLAG_WORDS = ((FLAG_BIAS, "bias"), (FLAG_SUM_NORM, "post-norm"), (FLAG_LAYER_NORM, "LayerNorm"),
               (FLAG_NORM_BIAS, "norm bias"), (FLAG_FP8_WIRE, "fp8 wire"),
               (FLAG_NO_NORM, "no norm"), (FLAG_MOE_FINALIZE, "MoE finalize"),
               (FLAGS_EXPERTS, lambda flags: f"{(flags & FLAGS_EXPERTS) >> EXPERTS_SHIFT} experts a token"),
               (FLAG_TOPK_WEIGHTS, "topk_weights"), (FLAG_SHARED_EXPERT, "shared expert"),
               (FLAG_NORMED_COPY, "a copy of the norm's output"))


#: Words after the descriptors that nothing writes: on AMD a wait reads a row's whole block of
#: columns, masked lanes too (``vendor.load_polled``), so the last row of the last region reads up to
#: a block of the largest hidden size past it.
POLL_REACH = MAX_KERNEL_HIDDEN


def buffer_elems(region_elems: int, world_size: int) -> int:
    """16-bit words of one rank's buffer: the slots' regions, then the descriptors, then
    :data:`POLL_REACH` words of room."""
    return NUM_SLOTS * world_size * (region_elems + DESC_WORDS) + POLL_REACH


def describe_call(n_tokens: int, hidden: int, flags: int, call: int, region_elems: int) -> list[int]:
    """The descriptor words of a call, as the kernels write them (``protocol._describe_call``).

    Tokens (< 2**30) and the region (< 2**31 words) span two and three 15-bit words; the call's number
    is kept modulo 2**15 (a peer is never more than one call apart). The flags' low 15 bits have a word
    of their own, the rest share the last word with the region's top bit.
    """
    return [n_tokens & 0x7FFF, (n_tokens >> 15) & 0x7FFF, hidden & 0x7FFF, flags & 0x7FFF, call & 0x7FFF,
            region_elems & 0x7FFF, (region_elems >> 15) & 0x7FFF,
            ((region_elems >> 30) & 1 | (flags >> 15) << 1) & 0x7FFF]


def call_flags(dtype: torch.dtype, has_residual: bool) -> int:
    """A call's flags word less the block end's bits (``Epilogue.flags``) and the algorithm's."""
    kind = FLAG_BF16 if dtype == torch.bfloat16 else FLAG_FP16 if dtype == torch.float16 else FLAG_FP32
    return kind | (FLAG_RESIDUAL if has_residual else 0)


def explain_flags(flags: int) -> str:
    """A flags word as words: ``bfloat16, residual, MoE finalize, 3 experts a token, topk_weights``."""
    dtype = "bfloat16" if flags & FLAG_BF16 else "float16" if flags & FLAG_FP16 else "float32" \
        if flags & FLAG_FP32 else "?"
    from tpfuse.kernels.outputs import explain_code  # the output formats build on this module

    return ", ".join([dtype, "residual" if flags & FLAG_RESIDUAL else "no residual"]
                     + [word if isinstance(word, str) else word(flags) for bits, word in _FLAG_WORDS if flags & bits]
                     + explain_code(flags))


def explain_descriptor(words: list[int], other: list[int] | None = None) -> str:
    """A descriptor as a reader wants it: ``5 x 512 bfloat16 oneshot, residual``; the call's number and
    the workspace's region are added where they differ from ``other``'s."""
    def tokens(w):
        return w[0] | w[1] << 15

    def region(w):
        return w[5] | w[6] << 15 | (w[7] & 1) << 30

    flags = words[3] | (words[7] >> 1) << 15
    dtype, *steps = explain_flags(flags).split(", ")
    parts = [f"{tokens(words)} x {words[2]} {dtype} {'twoshot' if flags & FLAG_TWOSHOT else 'oneshot'}", *steps]
    if other is not None and other[4] != words[4]:
        parts.append(f"its call #{words[4] + 1} (mod 32768)")
    if other is not None and region(other) != region(words):
        parts.append(f"a workspace region of {region(words)} words")
    return ", ".join(parts)


class Workspace:
    """One rank's view of the peer-mapped buffers of a group.

    Attributes
    ----------
    region_elems : int
        16-bit words one rank may send per call (its region in every peer's slot).
    buffer : torch.Tensor
        int16 [buffer_elems(region_elems, world_size)]: this rank's own buffer, which peers write into.
    peer_ptrs : torch.Tensor
        int64 [world_size] addresses of every rank's buffer, on the communicator's device.
    state : torch.Tensor
        int32 [STATE_LEN] slot-rotation state, private to this rank, on the device.
    """

    def __init__(self, region_elems: int, buffer: torch.Tensor, peer_ptrs: torch.Tensor, state: torch.Tensor,
                 keep_alive: list):
        self.region_elems = region_elems
        self.world_size = peer_ptrs.numel()
        self.buffer = buffer
        self.peer_ptrs = peer_ptrs
        self.state = state
        self._keep_alive = keep_alive  # the mapped tensors / symmetric buffers behind peer_ptrs

    @property
    def region_bytes(self) -> int:
        return self.region_elems * 2

    def regions(self) -> torch.Tensor:
        """int16 [NUM_SLOTS, world_size, region_elems] view of this rank's buffer: who wrote what where."""
        return self.buffer[:NUM_SLOTS * self.world_size * self.region_elems].view(
            NUM_SLOTS, self.world_size, self.region_elems)

    def descriptors(self) -> torch.Tensor:
        """int16 [NUM_SLOTS, world_size, DESC_WORDS] view of the call descriptors peers sent us."""
        start = NUM_SLOTS * self.world_size * self.region_elems
        return self.buffer[start:start + NUM_SLOTS * self.world_size * DESC_WORDS].view(
            NUM_SLOTS, self.world_size, DESC_WORDS)

    def release(self) -> None:
        self._keep_alive.clear()
        self.buffer = None
        self.peer_ptrs = None
        self.state = None


@dataclass
class LaunchContext:
    """What every launch of a group's kernels takes from its communicator, besides the call's tensors."""

    workspace: Workspace
    rank: int
    world_size: int
    max_programs: int  # programs a launch may use: the same on every rank, all resident at once
    wait_limit_ns: int  # the bound of every wait for a peer, from the start of a launch
    #: The launchers' kept decisions, one ``kernels.launch.LaunchPlan`` per kind of call.
    plans: dict = field(default_factory=dict, repr=False)
