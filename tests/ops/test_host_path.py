"""The eager call path: decisions made once per kind of call and kept (counted), and world size 1."""

import os

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_backends, rank_device

needs_kernels = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1"
                                   and not torch.cuda.is_available(),
                                   reason="needs a GPU or TRITON_INTERPRET=1")

# Every block end the local kernel runs, as the op's arguments.
WORLD_ONE_CASES = [
    Case(3, 64),
    Case(2, 96, residual=False, dtype=torch.float16),
    Case(2, 64, bias=True, weight_fp32=True),
    Case(2, 64, sum_norm=True, quant_scale=0.05),
    Case(2, 64, layer_norm=True, norm_bias=True, bias=True),
    Case(2, 128, scale_group=64),
    Case(2, 64, scale_group=64, sum_norm=True),
]


@pytest.fixture
def one_rank_group():
    """The default group, of this process alone (gloo): world size 1, no rank processes."""
    from tpfuse.testing.ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield
    finally:
        tpfuse.destroy_all()
        dist.destroy_process_group()


@needs_kernels
def test_world_size_one_runs_the_block_end_as_one_kernel(one_rank_group):
    """A group of one rank: the op's outputs match float64 for every block end, from the local kernel
    (counted under ``triton.local``), with and without a communicator."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for i, case in enumerate(WORLD_ONE_CASES):
        if i == 1:
            tpfuse.get_communicator(max_tokens=4, hidden=128)  # a group of one has no workspace
        inputs = case.inputs(1, device)
        tpfuse.reset_stats()
        got = case.call(inputs, 0)
        assert tpfuse.stats() == {"triton.local": 1}, case
        check_results(case, 1, [got], inputs)


def _count_decisions(monkeypatch, counts: dict) -> None:
    """Count every decision the per-call path should keep: the communicator's plan, the algorithm
    choice, and the launch plans (LaunchPlan objects)."""
    from tpfuse import select
    from tpfuse.blockend.call import FusedCall
    from tpfuse.comm.communicator import Communicator
    from tpfuse.kernels import launch

    def counted(name, fn):
        def wrapper(*args, **kwargs):
            counts[name] = counts.get(name, 0) + 1
            return fn(*args, **kwargs)
        return wrapper

    monkeypatch.setattr(Communicator, "_plan", counted("call plan", Communicator._plan))
    monkeypatch.setattr(select, "choose_algorithm", counted("algorithm", select.choose_algorithm))
    monkeypatch.setattr(launch.LaunchPlan, "__post_init__",
                        counted("launch plan", launch.LaunchPlan.__post_init__))
    monkeypatch.setattr(FusedCall, "kernel_key", counted("kind looked up", FusedCall.kernel_key))


def _repeated_calls(rank, world_size, backend, tokens):
    import pytest as _pytest

    from tpfuse.testing import forced_table

    counts: dict = {}
    with _pytest.MonkeyPatch.context() as monkeypatch, forced_table(world_size,
                                                                    rank_device(backend, rank), 4):
        _count_decisions(monkeypatch, counts)
        tpfuse.get_communicator(max_tokens=16, hidden=64)
        results = []
        for seed in range(4):  # fresh tensors each call: only their addresses change
            case = Case(tokens, 64, seed=seed)
            inputs = case.inputs(world_size, rank_device(backend, rank))
            results.append((case, [t.cpu() for t in case.call(inputs, rank)]))
        first = dict(counts)
        for seed in range(4, 8):
            case = Case(tokens, 64, seed=seed)
            inputs = case.inputs(world_size, rank_device(backend, rank))
            results.append((case, [t.cpu() for t in case.call(inputs, rank)]))
    return first, counts, results


@pytest.mark.parametrize("backend", rank_backends())
@pytest.mark.parametrize("tokens", [2, 9])  # the one-shot, then the two-shot (forced table: one-shot to 4)
def test_repeated_calls_decide_once(rank_pool, backend, tokens):
    """The same kind of call, made again with new tensors, recomputes nothing the first call decided:
    one communicator plan, one algorithm choice, one launch plan, however many calls follow; and a later
    call looks its kind up once (the communicator's plan holds the kernel's launch plan)."""
    per_rank = rank_pool(2, backend).run(_repeated_calls, backend, tokens)
    for first, total, _ in per_rank:
        looked_up = first.pop("kind looked up")
        assert first == {"call plan": 1, "algorithm": 1, "launch plan": 1}, first
        assert total.pop("kind looked up") - looked_up == 4, "a later call looked its kind up more than once"
        assert total == first, f"later calls decided again: {total} after the first four calls' {first}"
    for i in range(len(per_rank[0][2])):
        case = per_rank[0][2][i][0]
        check_results(case, 2, [results[i][1] for _, _, results in per_rank])


@pytest.mark.skipif(not torch.cuda.is_available(),
                    reason="needs a GPU (kept launches use the compiled launcher)")
def test_a_kept_launch_follows_each_pointers_alignment(one_rank_group):
    """The JIT compiles apart for each pointer that is not 16-byte aligned: the kernel kept for a call
    whose x is misaligned must not serve one whose residual or output is (it would load them as if
    aligned), and aligned calls after them still take the aligned kernel."""
    tokens, hidden = 4, 256
    g = torch.Generator(device="cuda").manual_seed(0)
    x, residual = (torch.randn(tokens, hidden, generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(2))
    weight = torch.randn(hidden, generator=g, device="cuda", dtype=torch.bfloat16)
    h_ref = x.double() + residual.double()
    y_ref = h_ref * torch.rsqrt(h_ref.pow(2).mean(-1, keepdim=True) + 1e-6) * weight.double()

    def misaligned(t):  # the same values 8 bytes past a 16-byte boundary (contiguous)
        view = torch.empty(t.numel() + 8, dtype=t.dtype, device=t.device)[4:4 + t.numel()].view_as(t)
        return view.copy_(t)

    for moved in ["", "x", "residual", "out", "x residual out", ""]:
        args = {"x": x, "residual": residual, "out": torch.empty_like(x)}
        args.update({name: misaligned(args[name]) for name in moved.split()})
        assert all((args[name].data_ptr() % 16 != 0) == (name in moved.split()) for name in args)
        y, h = tpfuse.allreduce_add_rmsnorm(args["x"], args["residual"], weight, 1e-6, out=args["out"])
        torch.cuda.synchronize()
        assert y.data_ptr() == args["out"].data_ptr()
        torch.testing.assert_close(h.double(), h_ref, rtol=1e-2, atol=1e-2, msg=f"h, misaligned: {moved!r}")
        torch.testing.assert_close(y.double(), y_ref, rtol=2e-2, atol=2e-2, msg=f"y, misaligned: {moved!r}")


def test_a_graphs_call_of_the_common_block_end_takes_its_own_path(one_rank_group, monkeypatch):
    """A compiled graph calls the op with every block-end keyword spelled out at its default: the call is
    still the common one (``epilogue.PLAIN`` itself: its checks, launch tensors and kept plans), as an
    eager call's is; one step that differs makes it a block end of its own."""
    from tpfuse.blockend.epilogue import PLAIN, Epilogue
    from tpfuse.ops.route import Route

    seen = []
    monkeypatch.setattr(Route, "run", lambda self, call: seen.append(call.epilogue))
    x, weight = torch.randn(2, 64).bfloat16(), torch.ones(64, dtype=torch.bfloat16)
    every_default = dict(quant_scale=None, bias=None, sum_weight=None, layer_norm=False, norm_bias=None,
                         scale_group=0, normed=True, experts=0, topk_weights=None, shared_expert=None,
                         normed_copy=False, ue8m0_scales=False, scale_layout=0, fp4=0, global_scale=None)
    group_name = dist.group.WORLD.group_name
    torch.ops.tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6, group_name, **every_default)
    torch.ops.tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6, group_name)
    torch.ops.tpfuse.allreduce_add_rmsnorm(x, None, weight, 1e-6, group_name,
                                           **{**every_default, "layer_norm": True})
    assert seen[0] is PLAIN and seen[1] is PLAIN
    assert seen[2] is not PLAIN and seen[2].layer_norm and Epilogue.of({"layer_norm": True}).kwargs() == {
        "layer_norm": True}


