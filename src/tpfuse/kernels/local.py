"""The block end alone, for a group of one rank (tensor parallelism of 1): nothing to sum or send.

The same model run at TP=1 still calls the fused op at every block end; here it is one kernel that
reads x (the whole sum, or a MoE block's experts to finalize) and the residual once and writes y and h, with
every step of
``kernels/epilogue.py``, as the one-shot kernel computes them. No workspace, no communicator needed.
"""

from __future__ import annotations

import operator

import triton
import triton.language as tl

from tpfuse.blockend.call import FusedCall
from tpfuse.kernels.epilogue import _before_residual, _load_params, _partial_row, _store_h_and_normed
from tpfuse.kernels.launch import LaunchPlan, kept_plan, launch
from tpfuse.kernels.protocol import launch_config


@triton.jit
def _local_add_rmsnorm_kernel(
    x_ptr, residual_ptr, weight_ptr, y_ptr, h_ptr, steps, hidden, eps,
    BLOCK_H: tl.constexpr, HAS_RESIDUAL: tl.constexpr, STEPS: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden
    offs = row.to(tl.int64) * hidden + cols
    params = _load_params(weight_ptr, steps, cols, mask, tl.num_programs(0), STEPS)  # a program a row
    h = _partial_row(x_ptr, steps, row, cols, mask, hidden, STEPS)
    h = _before_residual(h, params, hidden, eps, STEPS)
    if HAS_RESIDUAL:
        h += tl.load(residual_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _store_h_and_normed(h, params, y_ptr, h_ptr, steps, row, offs, offs, mask, hidden, eps, STEPS,
                        BLOCK_H)


_plans: dict = {}
#: The local kernel's runtime scalars of a call.
_HIDDEN_AND_EPS = operator.attrgetter("hidden", "eps")


def _local_plan(call: FusedCall) -> LaunchPlan:
    block_h, num_warps, _ = launch_config(call.hidden, call.x.device, pdl=False)
    return LaunchPlan(_local_add_rmsnorm_kernel, call.n_tokens, _HIDDEN_AND_EPS,
                      dict(BLOCK_H=block_h, HAS_RESIDUAL=call.residual is not None,
                           STEPS=call.epilogue.switches(call.hidden)),
                      dict(num_warps=num_warps))


def local_add_rmsnorm(call: FusedCall) -> None:
    """Write ``call``'s outputs from ``x`` alone (the sum over one rank): one program a row."""
    n_tokens = call.n_tokens
    if n_tokens == 0:
        return
    plan = kept_plan(_plans, (call.x.device, n_tokens, call.kernel_key()), _local_plan, call)
    launch(plan, call)
