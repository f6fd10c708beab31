"""Where Triton does not import, ``import tpfuse`` still works and every call takes the reference path
(the group's own all-reduce, then the block end in torch): two rank processes with Triton made
unimportable, their results against float64 and bit-identical across ranks."""

import os
import subprocess
import sys

import torch

from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import free_port

CASES = [Case(3, 64, seed=1), Case(2, 128, quant_scale=0.05, bias=True, seed=2),
         Case(3, 256, scale_group=128, scale_layout="packed_ue8m0", normed_copy=True, seed=3),
         Case(2, 64, fp4="mxfp4", residual=False, seed=4)]

_RANK = """
import sys
sys.modules["triton"] = None  # Triton missing: every "import triton" raises ImportError
import torch, torch.distributed as dist
import tpfuse
from tpfuse.kernels import kernels_usable
from test_core_without_triton import CASES
rank, port, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
dist.init_process_group("gloo", rank=rank, world_size=2, init_method=f"tcp://127.0.0.1:{port}")
tpfuse.get_communicator(max_tokens=8, hidden=256)
tpfuse.reset_stats()
results = [case.call(case.inputs(2), rank) for case in CASES]
torch.save({"results": results, "stats": tpfuse.stats(), "usable": kernels_usable(torch.device("cpu")),
            "triton": [name for name, m in sys.modules.items()
                       if name.startswith("triton") and m is not None]}, out)
dist.destroy_process_group()
"""


def test_import_and_the_reference_path_without_triton(tmp_path):
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), *sys.path])}
    ranks = [subprocess.Popen([sys.executable, "-c", _RANK, str(rank), str(port),
                               str(tmp_path / f"{rank}.pt")],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for rank in range(2)]
    for process in ranks:
        out, _ = process.communicate(timeout=120)
        assert process.returncode == 0, out[-3000:]
    done = [torch.load(tmp_path / f"{rank}.pt", weights_only=False) for rank in range(2)]
    for res in done:
        assert res["triton"] == [] and res["usable"] is False, res
        assert res["stats"] == {"reference": len(CASES)}, res["stats"]
    for i, case in enumerate(CASES):
        check_results(case, 2, [res["results"][i] for res in done])
