"""``python -m tpfuse bench host``: host microseconds a fused call costs, beside torch's unfused chain.

Outside CUDA graphs (``tpfuse.compile``'s default mode, the op in eager code, prefill in most engines)
every call's host work is paid on the critical path. This measures it per call, as the median of
``perf_counter`` around single calls (the launch queue kept short: the device is synchronised every
:data:`CALLS_PER_SYNC` calls, outside the timed spans):

- ``launch oneshot`` / ``launch twoshot``: the kernel's launch as the op makes it (``launch(plan, call)``,
  the plan kept by an earlier call: a communicator's plan of a call holds it).
- ``launcher oneshot`` / ``launcher twoshot``: the launchers' API (``kernels.oneshot`` / ``kernels.twoshot``),
  which looks the kept plan up by the call's kind before the launch (the launch rows until 2026-12-04).
- ``op oneshot`` / ``op twoshot``: the whole public op, ``tpfuse.allreduce_add_rmsnorm`` in eager
  code (checks, the communicator's plan, the launch), the algorithm forced by a table.
- ``op world size 1``: the op on a group of one rank (the block end as one kernel, no communication),
  also timed on the GPU (CUDA-graph replays), beside
- ``torch add + rms_norm``: torch's eager residual add and ``rms_norm`` (host and GPU), and with two or
  more ranks ``torch all_reduce + add + rms_norm`` (the group's NCCL all-reduce first).

With one GPU (no torchrun) two ranks share it, as ``scripts/loopback_latency.py`` does: rank 0's calls
are timed, rank 1's kernels are launched after each (untimed) on a stream of their own. Under torchrun
with one GPU a rank, the ranks are real and the slowest rank's median is reported. A size's rows are
measured in turns (:data:`ROUNDS` of :data:`TURN_CALLS` calls each, the median turn reported): a
shared host's speed drifts, and rows compared with each other see the same drift.
"""

from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Callable, NamedTuple

import torch
import torch.distributed as dist

from tpfuse import select

#: Calls between synchronisations: the device never falls far behind, and no launch blocks on a full queue.
CALLS_PER_SYNC = 32
#: Turns of measurements that are compared with each other (the median turn is reported).
ROUNDS = 5
#: Calls a row takes in one turn.
TURN_CALLS = 1000
EPS = 1e-6
#: The launch rows: the op's launch (its plan kept), and the launchers' API (the plan looked up a call).
_LAUNCH_ROWS = (("launch", False), ("launcher", True))


