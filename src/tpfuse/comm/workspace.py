"""Peer-mapped buffers the kernels push into: torch symmetric memory on CUDA, shared files on CPU.

Each rank owns one buffer of ``layout.buffer_elems`` 16-bit words (the slots, then the call
descriptors), filled with the sentinel, plus a small private state vector the kernels use to rotate
slots. Every rank holds a table of the device addresses of all ranks' buffers (``peer_ptrs``):
kernels reach peers only through it, never through tensor arguments (the Triton interpreter copies
tensor arguments back after a launch, which would overwrite what peers wrote meanwhile).
"""

from __future__ import annotations

import glob
import os
import re
import uuid
import warnings

import torch
import torch.distributed as dist

from tpfuse.kernels.layout import SENTINEL, STATE_LEN, Workspace, buffer_elems

SHM_DIR = "/dev/shm"
SHM_PREFIX = "tpfuse-"
#: A workspace file's name: ``tpfuse-<group token>-r<rank>-p<pid>`` (:func:`allocate_shared_files`).
SHM_NAME = re.compile(re.escape(SHM_PREFIX) + r"[0-9a-f]{12}-r\d+-p\d+")


def _buffer_elems(region_elems: int, world_size: int) -> int:
    total = buffer_elems(region_elems, world_size)
    if total >= 2**31:  # the kernels index buffers with 32-bit slot offsets
        raise ValueError(f"workspace of {total} words per rank is too large; ask for fewer tokens")
    return total


def enable_symm_mem(group_name: str) -> None:
    """Enable torch symmetric memory for a group: required by older torch, deprecated (a no-op) later."""
    import torch.distributed._symmetric_memory as symm_mem

    if hasattr(symm_mem, "enable_symm_mem_for_group"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            symm_mem.enable_symm_mem_for_group(group_name)


def allocate_cuda(group: dist.ProcessGroup, region_elems: int, device: torch.device) -> Workspace:
    """Symmetric-memory workspace for a NCCL group (collective: every rank of ``group`` calls it)."""
    import torch.distributed._symmetric_memory as symm_mem

    world = dist.get_world_size(group)
    try:
        buf = symm_mem.empty(_buffer_elems(region_elems, world), dtype=torch.int16, device=device)
        buf.fill_(SENTINEL)
        enable_symm_mem(group.group_name)
        handle = symm_mem.rendezvous(buf, group.group_name)
    except (RuntimeError, NotImplementedError, AttributeError) as exc:
        # The same torch on every rank fails the same way: every rank raises this, none waits.
        platform = f"ROCm (HIP {torch.version.hip})" if torch.version.hip else f"CUDA {torch.version.cuda}"
        raise RuntimeError(
            f"tpfuse: torch {torch.__version__} on {platform} cannot give group {group.group_name!r} a "
            f"symmetric-memory workspace ({type(exc).__name__}: {exc}); the fused kernels need it. Take the "
            "reference path (the group's own all-reduce): get_communicator(backend='reference') or "
            "TPFUSE_BACKEND=reference") from exc
    # The kernels move rows 16 bytes an access and tell the compiler these buffers allow it.
    if any(ptr % 16 for ptr in handle.buffer_ptrs):
        raise RuntimeError(f"tpfuse: a peer's workspace buffer is not 16-byte aligned: {handle.buffer_ptrs}")
    peer_ptrs = torch.tensor(list(handle.buffer_ptrs), dtype=torch.int64, device=device)
    state = torch.zeros(STATE_LEN, dtype=torch.int32, device=device)
    torch.cuda.synchronize(device)
    dist.barrier(group=group)  # every rank's sentinel fill is done before anyone pushes
    return Workspace(region_elems, buf, peer_ptrs, state, [handle])


def remove_stale_shm_files() -> int:
    """Unlink workspace files left by processes that died before they could unlink them.

    Files are named ``tpfuse-<group token>-r<rank>-p<pid>``; a file whose pid no longer runs is
    stale. Returns how many were removed.
    """
    removed = 0
    for path in glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*-p*")):
        try:
            pid = int(path.rsplit("-p", 1)[1])
            os.kill(pid, 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed += 1
            except FileNotFoundError:
                pass
        except (ValueError, PermissionError):
            continue
    return removed


def shm_files() -> list[str]:
    """Workspace files present now (normally none: each is unlinked once every rank mapped it)."""
    return sorted(glob.glob(os.path.join(SHM_DIR, SHM_PREFIX + "*")))


def mapped_shm_files(maps: str = "/proc/self/maps") -> list[str]:
    """Workspace files this process maps now, each once, as ``maps`` names them (an unlinked one ends in
    `` (deleted)``): none once its communicators are destroyed and no tensor over their buffers is left.

    Only workspace files count, by directory and name (:data:`SHM_NAME`): other mappings whose path has
    ``tpfuse-`` in it stay until the process exits and are none of the workspaces' (the shared objects
    Inductor compiles into ``tpfuse.bench.e2e``'s ``/tmp/tpfuse-e2e-cache-*``, say).
    """
    dirs = {SHM_DIR, os.path.realpath(SHM_DIR)}
    found = set()
    with open(maps) as fh:
        for line in fh:
            fields = line.split(None, 5)
            if len(fields) < 6:
                continue  # an anonymous mapping
            path = fields[5].rstrip("\n")
            name = path.removesuffix(" (deleted)")
            if os.path.dirname(name) in dirs and SHM_NAME.fullmatch(os.path.basename(name)):
                found.add(path)
    return sorted(found)


def allocate_shared_files(group: dist.ProcessGroup, region_elems: int) -> Workspace:
    """CPU workspace over shared-memory files that every rank maps (collective).

    Each rank creates its file, everyone maps everyone's, then each rank unlinks its own file: the
    mappings stay valid and nothing remains on disk, even if a process crashes later. Only a crash
    inside this function can leave a file; :func:`remove_stale_shm_files` (run here first) removes
    those by their dead pid.
    """
    from tpfuse.kernels import interpreter

    interpreter.install()  # peers poll words other processes write: each must move whole
    remove_stale_shm_files()
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    token = [uuid.uuid4().hex[:12] if rank == 0 else None]
    dist.broadcast_object_list(token, src=dist.get_global_rank(group, 0), group=group)
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid(), group=group)
    paths = [os.path.join(SHM_DIR, f"{SHM_PREFIX}{token[0]}-r{r}-p{pids[r]}") for r in range(world)]
    n = _buffer_elems(region_elems, world)
    own = torch.from_file(paths[rank], shared=True, size=n, dtype=torch.int16)
    own.fill_(SENTINEL)
    dist.barrier(group=group)
    mapped = [own if r == rank else torch.from_file(paths[r], shared=True, size=n, dtype=torch.int16)
              for r in range(world)]
    dist.barrier(group=group)
    os.unlink(paths[rank])
    peer_ptrs = torch.tensor([t.data_ptr() for t in mapped], dtype=torch.int64)
    state = torch.zeros(STATE_LEN, dtype=torch.int32)
    return Workspace(region_elems, own, peer_ptrs, state, mapped)


def allocate(group: dist.ProcessGroup, region_elems: int, device: torch.device) -> Workspace:
    """The workspace for ``device``: :func:`allocate_cuda` on a GPU, :func:`allocate_shared_files` on the
    CPU (collective)."""
    if device.type == "cuda":
        return allocate_cuda(group, region_elems, device)
    return allocate_shared_files(group, region_elems)
