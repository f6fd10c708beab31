"""Two ranks on one GPU: a block end's backward fused (``tpfuse.allreduce_rmsnorm_backward``'s kernel: the
sum of y's gradient parts, RMSNorm's backward, + grad_h, in one launch a rank) against it unfused (tpfuse's
plain all-reduce kernel, then RMSNorm's backward compiled by Inductor, as a compiled trainer's backward
runs it). GPU us a call, both ranks' kernels at once on streams of their own (CUDA-graph replays,
``bench.timing.graph_replay_us``); every output is checked against float64 and across the ranks first.
As ``scripts/loopback_latency.py``: the peers' buffers are in the same GPU, so only the ratio carries over
to two GPUs.

Usage: PYTHONPATH=src python3 scripts/backward_latency.py
"""

import torch

from tpfuse.bench.timing import graph_replay_us
from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.kernels import layout
from tpfuse.kernels.oneshot import oneshot_allreduce_add_rmsnorm
from tpfuse.kernels.twoshot import twoshot_allreduce_add_rmsnorm
from tpfuse.testing import compile_then_start_afresh, local_launch_contexts, on_rank_streams

WORLD, EPS = 2, 1e-5
SUM_ONLY = Epilogue(normed=False)


@torch.compile(dynamic=False)
def rmsnorm_backward(g, a, weight, grad_h):
    """RMSNorm's backward (+ grad_h) as Inductor compiles it: one kernel."""
    a32, gw = a.float(), g.float() * weight.float()
    r = torch.rsqrt(a32.pow(2).mean(-1, keepdim=True) + EPS)
    return (grad_h.float() + r * (gw - a32 * (gw * a32).mean(-1, keepdim=True) * r * r)).to(a.dtype)


def main() -> None:
    torch._dynamo.config.cache_size_limit = 64  # rmsnorm_backward: one graph a shape
    device = torch.device("cuda")
    contexts = local_launch_contexts(device, 512 * 8192, WORLD)
    streams = [torch.cuda.Stream() for _ in range(WORLD)]
    print(f"{'tokens x hidden':>16} {'fused us':>9} {'unfused us':>10} {'unfused/fused':>13}")
    for hidden in (4096, 8192):
        for tokens in (1, 8, 64, 512):
            g = torch.Generator(device="cpu").manual_seed(tokens + hidden)
            parts = [torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
                     for _ in range(WORLD)]
            a = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
            grad_h = torch.randn(tokens, hidden, generator=g).to(device, torch.bfloat16)
            weight = (1 + 0.1 * torch.randn(hidden, generator=g)).to(device, torch.bfloat16)
            epilogue = Epilogue(norm_input=a, grad_h=grad_h)
            launch = oneshot_allreduce_add_rmsnorm if tokens <= 8 else twoshot_allreduce_add_rmsnorm
            fused = [FusedCall(parts[r], None, weight, EPS, torch.empty_like(a), torch.empty_like(a),
                               epilogue) for r in range(WORLD)]
            summed = [FusedCall(parts[r], None, parts[r], 0.0, torch.empty_like(a), torch.empty_like(a),
                                SUM_ONLY) for r in range(WORLD)]
            unfused_out = [None] * WORLD

            def fused_step():
                on_rank_streams(streams, lambda r: launch(contexts[r], fused[r]))

            def unfused_step():
                def run(r):
                    launch(contexts[r], summed[r])
                    unfused_out[r] = rmsnorm_backward(summed[r].h, a, weight, grad_h)
                on_rank_streams(streams, run)

            compile_then_start_afresh(contexts, fused_step, unfused_step)
            for call in fused:
                call.y.fill_(float("nan"))
            fused_step()
            unfused_step()
            torch.cuda.synchronize()
            assert all(c.workspace.state[layout.STATE_ERROR].item() == 0 for c in contexts)
            a64 = a.double().cpu().requires_grad_()
            (a64 * torch.rsqrt((a64 * a64).mean(-1, keepdim=True) + EPS) * weight.double().cpu()).backward(
                torch.stack([p.double().cpu() for p in parts]).sum(0))
            expected = a64.grad + grad_h.double().cpu()
            for r in range(WORLD):
                error = ((fused[r].y.double().cpu() - expected).abs().max() / expected.abs().max()).item()
                assert error < 1e-2, (tokens, hidden, r, error)
                assert torch.equal(fused[r].y, fused[0].y) and torch.equal(fused[r].h, fused[0].h)
                assert torch.equal(unfused_out[r], unfused_out[0])
            t_fused, t_unfused = graph_replay_us(fused_step), graph_replay_us(unfused_step)
            ratio = t_unfused / t_fused
            print(f"{tokens:>7} x {hidden:<6} {t_fused:>9.2f} {t_unfused:>10.2f} {ratio:>13.2f}")


if __name__ == "__main__":
    main()
