"""tpfuse's SGLang plugin (tpfuse.engines.sglang) inside SGLang's own installed modules (SGLang 0.5.23).

Skipped where ``import sglang`` fails (the project's venv has no SGLang). In an environment with SGLang and
tpfuse (``pip install --no-deps -e .``, so that SGLang finds the plugin's entry point)::

    TRITON_INTERPRET=1 python -m pytest tests/engines/test_sglang.py -q -p no:cacheprovider

Real: SGLang's plugin loader (``sglang.srt.plugins.load_plugins``: the entry point, ``HookRegistry``, its
rewriting of other modules' references), its ``RMSNorm`` and fused-norm caller
``layernorm._forward_with_allreduce_fusion``, ``BaseRunner``'s workspace method and the gate
``flashinfer_ar_fusion_applies`` as the plugin replaced them; tpfuse's communicator and kernels (in Triton's
interpreter) on 2 gloo ranks.

Mocked on the ranks (SGLang's parallel state takes a whole server to initialise):
- ``layernorm.get_parallel()``: ``attn_tp_size=2`` (the caller's world-size check), nothing else;
- ``flashinfer_comm_fusion.resolve_fusion_group``: ``(2, rank, SimpleNamespace(device_group=<gloo WORLD>))``
  for the attention and the experts' group alike;
- the runner given to the workspace method: only ``model_runner.model_config.hidden_size`` and
  ``model_runner.dtype``.
"""

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from tpfuse.testing.cases import Case, check_results
from tpfuse.testing.ranks import run_ranks

pytest.importorskip("sglang", reason="SGLang is not importable here: run this file in an SGLang environment "
                                     "(see the module docstring)")
pytestmark = [pytest.mark.slow, pytest.mark.sglang]

HIDDEN = 64
SMALL = 5  # tokens of a call well under the limit

# Run in a fresh interpreter: which of the plugin's targets load_plugins() replaced, and how.
PROBE = """
import json, pkgutil, sys
from sglang.srt.plugins import load_plugins
from tpfuse.engines import sglang as plugin

def resolve(target):
    owner, attr = target.rsplit(".", 1)
    return getattr(pkgutil.resolve_name(owner), attr)

hooks = {plugin.FUSED_CALL: plugin.allreduce_residual_rmsnorm, plugin.GATE: plugin.fusion_applies,
         plugin.WORKSPACE: plugin.create_communicators}
before = {target: resolve(target) for target in hooks}
load_plugins()
found = {}
for target, hook in hooks.items():
    now, name = resolve(target), target.rsplit(".", 1)[1]
    cells = [c.cell_contents for c in getattr(now, "__closure__", None) or ()]  # SGLang's REPLACE wrapper
    found[target] = {"replaced": now is not before[target], "by_tpfuse": now is hook or hook in cells,
                     "wrapped_is_original": getattr(now, "__wrapped__", before[target]) is before[target],
                     "stale_references": sorted(m for m, mod in list(sys.modules.items())
                                                if getattr(mod, "__dict__", {}).get(name) is before[target])}
print(json.dumps(found))
"""


@pytest.mark.parametrize("enabled", [True, False], ids=["TPFUSE_SGLANG=1", "unset"])
def test_load_plugins_applies_the_three_hooks_only_when_enabled(enabled):
    env = {k: v for k, v in os.environ.items() if k not in ("TPFUSE_SGLANG", "SGLANG_PLUGINS")}
    env.update({"TPFUSE_SGLANG": "1"} if enabled else {})
    done = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=300,
                          check=False)
    assert done.returncode == 0, done.stderr[-4000:]
    log = "\n".join(line for line in done.stderr.splitlines() if "Warning" not in line)[-4000:]
    for target, found in json.loads(done.stdout.splitlines()[-1]).items():
        if enabled:  # tpfuse's function in SGLang's wrapper of the original; no module keeps the original
            assert found == {"replaced": True, "by_tpfuse": True, "wrapped_is_original": True,
                             "stale_references": []}, f"{target}: {found}\n{log}"
        else:
            assert not found["replaced"] and not found["by_tpfuse"], f"{target}: {found}"


def _sglang_on_ranks(rank, world_size):
    """On each rank: load the plugins, make the communicators through the replaced workspace method, ask
    the gate, and run SGLang's caller on a small call and one over tpfuse's limit."""
    import torch.distributed as dist
    from sglang.srt.layers import flashinfer_comm_fusion, layernorm
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.model_executor.runner.base_runner import BaseRunner
    from sglang.srt.plugins import load_plugins

    import tpfuse

    os.environ["TPFUSE_SGLANG"] = "1"
    load_plugins()
    gate = add_norm.flashinfer_ar_fusion_applies
    hooked = (flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm, gate,
              BaseRunner._pre_initialize_flashinfer_allreduce_workspace)
    assert all(hasattr(f, "__wrapped__") for f in hooked), "load_plugins() replaced nothing (see above)"
    coordinator = SimpleNamespace(device_group=dist.group.WORLD)
    layernorm.get_parallel = lambda: SimpleNamespace(attn_tp_size=world_size)
    flashinfer_comm_fusion.resolve_fusion_group = lambda *, use_attn_tp_group: (world_size, rank, coordinator)
    before = gate(1)  # no communicator yet
    runner = SimpleNamespace(model_runner=SimpleNamespace(model_config=SimpleNamespace(hidden_size=HIDDEN),
                                                          dtype=torch.bfloat16))
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)
    limit = tpfuse.get_communicator(dist.group.WORLD).max_token_num(HIDDEN, torch.bfloat16)
    gates = {"before": before, "1..limit": all(gate(n) for n in range(1, limit + 1)), "0": gate(0),
             "limit+1": gate(limit + 1)}
    result = {"limit": limit, "gate": gates, "calls": []}
    for tokens in (SMALL, limit + 1):
        case = Case(tokens, HIDDEN, torch.bfloat16, residual=True, seed=tokens, eps=1e-5)
        inputs = case.inputs(world_size)
        norm = layernorm.RMSNorm(HIDDEN, eps=case.eps, weight_dtype=torch.bfloat16)
        norm.weight.data.copy_(inputs["weight"])
        residual = inputs["residual"].clone()
        tpfuse.reset_stats()
        with torch.inference_mode():
            y, h = layernorm._forward_with_allreduce_fusion(norm, inputs["xs"][rank], residual, None,
                                                            norm.weight, use_attn_tp_group=True)
        result["calls"].append({"case": case, "y": y, "h": h, "stats": tpfuse.stats(),
                                "residual kept": torch.equal(residual, inputs["residual"]),
                                "h new": h.data_ptr() != residual.data_ptr()})
    return result


