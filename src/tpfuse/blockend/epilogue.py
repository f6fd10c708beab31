"""What a fused call does with the sum of a row, shared by the one-shot and two-shot kernels.

For each row, in fp32, with every step but the sum optional::

    x = sum over k of topk_weights[k] * x[k] + shared_expert   # a MoE block's finalize, on each rank,
                                                    #   rounded to x's dtype (x [T, K, H]: the top-k
                                                    #   experts' outputs)
    s = sum over ranks of x
    s = s + bias                                    # a row-parallel layer's bias, added once after the sum
    s = rmsnorm(s) * sum_weight                     # Gemma 2/3's post-norm, before the residual add
    h = s + residual
    y = rmsnorm(h) * weight                         # or LayerNorm: (h - mean) * rstd * weight + norm_bias
                                                    #   (none: a plain all-reduce ends at h)
    y = fp8(y / scale)                              # static: one scale for all
      | fp8(y / s_g), s_g = max(amax_g / 448, 1 / (448 * 512))    # dynamic: per token or per group
                                                    #   (s_g rounded up to a power of two: UE8M0)
      | e2m1(y * g / s_g), s_g = e4m3(amax_16 / 6 * g)            # NVFP4 (g: the global scale)
      | e2m1(y / s_g), s_g = 2**(floor(log2(amax_32)) - 2)        # MXFP4 (s_g an e8m0 exponent)
    normed = y before quantisation, in x's dtype    # optional: the norm's output beside its quantised one

fp8 is the device's (``tpfuse.targets.fp8_format``): float8_e4m3fn, or float8_e4m3fnuz on gfx942
(MI300), where 240 takes 448's place; the kernels take their compile target's (``vendor.fp8_max``).

Dynamic scales go where the next GEMM reads them (``scale_layout``): rows ``[T, G]`` float32;
columns (float32 ``[T, G]`` stored column-major, T padded to 4: DeepGEMM's fp8 GEMMs on Hopper); or
UE8M0 exponents packed four to an int32, column-major, T padded to 4 (DeepGEMM on Blackwell). fp4 ``y``
is two e2m1 codes a byte (the even column in the low nibble), ``[T, H / 2]`` uint8; NVFP4's e4m3 scales
are in the 128 x 4 tiles Blackwell's FP4 GEMMs read (``codecs.swizzle_block_scales``), MXFP4's e8m0
scales row-major ``[T, H / 32]``, or (``SCALES_SHUFFLED``) in the order AITER's MXFP4 GEMMs read them
(``codecs.shuffle_e8m0_scales``, AITER's ``e8m0_shuffle``). Every GPU converts to e2m1 and e8m0 here
in integer arithmetic (the same code the CPU interpreter runs); Blackwell
(``cvt.rn.satfinite.e2m1x2.f32``) and gfx950 have conversions of their own, which these kernels do not
use.

:class:`Epilogue` carries the optional steps; ``blockend.reference`` is the same in torch, and the
descriptor flags (``flags``) make every rank's kernel refuse a peer whose call does something else.
The kernels take a block end as two values, its tensors (``steps``: :data:`StepTensors`) and its
compile-time switches (``STEPS``: :class:`Switches`), and hand them on to the Triton functions of
``kernels.epilogue``, which alone read them: a new step changes no kernel's signature
(docs/architecture.md). This module needs no Triton: the ops, the reference path and the checks
import it where Triton is missing.
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import NamedTuple

import torch

from tpfuse.blockend import outputs
from tpfuse.blockend.bits import FP4_NONE, MAX_EXPERTS, QUANT_NONE, QUANT_STATIC, SCALES_ROWS
from tpfuse.blockend.stages import (
    NO_NORM,
    NORMED_COPY,
    RMSNORM,
    Bias,
    Finalize,
    LayerNorm,
    Norm,
    NormedCopy,
    PostNorm,
    RmsNormBackward,
)


@dataclass(frozen=True, eq=False)
class Epilogue:
    """A call's block end: the optional steps around the sum, beyond the residual add and the norm. The
    default is the plain ``all-reduce (+ residual) -> RMSNorm``.

    The fields are declared once, here: the ops' schemas (:func:`schema`), their Python signatures and
    the compiler's replacement all come from them, in this order.

    Attributes
    ----------
    quant_scale : Tensor [1] float32 or None
        Static fp8 ``y``: ``fp8(clamp(y / quant_scale))``.
    bias : Tensor [H] or None
        Added to the sum first (a row-parallel layer's bias), in x's dtype or float32.
    sum_weight : Tensor [H] or None
        RMSNorm of the (biased) sum with this gain before the residual add: Gemma 2/3's post-norm
        (pass Gemma's ``1 + w``). The same eps as the second norm.
    layer_norm : bool
        LayerNorm (mean subtracted) instead of RMSNorm for ``y``.
    norm_bias : Tensor [H] or None
        LayerNorm's bias (only with ``layer_norm``).
    scale_group : int
        Dynamic fp8 ``y``: 0 for none; else the elements per scale (H: one scale a token). The scales
        are an output of the call (``FusedCall.scales``).
    normed : bool
        False: the call ends at ``h`` (a plain all-reduce, with the other steps before the norm if
        any): no norm, ``y`` is not written, the weight and eps are not read.
    experts : int
        A MoE block's finalize: x is [T, K, H], the outputs of each token's top-k experts (K =
        ``experts``), and each rank sums them before the all-reduce. 0: x is [T, H].
    topk_weights : Tensor [T, K] or None
        The finalize's weights of the experts' outputs (float32 or x's dtype); None: the outputs are
        weighted already.
    shared_expert : Tensor [T, H] or None
        Added to this rank's part before the all-reduce (a MoE block's shared expert, or any second
        partial sum), in x's dtype.
    normed_copy : bool
        A quantised ``y`` and the norm's output before quantisation, in x's dtype, both written
        (``FusedCall.normed``): a normed row that feeds a quantised GEMM and something else.
    ue8m0_scales : bool
        Dynamic fp8 scales rounded up to powers of two (what a UE8M0 exponent holds exactly).
    scale_layout : int
        Where dynamic fp8 scales go: ``SCALES_ROWS``, ``SCALES_COLUMNS`` or ``SCALES_PACKED_UE8M0``
        (which rounds as ``ue8m0_scales``); MXFP4's: ``SCALES_ROWS`` or ``SCALES_SHUFFLED``.
    fp4 : int
        ``FP4_NVFP4`` or ``FP4_MXFP4``: ``y`` as e2m1 codes with a scale a 16 (e4m3) or 32 (e8m0)
        elements, written to ``FusedCall.scales``; ``FP4_NONE``: no fp4.
    global_scale : Tensor [1] float32 or None
        NVFP4's global scale ``g`` (``y`` is coded as ``y * g``; vLLM's ``input_global_scale``).
    norm_input : Tensor [T, H] or None
        RMSNorm's backward in place of the norm (``stages.RmsNormBackward``): x holds each rank's part of
        the gradient of a norm's output, ``norm_input`` the h that norm's forward returned, and ``y``
        becomes the gradient of ``norm_input`` plus ``grad_h``; ``h``, the summed gradient.
    grad_h : Tensor [T, H] or None
        With ``norm_input``: the gradient reaching the norm's input by the residual stream, added.
    """

    quant_scale: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    sum_weight: torch.Tensor | None = None
    layer_norm: bool = False
    norm_bias: torch.Tensor | None = None
    scale_group: int = 0
    normed: bool = True
    experts: int = 0
    topk_weights: torch.Tensor | None = None
    shared_expert: torch.Tensor | None = None
    normed_copy: bool = False
    ue8m0_scales: bool = False
    scale_layout: int = SCALES_ROWS
    fp4: int = FP4_NONE
    global_scale: torch.Tensor | None = None
    norm_input: torch.Tensor | None = None
    grad_h: torch.Tensor | None = None

    def __post_init__(self):
        # The stages are made (and checked) here, once: a combination that is no block end cannot be built.
        self.stages  # noqa: B018

    @classmethod
    def of(cls, steps: dict) -> Epilogue:
        """The block end of an op's keyword arguments: :data:`PLAIN` itself when every one is its default
        (a graph's call names them all), so that the common call takes its own path wherever it comes
        from."""
        for name, default in _DEFAULTS:
            if not _is_default(steps.get(name, default), default):
                return cls(**steps)
        return PLAIN

    def kwargs(self) -> dict:
        """The steps that differ from their defaults, as the ops' keyword arguments."""
        return {name: value for name, default in _DEFAULTS
                if not _is_default(value := getattr(self, name), default)}

    @functools.cached_property
    def stages(self) -> Stages:
        """The block end as typed stages (``blockend.stages``), in the kernels' order; ValueError where the
        keywords combine into no block end."""
        return stages_of(self)

    @property
    def output(self):
        """y's format (``blockend.outputs``: one of a closed set)."""
        return self.stages.output

    @property
    def plain(self) -> bool:
        """Nothing beyond the residual add, RMSNorm and a static scale (what every backend runs)."""
        finalize, bias, post_norm, norm, output, normed_copy = self.stages
        return (finalize is None and bias is None and post_norm is None and norm is RMSNORM
                and output.quant in (QUANT_NONE, QUANT_STATIC) and normed_copy is None)

    @property
    def fp8_output(self) -> bool:
        return self.output.fp8

    @property
    def quantised(self) -> bool:
        """y is fp8 or fp4 codes, not x's dtype."""
        return self.output.quantised

    @functools.cached_property  # asked once a launch; a block end never changes (PLAIN is shared)
    def signature(self) -> tuple:
        """What about this block end decides a compiled kernel: each stage's variant and its tensors'
        dtypes."""
        return tuple(None if stage is None else stage.signature for stage in self.stages)

    def rows(self, part: slice) -> Epilogue:
        """The block end of rows ``part`` of the call: the stages' tensors with a row a token (the MoE
        finalize's) cut to the part's."""
        cut = {name: t[part] for stage in self.stages if stage is not None for name in stage.per_row
               if (t := getattr(self, name)) is not None}
        return dataclasses.replace(self, **cut) if cut else self

    def shard_rows(self, start: int, stop: int, world_size: int) -> Epilogue:
        """The block end of a sharded call's part (``FusedCall.shard_part``): rows ``start:stop`` of each
        rank's shard of the per-row tensors that have all the call's rows, ``start:stop`` of those that
        have this rank's (``Stage.on_own_rows``)."""
        cut = {}
        for stage in self.stages:
            for name in () if stage is None else stage.per_row:
                if (t := getattr(self, name)) is not None:
                    cut[name] = (t[start:stop] if stage.on_own_rows
                                 else rows_of_every_shard(t, start, stop, world_size).flatten(0, 1))
        return dataclasses.replace(self, **cut) if cut else self

    def flags(self, hidden: int) -> int:
        """The descriptor bits (``bits.FLAG_*``) that tell this block end from others: each stage's."""
        return self._views(hidden)[0]

    def switches(self, hidden: int) -> Switches:
        """The kernels' compile-time switches for this block end (their ``STEPS`` argument): each stage's,
        the absent stages' off."""
        return self._views(hidden)[1]

    def _views(self, hidden: int) -> tuple[int, Switches]:
        # A stage's bits and switches follow from its signature (its variant, which tensors it has), so a
        # kind of block end works them out once (a call makes a new Epilogue: this is every call's host
        # cost).
        key = (self.signature, hidden)
        views = _VIEWS.get(key)
        if views is None:
            flags, switches = 0, dict(OFF_SWITCHES)
            for stage in self.stages:
                if stage is not None:
                    flags |= stage.flags(hidden)
                    switches.update(stage.switches(hidden))
            views = _VIEWS[key] = (flags, Switches(**switches))
        return views

    def check(self, x: torch.Tensor, shape: torch.Size, device: torch.device,
              own_shape: torch.Size | None = None) -> None:
        """Raise TypeError / ValueError naming what about the stages' tensors does not fit the call (x, its
        rows ``shape`` [T, H]; ``own_shape``, h's rows where they differ: a sharded call's)."""
        for stage in self.stages:
            if stage is not None:
                stage.check(x, own_shape if stage.on_own_rows and own_shape is not None else shape, device)
        for name in self.output.scale_keywords:
            scale = getattr(self, name)
            if not isinstance(scale, torch.Tensor):
                raise TypeError(f"{name} must be a tensor or None, got {type(scale).__name__}")
            if scale.dtype != torch.float32 or scale.numel() != 1:
                raise ValueError(f"{name} must be a float32 tensor of one element")
            if scale.device != device:
                raise ValueError(f"{name} is on {scale.device} but x is on {device}")

    def step_tensors(self, stand_in: torch.Tensor, scales: torch.Tensor | None,
                     normed: torch.Tensor | None) -> StepTensors:
        """The kernels' ``steps`` argument: each tensor step (``stand_in``, never read, for an absent one),
        then where the call writes its scales and the norm's copy."""
        return StepTensors(*[stand_in if (t := getattr(self, name)) is None else t for name in _TENSOR_STEPS],
                           stand_in if scales is None else scales, stand_in if normed is None else normed)


class Stages(NamedTuple):
    """A block end's stages, in the kernels' order; an absent optional stage is None."""

    finalize: Finalize | None
    bias: Bias | None
    post_norm: PostNorm | None
    norm: Norm
    output: outputs.Output
    normed_copy: NormedCopy | None


def stages_of(epilogue: Epilogue) -> Stages:
    """The stages of a block end's flat keywords; ValueError naming a combination that is no block end."""
    finalize = None
    if epilogue.experts or epilogue.topk_weights is not None or epilogue.shared_expert is not None:
        experts = epilogue.experts
        if isinstance(experts, bool) or not isinstance(experts, int) or experts < 0:
            raise ValueError(f"experts must be an int >= 0 (K of x [T, K, H]), got {experts!r}")
        if experts > MAX_EXPERTS:  # K travels in the call descriptor, which ranks compare
            raise ValueError(f"a MoE finalize takes at most {MAX_EXPERTS} experts a token, "
                             f"got {experts}")
        if epilogue.topk_weights is not None and not experts:
            raise ValueError("topk_weights weight the experts' outputs: x must be [tokens, K, hidden] "
                             "(experts=K)")
        finalize = Finalize(experts, epilogue.topk_weights, epilogue.shared_expert)
    if epilogue.norm_bias is not None and not epilogue.layer_norm:
        raise ValueError("norm_bias is LayerNorm's bias: pass layer_norm=True with it")
    output = outputs.of(epilogue)
    if (epilogue.norm_input is None) != (epilogue.grad_h is None):
        raise ValueError("RMSNorm's backward takes norm_input (the forward's h) and grad_h together")
    if epilogue.norm_input is not None:
        if (finalize is not None or epilogue.bias is not None or epilogue.sum_weight is not None
                or epilogue.layer_norm or not epilogue.normed or output.quantised or epilogue.normed_copy):
            raise ValueError("RMSNorm's backward (norm_input, grad_h) is a block end of its own: the sum of "
                             "the gradient's parts, then the norm's backward; no other step goes with it")
        norm = RmsNormBackward(epilogue.norm_input, epilogue.grad_h)
    elif not epilogue.normed:
        if epilogue.layer_norm:
            raise ValueError("layer_norm with normed=False: a call without a norm has no LayerNorm")
        if output.quantised:
            raise ValueError("normed=False ends the call at h: there is no y to quantise")
        norm = NO_NORM
    else:
        norm = LayerNorm(epilogue.norm_bias) if epilogue.layer_norm else RMSNORM
    if epilogue.normed_copy and not output.quantised:
        raise ValueError("normed_copy writes the norm's output beside a quantised one: "
                         "y is not quantised here")
    return Stages(finalize,
                  None if epilogue.bias is None else Bias(epilogue.bias),
                  None if epilogue.sum_weight is None else PostNorm(epilogue.sum_weight),
                  norm, output, NORMED_COPY if epilogue.normed_copy else None)


#: The kernels' switches of a block end with none of the optional stages (the norm's and the output's
#: come from their stage, always there).
OFF_SWITCHES = {**Finalize.off, **Bias.off, **PostNorm.off, **NormedCopy.off}


class Switches(NamedTuple):
    """The kernels' compile-time ``STEPS`` argument: which of the block end's steps they compile in."""

    HAS_BIAS: bool
    SUM_NORM: bool
    LAYER_NORM: bool
    HAS_NORM_BIAS: bool
    NORMED: bool  # False: no norm, y not written (a plain all-reduce)
    EXPERTS: int  # K of a MoE finalize's x [T, K, H], or 0 (x [T, H])
    TOPK_WEIGHTS: bool  # the finalize weights the experts' outputs
    SHARED_EXPERT: bool  # a shared expert's output is added to this rank's part
    NORMED_COPY: bool  # the norm's output also stored in x's dtype (steps.normed)
    NORM_BACKWARD: bool  # y is RMSNorm's backward at steps.norm_input, plus steps.grad_h
    # y's format, from ``blockend.outputs``:
    QUANT: int  # QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC, QUANT_NVFP4 or QUANT_MXFP4
    SCALE_GROUP: int  # dynamic fp8: elements a scale, or 0 for one scale a token
    POW2_SCALES: bool  # dynamic fp8 scales rounded up to powers of two
    SCALE_LAYOUT: int  # SCALES_ROWS, SCALES_COLUMNS, SCALES_PACKED_UE8M0 or SCALES_SHUFFLED (MXFP4)


def rows_of_every_shard(t: torch.Tensor, start: int, stop: int, world_size: int) -> torch.Tensor:
    """Rows ``start:stop`` of each of ``world_size`` equal shards of ``t``'s rows (a sharded call's), as a
    view [W, stop - start, ...]."""
    return t.unflatten(0, (world_size, -1))[:, start:stop]


def _is_default(value, default) -> bool:
    """Whether a step's argument is its default (None, False, 0): by identity, or equal and of its type
    (never comparing a tensor)."""
    return value is default or (type(value) is type(default) and value == default)


_TENSOR = "torch.Tensor | None"
_SCHEMA_TYPES = {_TENSOR: "Tensor?", "bool": "bool", "int": "int"}


def schema() -> str:
    """The block end's steps as keyword-only arguments of an op schema, with their defaults."""
    return ", ".join(f"{_SCHEMA_TYPES[f.type]} {f.name}={f.default}" for f in dataclasses.fields(Epilogue))


_TENSOR_STEPS = tuple(f.name for f in dataclasses.fields(Epilogue) if f.type == _TENSOR)
#: The kernels' ``steps`` argument, made from :class:`Epilogue`'s tensor fields (and the scales and the
#: norm's copy a call writes), so that a new tensor step changes no kernel's signature: the kernels hand
#: ``steps`` and ``STEPS`` on to the functions below, which alone read them.
StepTensors = NamedTuple("StepTensors", [(name, object) for name in _TENSOR_STEPS]
                         + [("scales", object), ("normed", object)])

PLAIN = Epilogue()
#: (flags, switches) by (signature, hidden): :meth:`Epilogue._views`.
_VIEWS: dict = {}
#: (name, default) of the block end's arguments, in declaration order.
_DEFAULTS = tuple((f.name, f.default) for f in dataclasses.fields(Epilogue))
