"""The flashinfer backend (GPU, when FlashInfer imports) agrees with ours and obeys the same limit."""

import pytest
import torch
import torch.distributed as dist

import tpfuse
from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import rank_device


def _flashinfer_available() -> bool:
    if not (torch.cuda.is_available() and torch.cuda.device_count() >= 2):
        return False
    try:
        from tpfuse.comm.flashinfer import load_flashinfer

        load_flashinfer()
        return True
    except ImportError:
        return False


def _both_backends(rank, world_size, cases):
    device = rank_device("nccl", rank)
    # Fresh groups for both: the pool's default-group communicator may have grown in earlier tests.
    ours_group, group = (dist.new_group(list(range(world_size))) for _ in range(2))
    ours = tpfuse.get_communicator(ours_group, max_tokens=1024, hidden=4096)
    theirs = tpfuse.get_communicator(group, max_tokens=1024, hidden=4096, backend="flashinfer")
    limits = {
        h: (ours.max_token_num(h, torch.bfloat16), theirs.max_token_num(h, torch.bfloat16))
        for h in (2048, 4096, 5120)
    }
    tpfuse.reset_stats()
    out = []
    for case in cases:
        inp = case.inputs(world_size, device)
        args = (inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
        out.append(
            [tuple(t.cpu() for t in tpfuse.allreduce_add_rmsnorm(*args, group=g))
             for g in (ours_group, group)]
        )
    stats = tpfuse.stats()
    return {"limits": limits, "outputs": out, "stats": stats}


@pytest.mark.skipif(not _flashinfer_available(), reason="needs 2 GPUs and FlashInfer")
def test_flashinfer_backend_matches_float64_and_our_limit(rank_pool):
    cases = [
        Case(t, h, dtype, residual=t != 3, seed=t)
        for t, h, dtype in (
            (1, 4096, torch.bfloat16),
            (3, 5120, torch.float16),
            (64, 4096, torch.bfloat16),
            (700, 2048, torch.bfloat16),
        )
    ]
    results = rank_pool(2, "nccl").run(_both_backends, cases)
    for res in results:
        assert all(a == b > 0 for a, b in res["limits"].values()), res["limits"]
        assert any(k.startswith("flashinfer.") for k in res["stats"]), res["stats"]
    for i, case in enumerate(cases):
        for backend in range(2):  # FlashInfer's communicator, then ours
            check_results(case, 2, [res["outputs"][i][backend] for res in results])
