"""torch.compile integration: the fusion pass and the token-range-splitting backend.

    model = tpfuse.compile(model)                              # or
    model = torch.compile(model, backend=tpfuse.compile.TpfuseBackend())

The backend compiles each graph twice with Inductor: once with :class:`FusionPass` for token counts
up to the fusion limit (``tpfuse.select.max_token_num`` of every site's group, dtype and hidden
size) and once unchanged for larger ones, and picks by the token count of each call. The token count
is dimension 0 of the all-reduced tensors ([tokens, hidden]).
"""

from __future__ import annotations

import collections
import hashlib
import logging
import pathlib
import sys
import types
import uuid

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from tpfuse import _stats
from tpfuse.comm.communicator import lookup_communicator
from tpfuse.compile.patterns import ALL_REDUCE, PATTERNS, FusionPattern, Match, static_int

log = logging.getLogger(__name__)
_reasons_logged: set[str] = set()
_pass_counts: collections.defaultdict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
_DYNAMO_ALL_REDUCE = (torch.ops._c10d_functional.all_reduce, ALL_REDUCE)

__all__ = ["CompiledModel", "FusionPass", "FusionPattern", "Match", "PATTERNS", "TpfuseBackend", "compile",
           "inductor_options_for_mode"]


def _log_once(reason: str) -> None:
    if reason not in _reasons_logged:
        _reasons_logged.add(reason)
        log.info("tpfuse: an all-reduce site was not fused: %s", reason)


class FusionPass(CustomGraphPass):
    """Inductor post-grad pass that replaces every eligible site with the fused op.

    Parameters
    ----------
    max_tokens : int or None
        Largest token count the graph will run with (the backend's split point); None accepts only
        graphs whose token count is static and within the limit.

    It looks communicators up in the registry and never creates or destroys one.
    """

    _source_hash = hashlib.sha256(b"".join(
        (pathlib.Path(__file__).parent / name).read_bytes() for name in ("__init__.py", "patterns.py")
    )).hexdigest()

    def __init__(self, max_tokens: int | None = None):
        self.max_tokens = max_tokens
        # Inductor may run a copy of the pass (config patches are copied): copies share this tag.
        self._tag = uuid.uuid4().hex

    @property
    def fused_sites(self) -> int:
        """Sites this pass (or a copy of it) fused."""
        return _pass_counts[self._tag][0]

    @property
    def unfused_sites(self) -> int:
        """All-reduce sites this pass (or a copy of it) saw and left alone."""
        return _pass_counts[self._tag][1]

    def __call__(self, graph: torch.fx.Graph) -> None:
        sites = [n for n in graph.nodes if n.op == "call_function" and n.target == ALL_REDUCE]
        fused = 0
        for site in sites:
            for pattern in PATTERNS:
                match = pattern.search(site)
                if match is None:
                    continue
                reason = pattern.extra_check(match, self.max_tokens)
                if reason is None:
                    pattern.replace(graph, match)
                    fused += 1
                else:
                    _log_once(f"{pattern.__name__}: {reason}")
                break
            else:
                _log_once("no fusable add/RMSNorm pattern follows the all-reduce (if the model has one: "
                          "is eps a graph input? tpfuse.compile traces with specialize_float=True)")
        graph.lint()
        counts = _pass_counts[self._tag]
        counts[0] += fused
        counts[1] += len(sites) - fused
        _stats.record("compile.fused_sites", fused)
        _stats.record("compile.unfused_sites", len(sites) - fused)
        log.info("tpfuse: fused %d of %d all-reduce sites in a graph (token range up to %s)",
                 fused, len(sites), self.max_tokens)

    def uuid(self) -> str:
        # Stable across runs (Inductor's cache key): the pass's code and its one parameter.
        return f"tpfuse-fusion-{self._source_hash[:16]}-{self.max_tokens}"


def _fusion_limit(gm: torch.fx.GraphModule) -> tuple[int, object]:
    """(token limit over the graph's eligible sites, a site's token dimension) from dynamo's graph."""
    limit, token_dim = None, None
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target not in _DYNAMO_ALL_REDUCE:
            continue
        value = node.meta.get("example_value")
        group_name, reduce_op = node.args[2], node.args[1]
        if value is None or value.dim() != 2 or reduce_op != "sum" or static_int(value.shape[1]) is None:
            continue
        comm = lookup_communicator(group_name) if isinstance(group_name, str) else None
        if comm is None:
            continue
        site_limit = comm.max_token_num(static_int(value.shape[1]), value.dtype)
        if site_limit > 0:
            limit = site_limit if limit is None else min(limit, site_limit)
            tokens = static_int(value.shape[0])
            token_dim = tokens if tokens is not None else value.shape[0]
    return limit or 0, token_dim


