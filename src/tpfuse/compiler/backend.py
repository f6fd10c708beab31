"""The ``torch.compile`` backend: a fused graph for token counts the fusion serves, a plain one above.

Dynamo hands the backend its graph before AOTAutograd has lowered DTensor redistributions to
collectives, so the backend reads all-reduce sites from both forms dynamo records: functional
collectives (``funcol.all_reduce``, ``dist.all_reduce`` rewritten by dynamo) and DTensor
redistributions from ``Partial`` to ``Replicate`` (``parallelize_module``'s ``RowwiseParallel``).
Each eligible site gives a token count (the product of all dims but the last, often a product of
symbols such as ``batch * seq``) and a limit (:func:`tpfuse.select.max_token_num`); the fused graph
runs when every such count is within its limit, the plain graph otherwise. In batch-invariant mode
(``tpfuse.set_batch_invariant``) there is no limit: one fused graph serves every token count, so no
compile range changes a token's bits.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import hashlib
import inspect
import json
import logging
import os
import pathlib
import types
import weakref
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

from tpfuse.compiler.fusion_pass import FusionPass, SiteReport, report_graph, site_limit, summarize
from tpfuse.compiler.patterns import UNBOUNDED_LIMIT
from tpfuse.compiler.reasons import Reason
from tpfuse.compiler.sizes import describe_shape, static_int, token_count

log = logging.getLogger("tpfuse.compiler")
_FUNCOL_ALL_REDUCE = (torch.ops._c10d_functional.all_reduce, torch.ops._c10d_functional.all_reduce.default)
_FUNCOL_REDUCE_SCATTER = (torch.ops._c10d_functional.reduce_scatter_tensor,
                          torch.ops._c10d_functional.reduce_scatter_tensor.default)


@dataclass
class GraphPlan:
    """What the backend decided for one dynamo graph."""

    sites: list[SiteReport] = field(default_factory=list)  # every all-reduce, with why it cannot fuse
    bounds: dict[str, tuple[object, int]] = field(default_factory=dict)  # token expression -> limit
    static_fusable: int = 0  # eligible sites whose token count is a constant within the limit

    @property
    def fusable(self) -> bool:
        return bool(self.bounds) or self.static_fusable > 0


def _is_dtensor(value) -> bool:
    return type(value).__name__ == "DTensor" and hasattr(value, "placements")


class DynamoSite(NamedTuple):
    """A reduction of a dynamo graph: an all-reduce, or (``sharded``) a reduce-scatter, sequence
    parallel's."""

    group_name: str
    reduce_op: str
    value: torch.Tensor
    sharded: bool = False


def _dtensor_reduction(node: torch.fx.Node) -> DynamoSite | None:
    """The reduction when ``node`` turns a Partial DTensor into a Replicate one (an all-reduce) or a Shard
    one (a reduce-scatter)."""
    out = node.meta.get("example_value")
    if not _is_dtensor(out):
        return None
    for arg in node.all_input_nodes:
        value = arg.meta.get("example_value")
        if not _is_dtensor(value) or value.device_mesh != out.device_mesh:
            continue
        for dim, (before, after) in enumerate(zip(value.placements, out.placements)):
            if before.is_partial() and (after.is_replicate() or after.is_shard()):
                local = getattr(out, "_local_tensor", out)
                return DynamoSite(out.device_mesh.get_group(dim).group_name, str(before.reduce_op), local,
                                  after.is_shard())
    return None


def dynamo_reductions(gm: torch.fx.GraphModule) -> list[DynamoSite]:
    """Every all-reduce and reduce-scatter of a dynamo graph, in graph order; those of its subgraphs too
    (an autograd.Function's body, as torchtitan's plain-tensor collectives are in training)."""
    found = []
    graphs = [gm.graph] + [module.graph for name, module in gm.named_modules()
                           if name and isinstance(module, torch.fx.GraphModule)]
    for node in (node for graph in graphs for node in graph.nodes):
        if node.op == "call_function" and node.target in _FUNCOL_ALL_REDUCE + _FUNCOL_REDUCE_SCATTER:
            value, reduce_op = node.meta.get("example_value"), node.args[1]
            sharded = node.target in _FUNCOL_REDUCE_SCATTER
            group_name = node.args[3 if sharded else 2]
            if isinstance(value, torch.Tensor) and isinstance(group_name, str):
                found.append(DynamoSite(group_name, str(reduce_op), value, sharded))
        elif node.op in ("call_function", "call_method"):
            site = _dtensor_reduction(node)
            if site is not None:
                found.append(site)
    return found


