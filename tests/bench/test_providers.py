"""``bench kernel --epilogue``: every provider computes the block end it is timed for (2 CPU ranks).

The benchmark itself needs GPUs (CUDA graphs); what it times is checked here, with the same inputs and
the same error measure, so a GPU run never times a provider that computes something else.
"""

import pytest
import torch

from tpfuse.bench.providers import EPILOGUES

PROVIDERS = ["tpfuse", "tpfuse:oneshot", "tpfuse:twoshot", "nccl", "tpfuse:sp", "nccl_sp"]


def _errors(rank, world_size, tokens, hidden):
    import torch.distributed as dist

    from tpfuse.bench.kernel import bench_inputs, relative_error
    from tpfuse.bench.providers import Providers
    from tpfuse.blockend.reference import add_rmsnorm_reference

    resources = Providers(PROVIDERS, tokens, hidden)
    resources._norm = add_rmsnorm_reference  # eager: compiling the baselines' norm would add minutes
    errors = {}
    for epilogue in EPILOGUES:
        case, inputs, y_ref = bench_inputs(epilogue, tokens, hidden, world_size, rank, torch.device("cpu"))
        calls = resources.calls(case, inputs, epilogue == "two_branches")
        errors[epilogue] = {name: relative_error(case, call(), y_ref) for name, call in calls.items()}
    dist.barrier()
    resources.release()
    return errors


@pytest.mark.extended  # a bench harness: CI leaves it to scripts/gpu_check.sh tests
@pytest.mark.parametrize("tokens", [3, 6])  # fewer tokens than the CPU's 4 programs, and more
def test_every_provider_computes_each_epilogue(rank_pool, tokens):
    for errors in rank_pool(2).run(_errors, tokens, 256):
        assert set(errors) == set(EPILOGUES)
        for epilogue, per_provider in errors.items():
            # sequence parallel's providers: the plain block end of an even number of rows
            sharded = {"tpfuse:sp", "nccl_rs+norm+ag"} if epilogue == "plain" and tokens % 2 == 0 else set()
            assert set(per_provider) == {"tpfuse", "tpfuse:oneshot", "tpfuse:twoshot", "nccl+norm"} | sharded
            bound = 0.05 if epilogue.startswith("fp8") else 0.01  # of |y|: fp8 keeps 3 bits
            assert all(err < bound for err in per_provider.values()), (epilogue, per_provider)
