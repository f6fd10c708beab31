"""The block end as typed stages: each step a value that owns, in one place, what the step means.

A block end (``blockend.epilogue.Epilogue``, the op's flat keywords: the op schema stays flat) is made of
these stages, in the order the kernels apply them::

    Finalize(experts, topk_weights, shared_expert)   a MoE block's finalize of this rank's part, or none
    Bias(bias)                                       + bias after the sum, or none
    PostNorm(sum_weight)                             rmsnorm(s) * sum_weight before the residual add, or none
    RmsNorm() | LayerNorm(norm_bias) | NoNorm()      y from the rounded h; NoNorm: the call ends at h
      | RmsNormBackward(norm_input, grad_h)          y: the norm's backward, h the summed gradient of its y
    Output (blockend.outputs)                        y unquantised, fp8 (static, dynamic), NVFP4, MXFP4
    NormedCopy()                                     the norm's output beside a quantised y, or none

Each stage owns its keywords (the ``Epilogue`` fields it reads: together the stages own every field once,
as tests/blockend/test_stages.py checks), the checks of its tensors against the call, its descriptor bits
(``flags``: what ranks compare, so every field two ranks could disagree on is there), its kernel switches
(``switches``: the kernels' ``STEPS``), what decides a compiled kernel (``signature``) and its torch
reference step. ``blockend.epilogue.stages_of`` makes the stages of a block end and refuses a combination
that is none; the block end's views (``Epilogue.flags``, ``signature``, ``switches``, ``plain``) are loops
over them. The compiler's graph matcher of each stage is named in ``compiler.matchers.STAGE_MATCHERS``.
Adding a step is a stage class here, its field in ``Epilogue``, its Triton code in ``kernels/epilogue.py``
and its matcher (docs/architecture.md). This module imports only ``blockend.bits``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tpfuse.blockend import bits

__all__ = ["Bias", "Finalize", "LayerNorm", "NoNorm", "NormedCopy", "PostNorm", "RmsNorm", "Stage",
           "check_like_rows", "check_row"]


def _dtype(t: torch.Tensor | None) -> torch.dtype | None:
    return None if t is None else t.dtype


def check_like_rows(name: str, t, shape: torch.Size, device: torch.device, dtype: torch.dtype,
                    dtype_note: str = "") -> None:
    """A [T, H] tensor beside x (the residual, an output, a shared expert): the call's row shape,
    ``dtype``, contiguous, x's device. Raises TypeError / ValueError naming the problem."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a tensor or None, got {type(t).__name__}")
    if t.dtype != dtype:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype}{dtype_note}")
    if t.shape != shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {tuple(shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def check_row(name: str, t, shape: torch.Size, dtype: torch.dtype, device: torch.device) -> None:
    """A row of H that every token shares (a gain or a bias): 1-D, x's dtype or float32, contiguous."""
    if not isinstance(t, torch.Tensor):
        or_none = "" if name == "weight" else " or None"
        raise TypeError(f"{name} must be a tensor{or_none}, got {type(t).__name__}")
    if t.dim() != 1 or t.shape[0] != shape[1]:
        raise ValueError(f"{name} must have shape ({shape[1]},), got {tuple(t.shape)}")
    if t.dtype is not dtype and t.dtype is not torch.float32:
        raise TypeError(f"{name} has dtype {t.dtype}; expected {dtype} or float32")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but x is on {device}")


def rmsnorm(s: torch.Tensor, eps: float) -> torch.Tensor:
    """``s * rsqrt(mean(s * s) + eps)`` by row, in ``s``'s floating type, with the row reductions of
    :func:`row_mean`."""
    return s * torch.rsqrt(row_mean(s * s) + eps)


#: The row reductions' chunk: torch's CPU reductions split one long row over threads (a row of 65536
#: alone summed otherwise than in a batch), never a reduction of this many elements.
_CHUNK = 2048


def row_mean(t: torch.Tensor) -> torch.Tensor:
    """The mean over the last dim, kept, in two stages of at most :data:`_CHUNK` elements (the rest zero
    padding), so that a row's result does not depend on the rows beside it."""
    hidden = t.shape[-1]
    if hidden > _CHUNK:
        t = torch.nn.functional.pad(t, (0, -hidden % _CHUNK)).unflatten(-1, (-1, _CHUNK)).sum(-1)
    return t.sum(-1, keepdim=True) / hidden


class Stage:
    """A block-end stage. Subclasses set :attr:`keywords` and :attr:`off` and override what they do."""

    #: The ``Epilogue`` fields this stage reads (its part of the op's keywords and schema).
    keywords: ClassVar[tuple[str, ...]] = ()
    #: The kernels' switches of this stage where the block end has none of it.
    off: ClassVar[dict] = {}
    #: Its keywords whose tensors have a row a token (a part of the call's rows takes theirs).
    per_row: ClassVar[tuple[str, ...]] = ()
    #: Whether those rows are h's (in a sharded call: this rank's rows only), not x's.
    on_own_rows: ClassVar[bool] = False

    def flags(self, hidden: int) -> int:
        """This stage's descriptor bits (``bits.FLAG_*``)."""
        return 0

    def switches(self, hidden: int) -> dict:
        """This stage's part of the kernels' ``STEPS`` (``epilogue.Switches``)."""
        return {}

    @property
    def signature(self) -> tuple:
        """What about this stage decides a compiled kernel (its variant, its tensors' dtypes)."""
        return (type(self).__name__,)

    def check(self, x: torch.Tensor, shape: torch.Size, device: torch.device) -> None:
        """Raise TypeError / ValueError naming what about this stage's tensors does not fit the call (x,
        its rows ``shape`` [T, H])."""


@dataclass(frozen=True, eq=False)
class Finalize(Stage):
    """A MoE block's finalize of this rank's part before the sum: x [T, K, H] holds each token's K
    experts' outputs (``experts``; 0: x is [T, H]), weighted by ``topk_weights`` [T, K] (or already
    weighted: None) and summed, plus ``shared_expert`` [T, H] (or none), rounded to x's dtype."""

    experts: int
    topk_weights: torch.Tensor | None
    shared_expert: torch.Tensor | None

    keywords: ClassVar[tuple] = ("experts", "topk_weights", "shared_expert")
    per_row: ClassVar[tuple] = ("topk_weights", "shared_expert")
    off: ClassVar[dict] = dict(EXPERTS=0, TOPK_WEIGHTS=False, SHARED_EXPERT=False)

    def flags(self, hidden):
        return (bits.FLAG_MOE_FINALIZE
                | (bits.FLAG_TOPK_WEIGHTS if self.topk_weights is not None else 0)
                | (bits.FLAG_SHARED_EXPERT if self.shared_expert is not None else 0)
                | self.experts << bits.EXPERTS_SHIFT)

    def switches(self, hidden):
        return dict(EXPERTS=self.experts, TOPK_WEIGHTS=self.topk_weights is not None,
                    SHARED_EXPERT=self.shared_expert is not None)

    @property
    def signature(self):
        return ("Finalize", self.experts, _dtype(self.topk_weights), _dtype(self.shared_expert))

    def check(self, x, shape, device):
        if self.experts and x.dim() != 3:
            check_experts(x, self.experts)
        weights = self.topk_weights
        if weights is not None:
            if not isinstance(weights, torch.Tensor):
                raise TypeError(f"topk_weights must be a tensor or None, got {type(weights).__name__}")
            if x.dim() != 3:
                raise ValueError("topk_weights weight the experts' outputs: x must be [tokens, K, hidden], "
                                 f"got shape {tuple(x.shape)}")
            if weights.shape != x.shape[:2]:
                raise ValueError(f"topk_weights has shape {tuple(weights.shape)}; "
                                 f"expected {tuple(x.shape[:2])}")
            if weights.dtype is not x.dtype and weights.dtype is not torch.float32:
                raise TypeError(f"topk_weights has dtype {weights.dtype}; expected {x.dtype} or float32")
            if not weights.is_contiguous():
                raise ValueError("topk_weights must be contiguous")
            if weights.device != device:
                raise ValueError(f"topk_weights is on {weights.device} but x is on {device}")
        if self.shared_expert is not None:
            check_like_rows("shared_expert", self.shared_expert, shape, device, x.dtype)

    def reference(self, x: torch.Tensor, accumulate: torch.dtype) -> torch.Tensor:
        """This rank's part in ``accumulate`` (float32 as the kernels, float64 for the oracle), before its
        rounding to x's dtype: the experts in the kernels' order (one rounding can move an fp8 code)."""
        part = x.to(accumulate)
        if x.dim() == 3:
            if self.topk_weights is not None:
                part = part * self.topk_weights.to(accumulate).unsqueeze(-1)
            experts = part.unbind(1)
            part = experts[0]
            for expert in experts[1:]:
                part = part + expert
        if self.shared_expert is not None:
            part = part + self.shared_expert.to(accumulate)
        return part


def check_experts(x: torch.Tensor, experts: int) -> None:
    """A 3-D x: the [T, K, H] outputs of a MoE block's experts, with ``experts`` K."""
    if len(x.shape) != 3:
        raise ValueError("x must be 2-D [tokens, hidden] (or [tokens, K, hidden] for a MoE finalize), "
                         f"got shape {tuple(x.shape)}")
    if experts != x.shape[1]:
        raise ValueError(f"x has shape {tuple(x.shape)}, the outputs of {x.shape[1]} experts a token: pass "
                         f"experts={x.shape[1]} (got {experts})")
    if x.shape[1] > bits.MAX_EXPERTS:  # K travels in the call descriptor, which ranks compare
        raise ValueError(f"x has shape {tuple(x.shape)}: a MoE finalize takes at most {bits.MAX_EXPERTS} "
                         "experts a token")


class _RowStage(Stage):
    """A stage of the sum with a row [H] of its own (x's dtype or float32): one descriptor bit, one switch."""

    flag: ClassVar[int]
    switch: ClassVar[str]

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.off = {cls.switch: False}  # its one switch, off

    @property
    def row(self) -> torch.Tensor:
        return getattr(self, self.keywords[0])

    def flags(self, hidden):
        return self.flag

    def switches(self, hidden):
        return {self.switch: True}

    @property
    def signature(self):
        return (type(self).__name__, self.row.dtype)

    def check(self, x, shape, device):
        check_row(self.keywords[0], self.row, shape, x.dtype, device)


@dataclass(frozen=True, eq=False)
class Bias(_RowStage):
    """``+ bias`` [H] right after the sum (a row-parallel layer's bias), in x's dtype or float32."""

    bias: torch.Tensor

    keywords: ClassVar[tuple] = ("bias",)
    flag: ClassVar[int] = bits.FLAG_BIAS
    switch: ClassVar[str] = "HAS_BIAS"

    def reference(self, s: torch.Tensor, eps: float) -> torch.Tensor:
        return s + self.bias.to(s.dtype)


@dataclass(frozen=True, eq=False)
class PostNorm(_RowStage):
    """``rmsnorm(s) * sum_weight`` before the residual add (Gemma 2/3's post-norm; pass Gemma's ``1 + w``),
    with the block end's eps."""

    sum_weight: torch.Tensor

    keywords: ClassVar[tuple] = ("sum_weight",)
    flag: ClassVar[int] = bits.FLAG_SUM_NORM
    switch: ClassVar[str] = "SUM_NORM"

    def reference(self, s: torch.Tensor, eps: float) -> torch.Tensor:
        return rmsnorm(s, eps) * self.sum_weight.to(s.dtype)


class Norm(Stage):
    """How ``y`` is made from the rounded ``h``: :class:`RmsNorm`, :class:`LayerNorm`, :class:`NoNorm` or
    :class:`RmsNormBackward`."""

    keywords: ClassVar[tuple] = ("layer_norm", "norm_bias", "normed", "norm_input", "grad_h")
    off: ClassVar[dict] = dict(NORMED=True, LAYER_NORM=False, HAS_NORM_BIAS=False, NORM_BACKWARD=False)
    #: Whether ``y`` is written (NoNorm: the call ends at ``h``; the weight and eps are not read).
    normed: ClassVar[bool] = True

    def reference(self, h: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """y from the rounded ``h``, in ``h``'s floating type (fp32 or float64), before any quantisation."""
        raise NotImplementedError


@dataclass(frozen=True, eq=False)
class RmsNorm(Norm):
    """``y = h * rsqrt(mean(h * h) + eps) * weight``: the plain block end's norm."""

    def switches(self, hidden):
        return self.off

    def reference(self, h, weight, eps):
        return rmsnorm(h, eps) * weight.to(h.dtype)


@dataclass(frozen=True, eq=False)
class LayerNorm(Norm):
    """``y = (h - mean) * rsqrt(var + eps) * weight + norm_bias`` (``norm_bias`` [H] or none)."""

    norm_bias: torch.Tensor | None = None

    def flags(self, hidden):
        return bits.FLAG_LAYER_NORM | (bits.FLAG_NORM_BIAS if self.norm_bias is not None else 0)

    def switches(self, hidden):
        return {**self.off, "LAYER_NORM": True, "HAS_NORM_BIAS": self.norm_bias is not None}

    @property
    def signature(self):
        return ("LayerNorm", _dtype(self.norm_bias))

    def check(self, x, shape, device):
        if self.norm_bias is not None:
            check_row("norm_bias", self.norm_bias, shape, x.dtype, device)

    def reference(self, h, weight, eps):
        y = rmsnorm(h - row_mean(h), eps) * weight.to(h.dtype)
        return y if self.norm_bias is None else y + self.norm_bias.to(h.dtype)


@dataclass(frozen=True, eq=False)
class NoNorm(Norm):
    """No norm: the call ends at ``h`` (a plain all-reduce, with the steps before the norm if any)."""

    normed: ClassVar[bool] = False

    def flags(self, hidden):
        return bits.FLAG_NO_NORM

    def switches(self, hidden):
        return {**self.off, "NORMED": False}


@dataclass(frozen=True, eq=False)
class RmsNormBackward(Norm):
    """RMSNorm's backward in the norm's place: the call's x holds each rank's part of the gradient of a
    norm's output, the sum (the call's ``h``, rounded) is that gradient, and

        y = grad_h + r * (h * w - norm_input * mean(h * w * norm_input) * r * r),
        r = rsqrt(mean(norm_input * norm_input) + eps)

    is the gradient of the norm's input ``norm_input`` [T, H] (the h its forward returned) plus ``grad_h``
    [T, H] (the gradient reaching it by the residual stream), in x's dtype. The backward of a
    block end whose next layer hands back a partial gradient: one all-reduce and the norm's backward in
    one kernel (docs/training.md)."""

    norm_input: torch.Tensor
    grad_h: torch.Tensor

    per_row: ClassVar[tuple] = ("norm_input", "grad_h")
    on_own_rows: ClassVar[bool] = True

    def flags(self, hidden):
        return bits.FLAG_NORM_BACKWARD

    def switches(self, hidden):
        return {**self.off, "NORM_BACKWARD": True}

    def check(self, x, shape, device):
        check_like_rows("norm_input", self.norm_input, shape, device, x.dtype)
        check_like_rows("grad_h", self.grad_h, shape, device, x.dtype)

    def reference(self, h, weight, eps):
        a = self.norm_input.to(h.dtype)
        r = torch.rsqrt(row_mean(a * a) + eps)
        gw = h * weight.to(h.dtype)
        return self.grad_h.to(h.dtype) + r * (gw - a * row_mean(gw * a) * r * r)


@dataclass(frozen=True, eq=False)
class NormedCopy(Stage):
    """The norm's output before quantisation also written, in x's dtype, beside a quantised ``y`` (a normed
    row that feeds a quantised GEMM and something else)."""

    keywords: ClassVar[tuple] = ("normed_copy",)
    off: ClassVar[dict] = dict(NORMED_COPY=False)

    def flags(self, hidden):
        return bits.FLAG_NORMED_COPY

    def switches(self, hidden):
        return dict(NORMED_COPY=True)


RMSNORM, NO_NORM, NORMED_COPY = RmsNorm(), NoNorm(), NormedCopy()
