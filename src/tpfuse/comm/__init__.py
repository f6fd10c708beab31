"""Communicators: one per process group, owning the peer-mapped workspace the kernels use."""

from tpfuse.comm.communicator import (
    Communicator,
    check_errors,
    destroy_all,
    get_communicator,
    lookup_communicator,
    resolve_group,
)

__all__ = [
    "Communicator",
    "check_errors",
    "destroy_all",
    "get_communicator",
    "lookup_communicator",
    "resolve_group",
]