def plan_graph(gm: torch.fx.GraphModule) -> GraphPlan:
    """Which all-reduces of a dynamo graph could fuse, and the token bounds that make them fuse."""
    plan = GraphPlan()
    for group_name, reduce_op, value, sharded in dynamo_reductions(gm):
        hidden = static_int(value.shape[-1]) if value.dim() >= 2 else None
        if hidden is None:
            limit, reason = 0, Reason("hidden",
                                      "the all-reduced tensor is not [..., hidden] with a static hidden size")
        else:
            limit, reason = site_limit(group_name, reduce_op, hidden, value.dtype)
        tokens = token_count(value.shape)
        if reason is None and isinstance(tokens, int) and tokens > limit:
            reason = Reason("tokens", f"{tokens} tokens exceed the fusion limit {limit}")
        if sharded:  # sequence parallel's: the op takes any size (in parts), so no range either
            reason = None if reason is None or reason.code == "tokens" else reason
        if reason is not None:
            shape = describe_shape(value.shape)
            plan.sites.append(SiteReport(shape, value.dtype, group_name, False, None, reason,
                                         collective="reduce-scatter" if sharded else "all-reduce"))
        elif sharded or isinstance(tokens, int) or limit >= UNBOUNDED_LIMIT:  # batch-invariant mode: no range
            plan.static_fusable += 1
        else:
            key = str(tokens)
            plan.bounds[key] = (tokens, min(limit, plan.bounds.get(key, (None, limit))[1]))
    return plan


def _token_reader(gm: torch.fx.GraphModule, expr):
    """A function of the compiled graph's runtime arguments that evaluates a token expression.

    The count may be a product of symbols (batch x sequence): every symbol is read from the input
    that carries it, then the expression is evaluated.
    """
    import sympy

    readers = {}
    for i, node in enumerate(n for n in gm.graph.nodes if n.op == "placeholder"):
        value = node.meta.get("example_value")
        if isinstance(value, torch.SymInt) and value.node.expr.is_Symbol:
            readers.setdefault(value.node.expr, lambda args, i=i: int(args[i]))
        elif isinstance(value, torch.Tensor):
            for d, size in enumerate(value.shape):
                if isinstance(size, torch.SymInt) and size.node.expr.is_Symbol:
                    readers.setdefault(size.node.expr, lambda args, i=i, d=d: args[i].shape[d])
    symbols = sorted(expr.free_symbols, key=str)
    if any(sym not in readers for sym in symbols):
        raise RuntimeError(f"tpfuse: cannot find the token count {expr} among the graph's inputs")
    if expr.is_Symbol:
        return readers[expr]
    evaluate = sympy.lambdify(symbols, expr, "math")
    return lambda args: int(evaluate(*(readers[sym](args) for sym in symbols)))


def _bounds_relied_on(fusion_pass: FusionPass, gm: torch.fx.GraphModule) -> set[str] | None:
    """The token bounds the fused sites of ``gm``'s fused graph rely on.

    The pass records them when it runs; when Inductor serves the graph from its cache the pass does
    not run, so they are also kept in a file beside Inductor's cache, under a key of the pass's
    identity and the graph. None (every candidate's bound stays, logged) when neither has them.
    """
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    inputs = [str(n.meta.get("example_value")) for n in gm.graph.nodes if n.op == "placeholder"]
    key = hashlib.sha256("\n".join([fusion_pass.uuid(), gm.code, *inputs]).encode()).hexdigest()[:32]
    record = pathlib.Path(cache_dir()) / "tpfuse" / f"{key}.json"
    relied = fusion_pass.bounds_relied_on
    try:
        if relied is not None:
            record.parent.mkdir(parents=True, exist_ok=True)
            partial = record.with_suffix(f".{os.getpid()}.tmp")
            partial.write_text(json.dumps(sorted(relied)))
            os.replace(partial, record)
        elif record.exists():
            relied = set(json.loads(record.read_text()))
    except (OSError, ValueError) as exc:  # a cache directory we cannot use costs range, not correctness
        log.warning("tpfuse: cannot use %s (%s)", record, exc)
    if relied is None:
        log.warning("tpfuse: a fused graph came from Inductor's cache without tpfuse's record of its "
                    "sites: its range keeps every all-reduce's bound (%s)",
                    ", ".join(fusion_pass.token_bounds))
    return relied


