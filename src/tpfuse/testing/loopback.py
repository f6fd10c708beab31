"""A group's ranks in one process on one GPU, behind the real communicator and op: for measuring the
op's whole eager path (checks, plan, launch) where only one GPU is lent.

:func:`loopback_communicator` registers, for a process group of one rank, a communicator that acts as
rank ``r`` of a larger group whose every rank lives in this process (the buffers of
:func:`tpfuse.testing.local_launch_contexts`). The op then takes its fused path for that group as on
real ranks; the caller launches the other ranks' kernels itself (on streams of their own), or the
op's call waits for them until its bound and fails.
"""

from __future__ import annotations

import torch.distributed as dist

from tpfuse.comm import communicator as registry
from tpfuse.comm.communicator import Communicator
from tpfuse.comm.triton_backend import TritonBackend
from tpfuse.kernels.layout import LaunchContext


class _LoopbackBackend(TritonBackend):
    """Our kernels over buffers that are all in this process (no collective set-up)."""

    def __init__(self, context: LaunchContext):
        self.workspace = context.workspace
        self.launch = context
        self.fp8_wire = False

    def set_wait_timeout(self, seconds: float) -> None:
        pass  # the context's own bound (local_launch_contexts keeps it in 32 bits)

    def release(self) -> None:
        self.workspace = None  # the buffers belong to the caller


class _LoopbackCommunicator(Communicator):
    def __init__(self, group: dist.ProcessGroup, context: LaunchContext):
        self._context = context
        super().__init__(group, 1, 8, "triton")

    def _allocate_backend(self, max_tokens: int, hidden: int) -> None:
        self.rank, self.world_size = self._context.rank, self._context.world_size
        self.fused_backend = _LoopbackBackend(self._context)


def loopback_communicator(group: dist.ProcessGroup, context: LaunchContext) -> Communicator:
    """Register for ``group`` (one rank) a communicator that is ``context``'s rank of its group.

    Destroy it (``comm.destroy()``) to unregister it. Raises if ``group`` already has a communicator.
    """
    if dist.get_world_size(group) != 1:
        raise ValueError("tpfuse: a loopback communicator stands in for a group of one process")
    with registry._registry_lock:
        if group.group_name in registry._registry:
            raise ValueError(f"tpfuse: group {group.group_name!r} already has a communicator")
        comm = registry._registry[group.group_name] = _LoopbackCommunicator(group, context)
    return comm
