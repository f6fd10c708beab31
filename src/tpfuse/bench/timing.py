"""CUDA-graph replay timing shared by the benchmarks."""

from __future__ import annotations

import sys
from typing import Callable

import torch
import torch.distributed as dist


def graph_replay_us(fn: Callable[[], object], calls_per_graph: int = 10, replays: int = 30,
                    repeats: int = 7) -> float:
    """Microseconds per ``fn()`` call, as the median over ``repeats`` timed batches of graph replays.

    ``fn`` is captured ``calls_per_graph`` times into one CUDA graph (launch gaps shrink as in a
    real decode step); ranks start each timed batch together and report the slowest rank's time.
    Without a process group (one process on one GPU) the same, alone.
    """
    ranks = dist.is_available() and dist.is_initialized()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls_per_graph):
            fn()
    for _ in range(3):
        graph.replay()
    samples = []
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(repeats):
        torch.cuda.synchronize()
        if ranks:
            dist.barrier()
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / (replays * calls_per_graph))
    t = torch.tensor([sorted(samples)[len(samples) // 2]], device="cuda")
    if ranks:
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
    del graph
    return t.item()


def progress(done: int, total: int, label: str) -> None:
    """A one-line progress bar on stderr (rank 0 calls it)."""
    filled = 30 * done // max(total, 1)
    end = "\n" if done >= total else ""
    sys.stderr.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} {label:<40}{end}")
    sys.stderr.flush()