@contextlib.contextmanager
def _norms_recomputed_in_backward():
    """Let AOTAutograd's partitioner recompute reductions in the backward from what it saves instead of
    saving their results: above all a norm's ``rsqrt``, from h. A saved ``rsqrt`` is a second reader of the
    norm's inside, where the fused op has none: with it no forward site of a training graph fuses; without
    it the forward's block ends fuse and the backward's norm recomputes one row reduction (the same ops,
    the same bits). The switch is the partitioner's, for the whole graph: it may recompute other cheap
    reductions too, trading their memory for time as its cost model says. Training graphs only: inference
    graphs are not partitioned."""
    from torch._functorch import config as functorch_config

    if not hasattr(functorch_config, "ban_recompute_reductions"):
        yield
        return
    with functorch_config.patch(ban_recompute_reductions=False):
        yield


@contextlib.contextmanager
def _first_symbol_proxy_kept():
    """Keep the first proxy of a bare size symbol in make_fx's ``sympy_expr_tracker`` (torch 2.13
    overwrites it). Else tracing a DTensor backward with dynamic sizes (training) maps ``s`` to the
    proxy of ``sym_max(s, 1)``, whose input ``s`` is untracked and resolves through the tracker to that
    same proxy: infinite recursion (RecursionError) in ``proxy_tensor._compute_proxy``."""
    from torch.fx.experimental import proxy_tensor

    original = proxy_tensor.set_proxy_slot

    def set_proxy_slot(obj, tracer, proxy):
        symbols = getattr(tracer, "sympy_expr_tracker", None)
        if symbols is None or not isinstance(obj, proxy_tensor.py_sym_types):
            return original(obj, tracer, proxy)
        kept = symbols.get(obj.node.expr)
        original(obj, tracer, proxy)
        if kept is not None:
            symbols[obj.node.expr] = kept

    proxy_tensor.set_proxy_slot = set_proxy_slot
    try:
        yield
    finally:
        proxy_tensor.set_proxy_slot = original


