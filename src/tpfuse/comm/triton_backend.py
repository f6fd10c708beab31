"""The Triton backend: tpfuse's one-shot and two-shot kernels over a peer-mapped workspace."""

from __future__ import annotations

import functools
import logging
from typing import Callable

import torch
import torch.distributed as dist

from tpfuse import select
from tpfuse.blockend.call import FusedCall, explain_descriptor
from tpfuse.comm import workspace as ws
from tpfuse.comm.backend import FusedBackend
from tpfuse.kernels import layout
from tpfuse.kernels.launch import launch
from tpfuse.kernels.oneshot import oneshot_plan
from tpfuse.kernels.twoshot import twoshot_plan
from tpfuse.kernels.wire import wire_supported

log = logging.getLogger(__name__)

# Programs per kernel launch on the CPU interpreter: few, so tests cover programs with several rows.
CPU_MAX_PROGRAMS = 4


class TritonBackend(FusedBackend):
    """Our kernels: a workspace of ``region_elems`` 16-bit words a rank a slot (collective to create).

    Attributes
    ----------
    workspace : tpfuse.kernels.layout.Workspace
        The buffers the kernels push into (tests and benchmarks read them).
    launch : tpfuse.kernels.layout.LaunchContext
        What every launch takes besides the call's tensors.
    fp8_wire : bool
        Two-shot calls send fp8 (``tpfuse.kernels.wire``) where the hidden size allows.
    """

    name = "triton"
    compares_calls = True  # every call exchanges descriptors (docs/reliability.md)
    shards_rows = True

    def __init__(self, group: dist.ProcessGroup, device: torch.device, region_elems: int,
                 wait_timeout_s: float, fp8_wire: bool = False):
        self.workspace = ws.allocate(group, region_elems, device)
        self.fp8_wire = fp8_wire
        programs = (torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda"
                    else CPU_MAX_PROGRAMS)
        # Kernel grids must match across ranks: agree on the smallest count once, here.
        agreed = torch.tensor([programs], dtype=torch.int64, device=device)
        dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
        self.launch = layout.LaunchContext(self.workspace, dist.get_rank(group), dist.get_world_size(group),
                                           int(agreed.item()), 0)
        self.set_wait_timeout(wait_timeout_s)
        log.info("tpfuse: group %s rank %d: workspace of %d bytes per rank region",
                 group.group_name, self.launch.rank, self.workspace.region_bytes)

    @property
    def region_bytes(self) -> int:
        return self.workspace.region_bytes if self.workspace is not None else 0

    def run(self, algorithm: str, call: FusedCall) -> None:
        self.launcher(algorithm, call)(call)

    def launcher(self, algorithm: str, call: FusedCall) -> Callable[[FusedCall], None]:
        if algorithm == select.ONESHOT:
            plan = oneshot_plan(self.launch, call)
        else:
            # The fp8 wire sends the sum before the residual, which only a sharded row's owner holds.
            plan = twoshot_plan(self.launch, call,
                                wire=self.fp8_wire and wire_supported(call.hidden) and not call.sharded)
        return functools.partial(launch, plan)

    def set_wait_timeout(self, seconds: float) -> None:
        self.launch.wait_limit_ns = int(seconds * 1e9)

    def failure(self, wait_timeout_s: float, waited_s: float | None) -> str | None:
        if self.workspace is None:
            return None
        state = self.workspace.state.tolist()
        failed_call = state[layout.STATE_ERROR]
        if not failed_call:
            return None
        own = state[layout.STATE_ERROR_OWN:layout.STATE_ERROR_OWN + layout.DESC_WORDS]
        peer = state[layout.STATE_ERROR_PEER] - 1
        if peer >= 0:
            seen = state[layout.STATE_ERROR_SEEN:layout.STATE_ERROR_SEEN + layout.DESC_WORDS]
            return (f"fused call #{failed_call} ({explain_descriptor(own, seen)}) does not match rank "
                    f"{peer}'s call ({explain_descriptor(seen, own)}): every rank must make the same "
                    "calls in the same order")
        waited = wait_timeout_s if waited_s is None else waited_s
        return (f"fused call #{failed_call} ({explain_descriptor(own)}) gave up after waiting "
                f"{waited:.3g} s for a peer (wait_timeout_s={wait_timeout_s:g}): a rank stalled or died, or "
                "made no fused call (a reference-path call, say)")

    def release(self) -> None:
        if self.workspace is not None:
            self.workspace.release()
        self.workspace = None
