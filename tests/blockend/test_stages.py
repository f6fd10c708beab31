"""The block end as typed stages (``blockend.stages``): the stages own every keyword once, every keyword two
ranks could disagree on reaches the call descriptor through its stage, a combination that is no block end
cannot be built, and the block end's views are the stages' own."""

import dataclasses

import pytest
import torch

from tpfuse.blockend import epilogue, outputs, stages
from tpfuse.blockend.bits import FP4_MXFP4, FP4_NVFP4, SCALES_COLUMNS, SCALES_SHUFFLED
from tpfuse.blockend.epilogue import PLAIN, Epilogue, Switches
from tpfuse.compiler.matchers import STAGE_MATCHERS

HIDDEN = 256
ONE = torch.ones(1)
ROW = torch.ones(HIDDEN)
ROWS = torch.ones(4, HIDDEN)
#: RMSNorm's backward in the norm's place: its two tensors come together.
NORM_BACKWARD = dict(norm_input=ROWS, grad_h=ROWS)

# Each keyword changed alone from a block end that allows it: (base, changed).
CHANGES = {
    "quant_scale": ({}, dict(quant_scale=ONE)),
    "bias": ({}, dict(bias=ROW)),
    "sum_weight": ({}, dict(sum_weight=ROW)),
    "layer_norm": ({}, dict(layer_norm=True)),
    "norm_bias": (dict(layer_norm=True), dict(layer_norm=True, norm_bias=ROW)),
    "scale_group": (dict(scale_group=128), dict(scale_group=64)),
    "normed": ({}, dict(normed=False)),
    "experts": (dict(experts=2), dict(experts=3)),
    "topk_weights": (dict(experts=2), dict(experts=2, topk_weights=torch.ones(4, 2))),
    "shared_expert": ({}, dict(shared_expert=torch.ones(4, HIDDEN))),
    "normed_copy": (dict(quant_scale=ONE), dict(quant_scale=ONE, normed_copy=True)),
    "ue8m0_scales": (dict(scale_group=128), dict(scale_group=128, ue8m0_scales=True)),
    "scale_layout": (dict(scale_group=128), dict(scale_group=128, scale_layout=SCALES_COLUMNS)),
    "fp4": (dict(fp4=FP4_MXFP4), dict(fp4=FP4_NVFP4, global_scale=ONE)),
    "global_scale": (dict(fp4=FP4_MXFP4), dict(fp4=FP4_NVFP4, global_scale=ONE)),
    "norm_input": ({}, NORM_BACKWARD),
    "grad_h": ({}, NORM_BACKWARD),
}

STAGE_CLASSES = (stages.Finalize, stages.Bias, stages.PostNorm, stages.Norm, outputs.Output,
                 stages.NormedCopy)


def test_the_stages_own_every_keyword_once():
    owned = [name for cls in STAGE_CLASSES for name in cls.keywords]
    assert sorted(owned) == sorted(f.name for f in dataclasses.fields(Epilogue)), owned
    assert len(owned) == len(set(owned)), owned


def test_every_keyword_covered_here():
    assert set(CHANGES) == {f.name for f in dataclasses.fields(Epilogue)}


@pytest.mark.parametrize("name", list(CHANGES))
def test_each_keyword_reaches_the_call_descriptor(name):
    """Two ranks whose block ends differ in this keyword alone make calls the descriptor tells apart (the
    ranks compare descriptors before they combine anything), and their kernels differ too."""
    base, changed = (Epilogue(**kw) for kw in CHANGES[name])
    assert base.flags(HIDDEN) != changed.flags(HIDDEN), name
    assert (base.signature, base.switches(HIDDEN)) != (changed.signature, changed.switches(HIDDEN)), name


@pytest.mark.parametrize("keywords, words", [
    (dict(norm_bias=ROW), "norm_bias is LayerNorm's bias"),
    (dict(normed=False, quant_scale=ONE), "no y to quantise"),
    (dict(normed=False, scale_group=128), "no y to quantise"),
    (dict(normed=False, layer_norm=True), "has no LayerNorm"),
    (dict(topk_weights=torch.ones(4, 2)), "topk_weights weight the experts' outputs"),
    (dict(experts=16), "at most 15 experts"),
    (dict(experts=-1), "experts must be an int >= 0"),
    (dict(normed_copy=True), "y is not quantised here"),
    (dict(quant_scale=ONE, scale_group=128), "exclude each other"),
    (dict(fp4=FP4_NVFP4), "NVFP4 takes a global_scale"),
    (dict(scale_layout=SCALES_SHUFFLED), "MXFP4's"),
    (dict(norm_input=ROWS), "norm_input .* and grad_h together"),
    (dict(NORM_BACKWARD, bias=ROW), "a block end of its own"),
    (dict(NORM_BACKWARD, quant_scale=ONE), "a block end of its own"),
])
def test_a_combination_that_is_no_block_end_cannot_be_built(keywords, words):
    with pytest.raises(ValueError, match=words):
        Epilogue(**keywords)


