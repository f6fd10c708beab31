"""The optional FlashInfer backend: FlashInfer's fused all-reduce kernels behind tpfuse's communicator.

FlashInfer is never required. When ``flashinfer.comm.trtllm_ar`` imports (CUDA only), a communicator
created with ``backend="flashinfer"`` owns one FlashInfer workspace, sized like ours, created once
and destroyed only by :meth:`tpfuse.comm.Communicator.destroy`. Its calls obey the same fusion limit
(:func:`tpfuse.select.max_token_num`) and the same one-shot / two-shot choice as the Triton backend.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from tpfuse.blockend.call import FusedCall
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.comm.backend import FusedBackend
from tpfuse.select import ONESHOT


def load_flashinfer():
    """FlashInfer's all-reduce module, or raise ImportError saying why it cannot be used."""
    try:
        import flashinfer.comm.trtllm_ar as fi

        fi.get_trtllm_comm_module()  # builds or loads the compiled kernels
    except Exception as exc:  # an import, a missing build or a CUDA problem: all mean "not usable"
        raise ImportError(
            f"flashinfer's fused all-reduce is not usable: {type(exc).__name__}: {exc}"
        ) from exc
    return fi


class FlashInferBackend(FusedBackend):
    """FlashInfer's kernels over one IPC workspace for ``max_tokens`` rows of up to ``hidden`` elements
    (collective to create). Only the plain epilogue (residual add and RMSNorm) is wired: fp8 output, the
    epilogue's other steps and empty calls take the reference path."""

    name = "flashinfer"

    def __init__(self, group: dist.ProcessGroup, max_tokens: int, hidden: int):
        self._fi = load_flashinfer()
        self.rank, self.world_size = dist.get_rank(group), dist.get_world_size(group)
        self.max_tokens, self.hidden = max_tokens, hidden
        self._ipc_handles, self._workspace = self._fi.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            self.rank, self.world_size, max_tokens, hidden, group=group
        )[:2]

    @property
    def region_bytes(self) -> int:
        return self.max_tokens * self.hidden * 2 if self._ipc_handles is not None else 0

    def takes(self, n_tokens: int, epilogue: Epilogue) -> bool:
        return n_tokens > 0 and epilogue.quant_scale is None and epilogue.plain

    def run(self, algorithm: str, call: FusedCall) -> None:
        assert call.epilogue.quant_scale is None and call.epilogue.plain, \
            "takes() refuses fp8 output and other block ends"
        x, residual, weight = call.x, call.residual, call.weight
        n_tokens, hidden = x.shape
        fi = self._fi
        fi.trtllm_allreduce_fusion(
            allreduce_in=x,
            world_size=self.world_size,
            world_rank=self.rank,
            token_num=n_tokens,
            hidden_dim=hidden,
            workspace_ptrs=self._workspace,
            launch_with_pdl=True,
            trigger_completion_at_end=True,
            fp32_acc=True,
            pattern_code=fi.AllReduceFusionPattern.kARResidualRMSNorm,
            use_oneshot=algorithm == ONESHOT,
            allreduce_out=None,
            residual_in=residual if residual is not None else torch.zeros_like(x),
            residual_out=call.h,
            norm_out=call.y,
            quant_out=None,
            scale_out=None,
            rms_gamma=weight if weight.dtype == x.dtype else weight.to(x.dtype),
            rms_eps=call.eps,
            scale_factor=None,
            layout_code=None,
        )

    def release(self) -> None:
        if self._ipc_handles is not None:
            self._fi.trtllm_destroy_ipc_workspace_for_all_reduce_fusion(self._ipc_handles)
            self._ipc_handles = self._workspace = None
