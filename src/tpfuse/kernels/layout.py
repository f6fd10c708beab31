"""The workspace's layout: what the kernels and the host that allocates the buffers agree on.

A rank's buffer holds ``NUM_SLOTS`` slots, each with one region of ``region_elems`` 16-bit words per
rank, and after them one call descriptor of ``DESC_WORDS`` words per slot and rank (what each peer
says its call is: ``blockend.bits.describe_call``); a word nobody has written since it was last cleared holds
``SENTINEL``. A small private state vector (int32, ``STATE_LEN`` entries at the ``STATE_*``
positions) rotates the slots and records a call that failed: a wait that ran out, or a peer whose
call differs. ``tpfuse.comm.workspace`` allocates buffers of this layout; the kernels
(``protocol.py``) read it through these names only.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tpfuse.blockend.bits import DESC_WORDS
from tpfuse.select import MAX_KERNEL_HIDDEN

#: -0.0 in bf16 and fp16: marks a word nobody has written since it was last cleared.
SENTINEL = -32768
NUM_SLOTS = 3
# state vector layout (int32): the kernel and the host agree on these positions.
STATE_CALL = 0  # calls completed: selects the slot (call % NUM_SLOTS)
STATE_ARRIVED = 1  # programs of the running call that have finished
STATE_EXTENT = 2  # NUM_SLOTS entries: elements per rank written into each slot by its last call
STATE_ERROR = 5  # 0, or the number (1-based) of a call that failed
STATE_ERROR_PEER = 6  # 0 when it failed by a wait that ran out; 1 + the rank whose call differed
STATE_ERROR_OWN = 7  # DESC_WORDS entries: the failed call's descriptor
STATE_ERROR_SEEN = STATE_ERROR_OWN + DESC_WORDS  # DESC_WORDS entries: the differing peer's descriptor
STATE_LEN = STATE_ERROR_SEEN + DESC_WORDS

#: Words after the descriptors that nothing writes: on AMD a wait reads a row's whole block of
#: columns, masked lanes too (``vendor.load_polled``), so the last row of the last region reads up to
#: a block of the largest hidden size past it.
POLL_REACH = MAX_KERNEL_HIDDEN


def buffer_elems(region_elems: int, world_size: int) -> int:
    """16-bit words of one rank's buffer: the slots' regions, then the descriptors, then
    :data:`POLL_REACH` words of room."""
    return NUM_SLOTS * world_size * (region_elems + DESC_WORDS) + POLL_REACH


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