class TpfuseBackend:
    """A ``torch.compile`` backend: Inductor with the fusion pass below the fusion limit, without above.

    Parameters
    ----------
    inductor_options : dict, optional
        Inductor settings for every graph, as a ``torch.compile`` mode sets them
        (:func:`inductor_options_for_mode`); ``{"triton.cudagraphs": True}`` captures CUDA graphs.

    Attributes
    ----------
    compiles : collections.Counter
        Inductor compilations made, by range: ``"fused"`` and ``"plain"``.
    passes : list of FusionPass
        The pass of every fused compilation (its ``reports`` say what it fused).
    unfusable : list of list of SiteReport
        Per graph compiled without the pass because none of its all-reduces could fuse, the reasons.
    """

    def __init__(self, inductor_options: dict | None = None):
        self.inductor_options = dict(inductor_options or {})
        self.compiles: collections.Counter[str] = collections.Counter()
        self.passes: list[FusionPass] = []
        self.unfusable: list[list[SiteReport]] = []

    @property
    def reports(self) -> list[list[SiteReport]]:
        """Every all-reduce site of every compiled graph, fused or not and why (pass runs first)."""
        return [graph for p in self.passes for graph in p.reports] + self.unfusable

    def __deepcopy__(self, memo):
        # Hugging Face deep-copies a CompileConfig (backend included) before handing it to torch.compile:
        # the copy would compile and record apart from the object the user holds. A backend is shared.
        return self

    def _compile(self, gm, example_inputs, fusion_pass: FusionPass | None, inductor_options: dict):
        from torch._inductor.compile_fx import compile_fx

        patches = dict(inductor_options)
        if fusion_pass is not None:
            patches["post_grad_custom_post_pass"] = fusion_pass
            self.passes.append(fusion_pass)
        self.compiles["fused" if fusion_pass is not None else "plain"] += 1
        with _first_symbol_proxy_kept(), _norms_recomputed_in_backward():
            return compile_fx(gm, example_inputs, config_patches=patches)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, *, mode: str | None = None,
                 options: dict | None = None):
        """Compile one dynamo graph. ``torch.compile(fn, backend=backend, mode=..., options=...)`` hands
        its ``mode`` and ``options`` here (Hugging Face's ``CompileConfig`` always sets a mode): they
        add to the Inductor settings the backend was made with."""
        inductor_options = {**self.inductor_options, **inductor_options_for_mode(mode), **(options or {})}
        plan = plan_graph(gm)
        if not plan.fusable:
            if plan.sites:  # never silent: a graph with all-reduces and nothing to fuse says why
                self.unfusable.append(plan.sites)
                report_graph(plan.sites, "compiled without the fusion")
            return self._compile(gm, example_inputs, None, inductor_options)
        bounds = {key: limit for key, (_, limit) in plan.bounds.items()}
        if not bounds:  # static token counts only: one graph
            return self._compile(gm, example_inputs, FusionPass(token_bounds={}), inductor_options)
        fusion_pass = FusionPass(token_bounds=bounds)
        fused = self._compile(gm, example_inputs, fusion_pass, inductor_options)
        # Only the token counts of sites that fused bound the fused graph: an all-reduce the pass left
        # alone (an MoE's [experts * tokens, H], say) runs at any size.
        relied = _bounds_relied_on(fusion_pass, gm)
        bounds = {key: limit for key, limit in bounds.items() if relied is None or key in relied}
        if not bounds:
            return fused  # nothing fused on a dynamic token count: the graph serves every size
        checks = [(_token_reader(gm, plan.bounds[key][0]), limit) for key, limit in bounds.items()]
        plain = self._compile(gm, example_inputs, None, inductor_options)
        log.info("tpfuse: graph split: the fused graph while %s, the plain graph above",
                 " and ".join(f"{key} <= {limit}" for key, limit in bounds.items()))

        def run(*args):
            return fused(*args) if all(read(args) <= limit for read, limit in checks) else plain(*args)

        return run


def _hooked_modules(module: torch.nn.Module) -> list[torch.nn.Module]:
    """``module`` and its submodules that carry module-level backward hooks."""
    return [m for m in module.modules() if m._backward_hooks or m._backward_pre_hooks]


def _run_traced(compiled, hooked: list[torch.nn.Module], args, kwargs):
    """Call a dynamo-compiled callable the way the fusion needs it traced.

    Floats are specialised: dynamo otherwise turns float attributes such as a norm's ``eps`` into
    graph inputs, and the fused op needs eps as a constant.

    Without grad the backward hooks of ``hooked`` modules are hidden during the call: dynamo breaks
    the graph at every module that has one, which separates an all-reduce from its add and norm
    (Hugging Face's tensor-parallel Qwen3 hooks its q/k norms to all-reduce their gradients), and
    without grad such a hook can never run. They are back in place when the call returns.
    """
    with torch._dynamo.config.patch(specialize_float=True):
        if not hooked or torch.is_grad_enabled():
            return compiled(*args, **kwargs)
        saved = [(m, m._backward_hooks, m._backward_pre_hooks) for m in hooked]
        try:
            for m in hooked:
                object.__setattr__(m, "_backward_hooks", collections.OrderedDict())
                object.__setattr__(m, "_backward_pre_hooks", collections.OrderedDict())
            return compiled(*args, **kwargs)
        finally:
            for m, hooks, pre_hooks in saved:
                object.__setattr__(m, "_backward_hooks", hooks)
                object.__setattr__(m, "_backward_pre_hooks", pre_hooks)


# An enclosing torch.compile (Hugging Face generate()'s own, over a static cache on a GPU) must not trace
# into a tpfuse-compiled call: it would inline the model with its own backend and lose the fusion. It
# calls this one as it stands instead (a graph break), and the call compiles with tpfuse's backend.
_not_traced_from_outside = torch._dynamo.disable


