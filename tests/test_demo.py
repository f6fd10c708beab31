"""The README's main command passes its own checks (2 CPU ranks, or every GPU)."""

from tpfuse.demo import run_demo


def test_demo_passes(capsys):
    assert run_demo() == 0
    out = capsys.readouterr().out
    assert "sites run per forward: 8 of 8" in out and "demo: OK" in out
