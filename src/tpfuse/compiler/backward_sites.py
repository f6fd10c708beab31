"""The backward's block ends in a training graph: the sum of y's gradient parts and RMSNorm's backward.

Before (AOTAutograd's backward graph, post-grad: the column-parallel layers after a norm hand back their
input gradients, each rank's part, and each is all-reduced; DTensor's ``Partial -> Replicate``)::

    g   = wait(all_reduce(p1)) (+ wait(all_reduce(p2)) + ...)   # the parts' sums, added
    d   = RMSNorm's backward at a of g                            # a: the norm's input, saved or recomputed
    out = g_h + d  |  d + g_h                                    # the residual stream's gradient

After::

    y2, g2 = tpfuse::allreduce_add_rmsnorm(p1 (+ p2 + ...), None, weight, eps, group,
                                           norm_input=a, grad_h=g_h)   # blockend.stages.RmsNormBackward
    out -> y2; g -> g2        (what else reads g, the weight's gradient, reads the op's sum)

Sequence parallel's backward (the column-parallel layers' input gradients summed on each rank, then
reduce-scattered; the result all-gathered for the row-parallel layer before)::

    g   = wait(reduce_scatter(p))                                 # this rank's rows
    out = g_h + RMSNorm's backward at a of g                      # out: read by the residual stream
    gx  = wait(all_gather(out))                                   # and gathered

After::

    gx2, out2, g2 = tpfuse::reduce_scatter_rmsnorm_backward_all_gather(p, a, weight, eps, group, g_h)

The norm's backward is recognised by what it computes, not by the form of its nodes (each RMSNorm and each
torch version decomposes it its own way): the region between ``g`` and the add reads only ``g``, one
tensor of g's shape and dtype (``a``) and one row of H (the weight), and evaluated on random rows it gives
RMSNorm's backward for one of the eps values it holds. A site that looks so but computes something else
is left alone, said why.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from tpfuse.compiler.matchers import (
    ALL_GATHER,
    ALL_REDUCE,
    REDUCE_SCATTER,
    WAIT,
    aten,
    collective_args,
    is_add,
    is_call,
    meta_val,
    only_user,
    other_arg,
    prims,
    sequence_first,
)
from tpfuse.compiler.patterns import graph_caller, rank_major_rows, site_problem, token_limit_problem
from tpfuse.compiler.reasons import Reason
from tpfuse.compiler.sizes import static_int, token_count

#: The names sites fused here report: all-reduce and sequence parallel's.
PATTERN = "AllReduceRMSNormBackward"
SHARDED_PATTERN = "ReduceScatterRMSNormBackwardAllGather"
#: The most nodes a norm's backward may span (a bound on the walk, far above any decomposition's).
_MAX_NODES = 200


@dataclass
class BackwardMatch:
    """A backward block end found by :func:`find_site`."""

    all_reduces: list[Node]  # the parts' all-reduces, the first one the site's
    adds: list[Node]  # the adds that sum their waits into g (g itself where there are several)
    parts: list[Node]  # their inputs: each rank's parts of y's gradient
    group_name: str
    total: Node  # g: the sum of the all-reduced parts
    out: Node  # the add of the residual stream's gradient
    grad_h: Node
    norm_input: Node
    weight: Node
    eps: float
    inside: set  # the norm's backward between g and the add
    gathered: Node | None = None  # sequence parallel's: the wait of out's all-gather
    shards: int = 0  # sequence parallel's: the ranks the rows are sharded over
    # ... reduce-scattered sequence-first (torchtitan's plain tensors): the permutes and copies around the
    # collectives, which go with them; ``parts`` then holds x as [B, S, H]
    around: tuple = ()

    @property
    def pattern(self) -> str:
        return SHARDED_PATTERN if self.shards else PATTERN

    @property
    def hidden(self) -> int:
        return static_int(meta_val(self.total).shape[-1])

    @property
    def tokens(self):
        return token_count(meta_val(self.total).shape)


def _summed_waits(node: object, group_name: str) -> tuple[list[Node], list[Node]] | None:
    """(the all-reduces of ``group_name`` whose waits ``node`` adds up, the adds): ``node`` a wait, or adds
    of waits; None if it is anything else."""
    if is_call(node, WAIT) and is_call(node.args[0], ALL_REDUCE) and node.args[0].args[2] == group_name \
            and node.args[0].args[1] == "sum" and len(node.users) == 1:
        return [node.args[0]], []
    if is_add(node) and len(node.users) == 1 and all(isinstance(a, Node) for a in node.args[:2]):
        left, right = (_summed_waits(a, group_name) for a in node.args[:2])
        if left is not None and right is not None:
            return left[0] + right[0], left[1] + right[1] + [node]
    return None


def _total(all_reduce: Node) -> tuple[Node, list[Node], list[Node]] | None:
    """(g, the all-reduces it sums, the adds that sum them): from ``all_reduce``'s wait up through the adds
    of other all-reduces of the same group (a reduce-scatter's wait alone: its parts are summed before)."""
    wait = only_user(all_reduce)
    if not is_call(wait, WAIT):
        return None
    if all_reduce.target == REDUCE_SCATTER:
        permuted = sequence_first(all_reduce)  # g: the permute back; the nodes around go with the site
        return (permuted[1], [all_reduce], permuted[2]) if permuted is not None else (wait, [all_reduce], [])
    group_name, total, members, adds = all_reduce.args[2], wait, [all_reduce], []
    while True:
        add = only_user(total)
        if not is_add(add):
            return total, members, adds
        more = _summed_waits(other_arg(add, total), group_name)
        if more is None:
            return total, members, adds
        total, members, adds = add, members + more[0], adds + more[1] + [add]


def _reachable(start: Node) -> set:
    seen, stack = set(), [start]
    while stack and len(seen) < 10 * _MAX_NODES:
        node = stack.pop()
        for user in node.users:
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return seen


def _same_rows(node: object, like: torch.Tensor) -> bool:
    val = meta_val(node) if isinstance(node, Node) else None
    return isinstance(val, torch.Tensor) and val.dtype == like.dtype and val.shape == like.shape


def _region(end: Node, total: Node, after_total: set, hidden: int):
    """The nodes that make ``end`` from g (``total``), and the leaves they read: (inside, leaves) or None
    where the region is larger than a norm's backward."""
    like = meta_val(total)
    inside, leaves, stack = set(), set(), [end]
    while stack:
        node = stack.pop()
        if node in inside or node in leaves:
            continue
        if node is total or node.op != "call_function":
            leaves.add(node)
            continue
        val = meta_val(node)
        if node not in after_total and (_same_rows(node, like) or not isinstance(val, torch.Tensor)
                                        or (val.dim() == 1 and static_int(val.shape[0]) == hidden)):
            leaves.add(node)  # the norm's input, the weight, or a size
            continue
        if "_c10d_functional" in str(node.target):  # a collective is no part of a norm's backward
            return None  # (and the recognition, which runs the region, must never run one)
        inside.add(node)
        if len(inside) > _MAX_NODES:
            return None
        stack.extend(n for n in node.all_input_nodes)
    return inside, leaves


def _hint(val):
    """A concrete value for a symbolic size (its example value), or the value itself."""
    if isinstance(val, torch.SymInt):
        return val.node.hint if static_int(val) is None else static_int(val)
    return val


def _evaluate(inside: set, end: Node, given: dict) -> torch.Tensor:
    """``end`` computed from the leaves' values ``given`` (sizes from the graph's example values)."""
    env = dict(given)
    for node in end.graph.nodes:  # graph order is topological
        if node in inside:
            args = map_arg(node.args, lambda n: env[n] if n in env else _hint(meta_val(n)))
            kwargs = map_arg(node.kwargs, lambda n: env[n] if n in env else _hint(meta_val(n)))
            env[node] = node.target(*args, **kwargs)
    return env[end]


def _rmsnorm_backward(g, a, weight, eps):
    """RMSNorm's backward in float64: the gradient of ``a`` given ``g``, the gradient of the norm's output."""
    a, g, w = a.double(), g.double(), weight.double()
    r = torch.rsqrt((a * a).mean(-1, keepdim=True) + eps)
    gw = g * w
    return r * (gw - a * (gw * a).mean(-1, keepdim=True) * r * r)


def _probe_rows(shape: list[int], dtype: torch.dtype, weight_dtype: torch.dtype):
    """Rows on which RMSNorm's backward differs from its look-alikes: ``a`` with a mean of its own
    (LayerNorm's backward differs), rows of every scale down to a mean square under any eps (eps then
    decides ``r``), and a gradient ``g`` that follows ``a * w`` (the mean term ``a * mean(g*w*a) * r^3``
    is then as large as the rest, where a region without it differs)."""
    generator = torch.Generator().manual_seed(0)
    rows = shape[:-1]
    scale = torch.logspace(-4, 1, steps=max(1, int(torch.tensor(rows).prod())), dtype=torch.float64)
    scale = scale[torch.randperm(len(scale), generator=generator)].reshape(*rows, 1)
    a = (torch.randn(shape, generator=generator, dtype=torch.float64) + 0.5) * scale
    w = 1 + 0.1 * torch.randn(shape[-1], generator=generator, dtype=torch.float64)
    g = a / scale * w + 0.5 * torch.randn(shape, generator=generator, dtype=torch.float64)
    return g.to(dtype), a.to(dtype), w.to(weight_dtype)


def _error(got: torch.Tensor, expected: torch.Tensor) -> float:
    """The largest error of ``got`` by element, relative to the element, with a floor of a quarter of its
    row's largest: an element near zero is a difference of terms as large as the row's, each rounded to
    bf16 where the model's norm rounds (Hugging Face's applies its weight in bf16: a step of 2**-8 of the
    row, 24% of a floor of 1/64 of it, seen on HF Llama)."""
    floor = expected.abs().amax(-1, keepdim=True) / 4
    return ((got - expected).abs() / (expected.abs() + floor)).max().item()


def _eps_of(inside: set, end: Node, total: Node, norm_input: Node, weight: Node) -> float | None:
    """The eps for which the region computes RMSNorm's backward (each element within 5% of it: bf16's
    rounding through the region's steps), the closest of the eps values the region holds; or None."""
    like = meta_val(total)
    g, a, w = _probe_rows([int(_hint(s)) for s in like.shape], like.dtype, meta_val(weight).dtype)
    try:
        got = _evaluate(inside, end, {total: g, norm_input: a, weight: w}).double()
    except Exception:  # an op the CPU cannot run as the graph has it: not recognised
        return None
    constants = {v for n in inside for v in (*n.args, *n.kwargs.values())
                 if isinstance(v, float) and 0 < v < 1e-2}
    errors = {eps: _error(got, _rmsnorm_backward(g, a, w, eps)) for eps in constants
              if got.shape == a.shape}
    best = min(errors, key=errors.get, default=None)
    return best if best is not None and errors[best] < 5e-2 else None


def find_site(all_reduce: Node) -> BackwardMatch | None:
    """The backward block end starting at ``all_reduce`` (as the first of its summed parts; or at a
    reduce-scatter whose result is all-gathered after the add: sequence parallel's), or None. A site none
    is found for is reported as the forward's patterns say (``patterns.unmatched_reason``)."""
    _, reduce_op, group_name, shards = collective_args(all_reduce)
    found = _total(all_reduce)
    if found is None:
        return None
    total, members, summing = found
    like = meta_val(total)
    hidden = static_int(like.shape[-1]) if isinstance(like, torch.Tensor) and like.dim() else None
    if hidden is None:
        return None
    after_total = _reachable(total)
    order = {node: i for i, node in enumerate(total.graph.nodes)}
    adds = sorted((n for n in after_total if is_call(n, aten.add.Tensor) and _same_rows(n, like)),
                  key=order.__getitem__)
    for out in adds[:4]:  # the residual stream's add closest to the sum
        ends = [a for a in out.args[:2] if isinstance(a, Node) and (a in after_total or a is total)]
        if len(ends) != 1 or not _same_rows(other_arg(out, ends[0]), like):
            continue
        end, grad_h = ends[0], other_arg(out, ends[0])
        region = _region(end, total, after_total, hidden)
        if region is None:
            continue
        inside, leaves = region
        rows = [n for n in leaves if n is not total and _same_rows(n, like)]
        row_vectors = [n for n in leaves if isinstance(meta_val(n), torch.Tensor) and meta_val(n).dim() == 1]
        others = [n for n in leaves if n is not total and n not in rows and n not in row_vectors
                  and isinstance(meta_val(n), torch.Tensor)]
        if len(rows) != 1 or len(row_vectors) != 1 or others or total not in leaves:
            continue
        norm_input, weight = rows[0], row_vectors[0]
        eps = _eps_of(inside, end, total, norm_input, weight)
        if eps is None:
            continue
        gather, around, parts = None, (), [m.args[0] for m in members]
        if shards:  # out's rows all-gathered (its other readers take this rank's rows), a copy between or not
            readers = [only_user(u) if is_call(u, aten.clone.default) and len(u.users) == 1 else u
                       for u in out.users]
            gathers = [r for r in readers if is_call(r, ALL_GATHER)
                       and (r.args[1], str(r.args[2])) == (shards, str(group_name))]
            if len(gathers) != 1 or not is_call(only_user(gathers[0]), WAIT):
                continue
            gather = only_user(gathers[0])
            if summing and is_call(summing[0], aten.permute.default):  # sequence-first: x as [B, S, H]
                around, parts, summing = (*summing, total), [summing[0].args[0]], []
        return BackwardMatch(members, summing, parts, group_name, total, out, grad_h, norm_input, weight, eps,
                             inside, gather, shards, around)
    return None


def problem(match: BackwardMatch, token_bound, fusion_limit: int) -> Reason | None:
    """Why ``match`` must stay unfused (None: it may fuse)."""
    reason = site_problem(collective_args(match.all_reduces[0])[1], match.hidden, meta_val(match.total).dtype)
    if reason is not None:
        return reason
    if meta_val(match.weight).dtype not in (meta_val(match.total).dtype, torch.float32):
        return Reason("operands", f"the norm's weight is {meta_val(match.weight).dtype}")
    if fusion_limit <= 0:
        return Reason("no-communicator", "its group has no tpfuse communicator that can fuse it")
    if match.shards:  # the sharded op takes any size, in parts
        return None
    return token_limit_problem(match.tokens, token_bound, fusion_limit, "compile with tpfuse.compile")


def _size(call, node: Node, dim: int):
    """``node``'s size ``dim``: an int, or the graph's ``sym_size`` of it."""
    size = static_int(meta_val(node).shape[dim])
    return size if size is not None else call(aten.sym_size.int, node, dim)


def replace(graph: Graph, m: BackwardMatch) -> None:
    """Rewrite the site to the fused op (the caller re-sorts the graph)."""
    call = graph_caller(graph, m.total)
    val = meta_val(m.total)
    with graph.inserting_before(m.out):
        x = m.parts[0]
        if m.around:
            x = rank_major_rows(call, x, m.shards, m.hidden)
        if len(m.parts) > 1:  # the parts summed before the one all-reduce, in fp32, rounded once
            x = call(prims.convert_element_type.default, x, torch.float32)
            for part in m.parts[1:]:
                x = call(aten.add.Tensor, x, call(prims.convert_element_type.default, part, torch.float32))
            x = call(prims.convert_element_type.default, x, val.dtype)
        flat = [call(aten.reshape.default, n, [-1, m.hidden]) for n in (x, m.norm_input, m.grad_h)]
        sizes = [static_int(s) if static_int(s) is not None else call(aten.sym_size.int, m.norm_input, d)
                 for d, s in enumerate(val.shape)]
        if m.shards:
            op = torch.ops.tpfuse.reduce_scatter_rmsnorm_backward_all_gather.default
            fused = call(op, flat[0], flat[1], m.weight, m.eps, m.group_name, flat[2])
            # the gathered rows have x's shape; sequence-first, [W * B, S / W, H]
            gathered_sizes = ([call(operator.mul, m.shards, _size(call, m.parts[0], 0)), -1, m.hidden]
                              if m.around else [_size(call, x, d) for d in range(len(meta_val(x).shape))])
            m.gathered.replace_all_uses_with(call(aten.reshape.default, call(operator.getitem, fused, 0),
                                                  gathered_sizes))
            grad_input, total = (call(aten.reshape.default, call(operator.getitem, fused, i), sizes)
                                 for i in (1, 2))
        else:
            fused = call(torch.ops.tpfuse.allreduce_add_rmsnorm.default, flat[0], None, m.weight, m.eps,
                         m.group_name, norm_input=flat[1], grad_h=flat[2])
            grad_input, total = (call(aten.reshape.default, call(operator.getitem, fused, i), sizes)
                                 for i in (0, 1))
    m.out.replace_all_uses_with(grad_input)
    m.total.replace_all_uses_with(total)
    order = {node: i for i, node in enumerate(graph.nodes)}
    gone = {m.out, *m.inside, *m.adds} | {n for r in m.all_reduces for n in (r, only_user(r))}
    if m.gathered is not None:
        gather = m.gathered.args[0]
        copied = is_call(gather.args[0], aten.clone.default)  # the copy before it, where there is one
        gone |= {m.gathered, gather, *m.around} | ({gather.args[0]} if copied else set())
    for node in sorted(gone, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)