class CompiledModel:
    """What :func:`compile` returns for a module: the module, compiled, standing in for it.

    Calling it runs the compiled model (:func:`_run_traced` says how it is traced). Every other
    attribute is the model's (``config``, ``device``, ``state_dict``, ``generate``, ...), read and
    set on the model itself; one the model lacks raises the model's own ``AttributeError``. While a
    method of the model runs through the wrapper (``compiled.generate(ids)``), the model's own calls
    of itself run compiled, so Hugging Face's ``generate()`` decodes, and prefills, with the fusion.
    A method that returns the model (``to``, ``eval``) returns the wrapper.

    Attributes
    ----------
    tpfuse_backend : TpfuseBackend
        What was compiled and fused (its ``compiles`` and ``reports``).
    _orig_mod : nn.Module
        The model, as ``torch.compile``'s wrapper names it.
    """

    _own = frozenset({"_orig_mod", "tpfuse_backend", "_compiled", "_hooked"})

    def __init__(self, model: torch.nn.Module, compiled, backend: TpfuseBackend):
        object.__setattr__(self, "_orig_mod", model)
        object.__setattr__(self, "tpfuse_backend", backend)
        object.__setattr__(self, "_compiled", compiled)  # torch.compile of model._call_impl
        object.__setattr__(self, "_hooked", _hooked_modules(model))

    @_not_traced_from_outside
    def __call__(self, *args, **kwargs):
        return _run_traced(self._compiled, self._hooked, args, kwargs)

    forward = __call__

    def __getattr__(self, name: str):
        if name in self._own:  # not set yet (a copy being made): never look for it on the model
            raise AttributeError(name)
        value = getattr(self._orig_mod, name)  # the model's own AttributeError when it has none
        if inspect.ismethod(value) and value.__self__ is self._orig_mod:
            return self._through_compiled(value)
        return value

    def __setattr__(self, name: str, value) -> None:
        if name in self._own:
            object.__setattr__(self, name, value)
        else:
            setattr(self._orig_mod, name, value)

    def __delattr__(self, name: str) -> None:
        delattr(self._orig_mod, name)

    def __dir__(self):
        return sorted(set(dir(self._orig_mod)) | self._own)

    def __repr__(self) -> str:
        return f"tpfuse.CompiledModel({self._orig_mod!r})"

    def _through_compiled(self, method):
        """``method`` of the model, run with the model's calls of itself going through the compiled call."""
        model = self._orig_mod

        @functools.wraps(method)
        def run(*args, **kwargs):
            # already routed (a nested call), or nn.Module.compile()
            if model._compiled_call_impl is not None:
                result = method(*args, **kwargs)
            else:
                # nn.Module.__call__ runs _compiled_call_impl when it is set (nn.Module.compile() uses it):
                # the compiled call traces model._call_impl, which does not look at it, so it cannot recurse.
                object.__setattr__(model, "_compiled_call_impl", self.__call__)
                try:
                    result = method(*args, **kwargs)
                finally:
                    object.__setattr__(model, "_compiled_call_impl", None)
            return self if result is model else result

        return run


class CompiledFunction:
    """What :func:`compile` returns for a function or a bound method: it, compiled.

    ``model.forward = tpfuse.compile(model.forward)`` (Hugging Face's idiom) and gpt-fast's
    ``decode_one_token = tpfuse.compile(decode_one_token)`` both fuse. Backward hooks are hidden
    (:func:`_run_traced`) on the module a bound method belongs to and on modules passed as arguments.
    Name, docstring and ``__wrapped__`` are the function's; it binds as a method when set on a class.

    Attributes
    ----------
    tpfuse_backend : TpfuseBackend
        What was compiled and fused (its ``compiles`` and ``reports``).
    """

    def __init__(self, fn, compiled, backend: TpfuseBackend):
        functools.update_wrapper(self, fn)
        self.tpfuse_backend = backend
        self._compiled = compiled
        owner = getattr(fn, "__self__", None)
        self._owner_hooked = _hooked_modules(owner) if isinstance(owner, torch.nn.Module) else []
        self._hooked_by_argument: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @_not_traced_from_outside
    def __call__(self, *args, **kwargs):
        hooked = list(self._owner_hooked)
        for arg in (*args, *kwargs.values()):
            if isinstance(arg, torch.nn.Module):
                if arg not in self._hooked_by_argument:
                    self._hooked_by_argument[arg] = _hooked_modules(arg)
                hooked += self._hooked_by_argument[arg]
        return _run_traced(self._compiled, hooked, args, kwargs)

    def __get__(self, instance, owner=None):
        return self if instance is None else types.MethodType(self, instance)

    def __repr__(self) -> str:
        return f"tpfuse.CompiledFunction({self.__wrapped__!r})"


