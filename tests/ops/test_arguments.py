"""Bad arguments get an error naming the problem before anything runs (no ranks needed: the fast lane)."""

import glob

import pytest
import torch

import tpfuse
from tpfuse.comm.communicator import check_sizes
from tpfuse.comm.workspace import SHM_DIR, SHM_PREFIX
from tpfuse.ops.allreduce_add_rmsnorm import check_inputs


@pytest.mark.parametrize("kwargs, error, words", [
    (dict(max_tokens=3, hidden=60), ValueError, "hidden must be a multiple of 8"),
    (dict(max_tokens=0, hidden=64), ValueError, "max_tokens must be >= 1, got 0"),
    (dict(max_tokens=16, hidden=0), ValueError, "hidden must be >= 1, got 0"),
    (dict(max_tokens=-4, hidden=64), ValueError, "max_tokens must be >= 1, got -4"),
    (dict(max_tokens=16.0, hidden=64), TypeError, "max_tokens must be an int, got float"),
    (dict(max_tokens=True, hidden=64), TypeError, "max_tokens must be an int, got bool"),
    (dict(wait_timeout_s=0), ValueError, "wait_timeout_s must be a finite number of seconds > 0"),
    (dict(wait_timeout_s=float("inf")), ValueError, "wait_timeout_s must be a finite number"),
])
def test_communicator_sizes_are_checked_before_anything_is_made(kwargs, error, words):
    before = set(glob.glob(f"{SHM_DIR}/{SHM_PREFIX}*"))
    with pytest.raises(error, match=words):
        tpfuse.get_communicator(**kwargs)  # no process group needed: the check comes first
    assert set(glob.glob(f"{SHM_DIR}/{SHM_PREFIX}*")) == before


def test_integer_like_sizes_are_accepted():
    import numpy as np

    check_sizes(np.int64(16), 4096, 2)  # numpy ints and an int timeout are sizes like any other


def _args(**changes):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    args = dict(x=x, residual=torch.randn_like(x), weight=torch.ones(64, dtype=torch.bfloat16), eps=1e-6,
                out=None, residual_out=None)
    args.update(changes)
    return args


def test_outputs_that_share_memory_are_refused():
    shared = torch.empty(4, 64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="out and residual_out share memory"):
        check_inputs(**_args(out=shared, residual_out=shared))
    halves = torch.empty(8, 64, dtype=torch.bfloat16)
    check_inputs(**_args(out=halves[:4], residual_out=halves[4:]))  # neighbours, no byte in common
    with pytest.raises(ValueError, match="share memory"):
        check_inputs(**_args(out=halves[:4], residual_out=halves[3:7]))


@pytest.mark.parametrize("changes, error, words", [
    (dict(weight=None), TypeError, "weight must be a tensor"),
    (dict(weight=[1.0] * 64), TypeError, "weight must be a tensor, got list"),
    (dict(residual=0.0), TypeError, "residual must be a tensor or None, got float"),
    (dict(out="y"), TypeError, "out must be a tensor or None, got str"),
])
def test_non_tensor_arguments_are_named(changes, error, words):
    with pytest.raises(error, match=words):
        check_inputs(**_args(**changes))
