"""Two ranks on one GPU: sequence parallel's block end fused
(``tpfuse.reduce_scatter_add_rmsnorm_all_gather``'s kernel: the two-shot with rows sharded, one launch a
rank) against tpfuse's all-reduce block end of the same rows (the two-shot, unsharded: every rank adds the
whole residual) and against the chain unfused, its collectives as plain reads of the peer's rows: the
reduce-scatter a torch add of both ranks' rows of this rank's shard, then Inductor's add + RMSNorm, then
the all-gather a copy of both ranks' normed rows (no synchronisation and no protocol: the unfused chain's
traffic at its cheapest). GPU us a call, both ranks' kernels at once on streams of their own (CUDA-graph
replays, ``bench.timing.graph_replay_us``); every output is checked against float64 and across the ranks
first, and the sharded call's rows against the all-reduce's bit for bit. As
``scripts/loopback_latency.py``: the peers' buffers are in the same GPU, so only the ratios carry over to
two GPUs, and there is no NCCL baseline here (two GPUs: ``gpu_check.sh sequence-parallel``).

Usage: PYTHONPATH=src python3 scripts/sequence_parallel_latency.py
"""

import torch

from tpfuse.bench.timing import graph_replay_us
from tpfuse.blockend.call import FusedCall
from tpfuse.kernels import layout
from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
from tpfuse.testing import compile_then_start_afresh, local_launch_contexts, on_rank_streams
from tpfuse.testing.cases import Case, check_results

WORLD, EPS = 2, 1e-6
TOKENS = (1024, 2048, 4096, 8192, 16384)


@torch.compile(dynamic=False)
def add_rmsnorm(s, residual, weight):
    """The unfused chain's add + RMSNorm as Inductor compiles it: one kernel, h and y."""
    h = s.float() + residual.float()
    y = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + EPS) * weight.float()
    return y.to(s.dtype), h.to(s.dtype)


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # add_rmsnorm: one graph a shape
    device = torch.device("cuda")
    contexts = local_launch_contexts(device, max(TOKENS) * 4096, WORLD)
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    print(f"{'tokens x hidden':>16} {'sharded us':>10} {'all-reduce us':>13} {'unfused us':>10} "
          f"{'all-reduce/sharded':>18} {'unfused/sharded':>15}")
    for hidden in (4096,):
        for tokens in TOKENS:
            case = Case(tokens, hidden, seed=tokens, eps=EPS)
            inputs = case.inputs(WORLD, device)
            own = tokens // WORLD
            rows = [slice(r * own, (r + 1) * own) for r in range(WORLD)]
            empty = torch.empty_like
            xs, residual, weight = inputs["xs"], inputs["residual"], inputs["weight"]
            sharded = [FusedCall(xs[r], residual[rows[r]].contiguous(), weight, EPS, empty(xs[r]),
                                 empty(residual[rows[r]]), sharded=True) for r in range(WORLD)]
            reduced = [case.fused_call(inputs, r) for r in range(WORLD)]
            normed = [None] * WORLD
            gathered = [empty(xs[r]) for r in range(WORLD)]

            def sharded_step():
                on_rank_streams(streams, lambda r: twoshot_allreduce_add_rmsnorm(contexts[r], sharded[r]))

            def reduced_step():
                on_rank_streams(streams, lambda r: twoshot_allreduce_add_rmsnorm(contexts[r], reduced[r]))

            def unfused_step():
                def norm(r):  # this rank's rows of every rank's x summed, then added and normed
                    normed[r] = add_rmsnorm(torch.add(xs[0][rows[r]], xs[1][rows[r]]), sharded[r].residual,
                                            weight)
                on_rank_streams(streams, norm)
                on_rank_streams(streams, lambda r: torch.cat([y for y, _ in normed], out=gathered[r]))

            compile_then_start_afresh(contexts, sharded_step, reduced_step, unfused_step)
            for call in sharded + reduced:
                call.y.fill_(float("nan"))
                call.h.fill_(float("nan"))
            sharded_step()
            reduced_step()
            unfused_step()
            torch.cuda.synchronize()
            assert all(c.workspace.state[layout.STATE_ERROR].item() == 0 for c in contexts)
            check_results(case, WORLD, [(c.y, torch.cat([s.h for s in sharded])) for c in sharded])
            for r in range(WORLD):
                # the unfused chain computes the same y, but for its bf16 sum's rounding
                torch.testing.assert_close(gathered[r].float(), sharded[r].y.float(), atol=5e-2, rtol=3e-2)
                assert torch.equal(sharded[r].y, reduced[r].y), (tokens, r)
                assert torch.equal(sharded[r].h, reduced[r].h[rows[r]]), (tokens, r)
            t_sharded, t_reduced, t_unfused = (graph_replay_us(step)
                                               for step in (sharded_step, reduced_step, unfused_step))
            print(f"{tokens:>7} x {hidden:<6} {t_sharded:>10.2f} {t_reduced:>13.2f} {t_unfused:>10.2f} "
                  f"{t_reduced / t_sharded:>18.2f} {t_unfused / t_sharded:>15.2f}")


if __name__ == "__main__":
    main()
