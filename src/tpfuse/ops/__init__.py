"""The fused op's one contract: ``tpfuse.allreduce_add_rmsnorm`` and its ``torch.library`` ops."""

from tpfuse.ops.allreduce_add_rmsnorm import (
                                              QuantizedOutputs,
                                              all_reduce,
                                              allreduce_add_rmsnorm,
                                              allreduce_add_rmsnorm_dynamic_fp8,
                                              allreduce_add_rmsnorm_quant,
                                              allreduce_rmsnorm_backward,
)
from tpfuse.ops.quantize import quantize_fp4
from tpfuse.ops.sequence_parallel import (
    reduce_scatter_add_rmsnorm_all_gather,
    reduce_scatter_add_rmsnorm_all_gather_quant,
    reduce_scatter_rmsnorm_backward_all_gather,
)

__all__ = ["QuantizedOutputs", "all_reduce", "allreduce_add_rmsnorm", "allreduce_add_rmsnorm_dynamic_fp8",
           "allreduce_add_rmsnorm_quant", "allreduce_rmsnorm_backward", "quantize_fp4",
           "reduce_scatter_add_rmsnorm_all_gather", "reduce_scatter_add_rmsnorm_all_gather_quant",
           "reduce_scatter_rmsnorm_backward_all_gather"]
