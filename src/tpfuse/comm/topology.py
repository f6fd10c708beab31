"""Whether the ranks of a group can map each other's memory: the fused kernels' precondition.

The kernels store into peers' buffers directly, so every rank must reach every other rank's memory:
all on one host, and (GPUs) every pair with peer access. A tensor-parallel group across nodes, or GPUs
without peer access, cannot; such a group is found when its communicator is set up, every rank comes to
the same answer (it is computed from what all ranks report), rank 0 says why once in the log, and the
group's calls take the reference path (its own all-reduce): never an abort, a hang or an error at the
first call.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import socket

import torch
import torch.distributed as dist

from tpfuse.comm import agreement

log = logging.getLogger(__name__)


@functools.cache
def host_name() -> str:
    """This host as peers must see it to map our memory: its name and this boot of it."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def _host_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:7], "little")


def unreachable_peers(group: dist.ProcessGroup, device: torch.device, timeout_s: float | None) -> str | None:
    """Why the ranks of ``group`` cannot map each other's memory, or None when they can (collective).

    Every rank returns the same answer. Rank 0 logs the reason once (WARNING).
    """
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    index = device.index if device.type == "cuda" and device.index is not None else (
        torch.cuda.current_device() if device.type == "cuda" else -1)
    mine = torch.tensor([_host_key(host_name()), index], dtype=torch.int64, device=device)
    gathered = agreement.all_gather(mine, group, timeout_s,
                                    f"the topology check of group {group.group_name!r}")
    hosts = [int(t[0]) for t in gathered]
    indices = [int(t[1]) for t in gathered]
    reason = None
    if len(set(hosts)) > 1:
        by_host: dict[int, list[int]] = {}
        for r, h in enumerate(hosts):
            by_host.setdefault(h, []).append(r)
        reason = (f"its {world} ranks are on {len(by_host)} hosts (ranks "
                  + "; ".join(", ".join(map(str, ranks)) for ranks in by_host.values()) + ")")
    elif device.type == "cuda":
        # Each rank checks its own GPU's access to the others'; the ranks then agree on the worst.
        missing = sum(1 for r in range(world) if r != rank and indices[r] != index
                      and not torch.cuda.can_device_access_peer(index, indices[r]))
        count = torch.tensor([missing], dtype=torch.int64, device=device)
        agreement.all_reduce(count, group, timeout_s, f"the peer-access check of group {group.group_name!r}")
        if int(count.item()):
            reason = f"{int(count.item())} pairs of its GPUs have no peer access"
    if reason is not None and rank == 0:
        log.warning("tpfuse: group %r: %s, so the ranks cannot map each other's memory; its fused calls take "
                    "the reference path (the group's own all-reduce)", group.group_name, reason)
    return reason
