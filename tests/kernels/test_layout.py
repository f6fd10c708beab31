"""Call descriptors (``blockend.bits``): what the kernels send (checked on ranks) and how an error message
reads them (``blockend.call``)."""

import torch

import tpfuse
from tpfuse.blockend import bits
from tpfuse.blockend.bits import FP4_MXFP4, FP4_NVFP4, SCALES_SHUFFLED
from tpfuse.blockend.call import explain_descriptor, explain_flags
from tpfuse.blockend.epilogue import Epilogue
from tpfuse.testing.cases import Case


def test_descriptor_words_never_hold_the_sentinel_and_read_back():
    words = bits.describe_call((1 << 30) - 1, 16384, 31, 40000, (1 << 31) - 8)
    assert len(words) == bits.DESC_WORDS and all(0 <= w <= 0x7FFF for w in words), words
    flags = bits.FLAG_BF16 | bits.FLAG_RESIDUAL
    five = bits.describe_call(5, 512, flags, 0, 8192)
    static_fp8 = Epilogue(quant_scale=torch.ones(1)).flags(512)
    three = bits.describe_call(3, 512, flags | bits.FLAG_TWOSHOT | static_fp8, 1, 4096)
    assert explain_descriptor(five) == "5 x 512 bfloat16 oneshot, residual"
    # Call number and workspace appear only where two descriptors differ in them.
    assert explain_descriptor(three, five) == (
        "3 x 512 bfloat16 twoshot, residual, fp8 output, its call #2 (mod 32768), "
        "a workspace region of 4096 words")


def test_flags_above_15_bits_travel_in_the_last_word_beside_the_regions_top_bit():
    """The quantised outputs' flags (bits 15 and up) share the last word with the region's top bit: both
    read back, and every word stays below the sentinel."""
    nvfp4 = Epilogue(fp4=FP4_NVFP4, global_scale=torch.ones(1), normed_copy=True).flags(4096)
    flags = bits.call_flags(torch.bfloat16, False) | nvfp4
    words = bits.describe_call(7, 4096, flags | bits.FLAG_TWOSHOT, 3, (1 << 31) - 8)
    assert all(0 <= w <= 0x7FFF for w in words), words
    assert explain_descriptor(words) == (
        "7 x 4096 bfloat16 twoshot, no residual, a copy of the norm's output, NVFP4 output")
    mxfp4 = Epilogue(fp4=FP4_MXFP4).flags(512)
    shuffled = bits.call_flags(torch.bfloat16, True) \
        | Epilogue(fp4=FP4_MXFP4, scale_layout=SCALES_SHUFFLED).flags(512)
    assert explain_descriptor(bits.describe_call(2, 512, shuffled, 1, 4096)) == (
        "2 x 512 bfloat16 oneshot, residual, MXFP4 output, shuffled e8m0 scales")
    # A call of the reference path (float32: no kernel takes one) as the host compares it.
    assert explain_flags(bits.call_flags(torch.float32, True) | mxfp4) == (
        "float32, residual, MXFP4 output")


def _sent_descriptors(rank, world_size):
    comm = tpfuse.get_communicator(max_tokens=16, hidden=512)
    case = Case(5, 512, torch.float16, seed=6)
    inp = case.inputs(world_size)
    tpfuse.allreduce_add_rmsnorm(inp["xs"][rank], inp["residual"], inp["weight"], case.eps)
    workspace = comm.fused_backend.workspace
    received = workspace.descriptors()[0, 1 - rank].tolist()  # call 0's slot, from the peer
    flags = bits.FLAG_FP16 | bits.FLAG_RESIDUAL
    expected = bits.describe_call(5, 512, flags, 0, workspace.region_elems)
    return {"received": received, "expected": expected}


def test_the_kernel_sends_the_descriptor_layout_describes(rank_pool):
    for report in rank_pool(2).run(_sent_descriptors):
        assert report["received"] == report["expected"], report


def test_every_flag_travels_in_the_descriptor():
    """Each ``FLAG_*`` (and the fields of K, the output format and its group) is at or below the last bit
    the descriptor carries, no two overlap, and they read back."""
    fields = [name for name in dir(bits) if name.startswith(("FLAG_", "FLAGS_"))]
    for i, name in enumerate(fields):
        assert all(getattr(bits, name) & getattr(bits, other) == 0 for other in fields[i + 1:]), name
    for name in fields:
        assert getattr(bits, name) < 1 << (bits.MAX_FLAG_BIT + 1), name
    flags = bits.call_flags(torch.bfloat16, False) | bits.FLAG_MOE_FINALIZE | bits.FLAG_TOPK_WEIGHTS \
        | bits.FLAG_SHARED_EXPERT | bits.MAX_EXPERTS << bits.EXPERTS_SHIFT | bits.FLAG_SHARDED
    words = bits.describe_call(2, 64, flags, 0, (1 << 31) - 8)
    assert all(0 <= w <= 0x7FFF for w in words), words
    assert explain_descriptor(words) == (
        "2 x 64 bfloat16 oneshot, no residual, MoE finalize, 15 experts a token, topk_weights, shared "
        "expert, rows sharded (sequence parallel)")


def test_a_finalize_that_differs_in_weights_k_or_shared_expert_differs_in_flags():
    """The descriptor's flags (what ranks compare) tell apart every finalize the kernels run."""
    weights, shared = torch.ones(2, 3), torch.ones(2, 64)
    finalizes = [Epilogue(experts=3), Epilogue(experts=3, topk_weights=weights), Epilogue(experts=2),
                 Epilogue(experts=3, shared_expert=shared), Epilogue(shared_expert=shared)]
    flags = [e.flags(64) for e in finalizes]
    assert len(set(flags)) == len(finalizes), [explain_flags(f) for f in flags]
