import pytest
import torch

from tpfuse.testing import RankPool, rank_device  # noqa: F401 - rank_device is imported by the tests

# Ranks run as processes: gloo on the CPU (kernels under the Triton interpreter) always, NCCL on GPUs
# when this machine has at least two.
BACKENDS = ["gloo"] + (["nccl"] if torch.cuda.is_available() and torch.cuda.device_count() >= 2 else [])

_pools: dict[tuple[int, str], RankPool] = {}


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """``rank_pool(world_size, backend)``: a live pool, reused across tests, replaced after a failure."""

    def get(world_size: int, backend: str = "gloo") -> RankPool:
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} GPUs")
        key = (world_size, backend)
        if key not in _pools or not _pools[key].alive:
            # A fresh Inductor cache per rank: the fusion pass runs (and counts) on every rank instead of
            # one rank loading the graph another rank just cached.
            cache = tmp_path_factory.mktemp("inductor-cache")
            env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/rank{{rank}}"}
            _pools[key] = RankPool(world_size, backend, env=env)
        return _pools[key]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()

