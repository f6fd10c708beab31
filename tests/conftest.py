import pytest
import torch

from tpfuse.testing.ranks import RankPool

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



def pytest_collection_modifyitems(items):
    """Two lanes: tests that start rank processes are ``slow``; ``pytest -m "not slow"`` runs the rest."""
    for item in items:
        if "rank_pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
