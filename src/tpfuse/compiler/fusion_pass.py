"""The Inductor post-grad pass that swaps the fused op in, and the report of what it did per site."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import pathlib
import uuid
from dataclasses import dataclass

import torch
from torch._inductor.custom_graph_pass import CustomGraphPass

from tpfuse import _stats
from tpfuse.comm.communicator import fusion_signature, lookup_communicator
from tpfuse.compiler import backward_sites, vllm_sites
from tpfuse.compiler.matchers import ALL_REDUCE, REDUCE_SCATTER, WAIT, collective_args, meta_val
from tpfuse.compiler.patterns import (
    PATTERNS,
    UNBOUNDED_LIMIT,
    Match,
    plain_all_reduce_problem,
    replace_with_plain_all_reduce,
    site_problem,
    unmatched_reason,
)
from tpfuse.compiler.reasons import Reason, no_communicator
from tpfuse.compiler.sizes import describe_shape, static_int, token_count
from tpfuse.ops.determinism import batch_invariant

log = logging.getLogger("tpfuse.compiler")
# Inductor may run a copy of a pass (config patches are copied): copies share a tag and these records.
_reports: collections.defaultdict[str, list[list[SiteReport]]] = collections.defaultdict(list)
_bounds_relied_on: collections.defaultdict[str, set[str]] = collections.defaultdict(set)


@dataclass(frozen=True)
class SiteReport:
    """One all-reduce of a compiled graph: whether it was fused, by which pattern, or why not (``reason``,
    whose ``code`` is one of ``compiler.reasons.CODES``)."""

    shape: tuple
    dtype: torch.dtype
    group_name: str
    fused: bool
    pattern: str | None = None
    reason: Reason | None = None
    plain: bool = False  # not fused, but on tpfuse's plain all-reduce (``tpfuse.all_reduce``)
    collective: str = "all-reduce"  # or "reduce-scatter": sequence parallel's site

    def __post_init__(self):
        if not self.fused and not isinstance(self.reason, Reason):
            raise TypeError(f"tpfuse: an unfused site's reason must be a "
                            f"compiler.reasons.Reason, got {self.reason!r}")

    @property
    def code(self) -> str | None:
        """Why it stayed unfused, as a code (``compiler.reasons.CODES``); None when fused."""
        return None if self.fused else self.reason.code

    def __str__(self) -> str:
        shape = "x".join(str(s) for s in self.shape)
        what = f"fused ({self.pattern})" if self.fused else f"not fused: {self.reason}"
        what += "; runs on tpfuse's plain all-reduce" if self.plain else ""
        dtype = str(self.dtype).replace("torch.", "")
        return f"{self.collective} [{shape}] {dtype} group {self.group_name!r}: {what}"


def sharded_name(pattern_name: str) -> str:
    """A pattern's name where its site is sequence parallel's: ``ReduceScatterAddRMSNormAllGather``."""
    return pattern_name.replace("AllReduce", "ReduceScatter", 1) + "AllGather"


def summarize(sites: list[SiteReport]) -> str:
    """``fused N of M`` and, per distinct reason, how many sites stayed unfused for it."""
    fused, plain = sum(s.fused for s in sites), sum(s.plain for s in sites)
    reasons = collections.Counter(s.reason for s in sites if not s.fused)
    detail = "; ".join(f"{n} x {reason}" for reason, n in reasons.items())
    return (f"fused {fused} of {len(sites)} all-reduce sites"
            + (f" ({sum(s.collective != 'all-reduce' for s in sites)} of them reduce-scatters)"
               if any(s.collective != "all-reduce" for s in sites) else "")
            + (f"; not fused: {detail}" if detail else "")
            + (f"; {plain} of those on tpfuse's plain all-reduce" if plain else ""))


def report_graph(sites: list[SiteReport], token_range: str) -> None:
    """Log a compiled graph's sites: INFO when all fused, one WARNING when any stayed unfused."""
    _stats.record("compile.fused_sites", sum(s.fused for s in sites))
    _stats.record("compile.unfused_sites", sum(not s.fused for s in sites))
    _stats.record("compile.plain_sites", sum(s.plain for s in sites))
    level = logging.INFO if all(s.fused or s.plain for s in sites) else logging.WARNING
    log.log(level, "tpfuse: %s in a graph (%s)", summarize(sites), token_range)
    left = sum(not (s.fused or s.plain) for s in sites)
    if left and batch_invariant():
        log.warning("tpfuse: batch-invariant mode: %d all-reduce site(s) of this graph stay on the group's "
                    "own all-reduce, which is not batch-invariant (the reasons above; docs/determinism.md)",
                    left)


