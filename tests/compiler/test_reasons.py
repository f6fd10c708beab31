"""Site reports' reasons: one code each, from compiler.reasons."""

import pickle

import pytest
import torch

from tpfuse.compiler.fusion_pass import SiteReport
from tpfuse.compiler.reasons import CODES, Reason


def test_a_reason_is_its_sentence_with_a_known_code():
    reason = Reason("tokens", "token range up to 128 exceeds the fusion limit 64")
    assert reason == "token range up to 128 exceeds the fusion limit 64" and reason.code == "tokens"
    again = pickle.loads(pickle.dumps(reason))  # reports travel from rank processes in tests
    assert again == reason and again.code == "tokens"
    with pytest.raises(ValueError, match="unknown reason code 'token'"):
        Reason("token", "a misspelt code")
    assert all(isinstance(meaning, str) and meaning for meaning in CODES.values())


def test_an_unfused_report_needs_a_coded_reason():
    report = SiteReport((4, 64), torch.bfloat16, "0", False,
                        reason=Reason("dtype", "64 x float32 is not supported"))
    assert report.code == "dtype"
    assert SiteReport((4, 64), torch.bfloat16, "0", True, "AllReduceAddRMSNorm").code is None
    with pytest.raises(TypeError, match="must be a compiler.reasons.Reason"):
        SiteReport((4, 64), torch.bfloat16, "0", False, reason="a sentence without a code")
