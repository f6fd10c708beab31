"""tpfuse in vLLM: its fusion pass in vLLM's pass manager, its communicator on vLLM's tensor-parallel group.

What a vLLM user writes (tpfuse installed in vLLM's environment; the plugin below loads itself)::

    from tpfuse.engines.vllm import compilation_config
    llm = LLM(model, tensor_parallel_size=2, compilation_config=compilation_config())

    vllm serve MODEL -tp 2 --compilation-config '{"inductor_passes": {"post_grad_custom_post_pass": "tpfuse.vllm_fusion_pass"}}'

The pieces:

- :class:`FusionPass`, a vLLM ``InductorPass``: after vLLM's own passes it replaces each
  ``vllm.all_reduce`` followed by vLLM's ``fused_add_rms_norm`` / ``rms_norm``
  (:mod:`tpfuse.compiler.vllm_sites`) with tpfuse's op, in the compile ranges up to the fusion limit
  (``is_applicable_for_range``); sites it leaves are logged with the reason, as ``tpfuse.compile`` does.
- :func:`register`, the ``vllm.general_plugins`` entry point, run by vLLM in every process. Where the
  config asks for tpfuse's pass, it (front end) sizes the pass from the model: the limit is
  ``tpfuse.select.max_token_num`` of the model's hidden size and dtype, added to vLLM's compile-range
  endpoints so the ranges above it compile unfused; it turns vLLM's own all-reduce fusion off (it
  would take the sites first). In each worker, right after vLLM makes its groups (before compiling
  and before CUDA-graph capture, also on compile-cache hits) it creates the tensor-parallel group's
  communicator in tpfuse's registry, and destroys it before vLLM destroys the group.

Without the plugin (``VLLM_PLUGINS`` excluding ``tpfuse``) the pass still runs but finds no
communicator: every site stays vLLM's, logged with that reason.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import threading

import torch
from vllm.compilation.passes.inductor_pass import CallableInductorPass, InductorPass

from tpfuse import select
from tpfuse.compiler import fusion_pass as tpfuse_pass
from tpfuse.compiler import vllm_sites

log = logging.getLogger("tpfuse.engines.vllm")

#: The config key vLLM reads its one third-party post-grad pass from.
PASS_KEY = "post_grad_custom_post_pass"


@dataclasses.dataclass(frozen=True)
class FusionPass(InductorPass):
    """tpfuse's fusion as a vLLM post-grad pass; picklable (vLLM sends it to its workers in its config).

    Parameters
    ----------
    max_tokens : int, optional
        The most tokens a call may fuse; by default vLLM's ``max_num_batched_tokens``, capped by the
        algorithm table's fused limit (``select.max_token_num``).

    ``limit`` and ``hidden`` are set by the plugin from the model (:meth:`sized_for`): the compile
    ranges the pass applies to end at ``limit``, and the workspace holds ``limit`` rows of ``hidden``.
    """

    max_tokens: int | None = None
    limit: int = 0
    hidden: int = 0

    def sized_for(self, vllm_config) -> FusionPass:
        """This pass with ``limit`` and ``hidden`` of ``vllm_config``'s model, tensor-parallel size and
        batch size (the same on every process: the front end computes it, the workers receive it)."""
        model = vllm_config.model_config
        hidden, dtype = model.get_hidden_size(), model.dtype
        tp = vllm_config.parallel_config.tensor_parallel_size
        batched = vllm_config.scheduler_config.max_num_batched_tokens
        tokens = min(self.max_tokens or batched, batched)
        limit = select.max_token_num(hidden, dtype, tp, tokens * hidden * select.ELEMENT_BYTES)
        return dataclasses.replace(self, limit=limit, hidden=hidden)

    def is_applicable_for_range(self, compile_range) -> bool:
        return compile_range.end <= self.limit

    def __call__(self, graph: torch.fx.Graph) -> None:
        tpfuse_pass.FusionPass(max_tokens=_compile_range_end(), vllm_groups=_groups_of(graph))(graph)


    def uuid(self) -> str:
        # Inductor's cache key: tpfuse's pass code and this pass's sizes (vLLM adds the compile range).
        key = f"{tpfuse_pass.FusionPass._source_hash}|{self.limit}|{self.hidden}"
        return "tpfuse-vllm-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def compilation_config(base: dict | None = None, max_tokens: int | None = None) -> dict:
    """vLLM's ``compilation_config`` with tpfuse's pass: ``base`` (a dict, default empty) with the pass in
    ``inductor_compile_config`` and vLLM's own all-reduce fusion off. The plugin sizes the pass."""
    config = dict(base or {})
    config["inductor_compile_config"] = {**config.get("inductor_compile_config", {}),
                                         PASS_KEY: FusionPass(max_tokens=max_tokens)}
    config["pass_config"] = {**config.get("pass_config", {}), "fuse_allreduce_rms": False}
    return config


