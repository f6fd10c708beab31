"""fp4 quantisation of a normed row on its own: ``tpfuse.quantize_fp4`` and its ``torch.library`` op.

The same codes and scales, in the same layouts, as :func:`tpfuse.allreduce_add_rmsnorm_quant` writes
for ``output="nvfp4"`` / ``"mxfp4"``, computed in torch (``blockend.outputs``): for a site the fused op
does not take (over the fusion limit, outside a tensor-parallel group), and as the form of fp4 a model
writes in PyTorch. The compiler pass finds ``tpfuse::quantize_fp4`` of a fused site's norm output and
takes it into the fused op (the ``...Fp4Quant`` patterns), as it takes vLLM's ``scaled_fp4_quant``.
"""

from __future__ import annotations

import torch

from tpfuse.blockend.bits import FP4_NONE, SCALES_ROWS
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.ops.allreduce_add_rmsnorm import OUTPUTS, SCALE_LAYOUTS

_lib = torch.library.Library("tpfuse", "FRAGMENT")
_lib.define("quantize_fp4(Tensor y, int fp4, Tensor? global_scale, int scale_layout=0) -> (Tensor, Tensor)")

#: ``quantize_fp4``'s ``output`` words (``allreduce_add_rmsnorm_quant``'s fp4 ones).
FP4_OUTPUTS = {word: fp4 for word, fp4 in OUTPUTS.items() if fp4 != FP4_NONE}


def _check(y: torch.Tensor, fp4: int, global_scale: torch.Tensor | None,
           scale_layout: int) -> Epilogue:
    """The quantisation's block end, after the fused op's own checks of its fp4 output."""
    if not isinstance(y, torch.Tensor) or y.dim() != 2 or not y.is_floating_point():
        raise ValueError(f"y must be a floating-point [tokens, hidden] tensor, got "
                         f"{tuple(y.shape) if isinstance(y, torch.Tensor) else type(y).__name__}"
                         f"{' ' + str(y.dtype) if isinstance(y, torch.Tensor) else ''}")
    if fp4 not in FP4_OUTPUTS.values():
        raise ValueError(f"fp4 must be FP4_NVFP4 or FP4_MXFP4, got {fp4!r}")
    # the fused op's own checks of its fp4 output: the group divides the row, the global scale's form,
    # the scales' layout
    epilogue = Epilogue(fp4=fp4, global_scale=global_scale, scale_layout=scale_layout)
    epilogue.check(y, y.shape, y.device)
    return epilogue


def _quantize(y, fp4, global_scale, scale_layout=SCALES_ROWS):
    epilogue = _check(y, fp4, global_scale, scale_layout)
    return epilogue.output.quantise(y.float(), epilogue, y.dtype)


def _quantize_fake(y, fp4, global_scale, scale_layout=SCALES_ROWS):
    epilogue = _check(y, fp4, global_scale, scale_layout)
    n_tokens, hidden = y.shape
    scales = epilogue.output.empty_scales(n_tokens, hidden, y.device)
    return y.new_empty((n_tokens, hidden // 2), dtype=torch.uint8), scales


_lib.impl("quantize_fp4", _quantize, "CompositeExplicitAutograd")
torch.library.register_fake("tpfuse::quantize_fp4", _quantize_fake, lib=_lib)


def quantize_fp4(y: torch.Tensor, output: str = "nvfp4", *, global_scale: torch.Tensor | None = None,
                 scale_layout: str = "rows") -> tuple[torch.Tensor, torch.Tensor]:
    """``y`` [T, H] as NVFP4 or MXFP4: ``(codes, scales)`` as :func:`tpfuse.allreduce_add_rmsnorm_quant`
    gives them for the same ``output`` and ``scale_layout`` (codes uint8 [T, H / 2], two e2m1 codes a
    byte, the even column in the low nibble; NVFP4's float8_e4m3fn scales swizzled in 128 x 4 tiles with
    ``global_scale``, MXFP4's float8_e8m0fnu [T, H / 32], or with ``scale_layout="shuffled"`` padded and
    in the order AITER's MXFP4 GEMMs read).

    In a compiled model, this after a norm that ends a tensor-parallel block fuses into the block's
    op. Raises ValueError for another ``output``, a hidden size that is not a multiple of the format's
    group (16, 32), NVFP4 without a float32 one-element ``global_scale``, or a layout the format has
    not.
    """
    if output not in FP4_OUTPUTS:
        raise ValueError(f"output must be one of {sorted(FP4_OUTPUTS)}, got {output!r}")
    if scale_layout not in SCALE_LAYOUTS:
        raise ValueError(f"scale_layout must be one of {sorted(SCALE_LAYOUTS)}, got {scale_layout!r}")
    return tuple(torch.ops.tpfuse.quantize_fp4(y, FP4_OUTPUTS[output], global_scale,
                                               SCALE_LAYOUTS[scale_layout]))
