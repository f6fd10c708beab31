"""The fused op's one contract: ``tpfuse.allreduce_add_rmsnorm`` and its ``torch.library`` ops."""

from tpfuse.ops.allreduce_add_rmsnorm import allreduce_add_rmsnorm

__all__ = ["allreduce_add_rmsnorm"]
