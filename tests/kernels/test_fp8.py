import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available(),
                                reason="needs a GPU or TRITON_INTERPRET=1")


def test_fp8_conversion_is_bit_exact_with_torch():
    from tpfuse.kernels.fp8 import to_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * s for s in (1e-3, 1e-2, 0.1, 1, 10, 100, 1e3)]
                  + [torch.tensor([0.0, -0.0, 100.0, 7.795, 2**-10, 3 * 2**-10, 448.0, 460.0, 1e9, -1e9])])
    x = x.to(device)
    got = to_fp8(x).view(torch.uint8)
    expected = x.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(got, expected), f"{(got != expected).sum().item()} codes differ"


def test_fp8_decoding_is_exact_for_every_code():
    from tpfuse.kernels.fp8 import from_fp8

    device = "cuda" if torch.cuda.is_available() else "cpu"
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).to(device)
    got, expected = from_fp8(codes), codes.float()
    nan = expected.isnan()
    assert torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int32),
                                                         expected[~nan].view(torch.int32))
