"""Run a function on N ranks as processes and get every rank's result back (tests, benchmarks).

    with RankPool(2) as pool:                   # gloo on CPU (Triton interpreter on), NCCL on GPU
        results = pool.run(fn, arg)             # fn(rank, world_size, arg) on every rank
        # results[r] is rank r's return value

A rank that raises makes ``run`` raise with that rank's traceback; ranks that do not answer in
time make it raise ``TimeoutError`` naming them, and the pool's processes are killed, so a hang
fails a test instead of stalling CI. A pool survives between runs, so tests pay process start-up
once; its ranks keep their process group, and nothing else: before every task each rank is put back
as a fresh process finds itself (:func:`reset_rank_process`), so what a task sees never depends on
which tasks ran before it in that pool, or on whether an earlier failure replaced the pool.

Tasks and results travel by value (:func:`_by_value`), never as shared memory.
"""

from __future__ import annotations

import datetime
import io
import multiprocessing as mp
import os
import queue
import socket
import time
import traceback
from typing import Any, Callable

from tpfuse.testing import environment

DEFAULT_TIMEOUT_S = 300.0
FAILURE_GRACE_S = 10.0


def rank_backends() -> list[str]:
    """Process-group backends the multi-rank tests run on: gloo always (CPU ranks, kernels in the
    Triton interpreter), NCCL too where this machine has two or more GPUs."""
    import torch

    two_gpus = torch.cuda.is_available() and torch.cuda.device_count() >= 2
    return ["gloo"] + (["nccl"] if two_gpus else [])


def rank_device(backend: str, rank: int):
    """The device rank ``rank`` of a pool works on: GPU ``rank`` under NCCL, else the CPU."""
    import torch

    return torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")


