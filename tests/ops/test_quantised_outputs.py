"""The quantised outputs the next GEMM takes (``tpfuse.allreduce_add_rmsnorm_quant``) against float64 on
every rank: the norm's copy beside fp8, UE8M0 scales (as float32 powers of two, column-major, packed four
to an int32), NVFP4 and MXFP4 (its scales row-major or shuffled as AITER's GEMMs read them); both
kernels at 2 and 3 ranks, over the workspace, world size 1 (the local kernel), the reference path, ranks
whose calls differ, bad input."""

import pytest
import torch

import tpfuse
from tpfuse.blockend import codecs
from tpfuse.testing import cases_on_a_fresh_group, error_of
from tpfuse.testing.cases import Case, check_case_runs

pytestmark = pytest.mark.slow

CASES = [Case(3, 4096, torch.bfloat16, quant_scale=0.02, normed_copy=True, seed=1),
         Case(5, 1024, torch.bfloat16, scale_group=128, ue8m0_scales=True, normed_copy=True, seed=2),
         Case(6, 2048, torch.float16, residual=False, scale_group=128, scale_layout="columns", seed=3),
         Case(5, 1024, torch.bfloat16, scale_group=128, scale_layout="packed_ue8m0", seed=4),  # 8 groups: 2 words
         Case(3, 4096, torch.bfloat16, scale_group=4096, scale_layout="packed_ue8m0", seed=5),  # one a token
         Case(4, 2880, torch.bfloat16, fp4="nvfp4", normed_copy=True, seed=6),
         Case(3, 4096, torch.bfloat16, fp4="mxfp4", experts=2, topk_weighted=True, seed=7),
         Case(40, 4096, torch.bfloat16, fp4="nvfp4", seed=8),  # over the workspace: the swizzled tiles
         Case(40, 4096, torch.bfloat16, scale_group=128, scale_layout="columns", seed=9),  # over it, columns
         Case(36, 512, torch.bfloat16, fp4="mxfp4", scale_layout="shuffled", seed=11),  # two blocks of 32 rows
         Case(3, 512, torch.float32, fp4="mxfp4", normed_copy=True, seed=10)]  # the reference path
KERNEL_CASES = 10  # the last one's dtype takes the reference path
OVER_WORKSPACE = (7, 8)


def _quantised_cases(rank, world_size, oneshot_max, with_communicator):
    return cases_on_a_fresh_group(rank, world_size, CASES, oneshot_max, with_communicator,
                                  hiddens=(512, 1024, 2048, 2880, 4096))


# 3 ranks: the extended lane (CI's 10 minutes).
@pytest.mark.parametrize("world_size", [2, pytest.param(3, marks=pytest.mark.extended)])
@pytest.mark.parametrize("algorithm, oneshot_max", [("oneshot", 4096), ("twoshot", 0)])
def test_quantised_outputs_match_float64_on_every_rank(rank_pool, world_size, algorithm, oneshot_max):
    results = rank_pool(world_size).run(_quantised_cases, oneshot_max, True)
    check_case_runs(world_size, CASES, results, KERNEL_CASES, algorithm, chunked=OVER_WORKSPACE)


@pytest.mark.parametrize("world_size", [1, 2])
def test_quantised_outputs_without_a_communicator(rank_pool, world_size):
    """World size 1: the local kernel; 2 ranks: the group's own all-reduce, then the torch reference."""
    results = rank_pool(world_size).run(_quantised_cases, 4096, False)
    check_case_runs(world_size, CASES, results, KERNEL_CASES, "local" if world_size == 1 else "reference")


