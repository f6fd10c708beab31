"""Whole-word 16-bit access in Triton's interpreter: the same results as Triton's own path, masks obeyed."""

import os

import pytest
import torch
import triton
import triton.language as tl

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                                reason="about Triton's CPU interpreter (TRITON_INTERPRET=1)")


def _copy_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def copy(src, dst, n, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        vals = tl.load(src + cols, mask=cols < n, other=0)  # masked tail: zeros
        tl.store(dst + cols, vals, mask=(cols < BLOCK - 2) & (cols != 3))  # lanes 3 and the last 2 off

    return copy


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.int16])
def test_masked_16bit_loads_and_stores_match_triton(dtype):
    from tpfuse.kernels import interpreter

    src = torch.randn(16).to(dtype) if dtype != torch.int16 else torch.randint(-9, 9, (16,), dtype=dtype)
    src[5] = -0.0 if dtype != torch.int16 else -32768  # the sentinel's bits pass unchanged
    copy = _copy_kernel()
    outs = []
    for whole_words in (False, True):
        if whole_words:
            interpreter.install()
        dst = torch.full((16,), 7, dtype=dtype)
        copy[(1,)](src, dst, 11, BLOCK=16)
        outs.append(dst)
    expected = torch.full((16,), 7, dtype=dtype)
    expected[:11] = src[:11]
    expected[11:14] = 0
    expected[3] = 7
    for out in outs:
        assert torch.equal(out.view(torch.int16), expected.view(torch.int16)), out


def test_float32_to_bfloat16_rounds_to_nearest_even_as_gpus_do():
    # Triton's interpreter truncates (1.99 -> 1.984375); GPUs round to nearest even (-> 1.9921875).
    import triton
    import triton.language as tl

    import tpfuse.kernels  # noqa: F401 - installs the interpreter's fixes

    @triton.jit
    def to_bf16(src, dst, BLOCK: tl.constexpr):
        cols = tl.arange(0, BLOCK)
        tl.store(dst + cols, tl.load(src + cols).to(tl.bfloat16))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, generator=g) * 10.0 ** torch.randint(-30, 30, (1024,), generator=g).float()
    x[:9] = torch.tensor([1.99, float("inf"), -float("inf"), float("nan"), 3.4e38, -0.0, 1e-40, -1e-39,
                          2.5e-3])
    got = torch.empty(1024, dtype=torch.bfloat16)
    to_bf16[(1,)](x, got, BLOCK=1024)
    expected = x.bfloat16()
    same = (got.view(torch.int16) == expected.view(torch.int16)) | (got.isnan() & expected.isnan())
    assert same.all(), (x[~same][:4], got[~same][:4], expected[~same][:4])


def test_helpers_run_under_the_kernels_language_patch():
    # Each @triton.jit helper call used to patch triton.language again (inspect.getmembers over its
    # modules): now a launch patches it once, however many helper calls its programs make, and
    # restores it when the kernel returns; the results are the same.
    from triton.runtime import interpreter as triton_interpreter

    import tpfuse.kernels  # noqa: F401 - installs the interpreter's fixes

    patched, patch_builtin = [], triton_interpreter._patch_builtin
    triton_interpreter._patch_builtin = lambda *args: (patched.append(args[0]), patch_builtin(*args))[1]
    try:
        counts = []
        for times in (1, 6):
            src, dst = torch.arange(8, dtype=torch.float32), torch.empty(8)
            patched.clear()
            doubled[(3,)](src, dst, TIMES=times, BLOCK=8)
            assert torch.equal(dst, src * 2 ** times)
            counts.append(len(patched))
    finally:
        triton_interpreter._patch_builtin = patch_builtin
    assert counts[0] == counts[1] > 0, counts  # (each helper call added a patch of every module before)
    assert getattr(tl.load, "__triton_builtin__", False), "the language was left patched after the kernel"


@triton.jit
def twice(v):
    return v * 2


@triton.jit
def doubled(src, dst, TIMES: tl.constexpr, BLOCK: tl.constexpr):
    cols = tl.arange(0, BLOCK)
    v = tl.load(src + cols)
    for _ in tl.static_range(TIMES):
        v = twice(v)
    tl.store(dst + cols, v)
