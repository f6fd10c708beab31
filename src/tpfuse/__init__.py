"""tpfuse: fused all-reduce + residual add + RMSNorm for tensor-parallel inference.

    import tpfuse
    comm = tpfuse.get_communicator(group)              # once, before any CUDA-graph capture
    y, h = tpfuse.allreduce_add_rmsnorm(x, residual, weight, eps, group=group)
    model = tpfuse.compile(model)                      # the fusion in any TP model (tpfuse.compiler);
                                                       # also a function: tpfuse.compile(decode_one_token)
    model.generation_config.compile_config = tpfuse.compile_config(model)   # HF generate()'s own compile
"""

from tpfuse._stats import reset_stats, stats
from tpfuse.comm import Communicator, check_errors, destroy_all, get_communicator
from tpfuse.compiler import compile, compile_config, explain
from tpfuse.engines import vllm_fusion_pass
from tpfuse.ops import (
    QuantizedOutputs,
    all_reduce,
    allreduce_add_rmsnorm,
    allreduce_add_rmsnorm_dynamic_fp8,
    allreduce_add_rmsnorm_quant,
    allreduce_rmsnorm_backward,
    quantize_fp4,
    reduce_scatter_add_rmsnorm_all_gather,
    reduce_scatter_add_rmsnorm_all_gather_quant,
    reduce_scatter_rmsnorm_backward_all_gather,
)
from tpfuse.ops.determinism import batch_invariant, set_batch_invariant

__version__ = "0.1.0"

__all__ = [
    "Communicator",
    "QuantizedOutputs",
    "all_reduce",
    "allreduce_add_rmsnorm",
    "allreduce_add_rmsnorm_dynamic_fp8",
    "allreduce_add_rmsnorm_quant",
    "allreduce_rmsnorm_backward",
    "batch_invariant",
    "check_errors",
    "compile",
    "compile_config",
    "destroy_all",
    "explain",
    "get_communicator",
    "quantize_fp4",
    "reduce_scatter_add_rmsnorm_all_gather",
    "reduce_scatter_add_rmsnorm_all_gather_quant",
    "reduce_scatter_rmsnorm_backward_all_gather",
    "reset_stats",
    "set_batch_invariant",
    "stats",
    "vllm_fusion_pass",
]
