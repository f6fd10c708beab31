import pytest
import torch

from tpfuse.testing.ranks import RankPool

_pools: dict[tuple[int, str], RankPool] = {}


def pytest_addoption(parser):
    parser.addoption("--reverse", action="store_true",
                     help="run the selected tests in reverse order "
                          "(a check that no test needs another first)")


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """``rank_pool(world_size, backend)``: a live pool, reused across tests, replaced after a failure.

    Every task starts in a rank process reset as a new one is (``ranks.reset_rank_process``), with an
    Inductor cache of its own: the fusion pass runs (and counts) in each task on every rank, instead
    of a rank loading a graph that another rank, or an earlier test, cached. So a test sees the same
    whether it runs first, after others, or in a pool that replaced one an earlier failure killed.
    """

    def get(world_size: int, backend: str = "gloo") -> RankPool:
        if backend == "nccl" and torch.cuda.device_count() < world_size:
            pytest.skip(f"needs {world_size} GPUs")
        key = (world_size, backend)
        if key not in _pools or not _pools[key].alive:
            cache = tmp_path_factory.mktemp("inductor-cache")
            # A peer may still be compiling its graph when the other's first fused call waits for it: on a
            # loaded machine longer than the default 10 s bound (seen 2026-12-04 under load 10-60 on 2
            # cores: three HF models failed so). Tests of the bound pass wait_timeout_s themselves.
            env = {"TORCHINDUCTOR_CACHE_DIR": f"{cache}/rank{{rank}}/task{{task}}",
                   "TPFUSE_WAIT_TIMEOUT_S": "300"}
            _pools[key] = RankPool(world_size, backend, env=env)
        return _pools[key]

    yield get
    for pool in _pools.values():
        pool.close()
    _pools.clear()


def pytest_collection_modifyitems(config, items):
    """Two lanes: tests that start rank processes are ``slow``; ``pytest -m "not slow"`` runs the rest.
    With ``--reverse``, the tests run last first."""
    for item in items:
        if "rank_pool" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)
    if config.getoption("--reverse"):
        items.reverse()
