"""The workspace's layout: what the kernels and the host that allocates the buffers agree on.

A rank's buffer holds ``NUM_SLOTS`` slots, each with one region of ``region_elems`` 16-bit words per
rank; a word nobody has written since it was last cleared holds ``SENTINEL``. A small private
state vector (int32, ``STATE_LEN`` entries at the ``STATE_*`` positions) rotates the slots and
records a wait that ran out. ``tpfuse.comm.workspace`` allocates buffers of this layout; the kernels
(``protocol.py``) read it through these names only.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: -0.0 in bf16 and fp16: marks a word nobody has written since it was last cleared.
SENTINEL = -32768
NUM_SLOTS = 3
# state vector layout (int32): the kernel and the host agree on these positions.
STATE_CALL = 0  # calls completed: selects the slot (call % NUM_SLOTS)
STATE_ARRIVED = 1  # programs of the running call that have finished
STATE_EXTENT = 2  # NUM_SLOTS entries: elements per rank written into each slot by its last call
STATE_ERROR = 5  # 0, or the number (1-based) of a call whose wait for a peer ran out
STATE_ERROR_TOKENS = 6  # that call's token count
STATE_ERROR_HIDDEN = 7  # and hidden size
STATE_LEN = 8


class Workspace:
    """One rank's view of the peer-mapped buffers of a group.

    Attributes
    ----------
    region_elems : int
        16-bit words one rank may send per call (its region in every peer's slot).
    peer_ptrs : torch.Tensor
        int64 [world_size] addresses of every rank's buffer, on the communicator's device.
    state : torch.Tensor
        int32 [STATE_LEN] slot-rotation state, private to this rank, on the device.
    """

    def __init__(self, region_elems: int, peer_ptrs: torch.Tensor, state: torch.Tensor, keep_alive: list):
        self.region_elems = region_elems
        self.peer_ptrs = peer_ptrs
        self.state = state
        self._keep_alive = keep_alive  # the mapped tensors / symmetric buffers behind peer_ptrs

    @property
    def region_bytes(self) -> int:
        return self.region_elems * 2

    def release(self) -> None:
        self._keep_alive.clear()
        self.peer_ptrs = None
        self.state = None


@dataclass
class LaunchContext:
    """What every launch of a group's kernels takes from its communicator, besides the call's tensors."""

    workspace: Workspace
    rank: int
    world_size: int
    max_programs: int  # programs a launch may use: the same on every rank, all resident at once
    wait_limit: int  # the bound of every wait for a peer: ns on a GPU, polls on the CPU (wait_limit_for)
