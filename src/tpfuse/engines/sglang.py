"""tpfuse in SGLang (0.5.23): a plugin that runs tpfuse's fused call where SGLang would call FlashInfer's.

What an SGLang user writes (tpfuse installed in SGLang's environment)::

    TPFUSE_SGLANG=1 python -m sglang.launch_server --model-path MODEL --tp 2

SGLang loads the plugins of the entry-point group ``sglang.srt.plugins`` in each of its processes; with
``$TPFUSE_SGLANG`` = 1, :func:`register` checks that SGLang has every seam it hooks (:data:`SEAMS`; one
missing raises at start-up, naming SGLang's version and the seam), then replaces (``HookType.REPLACE``;
SGLang rewrites every module's reference to the original too):

- ``flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm``, the one fused all-reduce + residual
  + RMSNorm call of SGLang's layers (``layernorm._forward_with_allreduce_fusion``): tpfuse's op on the
  same group SGLang's call reduces over (``resolve_fusion_group``). It never declines: a call over
  tpfuse's limit runs as fused calls of the limit's rows (or the group's own all-reduce), so SGLang's
  decline branch is never taken;
- ``layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies``, the gate that decides whether a
  layer defers its all-reduce to the fused call: on any GPU tpfuse runs on (not only SM90 / SM100 with
  FlashInfer), for batches up to tpfuse's limit (every batch in batch-invariant mode), with SGLang's own
  exclusions (attention data parallelism);
- ``BaseRunner._pre_initialize_flashinfer_allreduce_workspace``, run before CUDA-graph capture: tpfuse's
  communicators of the fusion groups instead of FlashInfer's workspaces.

Deterministic inference (``--enable-deterministic-inference``): SGLang turns FlashInfer's and AITER's
fusion off; tpfuse's hooks keep serving (SGLang still calls the replaced workspace method and gate), and
the plugin turns tpfuse's batch-invariant mode on (:mod:`tpfuse.ops.determinism`; also on under
``SGLANG_ENABLE_DETERMINISTIC_INFERENCE=1``): the gate then sends every batch to tpfuse's op, whose
fallback over the limit is batch-invariant, so no batch size changes a token's bits.

Versions: run against :data:`RUN_AGAINST` (SGLang's own modules on CPU ranks, tests/engines/test_sglang.py;
its server needs a GPU), read against :data:`READ_AGAINST`.
"""

from __future__ import annotations

import logging
import os

from tpfuse.engines.seams import Seam, SeamMissing, StartUpStopped, check

log = logging.getLogger("tpfuse.engines.sglang")

ENV = "TPFUSE_SGLANG"
#: The most tokens a fused call of SGLang's takes (its own limit for FlashInfer's fusion).
MAX_TOKENS = 2048
FUSED_CALL = "sglang.srt.layers.flashinfer_comm_fusion.flashinfer_allreduce_residual_rmsnorm"
GATE = "sglang.srt.layers.layer_boundary.residual.add_norm.flashinfer_ar_fusion_applies"
WORKSPACE = ("sglang.srt.model_executor.runner.base_runner.BaseRunner."
             "_pre_initialize_flashinfer_allreduce_workspace")
#: SGLang releases the plugin ran in (SGLang's modules, not its server: tests/engines/test_sglang.py).
RUN_AGAINST = ("0.5.23",)
#: SGLang releases whose source the plugin's seams were read in.
READ_AGAINST = ("0.5.23",)
#: What the plugin hooks or calls in SGLang (:func:`tpfuse.engines.seams.check`).
SEAMS = (
    Seam("sglang.srt.plugins.hook_registry:HookRegistry", "registers its hooks"),
    Seam("sglang.srt.plugins.hook_registry:HookType.REPLACE", "replaces SGLang's functions"),
    Seam("sglang.srt.layers.flashinfer_comm_fusion:flashinfer_allreduce_residual_rmsnorm",
         "runs its op where SGLang's layers call FlashInfer's fused all-reduce + residual + RMSNorm"),
    Seam("sglang.srt.layers.flashinfer_comm_fusion:resolve_fusion_group",
         "finds the group SGLang's fused call reduces over"),
    Seam("sglang.srt.layers.layer_boundary.residual.add_norm:flashinfer_ar_fusion_applies",
         "decides which layers defer their all-reduce to the fused call"),
    Seam("sglang.srt.model_executor.runner.base_runner:"
         "BaseRunner._pre_initialize_flashinfer_allreduce_workspace",
         "creates its communicators before CUDA-graph capture"),
    Seam("sglang.srt.layers.dp_attention:is_dp_attention_enabled",
         "keeps SGLang's data-parallel attention out"),
)
#: {c10d group name: the most tokens its communicator fuses at the model's hidden size and dtype}
_limits: dict[str, int] = {}


def check_seams() -> dict[str, object]:
    """Every seam of :data:`SEAMS` in the installed SGLang (raises ``SeamMissing`` naming a missing one with
    SGLang's version); logs what it found on a version it does not know."""
    import sglang

    return check("SGLang", getattr(sglang, "__version__", "unknown"), SEAMS, RUN_AGAINST, READ_AGAINST, log)