def communicator_limit(group_name: str, hidden: int, dtype: torch.dtype) -> int:
    """The most tokens a call of ``hidden`` x ``dtype`` on the group's registered communicator can fuse;
    0 when the group has none (or a destroyed one), or the kernels do not take the size. In
    batch-invariant mode every size the kernels take: ``patterns.UNBOUNDED_LIMIT``, with or without a
    communicator (the op then runs in parts, or on its gathered path)."""
    if site_problem("sum", hidden, dtype) is not None:
        return 0
    if batch_invariant():
        return UNBOUNDED_LIMIT
    comm = lookup_communicator(group_name)
    return comm.max_token_num(hidden, dtype) if comm is not None and not comm.destroyed else 0


def site_limit(group_name: str, reduce_op: str, hidden: int, dtype: torch.dtype) -> tuple[int, Reason | None]:
    """(fusion limit, None) of an all-reduce site, or (0, why no token count of it can fuse): what the
    backend asks of each all-reduce of dynamo's graph, in the pass's words."""
    reason = site_problem(reduce_op, hidden, dtype)
    if reason is not None:
        return 0, reason
    limit = communicator_limit(group_name, hidden, dtype)
    if limit <= 0:
        return 0, no_communicator(group_name, hidden, dtype)
    return limit, None


def _describe(node: torch.fx.Node) -> dict:
    """A site's SiteReport fields: its input's shape and dtype, its group and which collective it is."""
    x, _, group_name, shards = collective_args(node)
    val = x.meta.get("val") if isinstance(x, torch.fx.Node) else None
    shape = describe_shape(val.shape) if val is not None else ()
    return dict(shape=shape, dtype=getattr(val, "dtype", None), group_name=str(group_name),
                collective="reduce-scatter" if shards else "all-reduce")


