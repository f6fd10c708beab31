"""The fused op's one contract: ``tpfuse.allreduce_add_rmsnorm`` and its ``torch.library`` ops."""

from tpfuse.ops.allreduce_add_rmsnorm import all_reduce, allreduce_add_rmsnorm, allreduce_add_rmsnorm_dynamic_fp8

__all__ = ["all_reduce", "allreduce_add_rmsnorm", "allreduce_add_rmsnorm_dynamic_fp8"]
