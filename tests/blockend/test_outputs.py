"""The output formats as a closed set (``blockend.outputs``) and what each block-end step changes: every
step and every format differs from the plain block end, and from each other, in the descriptor's flags
(what ranks compare), the kernel signature and the kernels' switches."""

import pytest
import torch

from tpfuse.blockend import outputs
from tpfuse.blockend.bits import (
    FP4_MXFP4,
    FP4_NVFP4,
    SCALES_COLUMNS,
    SCALES_PACKED_UE8M0,
    SCALES_ROWS,
    SCALES_SHUFFLED,
)
from tpfuse.blockend.call import explain_flags
from tpfuse.blockend.epilogue import PLAIN, Epilogue

HIDDEN = 512
ONE = torch.ones(1)

# Every output format and variant, by the op's flat keywords.
FORMATS = {
    "unquantised": {},
    "static fp8": dict(quant_scale=ONE),
    "fp8 a token": dict(scale_group=HIDDEN),
    "fp8 a group of 128": dict(scale_group=128),
    "fp8 a group of 64": dict(scale_group=64),
    "fp8 a group of 8": dict(scale_group=8),
    "fp8 a group of 256": dict(scale_group=256),
    "fp8 UE8M0": dict(scale_group=128, ue8m0_scales=True),
    "fp8 columns": dict(scale_group=128, scale_layout=SCALES_COLUMNS),
    "fp8 columns UE8M0": dict(scale_group=128, scale_layout=SCALES_COLUMNS, ue8m0_scales=True),
    "fp8 packed UE8M0": dict(scale_group=128, scale_layout=SCALES_PACKED_UE8M0),
    "NVFP4": dict(fp4=FP4_NVFP4, global_scale=ONE),
    "MXFP4": dict(fp4=FP4_MXFP4),
    "MXFP4 shuffled": dict(fp4=FP4_MXFP4, scale_layout=SCALES_SHUFFLED),
}

# Each step alone, beside the plain block end.
STEPS = {
    "bias": dict(bias=torch.ones(HIDDEN)),
    "post-norm": dict(sum_weight=torch.ones(HIDDEN)),
    "LayerNorm": dict(layer_norm=True),
    "LayerNorm with bias": dict(layer_norm=True, norm_bias=torch.ones(HIDDEN)),
    "no norm": dict(normed=False),
    "finalize K=2": dict(experts=2),
    "finalize K=3": dict(experts=3),
    "finalize weighted": dict(experts=2, topk_weights=torch.ones(4, 2)),
    "shared expert": dict(shared_expert=torch.ones(4, HIDDEN, dtype=torch.bfloat16)),
    "normed copy": dict(quant_scale=ONE, normed_copy=True),
    **{name: keywords for name, keywords in FORMATS.items() if keywords},
}


def _views(epilogue: Epilogue) -> tuple:
    return epilogue.flags(HIDDEN), epilogue.signature, epilogue.switches(HIDDEN)


@pytest.mark.parametrize("name", list(STEPS))
def test_each_step_alone_differs_from_the_plain_block_end_in_every_view(name):
    epilogue = Epilogue(**STEPS[name])
    for view, plain, this in zip(("flags", "signature", "switches"), _views(PLAIN), _views(epilogue)):
        assert this != plain, (name, view)


def test_every_step_and_format_differs_from_every_other_in_the_descriptor():
    """Two ranks whose block ends differ in anything the kernels do make calls the descriptor tells apart,
    dynamic fp8's group size included; the words name it."""
    flags = {name: Epilogue(**keywords).flags(HIDDEN) for name, keywords in STEPS.items()}
    assert len(set(flags.values())) == len(flags), flags
    words = {name: explain_flags(f) for name, f in flags.items()}
    assert len(set(words.values())) == len(words), words
    assert "fp8 output scaled per group of 64" in words["fp8 a group of 64"], words
    assert "fp8 output scaled per token" in words["fp8 a token"], words


def test_the_formats_are_a_closed_set_named_by_the_keywords():
    expected = {"unquantised": outputs.Unquantised(), "static fp8": outputs.StaticFp8(),
                "fp8 a group of 64": outputs.DynamicFp8(64), "fp8 UE8M0": outputs.DynamicFp8(128, pow2=True),
                "fp8 packed UE8M0": outputs.DynamicFp8(128, pow2=True, layout=SCALES_PACKED_UE8M0),
                "NVFP4": outputs.NvFp4(), "MXFP4 shuffled": outputs.MxFp4(shuffled=True)}
    for name, output in expected.items():
        assert Epilogue(**FORMATS[name]).output == output, name
    assert all(isinstance(Epilogue(**k).output, outputs.Output) for k in FORMATS.values())