def requested_pass(vllm_config) -> FusionPass | None:
    """tpfuse's pass in ``vllm_config``, if the user asked for it (as an object or as
    ``"tpfuse.vllm_fusion_pass"``, which vLLM wraps in a ``CallableInductorPass``)."""
    from tpfuse.engines import vllm_fusion_pass

    found = vllm_config.compilation_config.inductor_compile_config.get(PASS_KEY)
    if isinstance(found, CallableInductorPass) and found.callable is vllm_fusion_pass:
        return FusionPass()
    return found if isinstance(found, FusionPass) else None


def configure(vllm_config) -> None:
    """The front end's part (inside ``VllmConfig.__post_init__``, before vLLM sets its compile ranges):
    size the requested pass, add its limit as a compile-range endpoint, turn vLLM's all-reduce fusion off."""
    requested = requested_pass(vllm_config)
    if requested is None or requested.limit:
        return
    compilation = vllm_config.compilation_config
    sized = requested.sized_for(vllm_config)
    compilation.inductor_compile_config[PASS_KEY] = sized
    compilation.pass_config.fuse_allreduce_rms = False
    if sized.limit > 1:
        compilation.compile_ranges_endpoints = sorted(set(compilation.compile_ranges_endpoints or []) | {sized.limit})
    log.info("tpfuse: fusing vLLM's all-reduce + RMSNorm sites for up to %d tokens (hidden %d)",
             sized.limit, sized.hidden)


def create_communicator() -> None:
    """The worker's part, right after vLLM made its groups: the tensor-parallel group's communicator in
    tpfuse's registry, sized for the pass's limit (collective over the group, before any capture)."""
    import tpfuse
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.parallel_state import get_tp_group

    vllm_config = get_current_vllm_config_or_none()
    requested = requested_pass(vllm_config) if vllm_config is not None else None
    tp = get_tp_group()
    if requested is None or not requested.limit or tp.world_size < 2:
        return
    comm = tpfuse.get_communicator(tp.device_group, max_tokens=requested.limit, hidden=requested.hidden)
    log.info("tpfuse: rank %d of vLLM group %s: %r", tp.rank_in_group, tp.unique_name, comm)


def destroy_communicator() -> None:
    """Before vLLM destroys its groups: the tensor-parallel group's communicator, if tpfuse made one."""
    from vllm.distributed import parallel_state

    from tpfuse.comm.communicator import lookup_communicator

    tp = parallel_state._TP
    comm = lookup_communicator(tp.device_group.group_name) if tp is not None and tp.device_group else None
    if comm is not None:
        comm.destroy()


_register_lock = threading.Lock()
_registered = False


def register() -> None:
    """vLLM's plugin entry point (``vllm.general_plugins``): hooks :func:`configure` into the platform's
    ``check_and_update_config`` and the communicator's life into vLLM's group set-up and tear-down.
    Idempotent; does nothing to a run whose config does not ask for tpfuse's pass."""
    global _registered
    with _register_lock:
        if _registered:
            return
        _registered = True
    from vllm.distributed import parallel_state
    from vllm.platforms import current_platform

    platform = type(current_platform)
    check_and_update = platform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check_and_update(cls, vllm_config)
        configure(vllm_config)

    platform.check_and_update_config = classmethod(check_and_update_config)
    initialize, destroy = parallel_state.initialize_model_parallel, parallel_state.destroy_model_parallel

    def initialize_model_parallel(*args, **kwargs):
        initialize(*args, **kwargs)
        create_communicator()

    def destroy_model_parallel(*args, **kwargs):
        destroy_communicator()
        destroy(*args, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel
    parallel_state.destroy_model_parallel = destroy_model_parallel
    _log_through_vllm()


def _log_through_vllm() -> None:
    """tpfuse's messages (which sites fused, why others did not) where vLLM's own go, at vLLM's level."""
    ours, theirs = logging.getLogger("tpfuse"), logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _compile_range_end() -> int | None:
    """The largest token count of the graph being compiled: vLLM's compile range (None outside one)."""
    from vllm.compilation.passes import inductor_pass

    context = inductor_pass._pass_context
    return context.compile_range.end if context is not None else None


def _groups_of(graph: torch.fx.Graph) -> dict[str, str]:
    """``{vLLM group name: c10d group name}`` of the groups the graph's all-reduces run on."""
    from vllm.distributed import parallel_state

    found = {}
    for name in vllm_sites.group_names(graph):
        coordinator = parallel_state._groups[name]() if name in parallel_state._groups else None
        if coordinator is not None and coordinator.device_group is not None:
            found[name] = coordinator.device_group.group_name
    return found