def test_padding_is_zero_and_layouts_are_what_gemms_read():
    """The op's scale tensors: DeepGEMM's column-major (T padded to 4) and packed words, NVFP4's tiles
    and MXFP4's shuffled blocks with zero padding, fp4 codes two a byte (checked by encoding known values)."""
    from tpfuse.blockend.bits import (
        FP4_MXFP4,
        FP4_NVFP4,
        SCALES_COLUMNS,
        SCALES_PACKED_UE8M0,
        SCALES_SHUFFLED,
    )
    from tpfuse.blockend.epilogue import Epilogue

    columns = Epilogue(scale_group=128, scale_layout=SCALES_COLUMNS).output.empty_scales(5, 1024, "cpu")
    assert columns.shape == (5, 8) and columns.stride() == (1, 8) and columns.dtype == torch.float32
    packed = Epilogue(scale_group=128, scale_layout=SCALES_PACKED_UE8M0).output.empty_scales(5, 1024, "cpu")
    assert packed.shape == (5, 2) and packed.stride() == (1, 8) and packed.dtype == torch.int32
    swizzled = Epilogue(fp4=FP4_NVFP4, global_scale=torch.ones(1)).output.empty_scales(5, 1024, "cpu")
    assert swizzled.shape == (128, 64) and swizzled.dtype == torch.float8_e4m3fn
    assert not swizzled.float().any()
    codes = codecs.e2m1_codes(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, -0.3, -0.0]))
    assert codes.tolist() == [0, 2, 2, 4, 4, 6, 6, 7, 9, 8]  # ties to even, saturated, signs kept
    assert codecs.pack_e2m1(torch.tensor([[1, 7]], dtype=torch.uint8)).tolist() == [[0x71]]
    logical = torch.arange(128 * 8, dtype=torch.float32).view(128, 8)
    tiles = codecs.swizzle_block_scales(logical)
    # Entry (m, g) at tile (m // 128, g // 4), then (m % 32) * 16 + (m % 128) // 32 * 4 + g % 4.
    assert tiles.flatten()[1 * 16 + 1 * 4].item() == logical[33, 0]
    assert tiles.flatten()[512 + 1 * 16 + 1 * 4 + 1].item() == logical[33, 5]
    assert torch.equal(codecs.unswizzle_block_scales(tiles, 128, 8), logical)
    shuffled = Epilogue(fp4=FP4_MXFP4, scale_layout=SCALES_SHUFFLED).output.empty_scales(5, 1024, "cpu")
    assert shuffled.shape == (256, 32) and shuffled.dtype == torch.float8_e8m0fnu
    assert not shuffled.view(torch.uint8).any()
    # AITER's e8m0_shuffle, entry by entry: (m, g) at (m // 32) * 32 * G + (g // 8) * 256 + (g % 4) * 64 +
    # (m % 16) * 4 + (g % 8) // 4 * 2 + (m % 32) // 16, for G (groups, padded to 8) = 16.
    logical = torch.arange(64 * 16, dtype=torch.int32).view(64, 16)
    flat = codecs.shuffle_e8m0_scales(logical).flatten()
    for m in range(64):
        for g in range(16):
            at = (m // 32) * 32 * 16 + (g // 8) * 256 + (g % 4) * 64 + (m % 16) * 4 + (g % 8) // 4 * 2 + (m % 32) // 16
            assert flat[at] == logical[m, g], (m, g)
    assert torch.equal(codecs.unshuffle_e8m0_scales(codecs.shuffle_e8m0_scales(logical), 64, 16), logical)
    # A call over the workspace runs in parts: each part's shuffled scales go to its rows of the whole.
    epilogue = Epilogue(fp4=FP4_MXFP4, scale_layout=SCALES_SHUFFLED)
    rows = torch.randint(100, 140, (40, 16), generator=torch.Generator().manual_seed(0)).to(torch.uint8)
    whole = epilogue.output.empty_scales(40, 512, "cpu")
    for start, stop in ((0, 16), (16, 32), (32, 40)):
        part = epilogue.output.empty_scales(stop - start, 512, "cpu")
        part.view(torch.uint8).copy_(codecs.shuffle_e8m0_scales(
            torch.nn.functional.pad(rows[start:stop], (0, 0, 0, 256 - (stop - start)))))
        epilogue.output.place_scale_rows(whole, start, part, stop - start)
    assert torch.equal(codecs.unshuffle_e8m0_scales(whole.view(torch.uint8), 256, 16)[:40], rows)
    assert not codecs.unshuffle_e8m0_scales(whole.view(torch.uint8), 256, 16)[40:].any()


def _one_rank_quantises_otherwise(rank, world_size):
    comm = tpfuse.get_communicator(max_tokens=16, hidden=4096)
    x, weight = torch.randn(2, 256).to(torch.bfloat16), torch.ones(256, dtype=torch.bfloat16)
    return error_of(lambda: tpfuse.allreduce_add_rmsnorm_quant(
        x, None, weight, 1e-6, output="mxfp4" if rank == 0 else "fp8", scale_group=None if rank == 0 else 32), comm)


def test_ranks_whose_calls_differ_get_an_error(rank_pool):
    errors = rank_pool(2).run(_one_rank_quantises_otherwise)
    assert all(e is not None and "does not match rank" in e and "MXFP4 output" in e for e in errors), errors


BAD = {
    "unknown output": (dict(output="int4"), ValueError, "output must be one of"),
    "unknown layout": (dict(scale_group=128, scale_layout="tiles"), ValueError, "scale_layout must be one of"),
    "NVFP4 without a global scale": (dict(output="nvfp4"), ValueError, "NVFP4 takes a global_scale"),
    "MXFP4 with one": (dict(output="mxfp4", global_scale=torch.ones(1)), ValueError, "MXFP4 takes none"),
    "fp4 of a hidden size it does not divide": (dict(output="mxfp4", x=torch.randn(2, 48)), ValueError,
                                                "must be a multiple of 32"),
    "fp4 with a scale group": (dict(output="nvfp4", scale_group=16, global_scale=torch.ones(1)), ValueError,
                               "scale_group is dynamic fp8's"),
    "float64 global scale": (dict(output="nvfp4", global_scale=torch.ones(1, dtype=torch.float64)), ValueError,
                             "global_scale must be a float32 tensor of one element"),
    "layout of static fp8": (dict(quant_scale=torch.ones(1), scale_layout="columns"), ValueError,
                             "they need a scale_group"),
    "shuffled NVFP4": (dict(output="nvfp4", global_scale=torch.ones(1), scale_layout="shuffled"), ValueError,
                       "is MXFP4's"),
    "shuffled fp8": (dict(scale_group=32, scale_layout="shuffled"), ValueError, "is MXFP4's"),
    "fp4 in DeepGEMM's columns": (dict(output="mxfp4", scale_layout="columns"), ValueError,
                                  "the columns and packed layouts are dynamic fp8's"),
}


def test_bad_input_is_named():
    weight = torch.ones(64, dtype=torch.bfloat16)
    for name, (change, error, message) in BAD.items():
        change = dict(change)
        x = change.pop("x", torch.randn(2, 64)).to(torch.bfloat16)
        with pytest.raises(error, match=None) as raised:
            tpfuse.allreduce_add_rmsnorm_quant(x, None, weight if x.shape[1] == 64 else torch.ones(x.shape[1]),
                                               1e-6, **change)
        assert message in str(raised.value), (name, str(raised.value))
