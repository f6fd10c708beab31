"""Fusion patterns over post-grad FX graphs: all-reduce -> (add) -> RMSNorm (-> static fp8).

Before (what Inductor's post-grad graph holds for a tensor-parallel block end; any rank >= 2, the
last dimension is the hidden size H, the others are tokens)::

    a  = wait_tensor(all_reduce(x, "sum", group))   # x: [..., H]
    a  = reshape(a, ...)                            # any views that keep rows of H (or none)
    h  = a + residual | residual + a                # residual patterns only; may broadcast [S,H]+[1,S,H]
    c  = h.to(float32); r = rsqrt(mean(c ** 2, -1, keepdim=True) + eps)
    y  = (c * r).to(dtype) * weight                 # HF Llama/Qwen/Mistral and gpt-fast styles
       | ((c * r) * weight).to(dtype)               # torch.nn.functional.rms_norm / nn.RMSNorm
    q  = clamp(y.to(float32) / scale, -448, 448).to(float8_e4m3fn)    # quant patterns only

After::

    y2, h2 = torch.ops.tpfuse.allreduce_add_rmsnorm(
        x.reshape(-1, H), residual.reshape(-1, H) or None, weight, eps, group, scale or None)
    y, h = y2.reshape(y.shape), h2.reshape(h.shape)  # the caller's shapes; views of the sum reuse h

One class per pattern: ``search`` walks from an all-reduce node and returns a :class:`Match` (with a
``problem`` when the structure is there but cannot be fused), ``extra_check`` returns why a match must
not be fused (or None), ``replace`` rewrites the graph, and ``example`` is the pattern in plain torch,
for tests and documentation. Any eps value matches.
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
#: Ops that change only how rows are grouped, looked through between the all-reduce, the add and the norm.
VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.default, getattr(aten.squeeze, "dims", aten.squeeze.dim))


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


def size_expr(size):
    """An int, or the sympy expression of a SymInt (after the shape environment's replacements)."""
    as_int = static_int(size)
    if as_int is not None:
        return as_int
    expr = size.node.expr
    shape_env = getattr(size.node, "shape_env", None)
    return shape_env.replace(expr) if shape_env is not None and hasattr(shape_env, "replace") else expr


def token_count(shape) -> object:
    """Tokens of an activation ``[..., hidden]``: the product of all dims but the last (int or sympy)."""
    import sympy

    product = sympy.Integer(1) if any(static_int(s) is None for s in shape[:-1]) else 1
    for s in shape[:-1]:
        product = product * size_expr(s)
    if isinstance(product, int):
        return product
    product = sympy.expand(product)
    return int(product) if product.is_number else product


def describe_shape(shape) -> tuple:
    """A shape for reports and logs: ints, and symbolic sizes as their expressions' text (picklable)."""
    return tuple(static_int(s) if static_int(s) is not None else str(size_expr(s)) for s in shape)


def site_limit(group_name: str, reduce_op: str, hidden: int, dtype: torch.dtype) -> tuple[int, str | None]:
    """(fusion limit, None) of an all-reduce site, or (0, why no token count of it can fuse).

    What a site's op, dtype, hidden size and group decide; the backend asks it of dynamo's graph and
    the patterns of the post-grad graph, so both give the same reasons.
    """
    if reduce_op != "sum":
        return 0, f"all-reduce op is {reduce_op!r}, not 'sum'"
    if dtype not in select.KERNEL_DTYPES:
        return 0, f"{hidden} x {dtype} is not supported by the kernels"
    if not select.kernel_supports(hidden, dtype):
        return 0, f"hidden size {hidden} is not supported (a multiple of 8 up to {select.MAX_KERNEL_HIDDEN})"
    comm = lookup_communicator(group_name)
    limit = comm.max_token_num(hidden, dtype) if comm is not None and not comm.destroyed else 0
    if limit <= 0:
        return 0, (f"group {group_name!r} has no tpfuse communicator that can fuse {hidden} x {dtype} "
                   "(call tpfuse.get_communicator before compiling)")
    return limit, None


def _numel(shape):
    return token_count(tuple(shape) + (1,))


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


def _row_views(node: Node, hidden: int) -> list[Node]:
    """``node`` and the chain of views that follows it while each is the only user and rows stay rows."""
    chain = [node]
    while True:
        view = _only_user(chain[-1])
        if not (_is(view, *VIEWS) and view.args[0] is chain[-1] and _val(view) is not None):
            return chain
        shape = _val(view).shape
        if len(shape) < 1 or static_int(shape[-1]) != hidden or _numel(shape) != _numel(_val(node).shape):
            return chain
        chain.append(view)


@dataclass
class Match:
    """What a pattern found: the op's inputs, the nodes it replaces, and the nodes that go away."""

    all_reduce: Node
    x: Node
    group_name: str
    reduce_op: str
    h: Node  # the residual-stream value: the add, or without residual what the norm reads
    out: Node  # the norm's (or the quantisation's) output
    weight: Node
    eps: float
    hidden: int
    residual: Node | None = None
    scale: Node | None = None
    internal: list[Node] = field(default_factory=list)  # may only be used inside the match
    aliases: list[Node] = field(default_factory=list)  # views of the sum before h: may have other users
    problem: str | None = None  # the structure matched but cannot be fused (why)

    @property
    def tokens(self):
        """The site's token count: an int, or a sympy expression of the graph's size symbols."""
        return token_count(_val(self.h).shape)


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


def _residual_problem(residual: object, add: Node, x: torch.Tensor, hidden: int) -> str | None:
    """Why the other operand of the add is not a residual the op can take (None when it is)."""
    if not isinstance(residual, Node) or not isinstance(_val(residual), torch.Tensor):
        return "the value added to the all-reduce result is not a tensor"
    r = _val(residual)
    if r.dtype != x.dtype:
        return f"the residual's dtype {r.dtype} differs from the all-reduce's {x.dtype}"
    if r.dim() < 1 or static_int(r.shape[-1]) != hidden or _numel(r.shape) != _numel(_val(add).shape):
        return (f"the add broadcasts a {tuple(r.shape)} tensor (a bias?) over the {tuple(_val(add).shape)} "
                "sum: not a residual of the same size")
    return None


class FusionPattern:
    """Base of the pattern classes; subclasses set ``residual`` and ``quant``."""

    residual: bool = False
    quant: bool = False

    @classmethod
    def search(cls, all_reduce: Node) -> Match | None:
        if not _is(all_reduce, ALL_REDUCE):
            return None
        wait = _only_user(all_reduce)
        if not _is(wait, WAIT) or not isinstance(_val(wait), torch.Tensor) or _val(wait).dim() < 1:
            return None
        x, reduce_op, group_name = all_reduce.args[:3]
        hidden = static_int(_val(wait).shape[-1])
        if hidden is None:
            return None
        chain = _row_views(wait, hidden)
        internal, aliases, residual, problem = [all_reduce], [], None, None
        if cls.residual:
            # The pre-add sum may have no other user (the op cannot provide it): extra_check says so.
            adds = [u for u in chain[-1].users if _is(u, aten.add.Tensor) and u.kwargs.get("alpha", 1) == 1]
            if len(adds) != 1:
                return None
            add = adds[0]
            residual = _other(add, chain[-1])
            problem = _residual_problem(residual, add, _val(x), hidden)
            internal += chain
            h = add
            norm_input = _row_views(add, hidden)[-1]
        else:
            h = norm_input = chain[-1]
            aliases = chain[:-1]
        norm = match_rmsnorm(norm_input)
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
        return Match(all_reduce, x, group_name, reduce_op, h, out, weight, eps, hidden, residual, scale,
                     internal + norm_nodes, aliases, problem)

    @classmethod
    def extra_check(cls, m: Match, token_bound) -> str | None:
        """Why ``m`` must stay unfused (a reason for the log), or None to fuse it.

        ``token_bound(tokens)`` gives the largest token count the graph runs this site with (or None
        when unknown); ``tokens`` is an int or a sympy expression of the graph's size symbols.
        """
        if m.problem is not None:
            return m.problem
        x = _val(m.x)
        limit, reason = site_limit(m.group_name, m.reduce_op, m.hidden, x.dtype)
        if reason is not None:
            return reason
        if _numel(x.shape) != _numel(_val(m.h).shape):
            return f"the all-reduced {tuple(x.shape)} is broadcast by the add to {tuple(_val(m.h).shape)}"
        w = _val(m.weight) if isinstance(m.weight, Node) else None
        if w is None or tuple(w.shape) != (m.hidden,) or w.dtype not in (x.dtype, torch.float32):
            return "the norm weight is not a [hidden] tensor of the input's dtype or float32"
        if m.scale is not None and (_val(m.scale) is None or _val(m.scale).dtype != torch.float32
                                    or _val(m.scale).numel() != 1):
            return "the fp8 scale is not a float32 tensor of one element"
        if _val(m.out).dtype != (torch.float8_e4m3fn if cls.quant else x.dtype):
            return "the norm's result dtype differs from the input's (e.g. an fp32 weight multiplied last)"
        allowed = set(m.internal) | {m.out, m.h}
        for node in m.internal:
            if any(u not in allowed for u in node.users):
                what = "the pre-add sum" if node.target in (WAIT,) + VIEWS else "an intermediate value"
                return f"{what} of the pattern has users outside it"
        for node in [m.out, m.h] + m.aliases:
            if any(static_int(s) is None and _size_source(m.all_reduce.graph, s, m) is None
                   for s in _val(node).shape):
                return f"no input of the graph carries the sizes of {tuple(_val(node).shape)}"
        tokens = m.tokens
        bound = tokens if isinstance(tokens, int) else token_bound(tokens)
        if bound is None:
            return f"the token count {tokens} of this graph is unbounded (compile with tpfuse.compile)"
        if bound > limit:
            return f"token range up to {bound} exceeds the fusion limit {limit}"
        return None

    @classmethod
    def replace(cls, graph: Graph, m: Match) -> None:
        """Rewrite the site to the fused op; the caller re-sorts the graph (``stable_topological_sort``)."""
        from torch._guards import detect_fake_mode

        hidden = m.hidden
        fake_mode = detect_fake_mode([_val(m.x)])

        def call(target, *args) -> Node:
            node = graph.call_function(target, args)
            if fake_mode is not None:  # Inductor lowers from these values
                fake_args = [_val(a) if isinstance(a, Node) else
                             [_val(s) if isinstance(s, Node) else s for s in a] if isinstance(a, list) else a
                             for a in args]
                with fake_mode:
                    node.meta["val"] = target(*fake_args)
            return node

        def shape_args(shape) -> list:
            args = []
            for size in shape:
                if static_int(size) is not None:
                    args.append(static_int(size))
                    continue
                node, dim = _size_source(graph, size, m)
                args.append(node if dim is None else call(aten.sym_size.int, node, dim))
            return args

        op = torch.ops.tpfuse.allreduce_add_rmsnorm.default
        with graph.inserting_before(m.out):
            x2 = call(aten.reshape.default, m.x, [-1, hidden])
            r2 = call(aten.reshape.default, m.residual, [-1, hidden]) if m.residual is not None else None
            fused = call(op, x2, r2, m.weight, m.eps, m.group_name, m.scale)
            y2, h2 = call(operator.getitem, fused, 0), call(operator.getitem, fused, 1)
            y = call(aten.reshape.default, y2, shape_args(_val(m.out).shape))
            h = call(aten.reshape.default, h2, shape_args(_val(m.h).shape))
            for alias in m.aliases:  # views of the sum that others read: the same rows of h
                if any(u not in m.aliases and u is not m.h for u in alias.users):
                    alias.replace_all_uses_with(call(aten.reshape.default, h2, shape_args(_val(alias).shape)))
        m.out.replace_all_uses_with(y)
        m.h.replace_all_uses_with(h)
        order = {node: i for i, node in enumerate(graph.nodes)}
        gone = set(m.internal) | set(m.aliases) | {m.h, m.out}
        for node in sorted(gone, key=order.__getitem__, reverse=True):
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


def _size_source(graph: Graph, size: torch.SymInt, m: Match) -> tuple[Node, int | None] | None:
    """Where a kept node holds the symbolic ``size``: (a SymInt input, None) or (a tensor, its dim)."""
    expr = size_expr(size)
    donors = [m.x] + ([m.residual] if m.residual is not None else [])
    donors += [n for n in graph.nodes if n.op == "placeholder"]
    for node in donors:
        val = _val(node)
        if isinstance(val, torch.SymInt) and size_expr(val) == expr:
            return node, None
        if isinstance(val, torch.Tensor):
            for dim, s in enumerate(val.shape):
                if static_int(s) is None and size_expr(s) == expr:
                    return node, dim
    return None


class AllReduceRMSNorm(FusionPattern):
    """all-reduce -> RMSNorm (the sum may have other users: the op returns it as ``h``)."""


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


def unmatched_reason(all_reduce: Node) -> str:
    """Why no pattern starts at ``all_reduce`` (the first thing the site lacks)."""
    wait = _only_user(all_reduce)
    if not _is(wait, WAIT):
        return "the all-reduce's result is not waited on directly"
    hidden = static_int(_val(wait).shape[-1]) if _val(wait) is not None and _val(wait).dim() else None
    if hidden is None:
        return "the hidden size (last dimension) is dynamic"
    end = _row_views(wait, hidden)[-1]
    if any(u.op == "output" for u in end.users):
        return ("the all-reduce's result leaves the compiled graph before its add and norm (a graph break "
                "between them? torch._dynamo.explain(model)(...) lists the breaks)")
    users = [u.target for u in end.users]
    return ("no RMSNorm (or residual add then RMSNorm) follows the all-reduce; its result goes to "
            f"{', '.join(str(getattr(t, '__name__', t)) for t in users) or 'nothing'} (if the model has "
            "a norm here: is eps a graph input? tpfuse.compile traces with specialize_float=True)")
