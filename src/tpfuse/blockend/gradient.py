"""The block end's gradient, in torch: what every input of a fused call receives, given the gradients of
``y`` and ``h``.

The contract is tensor parallelism's (Megatron's and DTensor's row-parallel layers): the forward sums the
ranks' partial ``x``; the gradients reaching ``y`` and ``h`` are replicated (every rank holds the same), and
every rank's ``x`` receives the gradient of the sum. With ``r = rsqrt(mean(h * h) + eps)`` from the rounded
``h`` the call returned::

    g_h' = g_h + d norm(h)/dh [g_y]           # RMSNorm: r * (g_y*w - h * mean(g_y*w*h) * r*r)
    g_w  = sum over rows of g_y * d y/dw      # each rank's own: the weight is replicated
    g_t  = g_h' through the post-norm (if any)   (t = sum + bias, the post-norm's input)
    g_bias = sum over rows of g_t;  g_x = g_t (or through the MoE finalize);  g_residual = g_h'
    g_topk_weights = sum over H of x_k * g_t   # this rank's part: the caller sums the ranks' parts

Where the gradient reaching ``y`` is each rank's part instead (``y_grad="partial"``), its sum and the
norm's backward are one fused call (``stages.RmsNormBackward``) and the rest starts from its result
(:func:`sum_backward`). Every step is in fp32 and row by row (the rows' reductions have the shapes of
the forward's, ``stages.row_mean``), so a row's gradients depend on its own inputs only; the weights'
and biases' gradients sum over rows. Quantised outputs have no gradient. This module needs no process
group: the post-norm's input, which the forward does not keep, is handed in by the caller (``ops.gradient``).
"""

from __future__ import annotations

import torch

from tpfuse.blockend.epilogue import Epilogue
from tpfuse.blockend.stages import rmsnorm, row_mean


def _grad(output: torch.Tensor, inputs: list, grad_output: torch.Tensor) -> list:
    """d output / d inputs [grad_output] for the inputs that are tensors (None elsewhere)."""
    wanted = [t for t in inputs if t is not None]
    got = iter(torch.autograd.grad(output, wanted, grad_output, allow_unused=True))
    return [None if t is None else next(got) for t in inputs]


def _leaf(t: torch.Tensor | None) -> torch.Tensor | None:
    return None if t is None else t.detach().float().requires_grad_()


def block_end_backward(epilogue: Epilogue, x: torch.Tensor, h: torch.Tensor, weight: torch.Tensor,
                       eps: float, g_y: torch.Tensor, g_h: torch.Tensor,
                       post_norm_input: torch.Tensor | None = None) -> dict:
    """The gradients of a call's inputs, fp32, by name: ``x``, ``residual``, ``weight``, and the block
    end's ``bias``, ``sum_weight``, ``norm_bias``, ``topk_weights``, ``shared_expert`` where it has them.

    ``h`` is the rounded [T, H] the forward returned, ``g_y`` / ``g_h`` the replicated gradients of ``y`` and
    ``h``; ``post_norm_input`` the post-norm's input ``sum + bias`` [T, H] (only with a post-norm).
    Raises ValueError for a quantised block end.
    """
    if epilogue.quantised:
        raise ValueError("a quantised y has no gradient: run the block end unquantised where it trains")
    grads = {}
    g_rows = g_h.float()
    if epilogue.normed:
        with torch.enable_grad():
            rows, gain = _leaf(h), _leaf(weight)
            norm_bias = _leaf(getattr(epilogue.stages.norm, "norm_bias", None))
            y = rmsnorm(rows - row_mean(rows), eps) if epilogue.layer_norm else rmsnorm(rows, eps)
            y = y * gain + (norm_bias if norm_bias is not None else 0)
            g_in, grads["weight"], grads["norm_bias"] = _grad(y, [rows, gain, norm_bias], g_y.float())
        g_rows = g_rows + g_in
    return grads | sum_backward(epilogue, x, g_rows, eps, post_norm_input)


def rmsnorm_weight_grad(h: torch.Tensor, g_y: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm's weight gradient, fp32: the sum over rows of ``g_y * h * r`` (``h`` the norm's input,
    ``g_y`` the gradient of its output, summed over the ranks)."""
    rows = h.float()
    return (g_y.float() * rmsnorm(rows, eps)).sum(0)


def sum_backward(epilogue: Epilogue, x: torch.Tensor, g_rows: torch.Tensor, eps: float,
                 post_norm_input: torch.Tensor | None = None) -> dict:
    """The gradients of what comes before the residual add, fp32, from ``g_rows`` (the gradient of h,
    the norm's part included): ``residual``, the post-norm's ``sum_weight``, ``bias``, ``x`` and the MoE
    finalize's ``topk_weights`` (this rank's part) and ``shared_expert``."""
    stages = epilogue.stages
    grads = {"residual": g_rows}
    g_t = g_rows
    if stages.post_norm is not None:
        if post_norm_input is None:
            raise ValueError("a post-norm's gradient needs its input (sum + bias)")
        with torch.enable_grad():
            t, gain = _leaf(post_norm_input), _leaf(stages.post_norm.sum_weight)
            g_t, grads["sum_weight"] = _grad(rmsnorm(t, eps) * gain, [t, gain], g_rows)
    if stages.bias is not None:
        grads["bias"] = g_t.sum(0)
    finalize = stages.finalize
    if finalize is None:
        grads["x"] = g_t
    else:
        grads["x"], grads["topk_weights"], grads["shared_expert"] = _finalize_backward(finalize, x, g_t)
    return grads


def _finalize_backward(finalize, x: torch.Tensor, g_part: torch.Tensor) -> tuple:
    """(g_x [T, K, H] or [T, H], g_topk_weights [T, K] or None, g_shared_expert or None) of a MoE finalize
    ``part = sum_k w_k * x_k + shared``, given the gradient of ``part``."""
    shared = g_part if finalize.shared_expert is not None else None
    if x.dim() == 2:
        return g_part, None, shared
    g_x = g_part.unsqueeze(1).expand(x.shape)
    g_weights = None
    if finalize.topk_weights is not None:
        g_x = g_x * finalize.topk_weights.float().unsqueeze(-1)
        g_weights = (x.float() * g_part.unsqueeze(1)).sum(-1)
    return g_x, g_weights, shared