class RankError(RuntimeError):
    """A rank raised; the message carries its traceback."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _by_value(obj: Any) -> bytes:
    """``obj`` serialised by value: tensors as their bytes, not as shared memory (:func:`_from_value`
    reads it back).

    A ``multiprocessing`` queue pickles with ``ForkingPickler``, for which torch registers its own
    reduction of CPU tensors: each storage is moved into shared memory and its file descriptor passed to
    the receiver, which keeps it open for as long as the tensor lives. A result of thousands of small
    tensors (the batch-invariance tests send every row's outputs of every batch back, 11,416 from
    4 ranks in one run) then takes thousands of the test process's open files, one per tensor, and the
    next run goes past ``RLIMIT_NOFILE`` (``RuntimeError: received 0 items of ancdata``). ``torch.save``
    copies the bytes instead (plain pickle would too, but cannot read fp8 tensors back on torch 2.13):
    nothing stays open or mapped, whatever the number of tensors or ranks.
    """
    import torch

    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _from_value(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=False)


def reset_rank_process(environ: dict[str, str], task_env: dict[str, str]) -> None:
    """Put this rank process back as it was when its process group was made, keeping only the group.

    A task must not see what earlier tasks of the pool left: dynamo's compiled frames (each code object
    takes at most ``torch._dynamo.config.recompile_limit`` compiles, after which it runs eagerly and
    nothing fuses), tpfuse's communicators (their workspaces' mappings and limits), the routes kept for
    them, call counts, the compiler's site reports, algorithm tables read from files, batch-invariant
    mode and the environment. ``environ`` is the environment to restore, ``task_env`` what the task
    adds to it.
    """
    import gc

    import torch

    import tpfuse
    from tpfuse import select
    from tpfuse.comm import agreement
    from tpfuse.compiler import fusion_pass
    from tpfuse.ops import route

    torch._dynamo.reset()  # first: compiled graphs hold the communicators' tensors
    tpfuse.destroy_all()
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update(task_env)
    tpfuse.set_batch_invariant(None)  # follow the (restored) environment, read anew
    select.reload_tables()
    route._routes.clear()
    route._names.clear()
    agreement._reference_calls.clear()
    fusion_pass._reports.clear()
    fusion_pass._bounds_relied_on.clear()
    tpfuse.reset_stats()
    gc.collect()  # a destroyed workspace's mapping goes when the last tensor over it does


def _worker(rank: int, world_size: int, backend: str, port: int, env: dict, tasks, results) -> None:
    env = {k: v.replace("{rank}", str(rank)) for k, v in env.items()}
    os.environ.update({k: v for k, v in env.items() if "{task}" not in v})
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank))
    import torch
    import torch.distributed as dist

    if backend == "nccl":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)  # ranks share the CPU's cores; more threads only oversubscribe them
    dist.init_process_group(backend, rank=rank, world_size=world_size,
                            timeout=datetime.timedelta(seconds=600),
                            device_id=torch.device("cuda", rank) if backend == "nccl" else None)
    environ = dict(os.environ)
    try:
        while True:
            task = tasks.get()
            if task is None:
                break
            task_id, fn, args = _from_value(task)
            try:
                reset_rank_process(environ, {k: v.replace("{task}", str(task_id)) for k, v in env.items()
                                             if "{task}" in v})
                results.put((task_id, rank, True, _by_value(fn(rank, world_size, *args))))
            except BaseException:  # noqa: BLE001 - every failure goes back to the parent
                results.put((task_id, rank, False, traceback.format_exc()))
    finally:
        import tpfuse

        tpfuse.destroy_all()
        dist.destroy_process_group()


class RankPool:
    """``world_size`` processes joined in one process group, each running the functions it is sent.

    Parameters
    ----------
    world_size : int
    backend : str
        "gloo" (CPU; sets ``TRITON_INTERPRET=1`` in the ranks) or "nccl" (rank r on GPU r).
    env : dict, optional
        Extra environment for the ranks; ``{rank}`` in a value becomes the rank, ``{task}`` the number
        of the task (a value with ``{task}`` is set for each task, as it starts).
    timeout : float
        Seconds one :meth:`run` may take before the pool is killed.
    """

    def __init__(self, world_size: int, backend: str = "gloo", env: dict | None = None,
                 timeout: float = DEFAULT_TIMEOUT_S):
        self.world_size = world_size
        self.backend = backend
        self.timeout = timeout
        rank_env = {"TRITON_INTERPRET": "1"} if backend == "gloo" else {}
        rank_env.update(env or {})
        ctx = mp.get_context("spawn")
        self._tasks = [ctx.Queue() for _ in range(world_size)]
        self._results = ctx.Queue()
        port = free_port()
        self._procs = [
            ctx.Process(target=_worker, args=(r, world_size, backend, port, rank_env, self._tasks[r],
                                              self._results), daemon=True)
            for r in range(world_size)
        ]
        # The environment must be in place when a rank's interpreter starts, not only when its worker
        # runs: spawn re-imports the parent's main script first, and Triton fixes its interpreter mode
        # when triton.language is first imported.
        with environment(rank_env):
            for p in self._procs:
                p.start()
        self._next_task = 0
        self.alive = True

    def run(self, fn: Callable[..., Any], *args: Any, timeout: float | None = None) -> list[Any]:
        """Call ``fn(rank, world_size, *args)`` on every rank; return the results in rank order.

        ``fn`` must be importable by name (a module-level function) and return picklable values
        (move GPU tensors to the CPU first). Arguments and results are copies (:func:`_by_value`): a
        rank's changes to an argument are not seen here.
        """
        if not self.alive:
            raise RuntimeError("this RankPool was closed after an earlier failure; make a new one")
        task_id = self._next_task
        self._next_task += 1
        task = _by_value((task_id, fn, args))
        for q in self._tasks:
            q.put(task)
        deadline = time.monotonic() + (timeout or self.timeout)
        results: dict[int, Any] = {}
        failures: dict[int, str] = {}
        failed_at = float("inf")
        while len(results) + len(failures) < self.world_size:
            now = time.monotonic()
            if now >= deadline or (failures and now >= failed_at + FAILURE_GRACE_S):
                break
            try:
                tid, rank, ok, payload = self._results.get(timeout=1.0)
                if tid == task_id:
                    if ok:
                        results[rank] = _from_value(payload)
                    else:
                        failures[rank] = payload
            except queue.Empty:
                pass
            for r, p in enumerate(self._procs):  # a rank that died never answers
                if not p.is_alive() and r not in results and r not in failures:
                    failures[r] = f"rank {r} exited with code {p.exitcode}"
            if failures and failed_at == float("inf"):
                failed_at = time.monotonic()
        missing = [r for r in range(self.world_size) if r not in results and r not in failures]
        if failures or missing:
            self.close(kill=True)
        if failures:
            first = min(failures)
            raise RankError(f"rank {first} of {self.world_size} failed in {fn.__name__}"
                            f"{f'; ranks {missing} did not finish' if missing else ''}:\n{failures[first]}")
        if missing:
            raise TimeoutError(f"ranks {missing} of {self.world_size} did not finish {fn.__name__} within "
                               f"{timeout or self.timeout:.0f} s (a hang?); the pool's processes were killed")
        return [results[r] for r in range(self.world_size)]

    def close(self, kill: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not kill:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)

    def __enter__(self) -> RankPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close(kill=exc[0] is not None)


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
              env: dict | None = None, timeout: float = DEFAULT_TIMEOUT_S) -> list[Any]:
    """Start ``world_size`` ranks, run ``fn(rank, world_size, *args)`` on each once, and stop them."""
    with RankPool(world_size, backend, env, timeout) as pool:
        return pool.run(fn, *args)