class FusionPass(CustomGraphPass):
    """Inductor post-grad pass that replaces every eligible site with the fused op.

    Parameters
    ----------
    max_tokens : int, optional
        Largest token count any site of the graph runs with. For a graph compiled for a known range
        of sizes (vLLM's compile ranges, say); :func:`tpfuse.compile` passes ``token_bounds``.
    token_bounds : dict, optional
        ``{str(token expression): largest value}``: the bound of the sites whose token count is that
        expression of the graph's size symbols (``"s0*s1"`` for ``[batch, seq, hidden]``), as the
        backend guarantees by its dispatch.
    fusion_limit : int, optional
        The most tokens any site may fuse with. By default each site's group's registered
        communicator says (:func:`tpfuse.get_communicator`); the pass never creates or destroys one.
        Given, the pass decides without the registry (a graph fused for communicators made later, or
        tests of the patterns without ranks).
    vllm_groups : dict, optional
        ``{vLLM group name: c10d group name}`` (``{"tp:0": "3"}``): the groups of the graph's
        ``vllm.all_reduce`` sites (:mod:`tpfuse.compiler.vllm_sites`), as ``tpfuse.engines.vllm``
        resolves them in vLLM's workers. A vLLM site of a group not in it stays unfused, said why.

    Sites with a static token count need no bound.
    """

    _source_hash = hashlib.sha256(b"".join(
        (pathlib.Path(__file__).parent / name).read_bytes()
        for name in ("fusion_pass.py", "patterns.py", "matchers.py", "sizes.py", "vllm_sites.py",
                     "backward_sites.py")
    )).hexdigest()

    def __init__(self, max_tokens: int | None = None, token_bounds: dict[str, int] | None = None,
                 fusion_limit: int | None = None, vllm_groups: dict[str, str] | None = None):
        self.max_tokens = max_tokens
        self.token_bounds = dict(token_bounds or {})
        self.fusion_limit = fusion_limit
        self.vllm_groups = dict(vllm_groups or {})
        self._tag = uuid.uuid4().hex

    @property
    def reports(self) -> list[list[SiteReport]]:
        """Per graph this pass (or a copy of it) ran on, every all-reduce site and what became of it."""
        return _reports.get(self._tag, [])

    @property
    def fused_sites(self) -> int:
        """Sites this pass (or a copy of it) fused."""
        return sum(s.fused for graph in self.reports for s in graph)

    @property
    def unfused_sites(self) -> int:
        """All-reduce sites this pass (or a copy of it) saw and left alone."""
        return sum(not s.fused for graph in self.reports for s in graph)

    @property
    def bounds_relied_on(self) -> set[str] | None:
        """The keys of ``token_bounds`` that some fused site's token count is; None when the pass has
        not run (Inductor took the graph from its cache)."""
        return set(_bounds_relied_on[self._tag]) if self._tag in _reports else None

    def _token_bound(self, tokens) -> int | None:
        return self.token_bounds.get(str(tokens), self.max_tokens)

    def _fusion_limit(self, group_name: str, hidden: int, dtype: torch.dtype) -> int:
        if self.fusion_limit is not None:
            return self.fusion_limit
        return communicator_limit(group_name, hidden, dtype)

    def _site_limit(self, match: Match) -> int:
        return self._fusion_limit(match.group_name, match.hidden, meta_val(match.x).dtype)

    def __call__(self, graph: torch.fx.Graph) -> None:
        from torch._inductor.pattern_matcher import stable_topological_sort

        # (report, the all-reduce when it stayed unfused: it may still run on tpfuse's plain all-reduce)
        entries: list[tuple[SiteReport, torch.fx.Node | None]] = []
        merged = set()
        collectives = [n for n in graph.nodes
                       if n.op == "call_function" and n.target in (ALL_REDUCE, REDUCE_SCATTER)]
        for node in collectives:
            if node in merged:  # a second branch of a site fused before: reported with it
                continue
            site = _describe(node)
            refused = None  # the first (longest) pattern that matched but may not fuse, and why
            for pattern in PATTERNS:
                match = pattern.search(node)
                if match is None:
                    continue
                reason = pattern.extra_check(match, self._token_bound, self._site_limit(match))
                if reason is None:
                    name = sharded_name(pattern.name) if match.shards else pattern.name
                    reports = [SiteReport(**_describe(n), fused=True, pattern=name)
                               for n in [node] + match.merged]
                    if str(match.tokens) in self.token_bounds:
                        _bounds_relied_on[self._tag].add(str(match.tokens))
                    pattern.replace(graph, match)
                    entries += [(report, None) for report in reports]
                    merged.update(match.merged)
                    break
                refused = refused or (pattern.name, reason)
            else:
                if refused is None and (backward := backward_sites.find_site(node)) is not None:
                    refused = self._fuse_backward_site(graph, backward, entries, merged)
                    if refused is None:
                        continue
                pattern_name, reason = refused or (None, unmatched_reason(node))
                entries.append((SiteReport(**site, fused=False, pattern=pattern_name, reason=reason),
                                node if node.target == ALL_REDUCE else None))
        # A site that a later one took in as its second branch is reported with that one only.
        entries = [(report, node) for report, node in entries if node not in merged]
        entries += [self._fuse_vllm_site(node) for node in vllm_sites.all_reduces(graph)]
        entries += [(SiteReport(**vllm_sites.describe(node), fused=False,
                                reason=vllm_sites.SEQUENCE_PARALLEL), None)
                    for node in vllm_sites.reduce_scatters(graph)]
        sites = [report if node is None else self._on_plain_all_reduce(graph, report, node)
                 for report, node in entries]
        if any(s.fused or s.plain for s in sites):
            stable_topological_sort(graph)  # shapes the replacements read may be defined after the site
        graph.lint()
        _reports[self._tag].append(sites)
        bounds = ", ".join(f"{k} <= {v}" for k, v in self.token_bounds.items()) or (
            f"tokens <= {self.max_tokens}" if self.max_tokens else "static token counts")
        report_graph(sites, bounds)

    def _fuse_backward_site(self, graph: torch.fx.Graph, match: backward_sites.BackwardMatch, entries: list,
                            merged: set) -> tuple[str, Reason] | None:
        """Fuse a backward block end (``compiler.backward_sites``): its all-reduces' reports go to
        ``entries``, the others it takes in to ``merged``. (pattern, why) where it may not fuse."""
        limit = self._fusion_limit(match.group_name, match.hidden, meta_val(match.total).dtype)
        reason = backward_sites.problem(match, self._token_bound, limit)
        if reason is not None:
            return match.pattern, reason
        if str(match.tokens) in self.token_bounds:
            _bounds_relied_on[self._tag].add(str(match.tokens))
        entries += [(SiteReport(**_describe(n), fused=True, pattern=match.pattern), None)
                    for n in match.all_reduces]
        merged.update(match.all_reduces[1:])
        backward_sites.replace(graph, match)
        return None

    def _fuse_vllm_site(self, node: torch.fx.Node) -> tuple[SiteReport, torch.fx.Node | None]:
        site = vllm_sites.describe(node)
        group_name = site["group_name"]
        if group_name not in self.vllm_groups:
            return SiteReport(**site, fused=False, reason=Reason(
                "no-communicator", f"vLLM group {group_name!r} has no process group known to the pass "
                                   "(tpfuse.engines.vllm resolves vLLM's groups in its workers)")), None
        match, reason = vllm_sites.find_site(node, self.vllm_groups[group_name])
        pattern = vllm_sites.pattern_of(match) if match is not None else None
        if pattern is not None:
            reason = pattern.extra_check(match, self._token_bound, self._site_limit(match))
        if reason is not None:
            return SiteReport(**site, fused=False, pattern=pattern and pattern.name, reason=reason), node
        pattern.replace(node.graph, match)
        return SiteReport(**site, fused=True, pattern=pattern.name), None

    def _on_plain_all_reduce(self, graph: torch.fx.Graph, report: SiteReport,
                             node: torch.fx.Node) -> SiteReport:
        """An all-reduce that no block end took in, on ``tpfuse.all_reduce`` where the kernels take it
        (its report says so), else as it was."""
        if node.target == ALL_REDUCE:  # funcol: all_reduce(x, op, group) -> wait_tensor
            x, reduce_op, group_name = node.args[:3]
            result = next(iter(node.users)) if len(node.users) == 1 else None
            if result is None or result.target != WAIT:
                return report
        else:  # vLLM: all_reduce(x, vLLM's group name), its group's c10d name known
            x, reduce_op, group_name, result = node.args[0], "sum", self.vllm_groups[node.args[1]], node
        val = meta_val(x)
        limit = self._fusion_limit(group_name, static_int(val.shape[-1]) or 0, val.dtype) if val.dim() else 0
        if plain_all_reduce_problem(x, reduce_op, self._token_bound, limit) is not None:
            return report
        if str(token_count(val.shape)) in self.token_bounds.keys() - _bounds_relied_on[self._tag]:
            return report  # relying on a bound no fused site relies on would narrow the fused graph's range
        replace_with_plain_all_reduce(graph, x, group_name, result)
        return dataclasses.replace(report, plain=True)

    def uuid(self) -> str:
        # Inductor's cache key: everything the pass's decisions depend on, stable across runs (the
        # code, the bounds, and each group's communicator: backend, size and algorithm table).
        bounds = sorted(self.token_bounds.items())
        limits = fusion_signature() if self.fusion_limit is None else f"limit {self.fusion_limit}"
        key = (f"{self._source_hash}|{self.max_tokens}|{bounds}|{limits}|{sorted(self.vllm_groups.items())}"
               f"|invariant={batch_invariant()}")
        return "tpfuse-fusion-" + hashlib.sha256(key.encode()).hexdigest()[:24]
