"""Fusion patterns over post-grad FX graphs: all-reduce -> (add) -> RMSNorm (-> static fp8).

Before (what Inductor's post-grad graph holds for a tensor-parallel block end)::

    a  = wait_tensor(all_reduce(x, "sum", group))
    h  = a + residual                               # residual patterns only
    c  = h.to(float32); r = rsqrt(mean(c ** 2, -1, keepdim=True) + eps)
    y  = (c * r).to(dtype) * weight                 # HF Llama/Qwen/Mistral and gpt-fast styles
       | ((c * r) * weight).to(dtype)               # torch.nn.functional.rms_norm / nn.RMSNorm
    q  = clamp(y.to(float32) / scale, -448, 448).to(float8_e4m3fn)    # quant patterns only

After::

    y, h = torch.ops.tpfuse.allreduce_add_rmsnorm(x, residual or None, weight, eps, group, scale or None)

One class per pattern: ``search`` walks from an all-reduce node and returns a :class:`Match`,
``extra_check`` returns why a match must not be fused (or None), ``replace`` rewrites the graph, and
``example`` is the pattern in plain torch, for tests and documentation. Any eps value matches.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from tpfuse import select
from tpfuse.comm.communicator import lookup_communicator
from tpfuse.kernels.reference import FP8_MAX

aten, prims = torch.ops.aten, torch.ops.prims
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default


def _is(node: object, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _val(node: Node):
    return node.meta.get("val")


def static_int(size) -> int | None:
    """``size`` as an int when it is one, or a SymInt that dynamo specialised to a constant; else None."""
    if isinstance(size, int):
        return size
    if isinstance(size, torch.SymInt):
        return size.node.maybe_as_int()
    return None


def _only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def _users(node: Node, *targets) -> list[Node]:
    return [u for u in node.users if _is(u, *targets)]


def _converts_to(node: Node, dtype: torch.dtype) -> list[Node]:
    """The users of ``node`` that convert it to ``dtype``."""
    return [u for u in _users(node, prims.convert_element_type.default) if u.args[1] == dtype]


def _convert_to(node: Node, dtype: torch.dtype) -> Node | None:
    """The first user of ``node`` that converts it to ``dtype``, if any."""
    casts = _converts_to(node, dtype)
    return casts[0] if casts else None


def _other(node: Node, known: Node) -> object:
    a, b = node.args[:2]
    return b if a is known else a


@dataclass
class Match:
    """What a pattern found: the op's inputs, the nodes it replaces, and the nodes that go away."""

    all_reduce: Node
    x: Node
    group_name: str
    reduce_op: str
    h: Node  # the residual-stream value (the add, or the all-reduce result without residual)
    out: Node  # the norm's (or the quantisation's) output
    weight: Node
    eps: float
    residual: Node | None = None
    scale: Node | None = None
    internal: list[Node] = field(default_factory=list)  # may only be used inside the match


def match_rmsnorm(h: Node) -> tuple[Node, Node, float, list[Node]] | None:
    """(out, weight, eps, internal nodes) of an RMSNorm of ``h`` in any supported style, or None."""
    dtype = _val(h).dtype
    # gpt-fast writes x.float() twice; the post-grad graph may keep both casts.
    casts = _converts_to(h, torch.float32)
    for c in casts:
        for p in c.users:
            squares = (_is(p, aten.pow.Tensor_Scalar) and p.args[1] == 2
                       or _is(p, aten.mul.Tensor) and p.args[:2] == (c, c))
            if not squares:
                continue
            mean = _only_user(p)
            if not _is(mean, aten.mean.dim) or len(mean.args) < 3 or not mean.args[2]:
                continue
            if list(mean.args[1]) not in ([-1], [_val(c).dim() - 1]):
                continue
            add_eps = _only_user(mean)
            if not (_is(add_eps, aten.add.Tensor, aten.add.Scalar)
                    and isinstance(add_eps.args[1], (int, float))):
                continue
            rsqrt = _only_user(add_eps)
            if not _is(rsqrt, aten.rsqrt.default):
                continue
            normed = _only_user(rsqrt)
            if not _is(normed, aten.mul.Tensor):
                continue
            other = _other(normed, rsqrt)
            if other not in casts:
                continue
            internal = list(dict.fromkeys([c, other, p, mean, add_eps, rsqrt, normed]))
            back = _convert_to(normed, dtype)
            if back is not None and len(normed.users) == 1:  # HF / gpt-fast: cast back, then the weight
                out = _only_user(back)
                if _is(out, aten.mul.Tensor):
                    return out, _other(out, back), float(add_eps.args[1]), internal + [back]
            scaled = _only_user(normed)  # torch rms_norm: the weight in fp32, then cast back
            if _is(scaled, aten.mul.Tensor):
                out = _convert_to(scaled, dtype)
                if out is not None and len(scaled.users) == 1:
                    return out, _other(scaled, normed), float(add_eps.args[1]), internal + [scaled]
    return None


