"""What bounds a one-token call from below, measured with the same tools: the ``floor`` and ``launch``
providers of ``bench kernel`` (issue 17).

- ``launch``: an empty Triton kernel, launched as ours are (same warps, PDL where we use it): what any
  kernel costs a call.
- ``floor``: one exchange with every peer and nothing else, on the grid of a one-token call's reducing
  program: each rank stores a 16-bit counter into every peer's buffer and polls its own until every
  peer's counter of this call has arrived (bounded as our kernels' waits are). A one-token fused call
  cannot cost much less than this plus loading its row and the norm.

Both return no output (nothing to check against float64); ``bench kernel`` times them beside the rest.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from tpfuse.kernels.protocol import _peer_base, launch_config
from tpfuse.kernels.vendor import load_polled, now, pdl_start, store_shared
from tpfuse.targets import wait_ticks

# Each rank's counter sits at its own 16-byte word group of a peer's buffer.
_STRIDE = tl.constexpr(8)


@triton.jit
def _launch_only_kernel(USE_PDL: tl.constexpr):
    pdl_start(USE_PDL)


@triton.jit
def _ping_pong_kernel(peer_ptrs_ptr, state_ptr, wait_limit, RANK: tl.constexpr, WORLD: tl.constexpr,
                      USE_PDL: tl.constexpr):
    """Send this call's counter (1..32767, then 0: never the -32768 a buffer starts with) to every peer,
    then wait for every peer's. A peer may already be one call ahead (it needed only our counter to
    finish this call) and have overwritten its counter with the next: that one counts as arrived too.
    ``state_ptr``: [calls made, calls whose wait ran out]."""
    pdl_start(USE_PDL)
    calls = tl.load(state_ptr)
    counter = ((calls + 1) & 0x7FFF).to(tl.int16)
    ahead = ((calls + 2) & 0x7FFF).to(tl.int16)
    for r in tl.static_range(WORLD):
        if r != RANK:
            store_shared(_peer_base(peer_ptrs_ptr, r) + RANK * _STRIDE, counter)
    own = _peer_base(peer_ptrs_ptr, RANK)
    deadline = now() + wait_limit
    missing = 0
    for r in tl.static_range(WORLD):
        if r != RANK:
            one = tl.arange(0, 1)
            seen = tl.max(load_polled(own + r * _STRIDE + one, one < 1), axis=0)
            while (seen != counter) & (seen != ahead) & (now() < deadline):
                seen = tl.max(load_polled(own + r * _STRIDE + one, one < 1), axis=0)
            missing |= ((seen != counter) & (seen != ahead)).to(tl.int32)
    tl.store(state_ptr, calls + 1)
    tl.store(state_ptr + 1, tl.load(state_ptr + 1) + missing)


class FloorKernels:
    """The buffers of the ``floor`` exchange (collective to create) and both providers' launches."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device, wait_timeout_s: float = 10.0):
        from tpfuse.comm import workspace as ws

        # A workspace of its own: the exchange never touches the communicator's slots.
        self.workspace = ws.allocate(group, 8, device)
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.state = torch.zeros(2, dtype=torch.int32, device=device)
        self.device = device
        self.wait_ticks = wait_ticks(device, wait_timeout_s)  # in ticks of vendor.now

    def floor(self, hidden: int) -> None:
        """One exchange with every peer, launched as a one-token call of ``hidden`` is."""
        _, num_warps, use_pdl = launch_config(hidden, self.device)
        _ping_pong_kernel[(1,)](self.workspace.peer_ptrs, self.state, self.wait_ticks, RANK=self.rank,
                                WORLD=self.world, USE_PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl)

    def launch(self, hidden: int) -> None:
        """An empty kernel, launched as a one-token call of ``hidden`` is."""
        _, num_warps, use_pdl = launch_config(hidden, self.device)
        _launch_only_kernel[(1,)](USE_PDL=use_pdl, num_warps=num_warps, launch_pdl=use_pdl)

    def counts(self) -> tuple[int, int]:
        """(exchanges made, exchanges whose wait ran out) on this rank."""
        calls, failed = self.state.tolist()
        return calls, failed

    def release(self) -> None:
        self.workspace.release()