def test_a_groups_route_is_kept_until_its_communicator_changes(one_rank_group):
    """One route a group (``ops.route``): the same object call after call, made again once a communicator
    is created or destroyed; the plan of a group of one rank is the local kernel where the kernels run."""
    from tpfuse import select
    from tpfuse.ops.route import group_name_of, route_of

    name = group_name_of(None)
    first = route_of(name)
    assert route_of(name) is first and first.comm is None and first.world_size == 1
    comm = tpfuse.get_communicator(max_tokens=4, hidden=64)
    with_comm = route_of(name)
    assert with_comm is not first and with_comm.comm is comm and route_of(name) is with_comm
    case = Case(2, 64)
    call = case.fused_call(case.inputs(1), 0)
    assert with_comm.plan(call).route == (select.LOCAL if os.environ.get("TRITON_INTERPRET") == "1"
                                          else select.REFERENCE)
    comm.destroy()
    assert route_of(name).comm is None


def test_a_destroyed_group_is_not_kept_alive():
    """Once the user destroys the communicator and then the group, nothing of tpfuse holds either: the
    group is freed then, not during the interpreter's teardown (where freeing a gloo group's threads and
    store can abort the process, seen as a rank exiting with SIGABRT after its last call)."""
    import gc
    import weakref

    from tpfuse.testing.ranks import free_port

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:  # the teardown under test, and the one later tests need if a call here fails
        group = weakref.ref(dist.group.WORLD)
        comm = weakref.ref(tpfuse.get_communicator(max_tokens=4, hidden=64))
        case = Case(2, 64)
        case.call(case.inputs(1), 0)  # a call makes the group's route, which holds the communicator
    finally:
        tpfuse.destroy_all()
        dist.destroy_process_group()
    gc.collect()
    assert comm() is None, [type(r).__name__ for r in gc.get_referrers(comm())]
    assert group() is None, [type(r).__name__ for r in gc.get_referrers(group())]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (two ranks share it)")
