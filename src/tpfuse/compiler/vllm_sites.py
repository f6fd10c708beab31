"""vLLM's block ends in its post-grad graphs: found and handed to the same replacement as every pattern.

vLLM (0.32 and newer, ``VLLM_COMPILE`` with Inductor) keeps its collectives and norms as opaque ops
until after the custom post-grad passes; what the fusion pass sees at a block end is::

    s = vllm.all_reduce(x, "tp:0")                                    # x: [tokens, H]; "tp:0" names
    out, h = vllm_ir.fused_add_rms_norm(s, residual, weight, eps)     # vLLM's GroupCoordinator
    out = vllm_ir.rms_norm(s, weight, eps)                            # no residual: h is s itself

After::

    out, h = tpfuse.allreduce_add_rmsnorm(x, residual or None, weight, eps, "<the TP group's c10d name>")

vLLM's norm computes ``h`` in fp32 and the norm from that fp32 row, as the kernels do; it multiplies
the weight after rounding the normed row to the weight's dtype, the kernels before (one rounding
apart). Nothing here imports vLLM: ops are known by their names, so the fast test lane builds such
graphs from stand-in ops. ``tpfuse.engines.vllm`` puts the pass into vLLM.
"""

from __future__ import annotations

import operator

import torch
from torch.fx import Graph, Node

from tpfuse.compiler.matchers import meta_val
from tpfuse.compiler.patterns import PATTERNS, Match, site_problem, token_limit_problem
from tpfuse.compiler.sizes import describe_shape, static_int

ALL_REDUCE = "vllm::all_reduce"
ADD_NORM = "vllm_ir::fused_add_rms_norm"
NORM = "vllm_ir::rms_norm"
_WITH_RESIDUAL, _WITHOUT = (next(p for p in PATTERNS if p.__name__ == name)
                            for name in ("AllReduceAddRMSNorm", "AllReduceRMSNorm"))


def op_name(node: Node) -> str | None:
    """``namespace::name`` of the operator a node calls (None for anything else)."""
    target = node.target if node.op == "call_function" else None
    return target.name() if isinstance(target, torch._ops.OpOverload) else None


def all_reduces(graph: Graph) -> list[Node]:
    """The graph's ``vllm.all_reduce`` nodes, in order."""
    return [n for n in graph.nodes if op_name(n) == ALL_REDUCE]


def group_names(graph: Graph) -> set[str]:
    """vLLM's names of the groups the graph's all-reduces run on (``"tp:0"``)."""
    return {str(n.args[1]) for n in all_reduces(graph)}


def describe(all_reduce: Node) -> tuple[tuple, torch.dtype | None, str]:
    """(shape, dtype, vLLM's group name) of an all-reduce site, for its report."""
    val = meta_val(all_reduce)
    shape = describe_shape(val.shape) if isinstance(val, torch.Tensor) else ()
    return shape, getattr(val, "dtype", None), str(all_reduce.args[1])


def _arg(node: Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _output(graph: Graph, node: Node, index: int) -> Node:
    """The one ``getitem(node, index)``: duplicates merged, made when no user reads that output."""
    found = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    for extra in found[1:]:
        extra.replace_all_uses_with(found[0])
        graph.erase_node(extra)
    if found:
        return found[0]
    with graph.inserting_after(node):
        item = graph.call_function(operator.getitem, (node, index))
    item.meta["val"] = meta_val(node)[index]
    return item


def find_site(all_reduce: Node, group_name: str) -> tuple[Match | None, str | None]:
    """(the site as a :class:`Match` in the c10d group ``group_name``, None) or (None, why it cannot fuse),
    before the fusion limit (:func:`limit_problem`). A norm's outputs that nothing reads get a
    ``getitem`` node (the match names both); one the site does not fuse leaves it to dead-code removal."""
    x = all_reduce.args[0]
    val = meta_val(all_reduce)
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or static_int(val.shape[-1]) is None:
        return None, "the hidden size (last dimension) is dynamic"
    hidden = static_int(val.shape[-1])
    problem = site_problem("sum", hidden, val.dtype)
    if problem is not None:
        return None, problem
    users = list(all_reduce.users)
    # vLLM passes the new sum first and the residual second; a sum that is some later add's residual
    # (the embedding's, read by the first norm and the next layer's add) is a site of the norm.
    norms = [u for u in users if op_name(u) == NORM and u.args[0] is all_reduce]
    add_norms = [u for u in users if op_name(u) == ADD_NORM and all_reduce in u.args[:(1 if norms else 2)]]
    if add_norms:
        norm = add_norms[0]
        if len(users) != 1:
            return None, ("the all-reduce's result has users besides vLLM's fused_add_rms_norm (the fused "
                          "op gives the sum only after the residual add)")
        residual = norm.args[1] if norm.args[0] is all_reduce else norm.args[0]
        weight, eps, variance_size = _arg(norm, 2, "weight"), _arg(norm, 3, "epsilon"), _arg(norm, 4, "variance_size")
    elif norms:
        norm, residual = norms[0], None
        weight, eps, variance_size = _arg(norm, 1, "weight"), _arg(norm, 2, "epsilon"), _arg(norm, 3, "variance_size")
    else:
        targets = ", ".join(op_name(u) or str(getattr(u.target, "__name__", u.target)) for u in users)
        return None, f"no vLLM RMSNorm follows the all-reduce; its result goes to {targets or 'nothing'}"
    if weight is None:
        return None, "vLLM's norm has no weight"
    if variance_size is not None:
        return None, "vLLM's norm takes its variance over part of the row (variance_size)"
    w = meta_val(weight)
    if not isinstance(w, torch.Tensor) or tuple(w.shape) != (hidden,) or w.dtype not in (val.dtype, torch.float32):
        return None, "the norm weight is not a [hidden] tensor of the input's dtype or float32"
    if residual is not None:
        r = meta_val(residual)
        if not isinstance(r, torch.Tensor) or r.dtype != val.dtype or tuple(r.shape) != tuple(val.shape):
            return None, "the residual is not a tensor of the all-reduce's dtype and shape"
    graph = all_reduce.graph
    if residual is None:  # h is the sum itself; its other users read the op's h
        out, h, internal = norm, all_reduce, []
    else:
        out, h, internal = _output(graph, norm, 0), _output(graph, norm, 1), [all_reduce, norm]
    return Match(all_reduce, x, group_name, "sum", h, out, weight, float(eps), hidden, residual=residual,
                 internal=internal), None


def limit_problem(match: Match, token_bound, fusion_limit: int) -> str | None:
    """Why the site's token count may exceed what its group can fuse (None: it may not);
    ``token_bound(tokens)`` as for ``FusionPattern.extra_check``."""
    dtype = meta_val(match.x).dtype
    if fusion_limit <= 0:
        return (f"group {match.group_name!r} has no tpfuse communicator that can fuse {match.hidden} x {dtype} "
                "(is tpfuse's vLLM plugin installed? it creates the communicator)")
    return token_limit_problem(match, token_bound, fusion_limit, "no compile range")


def replace(match: Match) -> str:
    """Rewrite a found site to the fused op; returns the pattern's name. The caller re-sorts the graph."""
    pattern = _WITH_RESIDUAL if match.residual is not None else _WITHOUT
    pattern.replace(match.all_reduce.graph, match)
    return pattern.__name__