def inductor_options_for_mode(mode: str | None) -> dict:
    """The Inductor settings a ``torch.compile`` mode stands for; ValueError for one the fusion cannot use."""
    from torch._inductor import list_mode_options

    modes = list_mode_options()
    if mode is None:
        return {}
    if mode not in modes:
        raise ValueError(f"tpfuse.compile: unknown mode {mode!r}; torch.compile's modes are "
                         f"{', '.join(modes)}")
    if not modes[mode].get("use_post_grad_passes", True):
        raise ValueError(f"tpfuse.compile: mode {mode!r} turns off the graph passes the fusion runs in")
    return dict(modes[mode])


def compile(model_or_fn, *, mode: str | None = None, dynamic: bool = True, **torch_compile_kwargs):
    """``torch.compile`` with tpfuse's fusion: one compiled graph per token range.

    Parameters
    ----------
    model_or_fn : nn.Module, function or bound method
        What ``torch.compile`` takes: a model whose tensor-parallel all-reduces are functional
        collectives, ``dist.all_reduce`` or DTensor redistributions (Hugging Face ``tp_plan="auto"``,
        ``parallelize_module``, gpt-fast's hooks), activations ``[tokens, hidden]`` or
        ``[batch, seq, hidden]``; or a function that runs one (``model.forward``, gpt-fast's
        ``decode_one_token(model, x, input_pos)``).
    mode : str, optional
        A ``torch.compile`` mode with the same meaning: "reduce-overhead" captures CUDA graphs,
        "max-autotune" also tunes the model's own kernels. Modes that turn off Inductor's graph
        passes (where the fusion runs) are refused.
    dynamic : bool
        Token counts are dynamic by default so each range compiles once (dynamo still specialises a
        size of 1 into a graph of its own).
    **torch_compile_kwargs
        Passed to ``torch.compile`` (``fullgraph``, ...).

    Returns
    -------
    CompiledModel or CompiledFunction
        Stands in for what it was given: call it as that; a model's attributes and methods stay
        reachable (``compiled.config``, ``compiled.generate(...)``, which runs the compiled model).
        ``.tpfuse_backend`` holds the :class:`TpfuseBackend` (its ``compiles`` and ``reports`` show
        what was compiled and fused).
    """
    if not callable(model_or_fn):
        raise TypeError(f"tpfuse.compile: expected a module, a function or a bound method, got "
                        f"{type(model_or_fn).__name__}")
    backend = TpfuseBackend(inductor_options_for_mode(mode))
    if isinstance(model_or_fn, torch.nn.Module):
        # The model's _call_impl (hooks and forward), as nn.Module.compile() does: the wrapper can then route
        # the model's own calls of itself (generate's) through the compiled call without recursion.
        compiled = torch.compile(model_or_fn._call_impl, backend=backend,
                                 dynamic=dynamic, **torch_compile_kwargs)
        return CompiledModel(model_or_fn, compiled, backend)
    compiled = torch.compile(model_or_fn, backend=backend, dynamic=dynamic, **torch_compile_kwargs)
    return CompiledFunction(model_or_fn, compiled, backend)


