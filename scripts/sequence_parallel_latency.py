"""Two ranks on one GPU: sequence parallel's block end fused
(``tpfuse.reduce_scatter_add_rmsnorm_all_gather``'s kernel: the two-shot with rows sharded, one launch a
rank) against tpfuse's all-reduce block end of the same rows (the two-shot, unsharded: every rank adds the
whole residual) and against the chain unfused (tpfuse's plain sum of the rank's rows, Inductor's add +
RMSNorm, a copy of both ranks' rows as the all-gather). GPU us a call, both ranks' kernels at once on
streams of their own (CUDA-graph replays, ``bench.timing.graph_replay_us``); every output is checked
against float64 and across the ranks first, and the sharded call's rows against the all-reduce's bit for
bit. As ``scripts/loopback_latency.py``: the peers' buffers are in the same GPU, so only the ratios carry
over to two GPUs, and there is no NCCL baseline here (two GPUs: ``bench kernel``).

Usage: PYTHONPATH=src python3 scripts/sequence_parallel_latency.py
"""

import torch

from tpfuse.bench.timing import graph_replay_us
from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.kernels import layout
from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
from tpfuse.testing import compile_then_start_afresh, local_launch_contexts
from tpfuse.testing.cases import Case, check_results

WORLD, EPS = 2, 1e-6
SUM_ONLY = Epilogue(normed=False)
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
            # the unfused chain: each rank sums its own rows (tpfuse's plain sum kernel, unsharded: a
            # stand-in for the reduce-scatter), adds and norms them, then both ranks' rows are copied whole
            parts = [FusedCall(xs[r][rows[r]].contiguous(), None, weight, 0.0, empty(residual[rows[r]]),
                               empty(residual[rows[r]]), SUM_ONLY) for r in range(WORLD)]
            normed = [None] * WORLD
            gathered = [empty(xs[r]) for r in range(WORLD)]

            def on_ranks(run):
                here = torch.cuda.current_stream()
                for r in range(WORLD):
                    streams[r].wait_stream(here)
                    with torch.cuda.stream(streams[r]):
                        run(r)
                for stream in streams:
                    here.wait_stream(stream)

            def sharded_step():
                on_ranks(lambda r: twoshot_allreduce_add_rmsnorm(contexts[r], sharded[r]))

            def reduced_step():
                on_ranks(lambda r: twoshot_allreduce_add_rmsnorm(contexts[r], reduced[r]))

            def unfused_step():
                def norm(r):
                    twoshot_allreduce_add_rmsnorm(contexts[r], parts[r])
                    normed[r] = add_rmsnorm(parts[r].h, sharded[r].residual, weight)
                on_ranks(norm)
                on_ranks(lambda r: torch.cat([normed[p][0] for p in range(WORLD)], out=gathered[r]))

            compile_then_start_afresh(contexts, sharded_step, reduced_step, unfused_step)
            for call in sharded + reduced:
                call.y.fill_(float("nan"))
                call.h.fill_(float("nan"))
            sharded_step()
            reduced_step()
            torch.cuda.synchronize()
            assert all(c.workspace.state[layout.STATE_ERROR].item() == 0 for c in contexts)
            check_results(case, WORLD, [(c.y, torch.cat([s.h for s in sharded])) for c in sharded])
            for r in range(WORLD):
                assert torch.equal(sharded[r].y, reduced[r].y), (tokens, r)
                assert torch.equal(sharded[r].h, reduced[r].h[rows[r]]), (tokens, r)
            t_sharded, t_reduced, t_unfused = (graph_replay_us(step)
                                               for step in (sharded_step, reduced_step, unfused_step))
            print(f"{tokens:>7} x {hidden:<6} {t_sharded:>10.2f} {t_reduced:>13.2f} {t_unfused:>10.2f} "
                  f"{t_reduced / t_sharded:>18.2f} {t_unfused / t_sharded:>15.2f}")


if __name__ == "__main__":
    main()