def register() -> None:
    """SGLang's plugin entry point: the three replacements above, when ``$TPFUSE_SGLANG`` is 1 (after
    checking every seam: one missing stops start-up with :class:`~tpfuse.engines.seams.StartUpStopped`,
    never a silent no-op)."""
    if os.environ.get(ENV) != "1":
        return
    try:
        check_seams()
    except SeamMissing as exc:
        # SGLang's load_plugins catches a plugin's Exception, logs it and serves without the plugin: tpfuse
        # would be unused though asked for. A SystemExit passes that handler and stops start-up.
        raise StartUpStopped(str(exc)) from exc
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    for target, hook in ((FUSED_CALL, allreduce_residual_rmsnorm), (GATE, fusion_applies),
                         (WORKSPACE, create_communicators)):
        HookRegistry.register(target, hook, HookType.REPLACE)  # load_plugins() names tpfuse as the source


def _fusion_group(use_attn_tp_group: bool):
    """The process group SGLang's fused call reduces over (the attention TP group, or the experts')."""
    from sglang.srt.layers.flashinfer_comm_fusion import resolve_fusion_group

    _, _, coordinator = resolve_fusion_group(use_attn_tp_group=use_attn_tp_group)
    return coordinator.device_group


def allreduce_residual_rmsnorm(input_tensor, residual, weight, eps: float = 1e-6,
                               max_token_num: int = MAX_TOKENS, use_oneshot=None,
                               trigger_completion_at_end: bool = False, fp32_acc: bool = True,
                               use_attn_tp_group: bool = True):
    """FlashInfer's call's signature and contract: ``(normed, residual_out)``, new tensors (SGLang keeps
    the residual it passed); the reduction in fp32 (``fp32_acc``). The remaining FlashInfer switches
    (one-shot, completion trigger) are tpfuse's own choices (its algorithm table)."""
    import tpfuse

    return tpfuse.allreduce_add_rmsnorm(input_tensor, residual, weight, eps,
                                        group=_fusion_group(use_attn_tp_group))


def fusion_applies(batch_size: int) -> bool:
    """Whether a layer defers its all-reduce to the fused call: a batch the attention TP group's
    communicator fuses (any batch in batch-invariant mode: the op's path over the limit is batch-invariant,
    SGLang's all-reduce + norm would give other bits), where SGLang's attention is not data-parallel."""
    from sglang.srt.layers.dp_attention import is_dp_attention_enabled

    from tpfuse.ops.determinism import batch_invariant

    if not _limits or batch_size <= 0 or is_dp_attention_enabled():  # no communicator made (yet)
        return False
    return batch_invariant() or batch_size <= _limits.get(_fusion_group(use_attn_tp_group=True).group_name, 0)


def deterministic_inference(runner) -> bool:
    """Whether SGLang's server runs with ``--enable-deterministic-inference``: its server args as the runner's
    model runner holds them, else the value in effect in SGLang's runtime context
    (``get_exec().deterministic``; SGLang 0.5.23 retired ``get_global_server_args``)."""
    args = getattr(getattr(runner, "model_runner", None), "server_args", None)
    if args is not None:
        return bool(getattr(args, "enable_deterministic_inference", False))
    try:
        from sglang.srt.runtime_context import get_exec

        return bool(get_exec().deterministic.enable_deterministic_inference)
    except Exception:  # noqa: BLE001 - no runtime context (SGLang's modules without a server): not asked for
        return False


def create_communicators(runner) -> None:
    """Before CUDA-graph capture: tpfuse's communicator of each group SGLang's fused calls reduce over,
    sized for :data:`MAX_TOKENS` rows of the model's hidden size (collective over each group). Under
    SGLang's deterministic inference, tpfuse's batch-invariant mode first (said once in the log)."""
    import tpfuse
    from tpfuse.ops.determinism import batch_invariant, batch_invariant_source, set_batch_invariant

    if deterministic_inference(runner) and not batch_invariant():
        set_batch_invariant(True)
    if batch_invariant():
        log.info("tpfuse: batch-invariant mode (%s): SGLang's deterministic inference turns FlashInfer's "
                 "fused all-reduce + RMSNorm off; tpfuse's op keeps serving SGLang's fused calls, at every "
                 "batch size", batch_invariant_source())
    hidden, dtype = runner.model_runner.model_config.hidden_size, runner.model_runner.dtype
    for use_attn_tp_group in (True, False):
        group = _fusion_group(use_attn_tp_group)
        if group.size() > 1:
            comm = tpfuse.get_communicator(group, max_tokens=MAX_TOKENS, hidden=hidden)
            _limits[group.group_name] = comm.max_token_num(hidden, dtype)
            log.info("tpfuse: SGLang's fused all-reduce + RMSNorm calls on group %s: %r", group.group_name,
                     comm)
