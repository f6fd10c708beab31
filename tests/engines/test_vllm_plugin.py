"""tpfuse's vLLM plugin without vLLM (fast lane): its switch's options, and which calls of vLLM's
manual-fusion
helpers tpfuse's op takes. vLLM itself with the plugin: test_vllm_seam.py (its helpers on 2 ranks) and
test_vllm.py (vLLM at TP=2)."""

from types import SimpleNamespace

import pytest
import torch

from tpfuse.engines import vllm as plugin

HIDDEN = 64


def _config(extra) -> SimpleNamespace:
    return SimpleNamespace(additional_config=extra,
                           compilation_config=SimpleNamespace(inductor_compile_config={}))


@pytest.mark.parametrize("value, settings", [
    (True, {"max_tokens": None, "limit": 0, "hidden": 0}),
    ({}, {"max_tokens": None, "limit": 0, "hidden": 0}),
    ({"max_tokens": 512}, {"max_tokens": 512, "limit": 0, "hidden": 0}),
    ({"max_tokens": 64, "limit": 64, "hidden": 4096}, {"max_tokens": 64, "limit": 64, "hidden": 4096}),
])
def test_the_switch_and_its_options(value, settings):
    assert plugin.settings_of(_config({"tpfuse": value})) == settings


@pytest.mark.parametrize("extra", [{}, {"tpfuse": False}, {"other_plugin": 1}])
def test_no_switch_no_tpfuse(extra):
    assert plugin.settings_of(_config(extra)) is None
    assert plugin.settings_of(None) is None


@pytest.mark.parametrize("value, message", [
    ({"max_token": 64}, "unknown option(s) 'max_token'"),
    ({"max_tokens": 0}, "must be a positive int"),
    ({"max_tokens": "64"}, "must be a positive int"),
    ("yes", "true, or a dict of options"),
])
def test_a_bad_option_is_named(value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        plugin.settings_of(_config({"tpfuse": value}))


def test_the_earlier_switch_the_pass_in_the_compilation_config_is_the_same_switch():
    config = _config({})
    config.compilation_config.inductor_compile_config[plugin.PASS_KEY] = plugin.FusionPass(max_tokens=96)
    assert plugin.settings_of(config) == {"max_tokens": 96, "limit": 0, "hidden": 0}


class _Comm:
    destroyed = False

    def __init__(self, limit):
        self.limit = limit

    def max_token_num(self, hidden, dtype):
        return self.limit


def _norm(weight=None, eps=1e-6, **extra):
    return SimpleNamespace(weight=torch.ones(HIDDEN, dtype=torch.bfloat16) if weight is None else weight,
                           variance_epsilon=eps, **extra)


def _rows(tokens, dtype=torch.bfloat16, hidden=HIDDEN):
    return torch.zeros(tokens, hidden, dtype=dtype)


@pytest.mark.parametrize("case, call, reason", [
    ("fits", (_rows(8), _rows(8), _norm(), _Comm(16)), None),
    ("at the limit", (_rows(16), _rows(16), _norm(), _Comm(16)), None),
    ("over the limit", (_rows(17), _rows(17), _norm(), _Comm(16)), "over the fusion limit of 16 tokens"),
    ("no communicator", (_rows(8), _rows(8), _norm(), None), "no tpfuse communicator"),
    ("float32", (_rows(8, torch.float32), _rows(8, torch.float32), _norm(), _Comm(16)),
     "not a size the kernels"),
    ("hidden 60", (_rows(8, hidden=60), _rows(8, hidden=60), _norm(torch.ones(60)), _Comm(16)),
     "not a size the kernels"),
    ("part of the row", (_rows(8), _rows(8), _norm(variance_size_override=32), _Comm(16)), "whole row"),
    ("no weight", (_rows(8), _rows(8), SimpleNamespace(variance_epsilon=1e-6), _Comm(16)), "whole row"),
    ("weight of another size", (_rows(8), _rows(8), _norm(torch.ones(32)), _Comm(16)), "norm weight (32,)"),
    ("residual of another dtype", (_rows(8), _rows(8, torch.float16), _norm(), _Comm(16)), "a residual"),
    ("3-D rows",
     (torch.zeros(2, 4, HIDDEN, dtype=torch.bfloat16), None, _norm(), _Comm(16)), "hidden states"),
])
def test_which_helper_calls_tpfuse_takes(case, call, reason):
    x, residual, norm, comm = call
    problem = plugin._call_problem(x, residual, norm, comm, invariant=False)
    assert problem == reason if reason is None else reason in problem, (case, problem)


@pytest.mark.parametrize("case, call, takes", [
    ("over the limit", (_rows(17), _rows(17), _norm(), _Comm(16)), True),
    ("no communicator", (_rows(8), _rows(8), _norm(), None), True),
    ("float32", (_rows(8, torch.float32), _rows(8, torch.float32), _norm(), None), True),
    ("part of the row", (_rows(8), _rows(8), _norm(variance_size_override=32), _Comm(16)), False),
])
def test_in_batch_invariant_mode_the_op_takes_every_size(case, call, takes):
    """The op serves every size there (its own fallback is batch-invariant); a norm it cannot compute
    stays vLLM's."""
    x, residual, norm, comm = call
    assert (plugin._call_problem(x, residual, norm, comm, invariant=True) is None) == takes, case


def test_gemmas_gain_is_one_plus_w_in_fp32_kept_until_the_weight_changes():
    weight = torch.nn.Parameter(torch.randn(HIDDEN, dtype=torch.bfloat16), requires_grad=False)
    norm = SimpleNamespace(weight=weight, variance_epsilon=1e-6)
    gain = plugin._gemma_gain(norm)
    assert gain.dtype == torch.float32 and torch.equal(gain, weight.float() + 1.0)
    assert plugin._gemma_gain(norm) is gain  # kept: no new tensor a call (none while a graph is captured)
    with torch.no_grad():
        weight.mul_(2)  # a weight loaded again in place
    assert torch.equal(plugin._gemma_gain(norm), weight.float() + 1.0)
