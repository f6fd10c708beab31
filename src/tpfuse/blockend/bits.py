"""The numbers a block end is spoken in: the op's keyword codes, the kernels' switch codes and the call
descriptor's flags word. The bottom of ``tpfuse.blockend``: it imports nothing of tpfuse.

A call descriptor is ``DESC_WORDS`` 15-bit words that every rank writes beside its data and every peer
compares (``describe_call``); its flags word says what the call is (dtype, residual, algorithm, the block
end's stages). Every field that two ranks could disagree on has bits here.
"""

from __future__ import annotations

import torch

#: How a call quantises y: the kernels' QUANT constexpr.
QUANT_NONE, QUANT_STATIC, QUANT_DYNAMIC, QUANT_NVFP4, QUANT_MXFP4 = 0, 1, 2, 3, 4
#: Where dynamic fp8 scales go (``Epilogue.scale_layout``), and MXFP4's (rows or shuffled): see
#: ``blockend.outputs``.
SCALES_ROWS, SCALES_COLUMNS, SCALES_PACKED_UE8M0, SCALES_SHUFFLED = 0, 1, 2, 3
#: fp4 outputs (``Epilogue.fp4``) and their elements a scale.
FP4_NONE, FP4_NVFP4, FP4_MXFP4 = 0, 1, 2
FP4_GROUP = {FP4_NVFP4: 16, FP4_MXFP4: 32}

#: Words of a call descriptor: one 16-byte access. Every word is in 0..32767, never the sentinel.
DESC_WORDS = 8

#: Bits of a descriptor's flags word. Bits from 15 on travel in the descriptor's last word, above the
#: region's top bit (``describe_call``).
FLAG_BF16, FLAG_FP16, FLAG_RESIDUAL, FLAG_TWOSHOT = 1, 2, 4, 16
#: A float32 call: only the host compares such calls (the reference path); no kernel takes one.
FLAG_FP32 = 8
#: The stages' bits (``blockend.stages``).
FLAG_BIAS, FLAG_SUM_NORM, FLAG_LAYER_NORM, FLAG_NORM_BIAS = 32, 64, 128, 256
#: The two-shot's fp8 wire (``kernels.wire``).
FLAG_FP8_WIRE = 2048
#: A plain all-reduce: the call ends at h (``Epilogue.normed`` False).
FLAG_NO_NORM = 4096
#: A MoE finalize before the sum (``Epilogue.experts`` / ``topk_weights`` / ``shared_expert``, x [T, K, H]),
#: and what it is beyond that: ranks that differ in its weights, its shared expert or its K (the experts a
#: token, ``FLAGS_EXPERTS``: bits 24-27) make calls that differ.
FLAG_MOE_FINALIZE = 8192
FLAG_TOPK_WEIGHTS, FLAG_SHARED_EXPERT = 512, 1024
#: The norm's output beside a quantised y (``Epilogue.normed_copy``).
FLAG_NORMED_COPY = 1 << 14
#: The output format (``blockend.outputs``: a code a format and variant, bits 15-18) and dynamic fp8's group
#: size (log2 - 2, bits 19-22; 0 for one scale a token).
OUTPUT_SHIFT, SCALE_GROUP_SHIFT = 15, 19
FLAGS_OUTPUT, FLAGS_SCALE_GROUP = 0xF << OUTPUT_SHIFT, 0xF << SCALE_GROUP_SHIFT
EXPERTS_SHIFT = 24
#: The largest K the descriptor holds (4 bits; the models we serve take at most 8 experts a token).
MAX_EXPERTS = 15
FLAGS_EXPERTS = MAX_EXPERTS << EXPERTS_SHIFT
#: The norm's backward in place of the norm (``Epilogue.norm_input``): bit 23.
FLAG_NORM_BACKWARD = 1 << 23
#: Rows sharded over the ranks (sequence parallel: ``FusedCall.sharded``): bit 28.
FLAG_SHARDED = 1 << 28
#: The last bit a descriptor carries: 15 bits in word 3, 14 beside the region's top bit in the last word.
MAX_FLAG_BIT = 28
#: What ``blockend.call.explain_flags`` says of each bit (the output format's bits say their own words).
EXPLAINED_FLAGS = ((FLAG_BIAS, "bias"), (FLAG_SUM_NORM, "post-norm"), (FLAG_LAYER_NORM, "LayerNorm"),
              (FLAG_NORM_BIAS, "norm bias"), (FLAG_FP8_WIRE, "fp8 wire"),
              (FLAG_NO_NORM, "no norm"), (FLAG_MOE_FINALIZE, "MoE finalize"),
              (FLAGS_EXPERTS, lambda flags: f"{(flags & FLAGS_EXPERTS) >> EXPERTS_SHIFT} experts a token"),
              (FLAG_TOPK_WEIGHTS, "topk_weights"), (FLAG_SHARED_EXPERT, "shared expert"),
              (FLAG_NORMED_COPY, "a copy of the norm's output"), (FLAG_NORM_BACKWARD, "RMSNorm's backward"),
              (FLAG_SHARDED, "rows sharded (sequence parallel)"))


def describe_call(n_tokens: int, hidden: int, flags: int, call: int, region_elems: int) -> list[int]:
    """The descriptor words of a call, as the kernels write them (``protocol._describe_call``).

    Tokens (< 2**30) and the region (< 2**31 words) span two and three 15-bit words; the call's number
    is kept modulo 2**15 (a peer is never more than one call apart). The flags' low 15 bits have a word
    of their own, the rest share the last word with the region's top bit.
    """
    return [n_tokens & 0x7FFF, (n_tokens >> 15) & 0x7FFF, hidden & 0x7FFF, flags & 0x7FFF, call & 0x7FFF,
            region_elems & 0x7FFF, (region_elems >> 15) & 0x7FFF,
            ((region_elems >> 30) & 1 | (flags >> 15) << 1) & 0x7FFF]


def call_flags(dtype: torch.dtype, has_residual: bool) -> int:
    """A call's flags word less the block end's bits (``Epilogue.flags``) and the algorithm's."""
    kind = FLAG_BF16 if dtype == torch.bfloat16 else FLAG_FP16 if dtype == torch.float16 else FLAG_FP32
    return kind | (FLAG_RESIDUAL if has_residual else 0)
