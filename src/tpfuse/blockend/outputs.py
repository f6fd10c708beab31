"""What a call writes as ``y``: the output formats, a closed set of typed values.

A block end's flat keywords (``quant_scale``, ``scale_group``, ``ue8m0_scales``, ``scale_layout``,
``fp4``, ``global_scale``: the op schema stays flat) name exactly one of these, and :func:`of` says which,
or raises naming the combination that is none of them::

    Unquantised()                      y in x's dtype
    StaticFp8()                        fp8(y / quant_scale)
    DynamicFp8(group_size, pow2, layout)  fp8 with a scale a ``group_size`` elements (H: one a token),
                                       rounded up to powers of two (``pow2``), placed in ``layout``
    NvFp4()                            e2m1 codes, an e4m3 scale a 16, swizzled 128 x 4 tiles
    MxFp4(shuffled)                    e2m1 codes, an e8m0 scale a 32, rows or AITER's shuffled order

Each format owns, in one place: its checks against the hidden size, its descriptor code (every field
that two ranks could disagree on, dynamic fp8's group size included), the kernels' switches, y's and the
scales' buffers and layout, and its torch reference step. A new format is one class here, its store in
``kernels/epilogue.py`` and a keyword in the op (docs/architecture.md). This module builds on
``blockend.bits``, ``codecs`` and ``stages``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from tpfuse.blockend import bits, codecs
from tpfuse.blockend.bits import (
    FP4_GROUP,
    FP4_MXFP4,
    FP4_NONE,
    FP4_NVFP4,
    QUANT_DYNAMIC,
    QUANT_MXFP4,
    QUANT_NONE,
    QUANT_NVFP4,
    QUANT_STATIC,
    SCALES_COLUMNS,
    SCALES_PACKED_UE8M0,
    SCALES_ROWS,
    SCALES_SHUFFLED,
)
from tpfuse.blockend.stages import Stage
from tpfuse.targets import fp8_format

__all__ = ["DynamicFp8", "Fp4", "MxFp4", "NvFp4", "Output", "StaticFp8", "Unquantised", "explain_code", "of"]

_LAYOUT_NAMES = {SCALES_ROWS: "rows", SCALES_COLUMNS: "columns", SCALES_PACKED_UE8M0: "packed UE8M0",
                 SCALES_SHUFFLED: "shuffled"}


def _round_up(n: int, to: int) -> int:
    return (n + to - 1) // to * to


@dataclass(frozen=True)
class Output(Stage):
    """An output format: the block end's last stage (``blockend.stages``). Subclasses set the class constants
    and override what differs."""

    keywords: ClassVar[tuple] = ("quant_scale", "scale_group", "ue8m0_scales", "scale_layout", "fp4",
                                 "global_scale")
    #: The block end's float32 one-element scales this format reads (``Epilogue.check`` checks them).
    scale_keywords: ClassVar[tuple] = ()

    #: The format's code in the descriptor (``bits.OUTPUT_SHIFT``): a number per format and variant.
    code: ClassVar[int]
    #: The kernels' ``QUANT`` switch.
    quant: ClassVar[int]
    #: What ``explain_flags`` says of it.
    words: ClassVar[str]

    @property
    def quantised(self) -> bool:
        """y is fp8 or fp4 codes, not x's dtype."""
        return self.quant != QUANT_NONE

    @property
    def fp8(self) -> bool:
        return self.quant in (QUANT_STATIC, QUANT_DYNAMIC)

    def check_hidden(self, hidden: int) -> None:
        """Raise ValueError where this format cannot serve rows of ``hidden`` elements."""

    def check(self, x, shape, device) -> None:
        self.check_hidden(shape[1])

    @property
    def signature(self):
        return self

    #: Elements a scale (0: no scales written).
    group: ClassVar[int] = 0

    def scale_groups(self, hidden: int) -> int:
        """Scales a row (0: none)."""
        return hidden // self.group if self.group else 0

    def flags(self, hidden: int) -> int:
        """The descriptor bits of this format (``bits.OUTPUT_*``)."""
        return self.code << bits.OUTPUT_SHIFT

    def switches(self, hidden: int) -> dict:
        """The kernels' switches for y: ``QUANT``, ``SCALE_GROUP``, ``POW2_SCALES``, ``SCALE_LAYOUT``."""
        return dict(QUANT=self.quant, SCALE_GROUP=0, POW2_SCALES=False, SCALE_LAYOUT=SCALES_ROWS)

    def empty_y(self, x: torch.Tensor, n_tokens: int, hidden: int) -> torch.Tensor:
        """y's buffer beside x."""
        return x.new_empty((n_tokens, hidden), dtype=fp8_format(x.device).dtype if self.fp8 else x.dtype)

    def empty_scales(self, n_tokens: int, hidden: int, device) -> torch.Tensor | None:
        """Where a call of ``n_tokens`` rows writes its scales (None: no scales); layouts with padding come
        zeroed (the kernels write only the real rows and groups)."""
        return None

    #: (to the layout, back to rows ``(scales, M, G)``) for scales not stored by rows; None for row layouts.
    tiled: ClassVar[tuple | None] = None

    @property
    def scales_by_rows(self) -> bool:
        """Whether rows ``a:b`` of a call's scales are rows ``0:b-a`` of the same layout."""
        return self.tiled is None

    def in_layout(self, scales: torch.Tensor) -> torch.Tensor:
        """Scales ``[T, groups]`` by row (in their format) placed in this format's layout."""
        out = self.empty_scales(scales.shape[0], scales.shape[1] * self.group, scales.device)
        if self.tiled is not None:  # placed in the zeroed padding, then reordered
            out[:scales.shape[0], :scales.shape[1]] = scales
            return self.tiled[0](out)
        out.copy_(scales)
        return out

    def scale_values(self, scales: torch.Tensor, n_tokens: int, groups: int) -> torch.Tensor:
        """The scales (by rows, padding cut) as float32 ``[T, groups]``."""
        return scales.float().contiguous()

    def scales_as_float(self, scales: torch.Tensor, n_tokens: int, hidden: int) -> torch.Tensor:
        """A call's scales, in this format's layout, as float32 ``[T, groups]``."""
        groups = self.scale_groups(hidden)
        if self.tiled is not None:
            scales = self.tiled[1](scales, *scales.shape)[:n_tokens, :groups]
        return self.scale_values(scales, n_tokens, groups)

    def place_scale_rows(self, scales: torch.Tensor, start: int, part: torch.Tensor, rows: int) -> None:
        """Put ``part`` (the scales of a call of ``rows`` rows, in this layout) at rows ``start:start +
        rows`` of ``scales`` (a larger call's)."""
        if self.tiled is None:
            scales[start:start + rows].copy_(part[:rows])
            return
        place, by_rows = self.tiled
        whole = by_rows(scales, *scales.shape)
        whole[start:start + rows] = by_rows(part, *part.shape)[:rows]
        scales.copy_(place(whole))

    def quantise(self, y: torch.Tensor, epilogue, out_dtype: torch.dtype):
        """The torch reference of this step: fp32 ``y`` [T, H] -> (y, scales or None)."""
        return y.to(out_dtype), None