ILLEGAL = {
    "static and dynamic fp8": (dict(quant_scale=ONE, scale_group=128), "exclude each other"),
    "NVFP4 and fp8": (dict(fp4=FP4_NVFP4, global_scale=ONE, quant_scale=ONE), "excludes fp8 output"),
    "NVFP4 without its global scale": (dict(fp4=FP4_NVFP4), "takes a global_scale"),
    "MXFP4 with a global scale": (dict(fp4=FP4_MXFP4, global_scale=ONE), "MXFP4 takes none"),
    "a global scale alone": (dict(global_scale=ONE), "global_scale is NVFP4's"),
    "shuffled without MXFP4": (dict(scale_group=128, scale_layout=SCALES_SHUFFLED), "MXFP4's"),
    "fp4 in the columns layout": (dict(fp4=FP4_MXFP4, scale_layout=SCALES_COLUMNS), "their format's layout"),
    "UE8M0 without a group": (dict(ue8m0_scales=True), "need a scale_group"),
    "a layout without a group": (dict(quant_scale=ONE, scale_layout=SCALES_COLUMNS), "need a scale_group"),
    "an unknown layout": (dict(scale_group=128, scale_layout=7), "scale_layout must be"),
    "an unknown fp4": (dict(fp4=5), "fp4 must be"),
}


@pytest.mark.parametrize("name", list(ILLEGAL))
def test_a_combination_that_is_no_format_is_refused_naming_it(name):
    keywords, words = ILLEGAL[name]
    with pytest.raises(ValueError, match=words):
        Epilogue(**keywords).output


@pytest.mark.parametrize("group, hidden, ok", [(128, 512, True), (8, 512, True), (480, 480, True),
                                               (4, 512, False), (96, 512, False), (1024, 512, False)])
def test_a_dynamic_group_is_the_row_or_a_power_of_two_that_divides_it(group, hidden, ok):
    output = outputs.DynamicFp8(group)
    if ok:
        output.check_hidden(hidden)
        return
    with pytest.raises(ValueError, match="scale_group"):
        output.check_hidden(hidden)


@pytest.mark.parametrize("name", [n for n, k in FORMATS.items() if k])
def test_each_formats_scales_read_back_from_its_layout(name):
    """``in_layout`` then ``scales_as_float`` is the identity on scales the format can hold, through the
    format's own buffers, for a token count that pads."""

    epilogue = Epilogue(**FORMATS[name])
    output, tokens = epilogue.output, 5
    groups = output.scale_groups(HIDDEN)
    y = output.empty_y(torch.empty(tokens, HIDDEN, dtype=torch.bfloat16), tokens, HIDDEN)
    assert y.shape == (tokens, HIDDEN // 2 if output.quant in (3, 4) else HIDDEN)
    if not groups:
        assert output.empty_scales(tokens, HIDDEN, "cpu") is None
        return
    exponents = torch.randint(-8, 8, (tokens, groups)).float()
    values = torch.exp2(exponents)
    if isinstance(output, outputs.NvFp4):
        values = values.to(torch.float8_e4m3fn)
    elif isinstance(output, outputs.MxFp4):
        values = (exponents + 127).to(torch.uint8).view(torch.float8_e8m0fnu)
    placed = output.in_layout(values)
    assert placed.shape == output.empty_scales(tokens, HIDDEN, "cpu").shape
    back = epilogue.output.scales_as_float(placed, tokens, HIDDEN)
    assert torch.equal(back, torch.exp2(exponents)), name


def test_the_kernels_switches_of_each_format():
    switches = {name: Epilogue(**k).switches(HIDDEN) for name, k in FORMATS.items()}
    assert switches["fp8 a token"].SCALE_GROUP == 0 and switches["fp8 a group of 64"].SCALE_GROUP == 64
    assert switches["fp8 packed UE8M0"].POW2_SCALES and not switches["fp8 columns"].POW2_SCALES
    assert switches["MXFP4 shuffled"].SCALE_LAYOUT == SCALES_SHUFFLED
    assert switches["MXFP4"].SCALE_LAYOUT == SCALES_ROWS
    # fp4's groups are fixed by the format: the kernels divide the row by them
    assert switches["NVFP4"].SCALE_GROUP == 16 and switches["MXFP4 shuffled"].SCALE_GROUP == 32


def _groups_differ(rank, world_size, with_communicator):
    """Rank 0 scales its fp8 y a group of 64, rank 1 a group of 128: the error each rank raised, or None.
    A group of its own: after a difference the group's collectives may be out of step."""
    import torch.distributed as dist

    import tpfuse
    from tpfuse.testing import error_of

    group = dist.new_group(list(range(world_size)))
    comm = tpfuse.get_communicator(group, max_tokens=16, hidden=256, wait_timeout_s=3.0) \
        if with_communicator else None
    x = torch.randn(2, 256, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)

    def call():
        tpfuse.allreduce_add_rmsnorm_dynamic_fp8(x, None, torch.ones(256, dtype=torch.bfloat16), 1e-6,
                                                 group=group, scale_group=64 if rank == 0 else 128)
        if comm is not None:
            comm.check_errors()

    return error_of(call, comm)


@pytest.mark.parametrize("with_communicator", [True, False], ids=["kernels", "reference path"])
def test_ranks_whose_fp8_groups_differ_raise_on_every_rank_naming_both(rank_pool, with_communicator):
    """Before the group size was in the descriptor both calls returned, each rank with its own scales."""
    for error in rank_pool(2).run(_groups_differ, with_communicator, timeout=120):
        assert error is not None, error
        assert "per group of 64" in error and "per group of 128" in error, error