@pytest.fixture(scope="module")
def ranks():
    # A peer's wait may be long in Triton's interpreter (a 2048-row call takes half a minute): no 10 s bound.
    return run_ranks(_sglang_on_ranks, 2, env={"TPFUSE_SGLANG": "1", "TPFUSE_WAIT_TIMEOUT_S": "300"})


def test_sglang_fused_norm_caller_runs_tpfuse_on_two_ranks(ranks):
    for i, label in enumerate(("small", "over the limit")):
        calls = [r["calls"][i] for r in ranks]
        assert all(c["y"] is not None and c["h"] is not None for c in calls), f"{label}: tpfuse declined"
        check_results(calls[0]["case"], 2, [(c["y"], c["h"]) for c in calls])  # float64, ranks bit-identical
        for rank, c in enumerate(calls):
            assert c["residual kept"] and c["h new"], f"{label}, rank {rank}: residual modified or reused"
            assert any(k.startswith("triton.") for k in c["stats"]), f"{label}, rank {rank}: {c['stats']}"
    small = [r["calls"][0]["stats"] for r in ranks]
    assert all(stats == {"triton.oneshot": 1} for stats in small), small  # one fused kernel call


def test_replaced_gate_follows_the_communicators_limit(ranks):
    for r in ranks:
        assert r["limit"] >= SMALL
        assert r["gate"] == {"before": False, "1..limit": True, "0": False, "limit+1": False}, r["gate"]


# Run in a fresh interpreter: SGLang's own loader with one seam taken away from SGLang's modules.
MISSING_GATE = """
from sglang.srt.layers.layer_boundary.residual import add_norm
del add_norm.flashinfer_ar_fusion_applies  # a release that moved the gate
from sglang.srt.plugins import load_plugins
load_plugins()
print("served on without tpfuse")
"""


def test_a_missing_seam_stops_sglangs_start_up_naming_it():
    """SGLang's load_plugins logs and swallows a plugin's Exception; tpfuse's plugin, asked for and missing a
    seam, stops the process instead (SystemExit), naming the seam and SGLang's version."""
    env = {k: v for k, v in os.environ.items() if k != "SGLANG_PLUGINS"}
    env["TPFUSE_SGLANG"] = "1"
    done = subprocess.run([sys.executable, "-c", MISSING_GATE], env=env, capture_output=True, text=True,
                          timeout=300, check=False)
    assert (done.returncode != 0
            and "served on without tpfuse" not in done.stdout), done.stdout + done.stderr[-3000:]
    import sglang

    from tpfuse.engines.sglang import GATE
    target = GATE.rsplit(".", 1)[0] + ":" + GATE.rsplit(".", 1)[1]
    assert target in done.stderr and f"SGLang {sglang.__version__}" in done.stderr, done.stderr[-3000:]


def _deterministic_on_ranks(rank, world_size):
    """With SGLang's server args asking for deterministic inference: the replaced workspace method turns
    tpfuse's batch-invariant mode on, and the gate sends every batch (over the limit too) to tpfuse."""
    import torch.distributed as dist
    from sglang.srt.layers import flashinfer_comm_fusion
    from sglang.srt.layers.layer_boundary.residual import add_norm
    from sglang.srt.model_executor.runner.base_runner import BaseRunner
    from sglang.srt.plugins import load_plugins

    import tpfuse

    os.environ["TPFUSE_SGLANG"] = "1"
    load_plugins()
    coordinator = SimpleNamespace(device_group=dist.group.WORLD)
    flashinfer_comm_fusion.resolve_fusion_group = lambda *, use_attn_tp_group: (world_size, rank, coordinator)
    before = tpfuse.batch_invariant()
    runner = SimpleNamespace(model_runner=SimpleNamespace(
        model_config=SimpleNamespace(hidden_size=HIDDEN), dtype=torch.bfloat16,
        server_args=SimpleNamespace(enable_deterministic_inference=True)))
    BaseRunner._pre_initialize_flashinfer_allreduce_workspace(runner)
    limit = tpfuse.get_communicator(dist.group.WORLD).max_token_num(HIDDEN, torch.bfloat16)
    gate = add_norm.flashinfer_ar_fusion_applies
    return {"before": before, "after": tpfuse.batch_invariant(), "over the limit": gate(limit + 1),
            "far over": gate(8 * limit), "0": gate(0)}


def test_deterministic_inference_keeps_tpfuse_serving_every_batch():
    results = run_ranks(_deterministic_on_ranks, 2, env={"TPFUSE_SGLANG": "1"})
    for r in results:
        assert r == {"before": False, "after": True, "over the limit": True, "far over": True, "0": False}, r