def compile_config(model: torch.nn.Module, *, mode: str | None = "reduce-overhead", fullgraph: bool = False,
                   dynamic: bool | None = None):
    """A ``transformers.CompileConfig`` for ``generate()``'s own decode compilation, fused by tpfuse.

    ``model.generation_config.compile_config = tpfuse.compile_config(model)``, then
    ``model.generate(ids, cache_implementation="static")``: where Hugging Face compiles (a static
    cache on a GPU), it compiles ``model.__call__`` with :class:`TpfuseBackend` and every decode step
    runs fused. Prefill stays uncompiled there, Hugging Face's choice: eager, unfused all-reduces.
    With the default dynamic cache Hugging Face does not compile; :func:`compile` (the wrapper) does,
    prefill included.

    Parameters
    ----------
    model : nn.Module
        The model it is for: refused (ValueError) when a module carries backward hooks, which break
        dynamo's graph between an all-reduce and its norm where tpfuse cannot hide them.
    mode, fullgraph : as ``CompileConfig`` has them (its default mode, "reduce-overhead").
    dynamic : None or False
        Hugging Face's default, None: decode shapes are static, and dynamo keeps a norm's float eps a
        constant. ``dynamic=True`` would make eps a graph input (dynamo specialises floats only when
        asked, and Hugging Face's call cannot ask): refused with a ValueError.
    """
    from transformers import CompileConfig

    if dynamic:
        raise ValueError("tpfuse.compile_config: dynamic=True makes a norm's float eps a graph input under "
                         "Hugging Face's compile (torch._dynamo.config.specialize_float is off there), so no "
                         "site would fuse; keep dynamic=None (decode shapes are static), or "
                         "use tpfuse.compile(model)")
    hooked = [name for name, m in model.named_modules() if m._backward_hooks or m._backward_pre_hooks]
    if hooked:
        raise ValueError(f"tpfuse.compile_config: {', '.join(hooked[:4])}{' ...' if len(hooked) > 4 else ''} "
                         "carry backward hooks, at which dynamo breaks the graph "
                         "between an all-reduce and its norm, and Hugging Face's "
                         "compile cannot hide them; use tpfuse.compile(model), which does")
    config = CompileConfig(fullgraph=fullgraph, dynamic=dynamic, backend=TpfuseBackend(), mode=mode)
    # Hugging Face compiles only on GPUs unless this is set; CPU ranks (tests) need it.
    config._compile_all_devices = not torch.cuda.is_available() or None
    return config


@dataclass
class Explanation:
    """What :func:`explain` found: per compiled graph, every all-reduce site and what became of it."""

    graphs: list[list[SiteReport]]

    @property
    def sites(self) -> list[SiteReport]:
        return [site for graph in self.graphs for site in graph]

    @property
    def fused(self) -> int:
        return sum(s.fused for s in self.sites)

    def __str__(self) -> str:
        if not self.graphs:
            return ("tpfuse: dynamo compiled no graph with an all-reduce (the model has none, it ran eagerly "
                    "after torch._dynamo's recompile limit, or its graphs came from a cache)")
        lines = [f"tpfuse: {summarize(self.sites)} in {len(self.graphs)} graph(s)"]
        for i, graph in enumerate(self.graphs):
            lines += [f"  graph {i}: {site}" for site in graph]
        return "\n".join(lines)


def explain(model: torch.nn.Module, *example_args, mode: str | None = None, backward: bool = False,
            **example_kwargs) -> Explanation:
    """Compile ``model`` with the fusion, run it once on the example inputs, and say what fused.

    Collective like the model's forward: every rank calls it with its inputs (and has called
    ``tpfuse.get_communicator`` first, as for :func:`compile`). Inductor's caches are bypassed so
    the pass runs and reports every site. ``print(tpfuse.explain(model, ids))`` lists each
    all-reduce: its shape, dtype and group, the pattern that fused it, or the reason it stayed unfused.
    ``backward=True``: as in training, the forward under autograd and a backward of the sum of its
    floating outputs, so the training forward graph and its backward graph are both reported (the
    model's parameters receive that stand-in loss's gradients).
    """
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    compiled = compile(model, mode=mode)
    with (torch.set_grad_enabled(backward), inductor_config.patch(fx_graph_cache=False),
          functorch_config.patch(enable_autograd_cache=False)):
        out = compiled(*example_args, **example_kwargs)
        if backward:
            outputs = [t for t in torch.utils._pytree.tree_leaves(out)
                       if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
            sum(t.float().sum() for t in outputs).backward()
    return Explanation(compiled.tpfuse_backend.reports)