def test_the_views_are_the_stages_own():
    epilogue = Epilogue(experts=2, topk_weights=torch.ones(4, 2), bias=ROW, sum_weight=ROW, layer_norm=True,
                        norm_bias=ROW, scale_group=64, ue8m0_scales=True, normed_copy=True)
    found = epilogue.stages
    assert tuple(type(stage) for stage in found) == (stages.Finalize, stages.Bias, stages.PostNorm,
                                                     stages.LayerNorm, outputs.DynamicFp8, stages.NormedCopy)
    flags = 0
    for stage in found:
        assert stage.flags(HIDDEN) & flags == 0, stage  # each stage's bits are its own
        flags |= stage.flags(HIDDEN)
    assert epilogue.flags(HIDDEN) == flags
    assert epilogue.signature == tuple(stage.signature for stage in found)
    switches = epilogue.switches(HIDDEN)
    assert isinstance(switches, Switches) and switches.EXPERTS == 2 and switches.SCALE_GROUP == 64
    assert not epilogue.plain and PLAIN.plain and Epilogue(quant_scale=ONE).plain


def test_the_plain_block_ends_switches_are_every_stage_off():
    assert PLAIN.stages == (None, None, None, stages.RMSNORM, outputs.UNQUANTISED, None)
    assert PLAIN.switches(HIDDEN)._asdict() == {**epilogue.OFF_SWITCHES, **stages.Norm.off,
                                                **outputs.UNQUANTISED.switches(HIDDEN)}


def test_every_stage_has_its_graph_matcher():
    concrete = [stages.Finalize, stages.Bias, stages.PostNorm, stages.RmsNorm, stages.LayerNorm,
                stages.NoNorm, stages.RmsNormBackward, stages.NormedCopy,
                *(type(output) for output in outputs._BY_CODE.values())]
    assert set(concrete) == set(STAGE_MATCHERS), set(concrete) ^ set(STAGE_MATCHERS)


def test_each_stage_reference_is_the_formula():
    s = torch.randn(3, HIDDEN, dtype=torch.float64)
    w = torch.randn(HIDDEN, dtype=torch.float64)
    rms = lambda t: t / (t.pow(2).mean(-1, keepdim=True) + 1e-6).sqrt()  # noqa: E731
    assert torch.allclose(stages.Bias(w).reference(s, 1e-6), s + w)
    assert torch.allclose(stages.PostNorm(w).reference(s, 1e-6), rms(s) * w)
    assert torch.allclose(stages.RMSNORM.reference(s, w, 1e-6), rms(s) * w)
    centred = s - s.mean(-1, keepdim=True)
    assert torch.allclose(stages.LayerNorm(w).reference(s, w, 1e-6), rms(centred) * w + w)
    experts, weights, shared = torch.randn(3, 2, HIDDEN), torch.rand(3, 2), torch.randn(3, HIDDEN)
    got = stages.Finalize(2, weights, shared).reference(experts, torch.float64)
    wanted = (experts.double() * weights.double().unsqueeze(-1)).sum(1) + shared.double()
    assert torch.allclose(got, wanted)
    # RMSNorm's backward: autograd's gradient of the norm's input, plus grad_h
    a, grad_h = torch.randn(3, HIDDEN, dtype=torch.float64, requires_grad=True), torch.randn(3, HIDDEN)
    g = torch.randn(3, HIDDEN, dtype=torch.float64)
    (rms(a) * w).backward(g)
    got = stages.RmsNormBackward(a.detach(), grad_h).reference(g, w, 1e-6)
    assert torch.allclose(got, a.grad + grad_h.double())


def test_a_part_of_the_rows_takes_the_per_row_tensors_part():
    weights, shared = torch.arange(8.0).view(4, 2), torch.randn(4, HIDDEN)
    part = Epilogue(experts=2, topk_weights=weights, shared_expert=shared, bias=ROW).rows(slice(1, 3))
    assert torch.equal(part.topk_weights, weights[1:3]) and torch.equal(part.shared_expert, shared[1:3])
    assert part.bias is ROW  # a row every token shares stays whole
    assert PLAIN.rows(slice(1, 3)) is PLAIN
