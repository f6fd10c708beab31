"""The fused op's one contract: ``tpfuse.allreduce_add_rmsnorm`` and its ``torch.library`` ops."""

from tpfuse.ops.allreduce_add_rmsnorm import allreduce_add_rmsnorm, allreduce_add_rmsnorm_dynamic_fp8

__all__ = ["allreduce_add_rmsnorm", "allreduce_add_rmsnorm_dynamic_fp8"]
