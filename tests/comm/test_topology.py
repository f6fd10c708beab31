"""A group whose ranks cannot map each other's memory (ranks on different hosts) runs on the reference
path."""

import logging

import pytest
import torch

import tpfuse
from tpfuse.testing.cases import Case, check_results


def _on_hosts(rank, world_size, hosts):
    from tpfuse.comm import topology

    # What this rank reports (the ranks run on one machine); put back after, for the pool's later tests.
    own_host_name, topology.host_name = topology.host_name, lambda: hosts[rank]
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("tpfuse.comm.topology").addHandler(handler)
    logging.getLogger("tpfuse.comm.topology").setLevel(logging.INFO)
    try:
        comm = tpfuse.get_communicator(max_tokens=8, hidden=512)
        tpfuse.reset_stats()
        case = Case(5, 512, torch.bfloat16, seed=11)
        y, h = case.call(case.inputs(world_size), rank)
        comm.check_errors()
        result = {"fused": comm.fused_backend is not None, "workspace_bytes": comm.workspace_bytes,
                  "outputs": (y, h), "stats": tpfuse.stats(), "log": [r.getMessage() for r in records]}
        comm.destroy()
        return result
    finally:
        topology.host_name = own_host_name
        logging.getLogger("tpfuse.comm.topology").removeHandler(handler)


# (One host: every other test of the triton backend.)
@pytest.mark.parametrize("world_size, hosts",
                         [(2, ["node-a", "node-b"]), (3, ["node-a", "node-a", "node-b"])])
def test_ranks_on_different_hosts_take_the_reference_path(rank_pool, world_size, hosts):
    results = rank_pool(world_size).run(_on_hosts, hosts)
    case = Case(5, 512, torch.bfloat16, seed=11)
    check_results(case, world_size, [res["outputs"] for res in results])  # right, every rank, bit-identical
    apart = len(set(hosts)) > 1
    for rank, res in enumerate(results):
        assert res["fused"] is not apart and (res["workspace_bytes"] == 0) is apart
        assert res["stats"] == ({"reference": 1} if apart else {"triton.oneshot": 1}), res["stats"]
        said = [line for line in res["log"] if "cannot map each other's memory" in line]
        assert len(said) == (1 if apart and rank == 0 else 0), res["log"]
    if apart:
        assert f"on {len(set(hosts))} hosts" in results[0]["log"][0]
