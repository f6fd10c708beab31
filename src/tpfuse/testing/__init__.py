"""Helpers the tests, benchmarks and scripts share: fused-call counts, local launch contexts, forced
algorithm tables. Ranks as processes: :mod:`tpfuse.testing.ranks`."""

from __future__ import annotations

import contextlib
import os


def fused_calls(counts: dict[str, int] | None = None,
                backends: tuple[str, ...] = ("triton", "flashinfer")) -> int:
    """Fused kernel calls among ``counts`` (default: :func:`tpfuse.stats` now) made by ``backends``.

    The op counts each call as ``"<backend>.<algorithm>"``; the reference path and the compiler's own
    counts are not kernel calls.
    """
    if counts is None:
        import tpfuse

        counts = tpfuse.stats()
    return sum(n for label, n in counts.items() if label.startswith(tuple(f"{b}." for b in backends)))


def previous_slot_is_clear(comm) -> bool:
    """Whether the slot of the call before the last one is all sentinel again in this rank's buffer:
    the peers' regions and descriptors (the kernels clear it during the last call). True before two
    calls were made. Reads the Triton backend's workspace."""
    from tpfuse.kernels.layout import NUM_SLOTS, SENTINEL, STATE_CALL

    workspace = comm.fused_backend.workspace
    call = int(workspace.state[STATE_CALL])
    if call < 2:
        return True
    prev = (call - 2) % NUM_SLOTS
    others = [r for r in range(comm.world_size) if r != comm.rank]
    return bool((workspace.regions()[prev, others] == SENTINEL).all() and
                (workspace.descriptors()[prev, others] == SENTINEL).all())


def on_rank_streams(streams: list, run) -> None:
    """``run(r)`` for each rank of a group whose ranks share this process's GPU, each on its stream in
    ``streams`` (forked from the current stream and joined back), so the ranks' kernels run at once, as
    the kernels' protocol needs (:func:`local_launch_contexts`)."""
    import torch

    here = torch.cuda.current_stream()
    for r, stream in enumerate(streams):
        stream.wait_stream(here)
        with torch.cuda.stream(stream):
            run(r)
    for stream in streams:
        here.wait_stream(stream)


def local_launch_contexts(device, region_elems: int, world_size: int = 1) -> list:
    """One :class:`tpfuse.kernels.layout.LaunchContext` per rank of a group whose ranks all live in this
    process, every buffer on ``device``: a group of one runs the kernels' own arithmetic as the device
    compiles it (no peer to exchange with); a larger group runs the whole protocol through local memory
    when each rank's kernel is launched on a stream of its own (two ranks on one GPU). The ranks'
    grids are resident together (the device's programs shared out)."""
    import torch

    from tpfuse.kernels import layout

    words = layout.buffer_elems(region_elems, world_size)
    buffers = [torch.full((words,), layout.SENTINEL, dtype=torch.int16, device=device)
               for _ in range(world_size)]
    states = [torch.zeros(layout.STATE_LEN, dtype=torch.int32, device=device) for _ in range(world_size)]
    peer_ptrs = torch.tensor([b.data_ptr() for b in buffers], device=device)
    programs = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    # A bound under 2**31 ns: Triton compiles an int64 argument apart (compile_then_start_afresh).
    return [layout.LaunchContext(layout.Workspace(region_elems, buffers[r], peer_ptrs, states[r], []), r,
                                 world_size, programs // world_size, 2 * 10**9) for r in range(world_size)]


def compile_then_start_afresh(contexts: list, *steps) -> None:
    """Run each of ``steps`` once on ``contexts`` (:func:`local_launch_contexts`) with a short wait bound,
    then start their workspaces afresh. Loading a new kernel waits for the device to be idle, so one
    rank's first launch would wait out the other's compile: the first calls may fail, the next start
    clean. Both bounds fit an int32 (Triton compiles an int64 argument apart, loading new kernels again)."""
    import torch

    from tpfuse.kernels import layout

    for ctx in contexts:
        ctx.wait_limit_ns = 10**6
    for step in steps:
        step()
    torch.cuda.synchronize()
    for ctx in contexts:
        ctx.wait_limit_ns = 2 * 10**9
        ctx.workspace.buffer.fill_(layout.SENTINEL)
        ctx.workspace.state.zero_()


@contextlib.contextmanager
def environment(values: dict[str, str]):
    """Within the block, ``os.environ`` has ``values``; after it, each name is as it was (or unset)."""
    saved = {name: os.environ.get(name) for name in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


@contextlib.contextmanager
def forced_table(world_size: int, device, oneshot_max: int, fused_max: int = 4096,
                 hiddens: tuple[int, ...] = (8, 512, 2880, 4096)):
    """Within the block, calls take the one-shot up to ``oneshot_max`` tokens and the two-shot above.

    Writes an algorithm table for ``world_size`` ranks and points ``$TPFUSE_TUNE_TABLE`` at it.
    """
    import json
    import tempfile

    from tpfuse import select

    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "table.json")
        limits = {h: (oneshot_max, fused_max) for h in hiddens}
        with open(path, "w") as fh:
            json.dump(select.AlgorithmTable(select.device_slug(device), world_size, limits).to_json(), fh)
        os.environ["TPFUSE_TUNE_TABLE"] = path
        select.reload_tables()
        try:
            yield
        finally:
            del os.environ["TPFUSE_TUNE_TABLE"]
            select.reload_tables()


def cases_on_a_fresh_group(rank: int, world_size: int, cases: list, oneshot_max: int, with_communicator: bool,
                           hiddens: tuple[int, ...]) -> dict:
    """Run a rank's ``cases`` (``testing.cases.Case``) through the public API on a new group of every
    rank: ``{"outputs", "stats" (one a case), "limit"}``. With a communicator of its own, of 16 rows of
    4096 (the default group's may have grown in the pool's earlier tests), destroyed after; without one
    the reference path (or, at world size 1, the local kernel). ``oneshot_max`` and ``hiddens`` force
    the algorithm table (:func:`forced_table`). A call that changes its ``x`` fails."""
    import torch
    import torch.distributed as dist

    import tpfuse

    group, limit, comm = dist.new_group(list(range(world_size))), None, None
    if with_communicator:
        comm = tpfuse.get_communicator(group, max_tokens=16, hidden=4096)
        limit = comm.max_token_num(4096, torch.bfloat16)
    outputs, stats = [], []
    with forced_table(world_size, "cpu", oneshot_max=oneshot_max, hiddens=hiddens):
        for case in cases:
            inputs = case.inputs(world_size)
            x = inputs["xs"][rank].clone()
            tpfuse.reset_stats()
            outputs.append(case.call(inputs, rank, group=group))
            assert torch.equal(x, inputs["xs"][rank]), f"{case}: the call changed its x"
            stats.append(tpfuse.stats())
    if comm is not None:
        comm.destroy()
    return {"outputs": outputs, "stats": stats, "limit": limit}


def error_of(call, comm=None) -> str | None:
    """The message of the RuntimeError ``call()`` raises (None if it returns); ``comm`` (if any) destroyed
    after, as a failed call leaves it unusable (the rank pool's next test makes a new one)."""
    try:
        call()
    except RuntimeError as exc:
        return str(exc)
    finally:
        if comm is not None:
            comm.destroy()
    return None
