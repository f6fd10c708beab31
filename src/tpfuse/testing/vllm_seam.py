"""Test scaffolding, not product: vLLM's manual-fusion helpers on 2 CPU ranks in vLLM's own distributed state.

Run in vLLM's environment (.venv-vllm), one process that starts two ranks::

    python -m tpfuse.testing.vllm_seam --out DIR

The parent builds two ``VllmConfig`` of a tiny model (its config.json only), with vLLM's plugins loaded
as vLLM loads them: one without tpfuse's switch, one with it (``additional_config={"tpfuse":
{"max_tokens": MAX_TOKENS}}``; tpfuse's plugin sizes its limit from the model). Each rank then does what
vLLM's CPU worker does: ``init_distributed_environment`` (gloo), and ``ensure_model_parallel_initialized``
inside ``set_current_vllm_config``, first with the config without the switch, then (the groups made
again) with it, where the plugin creates the communicator and serves the helpers. Before that, each rank
imports a model module that imports ``fused_allreduce_rms_norm`` by name (DeepSeek-V3.2's) and a module
that imports the Gemma helper by name, so the rebinding of such names is seen.

In each phase the ranks call the helpers as the models call them (``fused_allreduce_rms_norm(hidden_states,
residual, norm)`` with vLLM's ``RMSNorm``; the Gemma helper with vLLM's ``GemmaRMSNorm``) on fresh random
data, under the limit and over it, then (with the switch) once more in batch-invariant mode
(``VLLM_BATCH_INVARIANT=1``, read anew), and write per rank ``DIR/rank{r}.pt``: ``{"alone" | "tpfuse":
every call's inputs, outputs, tpfuse's call counts, and vLLM's own path on the same inputs (the helper
tpfuse replaced)}``. ``DIR/parent.json`` has each config's ``additional_config`` and the error vLLM's
start-up gives with tpfuse on when vLLM lacks ``fused_allreduce_rms_norm`` (the simulated missing seam).
tests/engines/test_vllm_seam.py checks them.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import types

HIDDEN = 256
EPS = 1e-6
MAX_TOKENS = 64
SMALL = 5  # tokens of a call under the limit
#: A module that imports the Gemma helper by name (as MiniMax-M3's does; that model needs torchvision).
GEMMA_USER = "tpfuse_testing_gemma_user"
#: A model module that imports ``fused_allreduce_rms_norm`` by name and imports on the CPU build.
RMS_USER = "vllm.models.deepseek_v32.nvidia.model"
RMS_HELPER = "vllm.models.common.ops.fused_allreduce_rms_norm"
GEMMA_HELPER = "vllm.model_executor.layers.fused_allreduce_gemma_rms_norm"


def tiny_config_dir() -> str:
    directory = tempfile.mkdtemp(prefix="tiny-llama-config-")
    config = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": HIDDEN,
              "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 64, "vocab_size": 512, "max_position_embeddings": 512,
              "rms_norm_eps": EPS,
              "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
              "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2}
    pathlib.Path(directory, "config.json").write_text(json.dumps(config))
    return directory


def vllm_config(directory: str, tpfuse: bool):
    from vllm.config import ModelConfig, ParallelConfig, VllmConfig

    model = ModelConfig(model=directory, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=256)
    extra = {"tpfuse": {"max_tokens": MAX_TOKENS}} if tpfuse else {}
    return VllmConfig(model_config=model, parallel_config=ParallelConfig(tensor_parallel_size=2),
                      additional_config=extra)


def _calls(rank: int, seed: int, tokens: int, gemma: bool, helpers, rows: int) -> dict:
    """One helper call on every rank: the first ``tokens`` of ``rows`` fresh random rows (seeded: calls of one
    seed share their rows) of each rank's part, a residual, a weight alike on every rank; tpfuse's call
    counts; vLLM's own helper on the same inputs."""
    import torch
    from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm

    import tpfuse

    generator = torch.Generator().manual_seed(seed)

    def draw():
        return torch.randn(rows, HIDDEN, generator=generator).to(torch.bfloat16)[:tokens].contiguous()

    xs = [draw() for _ in range(2)]
    residual = draw()
    weight = (torch.randn(HIDDEN, generator=generator) * (0.1 if gemma else 1.0)).to(torch.bfloat16)
    norm = GemmaRMSNorm(HIDDEN, eps=EPS) if gemma else RMSNorm(HIDDEN, eps=EPS, dtype=torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(weight)
    helper = helpers["gemma" if gemma else "rms"]
    tpfuse.reset_stats()
    x_in, residual_in = xs[rank].clone(), residual.clone()
    with torch.inference_mode():
        y, h = helper(x_in, residual_in, norm)
    stats = tpfuse.stats()
    vllm_own = getattr(helper, "_tpfuse_serves", helper)
    with torch.inference_mode():  # vLLM's CPU all-reduce sums in place: its own copy of the inputs
        y_vllm, h_vllm = vllm_own(xs[rank].clone(), residual.clone(), norm)
    return {"tokens": tokens, "gemma": gemma, "xs": xs, "residual": residual, "weight": weight,
            "y": y.clone(), "h": h.clone(), "stats": stats, "y_vllm": y_vllm.clone(),
            "h_vllm": h_vllm.clone(),
            "inputs_kept": torch.equal(x_in, xs[rank]) and torch.equal(residual_in, residual)}


def rank_main(rank: int, port: int, configs: dict, out: str) -> None:
    import torch

    torch.set_num_threads(1)
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # as vLLM's workers do: tpfuse's plugin registers its hooks
    import importlib

    importlib.import_module(RMS_USER)  # imported by name before the plugin serves the helper
    gemma_user = types.ModuleType(GEMMA_USER)
    exec(f"from {GEMMA_HELPER} import fused_allreduce_gemma_rms_norm", gemma_user.__dict__)
    sys.modules[GEMMA_USER] = gemma_user

    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    # vLLM without tpfuse's switch first (the plugin loaded, tpfuse not asked for), then vLLM's groups made
    # again with it. A config is current throughout, as in vLLM's workers (its norms read it when made).
    parallel_state.init_distributed_environment(2, rank, f"tcp://127.0.0.1:{port}", rank, "gloo")
    result = {}
    for name in ("alone", "tpfuse"):
        with set_current_vllm_config(configs[name]):
            result[name] = _rank_calls(rank, batch_invariant_too=name == "tpfuse")
    parallel_state.destroy_distributed_environment()
    torch.save(result, pathlib.Path(out, f"rank{rank}.pt"))


def _rank_calls(rank: int, batch_invariant_too: bool) -> dict:
    import importlib

    import torch
    from vllm.distributed import parallel_state

    import tpfuse
    from tpfuse.comm.communicator import lookup_communicator

    parallel_state.ensure_model_parallel_initialized(2, 1)
    rms_module, gemma_module = importlib.import_module(RMS_HELPER), importlib.import_module(GEMMA_HELPER)
    # The names as the models call them: DeepSeek-V3.2's module, and the module that imported Gemma's.
    helpers = {"rms": sys.modules[RMS_USER].fused_allreduce_rms_norm,
               "gemma": sys.modules[GEMMA_USER].fused_allreduce_gemma_rms_norm}
    tp = parallel_state.get_tp_group()
    comm = lookup_communicator(tp.device_group.group_name)
    limit = comm.max_token_num(HIDDEN, torch.bfloat16) if comm is not None else 0
    result = {
        "limit": limit,
        "served": {name: getattr(f, "_tpfuse_serves", None) is not None for name, f in helpers.items()},
        "same_everywhere": helpers["rms"] is rms_module.fused_allreduce_rms_norm
        and helpers["gemma"] is gemma_module.fused_allreduce_gemma_rms_norm,
        "calls": [],
    }
    sizes = (SMALL, (limit or MAX_TOKENS) + 3)  # under the limit, over it
    for gemma in (False, True):
        for i, tokens in enumerate(sizes):
            call = _calls(rank, 100 * gemma + i, tokens, gemma, helpers, max(sizes))
            result["calls"].append({"mode": "plain", **call})
    if not batch_invariant_too:
        parallel_state.destroy_model_parallel()
        return result
    # Batch-invariant mode as vLLM's switch turns it on: every size on tpfuse's op. The big call's first
    # rows are the small call's rows (its seed's draw), so a row's bits can be compared across the calls.
    os.environ["VLLM_BATCH_INVARIANT"] = "1"
    tpfuse.set_batch_invariant(None)  # read the environment anew
    result["batch_invariant"] = tpfuse.batch_invariant()
    for gemma in (False, True):
        for tokens in sizes:
            call = _calls(rank, 7 + gemma, tokens, gemma, helpers, max(sizes))
            result["calls"].append({"mode": "batch-invariant", **call})
    parallel_state.destroy_model_parallel()
    return result


def missing_seam_error(directory: str) -> str | None:
    """The error vLLM's start-up gives with tpfuse on when vLLM lacks ``fused_allreduce_rms_norm`` (the
    helper deleted from its module: a release that moved it), or None where none is raised."""
    import importlib

    module = importlib.import_module(RMS_HELPER)
    saved = module.fused_allreduce_rms_norm
    del module.fused_allreduce_rms_norm
    try:
        vllm_config(directory, tpfuse=True)
    except Exception as exc:  # noqa: BLE001 - the error itself is the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        module.fused_allreduce_rms_norm = saved
    return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    import multiprocessing as mp

    from vllm.plugins import load_general_plugins

    from tpfuse.testing.ranks import free_port

    load_general_plugins()
    directory = tiny_config_dir()
    configs = {"alone": vllm_config(directory, tpfuse=False), "tpfuse": vllm_config(directory, tpfuse=True)}
    parent = {name: config.additional_config for name, config in configs.items()}
    parent["missing_seam_error"] = missing_seam_error(directory)
    # vLLM's CPU communicator names its shared memory by this (vLLM's CPU executor sets it per instance)
    os.environ.setdefault("VLLM_DIST_IDENT", f"tpfuse-seam-{os.getpid()}")
    port = free_port()
    context = mp.get_context("spawn")
    ranks = [context.Process(target=rank_main, args=(rank, port, configs, args.out)) for rank in range(2)]
    for process in ranks:
        process.start()
    for process in ranks:
        process.join(timeout=500)
    codes = [process.exitcode for process in ranks]
    pathlib.Path(args.out, "parent.json").write_text(json.dumps({**parent, "exit_codes": codes}))
    sys.exit(0 if codes == [0, 0] else 1)


if __name__ == "__main__":
    main()