def match_static_fp8(y: Node) -> tuple[Node, Node, list[Node]] | None:
    """(out, scale, internal nodes) of ``clamp(y.float() / scale, -448, 448).to(fp8)``, or None."""
    start = _convert_to(y, torch.float32)
    start = start if start is not None and len(y.users) == 1 else y
    div = _only_user(start)
    if not _is(div, aten.div.Tensor) or div.args[0] is not start or not isinstance(div.args[1], Node):
        return None
    nodes, cur = [div], _only_user(div)
    if _is(cur, aten.clamp.default) and tuple(cur.args[1:3]) == (-FP8_MAX, FP8_MAX):
        nodes.append(cur)
    else:
        lo, hi = cur, _only_user(cur) if isinstance(cur, Node) else None
        if not (_is(lo, aten.clamp_min.default) and lo.args[1] == -FP8_MAX
                and _is(hi, aten.clamp_max.default) and hi.args[1] == FP8_MAX):
            return None
        nodes += [lo, hi]
        cur = hi
    out = _convert_to(cur, torch.float8_e4m3fn) if len(cur.users) == 1 else None
    if out is None:
        return None
    return out, div.args[1], ([start] if start is not y else []) + nodes


class FusionPattern:
    """Base of the pattern classes; subclasses set ``residual`` and ``quant``."""

    residual: bool = False
    quant: bool = False

    @classmethod
    def search(cls, all_reduce: Node) -> Match | None:
        if not _is(all_reduce, ALL_REDUCE):
            return None
        wait = _only_user(all_reduce)
        if not _is(wait, WAIT):
            return None
        x, reduce_op, group_name = all_reduce.args[:3]
        h, residual, internal = wait, None, [all_reduce, wait]
        if cls.residual:
            add = _only_user(wait)  # the pre-add sum has no other user: the op cannot provide it
            if not _is(add, aten.add.Tensor) or add.kwargs.get("alpha", 1) != 1:
                return None
            residual = _other(add, wait)
            if (not isinstance(residual, Node) or _val(residual) is None
                    or _val(residual).shape != _val(wait).shape):
                return None
            h = add
        norm = match_rmsnorm(h)
        if norm is None:
            return None
        out, weight, eps, norm_nodes = norm
        scale = None
        if cls.quant:
            quant = match_static_fp8(out)
            if quant is None:
                return None
            q_out, scale, quant_nodes = quant
            norm_nodes = norm_nodes + [out] + quant_nodes
            out = q_out
        return Match(all_reduce, x, group_name, reduce_op, h, out, weight, eps, residual, scale,
                     internal + norm_nodes)

    @classmethod
    def extra_check(cls, m: Match, max_tokens: int | None) -> str | None:
        """Why ``m`` must stay unfused (a reason logged once), or None to fuse it."""
        x = _val(m.x)
        if m.reduce_op != "sum":
            return f"all-reduce op is {m.reduce_op!r}, not 'sum'"
        if x.dtype not in select.KERNEL_DTYPES:
            return f"dtype {x.dtype} is not supported by the kernels"
        if x.dim() != 2:
            return "the all-reduce input is not 2-D [tokens, hidden]"
        hidden = static_int(x.shape[-1])
        if hidden is None:
            return "hidden size is dynamic"
        if not select.kernel_supports(hidden, x.dtype):
            return f"hidden size {hidden} is not supported (a multiple of 8 up to {select.MAX_KERNEL_HIDDEN})"
        w = _val(m.weight)
        if w is None or tuple(w.shape) != (hidden,) or w.dtype not in (x.dtype, torch.float32):
            return "the norm weight is not a [hidden] tensor of the input's dtype or float32"
        if m.scale is not None and (_val(m.scale) is None or _val(m.scale).dtype != torch.float32
                                    or _val(m.scale).numel() != 1):
            return "the fp8 scale is not a float32 tensor of one element"
        if _val(m.out).dtype != (torch.float8_e4m3fn if cls.quant else x.dtype):
            return "the norm's result dtype differs from the input's (e.g. an fp32 weight multiplied last)"
        allowed = set(m.internal) | {m.out, m.h}
        for node in m.internal:
            if node is not m.h and any(u not in allowed for u in node.users):
                return "an intermediate value of the pattern has users outside it"
        comm = lookup_communicator(m.group_name)
        if comm is None or comm.workspace is None:
            return f"group {m.group_name!r} has no tpfuse communicator with a workspace"
        limit = comm.max_token_num(hidden, x.dtype)
        tokens = static_int(x.shape[0])
        bound = tokens if tokens is not None else max_tokens
        if bound is None:
            return "the token range of this graph is unbounded (compile with tpfuse.compile)"
        if bound > limit:
            return f"token range up to {bound} exceeds the fusion limit {limit}"
        return None

    @classmethod
    def replace(cls, graph: Graph, m: Match) -> None:
        from torch._guards import detect_fake_mode

        op = torch.ops.tpfuse.allreduce_add_rmsnorm.default
        args = (m.x, m.residual, m.weight, m.eps, m.group_name, m.scale)
        with graph.inserting_before(m.out):
            fused = graph.call_function(op, args)
            y = graph.call_function(operator.getitem, (fused, 0))
            h = graph.call_function(operator.getitem, (fused, 1))
        fake_args = [_val(a) if isinstance(a, Node) else a for a in args]
        fake_mode = detect_fake_mode([a for a in fake_args if isinstance(a, torch.Tensor)])
        if fake_mode is not None:  # Inductor lowers from these values
            with fake_mode:
                fused.meta["val"] = op(*fake_args)
            y.meta["val"], h.meta["val"] = fused.meta["val"]
        m.out.replace_all_uses_with(y)
        m.h.replace_all_uses_with(h)
        order = {node: i for i, node in enumerate(graph.nodes)}
        for node in sorted(set(m.internal) | {m.h, m.out}, key=order.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)

    @classmethod
    def example(cls, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float,
                scale: torch.Tensor | None = None, group=None):
        """The unfused pattern in plain torch (functional all-reduce, HF-style RMSNorm)."""
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        h = fc.all_reduce(x, "sum", group or dist.group.WORLD)
        if cls.residual:
            h = h + residual
        c = h.float()
        y = (c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight
        if cls.quant:
            y = (y.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return y, h


class AllReduceRMSNorm(FusionPattern):
    """all-reduce -> RMSNorm."""


class AllReduceAddRMSNorm(FusionPattern):
    """all-reduce -> + residual -> RMSNorm, returning the norm and the new residual."""

    residual = True


class AllReduceRMSNormQuant(FusionPattern):
    """all-reduce -> RMSNorm -> static fp8."""

    quant = True


class AllReduceAddRMSNormQuant(FusionPattern):
    """all-reduce -> + residual -> RMSNorm -> static fp8."""

    residual = True
    quant = True


# Longest first: a site that continues into a residual add or a quantisation takes the larger pattern.
PATTERNS = [AllReduceAddRMSNormQuant, AllReduceAddRMSNorm, AllReduceRMSNormQuant, AllReduceRMSNorm]
