"""``tpfuse.quantize_fp4``: NVFP4 and MXFP4 of a row on its own, in the fused op's layouts, decoded by each
format's definition; exact where the format is; the same under torch.compile; bad input named."""

import pytest
import torch

import tpfuse
from tpfuse.blockend import codecs
from tpfuse.blockend.bits import FP4_GROUP, FP4_MXFP4, FP4_NVFP4, SCALES_ROWS, SCALES_SHUFFLED
from tpfuse.blockend.epilogue import Epilogue

FP4 = {"nvfp4": FP4_NVFP4, "mxfp4": FP4_MXFP4}
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _decoded(codes, scales, fp4, global_scale, n_tokens, hidden, scale_layout=SCALES_ROWS):
    """The values the codes stand for: e2m1 times its group's scale (NVFP4's over the global scale)."""
    nvfp4 = torch.ones(1) if fp4 == FP4_NVFP4 else None  # the format's own keyword, never read here
    group = Epilogue(fp4=fp4, scale_layout=scale_layout, global_scale=nvfp4).output.scales_as_float(scales,
                                    n_tokens, hidden).double()
    if fp4 == FP4_NVFP4:
        group = group / global_scale.double()
    values = codecs.e2m1_values(codes).double().unflatten(-1, (-1, FP4_GROUP[fp4]))
    return (values * group.unsqueeze(-1)).flatten(-2)


@pytest.mark.parametrize("output", ["nvfp4", "mxfp4"])
def test_values_the_format_holds_come_back_exactly(output):
    # Each group: e2m1 values times a power of two, its largest 6 * 2**k: both formats hold them exactly
    # (MXFP4's scale 2**k; NVFP4's e4m3 scale 2**(k + 4) with a global scale of 16).
    fp4 = FP4[output]
    group, n_tokens, hidden = FP4_GROUP[fp4], 5, 256
    g = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (n_tokens, hidden // group, group), generator=g)
    codes[..., 0] = 7  # 6.0: each group's largest
    powers = 2.0 ** torch.randint(-6, 4, (n_tokens, hidden // group, 1), generator=g)
    y = (codecs.E2M1_VALUES[codes] * powers).flatten(-2).bfloat16()
    global_scale = torch.tensor([16.0]) if fp4 == FP4_NVFP4 else None
    packed, scales = tpfuse.quantize_fp4(y, output, global_scale=global_scale)
    assert packed.shape == (n_tokens, hidden // 2) and packed.dtype == torch.uint8
    layout = Epilogue(fp4=fp4, global_scale=global_scale).output.empty_scales(n_tokens, hidden, "cpu")
    assert (scales.shape == layout.shape and scales.dtype == layout.dtype
            and scales.stride() == layout.stride())
    assert torch.equal(_decoded(packed, scales, fp4, global_scale, n_tokens, hidden), y.double())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("output", ["nvfp4", "mxfp4"])
def test_random_rows_are_within_a_code_step_and_compile_to_the_same(output, device):
    fp4 = FP4[output]
    group = FP4_GROUP[fp4]
    y = torch.randn(7, 512, generator=torch.Generator().manual_seed(4)).bfloat16().to(device)
    amax = y.double().abs().unflatten(-1, (-1, group)).amax(-1, keepdim=True)
    global_scale = (448 * 6 / y.float().abs().max()).reshape(1) if fp4 == FP4_NVFP4 else None
    packed, scales = tpfuse.quantize_fp4(y, output, global_scale=global_scale)
    assert packed.device == scales.device == y.device
    if device != "cpu":  # the same bits as on the CPU
        on_cpu = tpfuse.quantize_fp4(y.cpu(), output, global_scale=None
                                     if global_scale is None else global_scale.cpu())
        assert torch.equal(packed.cpu(), on_cpu[0]) and torch.equal(scales.cpu().view(torch.uint8),
                                                                    on_cpu[1].view(torch.uint8))
    error = (_decoded(packed, scales, fp4, global_scale, 7, 512) - y.double()).unflatten(-1, (-1, group))
    # NVFP4: half of e2m1's widest step (2) at a scale of amax / 6, e4m3-rounded; MXFP4: amax / 2**e in
    # [4, 8), saturated at 6: up to 2 at a scale of amax / 4
    assert (error.abs() <= amax * (0.5 if fp4 == FP4_MXFP4 else 0.18)).all()
    compiled = torch.compile(lambda t: tpfuse.quantize_fp4(t, output, global_scale=global_scale),
                             fullgraph=True)
    again = compiled(y)
    assert torch.equal(again[0], packed) and torch.equal(again[1].view(torch.uint8), scales.view(torch.uint8))


def test_shuffled_mxfp4_scales_are_the_rows_in_aiters_order():
    """``scale_layout="shuffled"``: the same codes, the row-major scales shuffled and zero-padded (the
    fused op's tensor), decoding to the same values; the same under torch.compile."""
    y = torch.randn(37, 1024, generator=torch.Generator().manual_seed(5)).bfloat16()
    codes, rows = tpfuse.quantize_fp4(y, "mxfp4")
    again, shuffled = tpfuse.quantize_fp4(y, "mxfp4", scale_layout="shuffled")
    layout = Epilogue(fp4=FP4_MXFP4, scale_layout=SCALES_SHUFFLED).output.empty_scales(37, 1024, "cpu")
    assert shuffled.shape == layout.shape == (256, 32) and shuffled.dtype == layout.dtype
    assert torch.equal(again, codes)
    padded = torch.zeros(256, 32, dtype=torch.uint8)
    padded[:37] = rows.view(torch.uint8)
    assert torch.equal(shuffled.view(torch.uint8), codecs.shuffle_e8m0_scales(padded))
    assert torch.equal(_decoded(codes, shuffled, FP4_MXFP4, None, 37, 1024, SCALES_SHUFFLED),
                       _decoded(codes, rows, FP4_MXFP4, None, 37, 1024))
    compiled = torch.compile(lambda t: tpfuse.quantize_fp4(t, "mxfp4", scale_layout="shuffled"),
                             fullgraph=True)
    assert torch.equal(compiled(y)[1].view(torch.uint8), shuffled.view(torch.uint8))


BAD = {
    "unknown output": (dict(output="int4"), "output must be one of"),
    "NVFP4 without a global scale": (dict(output="nvfp4"), "NVFP4 takes a global_scale"),
    "MXFP4 with one": (dict(output="mxfp4", global_scale=torch.ones(1)), "MXFP4 takes none"),
    "a hidden size the group does not divide": (dict(output="mxfp4", y=torch.randn(2, 48)),
                                                "must be a multiple of 32"),
    "float64 global scale": (dict(output="nvfp4", global_scale=torch.ones(1, dtype=torch.float64)),
                             "global_scale must be a float32 tensor of one element"),
    "rows of three dimensions": (dict(output="mxfp4", y=torch.randn(2, 3, 64)), "[tokens, hidden]"),
    "integer rows": (dict(output="mxfp4", y=torch.ones(2, 64, dtype=torch.int32)), "floating-point"),
    "unknown layout": (dict(output="mxfp4", scale_layout="tiles"), "scale_layout must be one of"),
    "shuffled NVFP4": (dict(output="nvfp4", global_scale=torch.ones(1), scale_layout="shuffled"),
                       "is MXFP4's"),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_input_is_named(name):
    change, message = BAD[name]
    change = dict(change)
    y = change.pop("y", torch.randn(2, 64))
    with pytest.raises(ValueError) as raised:
        tpfuse.quantize_fp4(y, **change)
    assert message in str(raised.value), str(raised.value)
