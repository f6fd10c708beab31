"""The README's main command passes its own checks (2 CPU ranks, or every GPU)."""

import pytest

from tpfuse.demo import is_near_tie, report_e2e, run_demo


@pytest.mark.slow  # starts its own ranks
def test_demo_passes(capsys):
    assert run_demo() == 0
    out = capsys.readouterr().out
    assert "sites run per forward: 8 of 8" in out and "demo: OK" in out


def test_parted_ids_pass_only_at_a_near_tie_with_small_noise():
    assert is_near_tie(0.0059, 0.0078, 0.62)  # what the GPU showed: bf16 vs fp32 sums
    assert not is_near_tie(0.1, 0.0078, 0.62)  # a clear choice that changed: a fusion error
    assert not is_near_tie(0.2, 0.2, 0.62)  # logits that differ by a third of the largest: wrong


def test_e2e_report_writes_the_table(tmp_path, capsys):
    # What the demo does with the end-to-end rows on GPUs (the rows here are made up).
    rows = [{"workload": "decode b1", "tokens": 1, "unfused_ms": 1.0, "tpfuse_ms": 0.8,
             "tpfuse_speedup_%": 25.0}]
    report_e2e(rows, 2, str(tmp_path))
    assert "llama-3-8b (8 layers" in capsys.readouterr().out
    assert (tmp_path / "e2e.csv").read_text().startswith("workload,tokens,unfused_ms")