@dataclass(frozen=True)
class Unquantised(Output):
    """y in x's dtype."""

    code: ClassVar[int] = 0
    quant: ClassVar[int] = QUANT_NONE
    words: ClassVar[str] = ""


@dataclass(frozen=True)
class StaticFp8(Output):
    """fp8 ``clamp(y / quant_scale)``: one float32 scale for the whole call, the caller's."""

    code: ClassVar[int] = 1
    quant: ClassVar[int] = QUANT_STATIC
    words: ClassVar[str] = "fp8 output"
    scale_keywords: ClassVar[tuple] = ("quant_scale",)

    def quantise(self, y, epilogue, out_dtype):
        fmt = fp8_format(y.device)
        return (y / epilogue.quant_scale.float()).clamp(-fmt.max, fmt.max).to(fmt.dtype), None


@dataclass(frozen=True)
class DynamicFp8(Output):
    """fp8 with a scale a ``group_size`` elements computed from their amax (H: one a token), rounded up to
    powers of two where ``pow2`` (UE8M0), stored in ``layout``: rows (float32 [T, G]), columns (float32,
    column-major, T padded to 4: DeepGEMM on Hopper) or packed UE8M0 (four exponents an int32,
    column-major, T padded to 4: DeepGEMM on Blackwell; always powers of two)."""

    group_size: int = 0  # elements a scale; the hidden size for one scale a token
    pow2: bool = False
    layout: int = SCALES_ROWS

    quant: ClassVar[int] = QUANT_DYNAMIC
    words: ClassVar[str] = "fp8 output scaled per token"
    # Codes 2-6: rows, rows pow2, columns, columns pow2, packed (pow2 by definition).
    _CODES: ClassVar[dict] = {(SCALES_ROWS, False): 2, (SCALES_ROWS, True): 3, (SCALES_COLUMNS, False): 4,
                              (SCALES_COLUMNS, True): 5, (SCALES_PACKED_UE8M0, True): 6}

    @property
    def code(self) -> int:
        return self._CODES[self.layout, self.pow2]

    def check_hidden(self, hidden: int) -> None:
        group = self.group_size
        if not (group == hidden or (group >= 8 and group & (group - 1) == 0 and hidden % group == 0)):
            raise ValueError(f"scale_group {group} must be the hidden size {hidden} (a scale per token) or "
                             "a power of two >= 8 that divides it")

    @property
    def group(self) -> int:
        return self.group_size

    @property
    def scales_by_rows(self) -> bool:
        return self.layout == SCALES_ROWS

    def in_layout(self, scales):
        if self.layout != SCALES_PACKED_UE8M0:
            return super().in_layout(scales)
        out = self.empty_scales(scales.shape[0], scales.shape[1] * self.group, scales.device)
        exponents = codecs.ue8m0_bytes(scales).to(torch.int32)
        padded = torch.zeros((scales.shape[0], out.shape[1] * 4), dtype=torch.int32, device=scales.device)
        padded[:, :scales.shape[1]] = exponents
        words = padded.view(scales.shape[0], -1, 4)
        out.copy_(words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24)
        return out

    def flags(self, hidden: int) -> int:
        # A group's log2 - 2 (8 -> 1, ..., 16384 -> 12); 0 for one scale a token (the group is the row).
        group_code = 0 if self.group_size == hidden else self.group_size.bit_length() - 3
        return self.code << bits.OUTPUT_SHIFT | group_code << bits.SCALE_GROUP_SHIFT

    def switches(self, hidden: int) -> dict:
        return dict(QUANT=QUANT_DYNAMIC, SCALE_GROUP=0 if self.group_size == hidden else self.group_size,
                    POW2_SCALES=self.pow2, SCALE_LAYOUT=self.layout)

    def empty_scales(self, n_tokens, hidden, device):
        groups = self.scale_groups(hidden)
        if self.layout == SCALES_ROWS:
            return torch.empty((n_tokens, groups), dtype=torch.float32, device=device)
        columns, dtype = ((groups, torch.float32) if self.layout == SCALES_COLUMNS
                          else ((groups + 3) // 4, torch.int32))
        # [T, columns] stored column-major, the tokens padded to 4: a view of [columns, T4].
        return torch.zeros((columns, _round_up(n_tokens, 4)), dtype=dtype, device=device).t()[:n_tokens]

    def scale_values(self, scales, n_tokens, groups):
        if self.layout == SCALES_PACKED_UE8M0:
            # row-major
            rows = torch.empty(scales.shape, dtype=torch.int32, device=scales.device).copy_(scales)
            words = rows.view(torch.uint8).view(n_tokens, -1)  # bytes little-endian: group order
            return codecs.e8m0_values(words[:, :groups])
        return scales.float().contiguous()

    def quantise(self, y, epilogue, out_dtype):
        y, scales = codecs.dynamic_fp8(y, self.group_size, pow2=self.pow2)
        return y, self.in_layout(scales)


@dataclass(frozen=True)
class Fp4(Output):
    """What NVFP4 and MXFP4 share: two e2m1 codes a byte, a scale a fixed group of a row."""

    #: The format's name in errors.
    label: ClassVar[str]
    #: Where the kernels place the scales (``SCALE_LAYOUT``).
    scale_layout: ClassVar[int] = SCALES_ROWS

    def check_hidden(self, hidden: int) -> None:
        if hidden % self.group:
            raise ValueError(f"{self.label} scales {self.group} elements each: the hidden size {hidden} must "
                             f"be a multiple of {self.group}")

    def switches(self, hidden: int) -> dict:
        return dict(QUANT=self.quant, SCALE_GROUP=self.group, POW2_SCALES=False,
                    SCALE_LAYOUT=self.scale_layout)

    def empty_y(self, x, n_tokens, hidden):
        return x.new_empty((n_tokens, hidden // 2), dtype=torch.uint8)


@dataclass(frozen=True)
class NvFp4(Fp4):
    """e2m1 codes of ``y * g / s`` (two a byte), ``s = e4m3(amax / 6 * g)`` a 16 elements in the 128 x 4
    tiles Blackwell's FP4 GEMMs read, ``g`` the caller's float32 global scale."""

    code: ClassVar[int] = 7
    quant: ClassVar[int] = QUANT_NVFP4
    words: ClassVar[str] = "NVFP4 output"
    scale_keywords: ClassVar[tuple] = ("global_scale",)
    tiled: ClassVar[tuple] = (codecs.swizzle_block_scales, codecs.unswizzle_block_scales)

    label: ClassVar[str] = "NVFP4"
    group: ClassVar[int] = FP4_GROUP[FP4_NVFP4]

    def empty_scales(self, n_tokens, hidden, device):
        return torch.zeros((_round_up(n_tokens, 128), _round_up(self.scale_groups(hidden), 4)),
                           dtype=torch.float8_e4m3fn, device=device)

    def quantise(self, y, epilogue, out_dtype):
        codes, scales = codecs.nvfp4(y, epilogue.global_scale)
        return codes, self.in_layout(scales)


@dataclass(frozen=True)
class MxFp4(Fp4):
    """e2m1 codes of ``y / 2**e`` (two a byte), an e8m0 scale ``2**e`` a 32 elements (OCP MX), row-major or
    (``shuffled``) in the order AITER's MXFP4 GEMMs read them."""

    shuffled: bool = False

    quant: ClassVar[int] = QUANT_MXFP4
    label: ClassVar[str] = "MXFP4"
    group: ClassVar[int] = FP4_GROUP[FP4_MXFP4]

    @property
    def code(self) -> int:
        return 9 if self.shuffled else 8

    @property
    def words(self) -> str:
        return "MXFP4 output, shuffled e8m0 scales" if self.shuffled else "MXFP4 output"

    @property
    def tiled(self):
        return (codecs.shuffle_e8m0_scales, codecs.unshuffle_e8m0_scales) if self.shuffled else None

    @property
    def scale_layout(self) -> int:
        return SCALES_SHUFFLED if self.shuffled else SCALES_ROWS

    def empty_scales(self, n_tokens, hidden, device):
        groups = self.scale_groups(hidden)
        if self.shuffled:
            return torch.zeros((_round_up(n_tokens, 256), _round_up(groups, 8)),
                               dtype=torch.float8_e8m0fnu, device=device)
        return torch.empty((n_tokens, groups), dtype=torch.float8_e8m0fnu, device=device)

    def scale_values(self, scales, n_tokens, groups):
        return codecs.e8m0_values(scales.view(torch.uint8))

    def quantise(self, y, epilogue, out_dtype):
        codes, scales = codecs.mxfp4(y)
        return codes, self.in_layout(scales)


_NEEDS_GROUP = "ue8m0_scales and scale_layout place dynamic fp8 scales: they need a scale_group"
_SHUFFLED_IS_MXFP4 = "the shuffled scale layout (AITER's e8m0_shuffle) is MXFP4's: pass fp4=MXFP4 with it"


def of(epilogue) -> Output:
    """The output format a block end's flat keywords name; ValueError for a combination that is none."""
    fp4, layout_, group = epilogue.fp4, epilogue.scale_layout, epilogue.scale_group
    if fp4 not in (FP4_NONE, FP4_NVFP4, FP4_MXFP4):
        raise ValueError(f"fp4 must be FP4_NVFP4 or FP4_MXFP4, got {fp4!r}")
    if layout_ not in _LAYOUT_NAMES:
        raise ValueError("scale_layout must be SCALES_ROWS, SCALES_COLUMNS, SCALES_PACKED_UE8M0 or "
                         f"SCALES_SHUFFLED, got {layout_!r}")
    if isinstance(group, bool) or not isinstance(group, int) or group < 0:
        raise ValueError(f"scale_group must be a positive int (elements per scale), got {group!r}")
    static = epilogue.quant_scale is not None
    if fp4 != FP4_NONE:
        name = "NVFP4" if fp4 == FP4_NVFP4 else "MXFP4"
        if static or group:
            raise ValueError(f"{name} output excludes fp8 output (quant_scale, scale_group)")
        if (epilogue.global_scale is None) != (fp4 == FP4_MXFP4):
            raise ValueError("NVFP4 takes a global_scale (float32, one element); MXFP4 takes none")
        if epilogue.ue8m0_scales:
            raise ValueError(_NEEDS_GROUP)
        if layout_ == SCALES_SHUFFLED and fp4 == FP4_MXFP4:
            return MxFp4(shuffled=True)
        if layout_ != SCALES_ROWS:
            if layout_ == SCALES_SHUFFLED:
                raise ValueError(_SHUFFLED_IS_MXFP4)
            raise ValueError("fp4 scales go in their format's layout (NVFP4's swizzled tiles; MXFP4's rows, "
                             "or shuffled): the columns and packed layouts are dynamic fp8's")
        return NvFp4() if fp4 == FP4_NVFP4 else MxFp4()
    if epilogue.global_scale is not None:
        raise ValueError("global_scale is NVFP4's: pass fp4=NVFP4 with it")
    if layout_ == SCALES_SHUFFLED:
        raise ValueError(_SHUFFLED_IS_MXFP4)
    if group:
        if static:
            raise ValueError("quant_scale (static fp8) and a dynamic fp8 scale_group exclude each other")
        return DynamicFp8(group_size=group, pow2=epilogue.ue8m0_scales or layout_ == SCALES_PACKED_UE8M0,
                          layout=layout_)
    if epilogue.ue8m0_scales or layout_ != SCALES_ROWS:
        raise ValueError(_NEEDS_GROUP)
    return StaticFp8() if static else UNQUANTISED


UNQUANTISED = Unquantised()
_BY_CODE = {output.code: output for output in (
    UNQUANTISED, StaticFp8(), NvFp4(), MxFp4(), MxFp4(shuffled=True),
    *(DynamicFp8(layout=lay, pow2=pow2) for lay, pow2 in DynamicFp8._CODES))}


def explain_code(flags: int) -> list[str]:
    """The output format's words of a flags word (``call.explain_flags``)."""
    code = (flags & bits.FLAGS_OUTPUT) >> bits.OUTPUT_SHIFT
    output = _BY_CODE.get(code)
    if output is None:
        return [f"output code {code}"]
    if not isinstance(output, DynamicFp8):
        return [output.words] if output.words else []
    group_code = (flags & bits.FLAGS_SCALE_GROUP) >> bits.SCALE_GROUP_SHIFT
    words = [f"fp8 output scaled per group of {1 << (group_code + 2)}" if group_code else output.words]
    if output.pow2 and output.layout != SCALES_PACKED_UE8M0:
        words.append("UE8M0 scales")
    if output.layout != SCALES_ROWS:
        words.append(f"{_LAYOUT_NAMES[output.layout]} scales")
    return words