def _token_reader(gm: torch.fx.GraphModule, token_dim):
    """A function of the compiled graph's runtime arguments that returns the token count.

    The count may be a product of symbols (batch x sequence flattened): every symbol is read from
    the input that carries it, then the expression is evaluated.
    """
    if isinstance(token_dim, int):
        return lambda args: token_dim
    import sympy

    expr = token_dim.node.expr
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
    """

    def __init__(self, inductor_options: dict | None = None):
        self.inductor_options = dict(inductor_options or {})
        self.compiles: collections.Counter[str] = collections.Counter()
        self.passes: list[FusionPass] = []

    def _compile(self, gm, example_inputs, fusion_pass: FusionPass | None):
        from torch._inductor.compile_fx import compile_fx

        patches = dict(self.inductor_options)
        if fusion_pass is not None:
            patches["post_grad_custom_post_pass"] = fusion_pass
            self.passes.append(fusion_pass)
        self.compiles["fused" if fusion_pass is not None else "plain"] += 1
        return compile_fx(gm, example_inputs, config_patches=patches)

    def __call__(self, gm: torch.fx.GraphModule, example_inputs):
        limit, token_dim = _fusion_limit(gm)
        if limit == 0:
            return self._compile(gm, example_inputs, None)
        if isinstance(token_dim, int):  # a static token count needs one graph only
            return self._compile(gm, example_inputs, FusionPass(limit) if token_dim <= limit else None)
        read_tokens = _token_reader(gm, token_dim)
        fused = self._compile(gm, example_inputs, FusionPass(limit))
        plain = self._compile(gm, example_inputs, None)
        log.info("tpfuse: graph split at %d tokens: fused graph up to it, plain graph above", limit)

        def run(*args):
            return fused(*args) if read_tokens(args) <= limit else plain(*args)

        return run


class CompiledModel(torch.nn.Module):
    """What :func:`compile` returns for a module: the compiled module, traced with floats specialised.

    Dynamo turns float attributes such as a norm's ``eps`` into graph inputs unless floats are
    specialised; the fused op needs eps as a constant, so calls trace with ``specialize_float=True``.
    """

    def __init__(self, compiled: torch.nn.Module, backend: TpfuseBackend):
        super().__init__()
        self.compiled = compiled
        self.tpfuse_backend = backend

    def forward(self, *args, **kwargs):
        with torch._dynamo.config.patch(specialize_float=True):
            return self.compiled(*args, **kwargs)


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


def compile(model: torch.nn.Module, *, mode: str | None = None, dynamic: bool = True, **torch_compile_kwargs):
    """``torch.compile`` with tpfuse's fusion: one compiled graph per token range.

    Parameters
    ----------
    model : nn.Module
    mode : str, optional
        A ``torch.compile`` mode with the same meaning: "reduce-overhead" captures CUDA graphs,
        "max-autotune" also tunes the model's own kernels. Modes that turn off Inductor's graph
        passes (where the fusion runs) are refused.
    dynamic : bool
        Token counts are dynamic by default so each range compiles once (dynamo still specialises a
        token count of 1 into a graph of its own).
    **torch_compile_kwargs
        Passed to ``torch.compile`` (``fullgraph``, ...).

    Returns
    -------
    CompiledModel
        Call it like the model; ``.tpfuse_backend`` holds the :class:`TpfuseBackend` (its
        ``compiles`` and ``passes`` show what was compiled and fused).
    """
    backend = TpfuseBackend(inductor_options_for_mode(mode))
    compiled = torch.compile(model, backend=backend, dynamic=dynamic, **torch_compile_kwargs)
    return CompiledModel(compiled, backend)


class _CallableModule(types.ModuleType):
    """Lets ``tpfuse.compile(model)`` call :func:`compile` while ``tpfuse.compile.X`` stays this module."""

    def __call__(self, model, **kwargs):
        return compile(model, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
