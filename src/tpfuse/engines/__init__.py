"""tpfuse inside serving engines: vLLM (:mod:`tpfuse.engines.vllm`) and SGLang (:mod:`tpfuse.engines.sglang`).

Each engine module imports its engine and is loaded by the engine's plugin mechanism (the entry points
in pyproject.toml); this package itself imports neither engine.
"""

from __future__ import annotations


def vllm_fusion_pass(graph) -> None:
    """tpfuse's fusion pass as vLLM names a pass in JSON: ``"tpfuse.vllm_fusion_pass"`` (vLLM resolves a
    qualified name as an attribute of the top-level package, so :mod:`tpfuse` exports this).

    With tpfuse's vLLM plugin loaded (installed with tpfuse) this function never runs: the plugin puts
    a configured :class:`tpfuse.engines.vllm.FusionPass` in its place. Called directly, it runs an
    unconfigured one (sites fuse only where a communicator exists).
    """
    from tpfuse.engines.vllm import FusionPass

    FusionPass()(graph)