@pytest.mark.parametrize("algorithm", ["oneshot", "twoshot"])
def test_the_op_captured_in_a_cuda_graph_replays_right(algorithm):
    """The op called inside CUDA-graph capture, two ranks on one GPU (rank 0 through a loopback
    communicator's ``run_fused``, rank 1's kernel on its own stream, both in the graph): the communicator
    knows a fused call was captured (its destroy keeps the workspace the graph replays into), and every
    replay on fresh inputs, outputs poisoned before it, matches float64 on both ranks, bit-identical."""
    from tpfuse.bench.host import loopback_pair
    from tpfuse.comm import communicator as registry
    from tpfuse.testing.cases import check_results

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1,
                            device_id=torch.device("cuda", torch.cuda.current_device()))
    try:
        kept_before = len(registry._kept_for_graphs)
        with loopback_pair(8, 256, torch.device("cuda")) as pair, pair.op(algorithm) as op:
            comm = registry._registry[dist.group.WORLD.group_name]

            def step():  # rank 1's launch forked from the capturing stream and joined back
                here = torch.cuda.current_stream()
                pair.peer_stream.wait_stream(here)
                op()
                pair.peer(algorithm)()
                here.wait_stream(pair.peer_stream)

            step()  # eager first: the kernels are loaded outside the capture
            torch.cuda.synchronize()
            assert not comm._captured
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                step()
            assert comm._captured, "a fused call captured in a CUDA graph was not noticed"
            g = torch.Generator().manual_seed(5)
            for _ in range(3):
                for t in [*pair.inputs["xs"], pair.inputs["residual"]]:
                    t.copy_(torch.randn(t.shape, generator=g).to(t.dtype))
                for call in pair.calls:
                    call.y.fill_(float("nan"))
                    call.h.fill_(float("nan"))
                graph.replay()
                torch.cuda.synchronize()
                check_results(pair.case, 2, [(c.y.cpu(), c.h.cpu()) for c in pair.calls], pair.inputs)
        # (leaving the pair checked that no rank's call failed)
        assert len(registry._kept_for_graphs) == kept_before + 1, "the captured workspace was released"
    finally:
        tpfuse.destroy_all()
        dist.destroy_process_group()
