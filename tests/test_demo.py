"""The README's main command passes its own checks (2 CPU ranks, or every GPU)."""

from tpfuse.demo import is_near_tie, run_demo


def test_demo_passes(capsys):
    assert run_demo() == 0
    out = capsys.readouterr().out
    assert "sites run per forward: 8 of 8" in out and "demo: OK" in out


def test_parted_ids_pass_only_at_a_near_tie_with_small_noise():
    assert is_near_tie(0.0059, 0.0078, 0.62)  # what the GPU showed: bf16 vs fp32 sums
    assert not is_near_tie(0.1, 0.0078, 0.62)  # a clear choice that changed: a fusion error
    assert not is_near_tie(0.2, 0.2, 0.62)  # logits that differ by a third of the largest: wrong