def host_us(call: Callable[[], object], after: Callable[[], object] | None = None, calls: int = 2000,
            warmup: int = 64) -> float:
    """Median host microseconds of ``call()``; ``after()`` (untimed) follows each call."""
    samples = []
    for i in range(warmup + calls):
        start = time.perf_counter_ns()
        call()
        elapsed = time.perf_counter_ns() - start
        if after is not None:
            after()
        if i >= warmup:
            samples.append(elapsed)
        if i % CALLS_PER_SYNC == CALLS_PER_SYNC - 1 and torch.cuda.is_available():
            torch.cuda.synchronize()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    samples.sort()
    return samples[len(samples) // 2] / 1000


def _slowest(value: float) -> float:
    """The largest of the ranks' values (the value itself with one process)."""
    if dist.get_world_size() == 1:
        return value
    t = torch.tensor([value], device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _torch_chain(x, residual, weight, all_reduce: bool):
    def chain():
        if all_reduce:
            dist.all_reduce(x)
        h = x + residual
        return torch.nn.functional.rms_norm(h, (h.shape[-1],), weight, EPS), h
    return chain


def _gpu_us(fn: Callable[[], object]) -> float | None:
    if not torch.cuda.is_available():
        return None
    from tpfuse.bench.timing import graph_replay_us

    return graph_replay_us(fn)


def _plans(tokens: int, world: int) -> dict:
    """The algorithms a call of ``tokens`` rows can take, with the functions giving their kept launch plans
    (``oneshot_plan`` / ``twoshot_plan``: the launchers' API is ``launch(plan(ctx, call), call)``; the
    two-shot needs a row for every rank)."""
    from tpfuse.kernels.oneshot import oneshot_plan
    from tpfuse.kernels.twoshot import twoshot_plan

    plans = {select.ONESHOT: oneshot_plan}
    if tokens >= world:
        plans[select.TWOSHOT] = twoshot_plan
    return plans


def _launch(plan_of: Callable, ctx, call, look_up: bool) -> Callable[[], None]:
    """A launch of ``call``: with its plan kept here (as the op's), or looked up each time (the
    launchers' API)."""
    from tpfuse.kernels.launch import launch

    if look_up:
        return lambda: launch(plan_of(ctx, call), call)
    return functools.partial(launch, plan_of(ctx, call), call)


class Row(NamedTuple):
    """One row of the table: ``take()`` measures it once (host us); ``gpu``, if given, is timed on the
    GPU too."""

    ranks: int
    what: str
    take: Callable[[], float]
    gpu: Callable[[], object] | None = None


def _in_turns(rows: list[Row]) -> list[dict]:
    """Every row measured :data:`ROUNDS` times in turns, so that a drift of the host's speed (seen to
    double a call's time within seconds on a shared GPU host) hits every row alike; the median turn of
    each, the slowest rank's."""
    samples: list[list[float]] = [[] for _ in rows]
    for _ in range(ROUNDS):
        for row, found in zip(rows, samples):
            found.append(row.take())
    return [dict(ranks=row.ranks, what=row.what, host_us=_slowest(sorted(found)[len(found) // 2]),
                 gpu_us=None if row.gpu is None else _gpu_us(row.gpu)) for row, found in zip(rows, samples)]


def _world_size_one_rows(tokens: int, hidden: int, device) -> list[Row]:
    """The op on a group of one rank, and torch's chain without an all-reduce."""
    import tpfuse

    g = torch.Generator(device=device).manual_seed(tokens)
    x, residual = (torch.randn(tokens, hidden, generator=g, device=device, dtype=torch.bfloat16)
                   for _ in range(2))
    weight = torch.randn(hidden, generator=g, device=device, dtype=torch.bfloat16)
    # A group of its own even at world size 1: the loopback rows, measured in the same turns, register a
    # two-rank communicator for the default group.
    alone = dist.new_group([dist.get_rank()])
    op = lambda: tpfuse.allreduce_add_rmsnorm(x, residual, weight, EPS, group=alone)  # noqa: E731
    chain = _torch_chain(x, residual, weight, all_reduce=False)
    return [Row(1, "op world size 1", lambda: host_us(op, calls=TURN_CALLS), op),
            Row(1, "torch add + rms_norm", lambda: host_us(chain, calls=TURN_CALLS), chain)]


class LoopbackPair(NamedTuple):
    """Two ranks on one GPU, ready to call (:func:`loopback_pair`). ``own``, ``peer`` and ``op`` are
    functions of an algorithm (``select.ONESHOT`` / ``TWOSHOT``)."""

    #: ``own(algorithm, look_up=False)``: rank 0's launch on the current stream (``look_up``: through the
    #: launchers' API).
    own: Callable[..., Callable[[], object]]
    #: ``peer(algorithm)``: rank 1's launch on ``peer_stream`` (run it after each of rank 0's calls).
    peer: Callable[[str], Callable[[], object]]
    #: ``op(algorithm)``: a context manager giving rank 0's whole eager op with that algorithm forced.
    op: Callable
    peer_stream: torch.cuda.Stream
    #: The ranks' inputs (``Case.inputs``) and calls (outputs ``call.y`` / ``call.h``), tensors the calls
    #: read and write in place.
    case: object
    inputs: dict
    calls: list


@contextlib.contextmanager
def loopback_pair(tokens: int, hidden: int, device):
    """Two ranks on this process's GPU, ready to call: yields a :class:`LoopbackPair`; rank 0's op goes
    through a loopback communicator of the default group. Checks afterwards that no call failed."""
    import tpfuse
    from tpfuse.kernels import layout
    from tpfuse.testing import forced_table, local_launch_contexts
    from tpfuse.testing.cases import Case
    from tpfuse.testing.loopback import loopback_communicator

    world = 2
    contexts = local_launch_contexts(device, tokens * hidden, world)
    case = Case(tokens, hidden, seed=tokens)
    inputs = case.inputs(world, device)
    calls = [case.fused_call(inputs, r) for r in range(world)]
    streams = [torch.cuda.Stream(device) for _ in range(world)]
    plans = _plans(tokens, world)

    def on_stream(rank: int, fn: Callable[[], object]) -> Callable[[], object]:
        def run():
            with torch.cuda.stream(streams[rank]):
                fn()
        return run

    # Loading a kernel waits for the device to be idle, so a rank's first launch would wait out its peer's
    # (see scripts/loopback_latency.py): load both kernels with a short bound, then start afresh.
    for ctx in contexts:
        ctx.wait_limit_ns = 10**6
    for plan_of in plans.values():
        for rank in range(world):
            on_stream(rank, _launch(plan_of, contexts[rank], calls[rank], look_up=True))()
        torch.cuda.synchronize()
    for ctx in contexts:
        ctx.wait_limit_ns = 2 * 10**9
        ctx.workspace.buffer.fill_(layout.SENTINEL)
        ctx.workspace.state.zero_()
    torch.cuda.synchronize()

    def own(algorithm: str, look_up: bool = False) -> Callable[[], object]:
        return _launch(plans[algorithm], contexts[0], calls[0], look_up)

    def peer(algorithm: str) -> Callable[[], object]:
        return on_stream(1, _launch(plans[algorithm], contexts[1], calls[1], look_up=False))

    @contextlib.contextmanager
    def op(algorithm: str):
        call = calls[0]
        with forced_table(world, device, tokens if algorithm == select.ONESHOT else 0, hiddens=(hidden,)):
            planned = comm.plan(call).route
            if planned != algorithm:
                raise RuntimeError(f"tpfuse: the loopback op would run {planned}, not {algorithm}")
            yield lambda: tpfuse.allreduce_add_rmsnorm(call.x, call.residual, call.weight, call.eps,
                                                       out=call.y,
                                                       residual_out=call.h)

    # Rank 0's calls run on the current stream, set once (entering a stream context costs more host
    # time than a launch); rank 1's enter theirs, untimed.
    before = torch.cuda.current_stream(device)
    torch.cuda.set_stream(streams[0])
    comm = loopback_communicator(dist.group.WORLD, contexts[0])
    try:
        yield LoopbackPair(own, peer, op, streams[1], case, inputs, calls)
    finally:
        comm.destroy()
        torch.cuda.set_stream(before)
    errors = [c.workspace.state[layout.STATE_ERROR].item() for c in contexts]
    if any(errors):
        raise RuntimeError(f"tpfuse: a loopback call failed (error entries {errors}): the times are void")


@contextlib.contextmanager
def _loopback_rows(tokens: int, hidden: int, device):
    """Two ranks on this process's GPU: the launchers and the whole op (rank 0 timed); valid while the
    context is."""
    algorithms = list(_plans(tokens, 2))
    with loopback_pair(tokens, hidden, device) as pair:
        def take_op(algorithm: str) -> float:
            with pair.op(algorithm) as call:
                return host_us(call, after=pair.peer(algorithm), calls=TURN_CALLS)

        yield [Row(2, f"{word} {a}", lambda a=a, look_up=look_up: host_us(pair.own(a, look_up),
                                                                          after=pair.peer(a),
                                                                          calls=TURN_CALLS))
               for word, look_up in _LAUNCH_ROWS for a in algorithms] + [
            Row(2, f"op {a}", lambda a=a: take_op(a)) for a in algorithms]


@contextlib.contextmanager
def _group_rows(tokens: int, hidden: int, device):
    """Real ranks (torchrun): the launchers and the op through the group's communicator, beside torch's
    chain with the group's all-reduce; valid while the context is."""
    import tpfuse
    from tpfuse.testing import forced_table
    from tpfuse.testing.cases import Case

    world, rank = dist.get_world_size(), dist.get_rank()
    comm = tpfuse.get_communicator(max_tokens=tokens, hidden=hidden)
    case = Case(tokens, hidden, seed=tokens)
    call = case.fused_call(case.inputs(world, device), rank)

    def take_op(algorithm: str) -> float:
        with forced_table(world, device, tokens if algorithm == select.ONESHOT else 0, hiddens=(hidden,)):
            dist.barrier()
            return host_us(lambda: tpfuse.allreduce_add_rmsnorm(call.x, call.residual, call.weight, call.eps,
                                                                out=call.y, residual_out=call.h),
                                                                calls=TURN_CALLS)

    chain = _torch_chain(call.x.clone(), call.residual, call.weight, all_reduce=True)
    plans = _plans(tokens, world)
    yield [Row(world, f"{word} {a}", lambda f=f, look_up=look_up: host_us(
               _launch(f, comm.fused_backend.launch, call, look_up), calls=TURN_CALLS))
           for word, look_up in _LAUNCH_ROWS for a, f in plans.items()] + [
        Row(world, f"op {a}", lambda a=a: take_op(a)) for a in plans] + [
        Row(world, "torch all_reduce + add + rms_norm", lambda: host_us(chain, calls=TURN_CALLS))]
    comm.check_errors()


@contextlib.contextmanager
def _process_group():
    """torchrun's NCCL group, or a group of this process alone on the current GPU (or the CPU)."""
    if "RANK" in os.environ:
        from tpfuse.bench.kernel import finish_torchrun, init_torchrun

        init_torchrun()
        try:
            yield
        finally:
            finish_torchrun()
        return
    cuda = torch.cuda.is_available()
    store = dist.HashStore()
    if cuda:
        dist.init_process_group("nccl", store=store, rank=0, world_size=1,
                                device_id=torch.device("cuda", torch.cuda.current_device()))
    else:
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        yield
    finally:
        import tpfuse

        tpfuse.destroy_all()
        dist.destroy_process_group()


def bench_host(hiddens: list[int], tokens: list[int]) -> list[dict]:
    """The rows of ``bench host`` (every rank returns them; call inside a process group): a size's rows
    measured in turns (:func:`_in_turns`)."""
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    rows = []
    for hidden in hiddens:
        for n in tokens:
            with contextlib.ExitStack() as stack:
                measured = _world_size_one_rows(n, hidden, device)
                if cuda:  # two ranks need a GPU (the interpreter runs one launch at a time)
                    ranks = _group_rows if dist.get_world_size() > 1 else _loopback_rows
                    measured += stack.enter_context(ranks(n, hidden, device))
                rows += [dict(tokens=n, hidden=hidden, **row) for row in _in_turns(measured)]
    return rows


def print_rows(rows: list[dict]) -> None:
    print(f"{'tokens x hidden':>16}  {'ranks':>5}  {'what':<36} {'host us':>8} {'GPU us':>8}")
    for row in rows:
        gpu = f"{row['gpu_us']:8.2f}" if row.get("gpu_us") is not None else f"{'':>8}"
        print(f"{row['tokens']:>7} x {row['hidden']:<6}  {row['ranks']:>5}  {row['what']:<36} "
              f"{row['host_us']:8.2f} {gpu}")


def run_host_bench(hiddens: list[int], tokens: list[int], out_dir: str) -> int:
    """Entry point of ``python -m tpfuse bench host``: alone on one GPU (two ranks share it), or under
    torchrun with one GPU a rank."""
    from tpfuse.bench.output import write_csv

    with _process_group():
        rows = bench_host(hiddens, tokens)
        if dist.get_rank() == 0:
            print_rows(rows)
            write_csv(rows, out_dir, "host.csv")
    return 0
