"""tpfuse: fused all-reduce + residual add + RMSNorm for tensor-parallel inference.

    import tpfuse
    comm = tpfuse.get_communicator(group)              # once, before any CUDA-graph capture
    y, h = tpfuse.allreduce_add_rmsnorm(x, residual, weight, eps, group=group)
    model = tpfuse.compile(model)                      # the fusion in any TP model (tpfuse.compiler)
"""

from tpfuse._stats import reset_stats, stats
from tpfuse.comm import Communicator, check_errors, destroy_all, get_communicator
from tpfuse.compiler import compile, explain
from tpfuse.ops import allreduce_add_rmsnorm, allreduce_add_rmsnorm_dynamic_fp8

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "allreduce_add_rmsnorm",
    "allreduce_add_rmsnorm_dynamic_fp8",
    "check_errors",
    "compile",
    "destroy_all",
    "explain",
    "get_communicator",
    "reset_stats",
    "stats",
]
