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
from tpfuse.kernels.epilogue import FP8_MAX, MIN_DYNAMIC_SCALE
from tpfuse.kernels.reference import dynamic_fp8

aten, prims = torch.ops.aten, torch.ops.prims
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
#: Ops that change only how rows are grouped, looked through between the all-reduce, the add and the norm.
VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.default, getattr(aten.squeeze, "dims", aten.squeeze.dim))


def _is(node: object, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def _is_add(node: object) -> bool:
    """``a + b`` of two tensors (no ``alpha``)."""
    return _is(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1


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
    scale: Node | None = None  # static fp8
    internal: list[Node] = field(default_factory=list)  # may only be used inside the match
    aliases: list[Node] = field(default_factory=list)  # views of the sum before h: may have other users
    problem: str | None = None  # the structure matched but cannot be fused (why)
    x_scale: object = None  # a number or one-element tensor the sum is multiplied by (Gemma's embedding)
    biases: list = field(default_factory=list)  # [H] tensors added to the sum (one a branch)
    x_other: Node | None = None  # the second branch's all-reduce input: x + x_other is all-reduced once
    x_other_copies: int = 1  # x_other holds this many copies of the rows, summed (Llama 4's experts)
    merged: list[Node] = field(default_factory=list)  # other all-reduces this site takes in
    sum_weight: object = None  # the post-norm's gain (Gemma)
    norm_bias: object = None  # LayerNorm's bias
    scales: Node | None = None  # dynamic fp8: the node of the scales
    scale_group: int = 0  # dynamic fp8: elements per scale

    @property
    def tokens(self):
        """The site's token count: an int, or a sympy expression of the graph's size symbols."""
        return token_count(_val(self.h).shape)


def _scalar(node: object) -> bool:
    """A number, or a tensor node of one element."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return True
    return isinstance(node, Node) and isinstance(_val(node), torch.Tensor) and _val(node).numel() == 1


def _row_vector(node: object, hidden: int) -> bool:
    """A tensor node that is one row of ``hidden`` for every token: a bias or a gain."""
    val = _val(node) if isinstance(node, Node) else None
    return (isinstance(val, torch.Tensor) and val.dim() >= 1 and static_int(val.shape[-1]) == hidden
            and val.numel() == hidden)


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
            if not _last_dim(mean.args[1], c):
                continue
            add_eps, rsqrt = _plus_eps_rsqrt(mean)
            if rsqrt is None:
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
            scaled = _only_user(normed)  # torch rms_norm, Gemma: the weight in fp32, then cast back
            if _is(scaled, aten.mul.Tensor):
                out = _convert_to(scaled, dtype)
                if out is not None and len(scaled.users) == 1:
                    return out, _other(scaled, normed), float(add_eps.args[1]), internal + [scaled]
    return None


def _plus_eps_rsqrt(node: Node) -> tuple[Node | None, Node | None]:
    """(the add, the rsqrt) when ``node``'s only use is ``rsqrt(node + eps)`` with a constant eps."""
    add_eps = _only_user(node)
    if _is(add_eps, aten.add.Tensor, aten.add.Scalar) and isinstance(add_eps.args[1], (int, float)):
        rsqrt = _only_user(add_eps)
        if _is(rsqrt, aten.rsqrt.default):
            return add_eps, rsqrt
    return None, None


def _last_dim(dims, node: Node) -> bool:
    return list(dims) in ([-1], [_val(node).dim() - 1])


def match_layernorm(h: Node) -> tuple[Node, Node, float, object, list[Node]] | None:
    """(out, weight, eps, bias or None, internal nodes) of a LayerNorm of ``h``, or None. Two styles:
    Inductor's decomposition of ``nn.LayerNorm`` / ``F.layer_norm`` (``var_mean`` in fp32), and the
    hand-written one of Cohere (``mean``, ``(c - mean) ** 2``, ``mean``); then the weight, an optional
    bias, and the cast back."""
    for c in _converts_to(h, torch.float32):
        for stats in _layernorm_statistics(c):
            add_eps, rsqrt = _plus_eps_rsqrt(stats.var)
            normed = _only_user(rsqrt) if rsqrt is not None else None
            if not (_is(normed, aten.mul.Tensor) and _other(normed, rsqrt) in stats.centred):
                continue
            scaled = _only_user(normed)
            if not _is(scaled, aten.mul.Tensor):
                continue
            internal = [c] + stats.nodes + [add_eps, rsqrt, normed, scaled]
            bias, last = None, scaled
            after = _only_user(scaled)
            if _is_add(after):
                bias, last = _other(after, scaled), after
                internal.append(after)
            out = _convert_to(last, _val(h).dtype) if len(last.users) == 1 else None
            if out is not None:
                return out, _other(scaled, normed), float(add_eps.args[1]), bias, internal
    return None


@dataclass
class _Statistics:
    var: Node  # the variance, which ``rsqrt(var + eps)`` reads
    centred: list[Node]  # c - mean (Cohere writes it twice; the graph may keep both)
    nodes: list[Node]  # every node that computes them


def _layernorm_statistics(c: Node) -> list[_Statistics]:
    """The ways a LayerNorm computes the mean and variance of the fp32 row ``c``."""
    found = []
    for vm in _users(c, aten.var_mean.correction):
        if not (vm.kwargs.get("correction") == 0 and vm.kwargs.get("keepdim") and len(vm.args) > 1
                and _last_dim(vm.args[1], c)):
            continue
        parts = {u.args[1]: u for u in vm.users if _is(u, operator.getitem)}
        var, mean = parts.get(0), parts.get(1)
        subs = [u for u in _users(c, aten.sub.Tensor) if u.args[:2] == (c, mean)]
        if var is not None and mean is not None and len(subs) == 1 and len(mean.users) == 1:
            found.append(_Statistics(var, subs, [vm, var, mean, subs[0]]))
    for mean in _users(c, aten.mean.dim):
        if not (len(mean.args) > 2 and mean.args[2] and _last_dim(mean.args[1], c)):
            continue
        subs = [u for u in _users(c, aten.sub.Tensor) if u.args[:2] == (c, mean)]
        if not subs or len(mean.users) != len(subs):
            continue
        for sub in subs:
            for square in sub.users:
                if not (_is(square, aten.pow.Tensor_Scalar) and square.args[1] == 2
                        or _is(square, aten.mul.Tensor) and square.args[:2] == (sub, sub)):
                    continue
                var = _only_user(square)
                if (_is(var, aten.mean.dim) and len(var.args) > 2 and var.args[2]
                        and _last_dim(var.args[1], square)):
                    found.append(_Statistics(var, subs, [mean] + subs + [square, var]))
    return found


def match_static_fp8(y: Node, div: Node | None = None) -> tuple[Node, Node, list[Node]] | None:
    """(out, scale, internal nodes) of ``clamp(y.float() / scale, -448, 448).to(fp8)``, or None.
    ``div``: the division to start from, when ``y`` has other users (dynamic fp8)."""
    start = _convert_to(y, torch.float32) if div is None else None
    start = start if start is not None and len(y.users) == 1 else y
    div = div if div is not None else _only_user(start)
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


def _bias_of(node: Node, hidden: int) -> tuple[Node | None, object]:
    """(the add, the bias) when ``node``'s only user adds a [hidden] row to it, else (None, None)."""
    add = _only_user(node)
    if _is_add(add) and _row_vector(_other(add, node), hidden):
        return add, _other(add, node)
    return None, None


def _branch(node: object, group_name: str, reduce_op: str, hidden: int, with_bias: bool):
    """(all-reduce, nodes, bias, copies) when ``node`` is another all-reduce of the same group (+ its bias,
    views between), the second term of a sum of two; else None. ``copies`` > 1: the all-reduced tensor
    holds that many copies of the rows, summed after it (Llama 4's experts: ``[E * T, H]`` viewed as
    ``[E, T, H]``, then ``.sum(0)``), which the fusion sums before the all-reduce instead."""
    nodes, bias, copies = [], None, 1
    if with_bias:
        if not _is_add(node):
            return None
        a, b = node.args[:2]
        bias = b if _row_vector(b, hidden) else a if _row_vector(a, hidden) else None
        if bias is None:
            return None
        nodes.append(node)
        node = a if bias is b else b
    if (_is(node, aten.sum.dim_IntList) and list(node.args[1]) == [0] and node.args[2:] in ((), (False,))
            and not node.kwargs and len(node.users) == 1 and isinstance(_val(node.args[0]), torch.Tensor)
            and _val(node.args[0]).dim() == 3):
        copies = static_int(_val(node.args[0]).shape[0])
        if copies is None:
            return None
        nodes.append(node)
        node = node.args[0]
    while _is(node, *VIEWS) and len(node.users) == 1:
        nodes.append(node)
        node = node.args[0]
    if not (_is(node, WAIT) and len(node.users) == 1 and static_int(_val(node).shape[-1]) == hidden):
        return None
    reduce = node.args[0]
    if not (_is(reduce, ALL_REDUCE) and tuple(reduce.args[1:3]) == (reduce_op, group_name)):
        return None
    return reduce, nodes + [node], bias, copies


def match_dynamic_fp8(y: Node, hidden: int) -> tuple[Node, Node, int, list[Node]] | None:
    """(out, scales, elements per scale, internal nodes) of dynamic fp8 in ``kernels.reference.dynamic_fp8``'s
    form: ``g = y.float()`` (viewed as groups or not), ``s = clamp(amax(|g|, -1) / 448, min)``,
    ``out = clamp(g / s, -448, 448).to(fp8)`` (viewed back), ``scales = s.squeeze(-1)``; or None."""
    start = _convert_to(y, torch.float32) if len(y.users) == 1 else None
    if start is None:
        return None
    nodes, grouped, group = [start], start, hidden
    view = _only_user(start)
    if _is(view, *VIEWS) and len(_val(view).shape) == len(_val(start).shape) + 1:
        group = static_int(_val(view).shape[-1])
        nodes.append(view)
        grouped = view
    absolute = _users(grouped, aten.abs.default)
    amax = _only_user(absolute[0]) if len(absolute) == 1 else None
    if not (_is(amax, aten.amax.default) and len(amax.args) > 2 and amax.args[2]
            and _last_dim(amax.args[1], grouped)):
        return None
    to_unit = _only_user(amax)
    if not (_is(to_unit, aten.div.Tensor) and to_unit.args[1] == FP8_MAX):
        return None
    floor = _only_user(to_unit)
    if not (_is(floor, aten.clamp_min.default, aten.clamp.default) and floor.args[1] == MIN_DYNAMIC_SCALE):
        return None
    nodes += [absolute[0], amax, to_unit, floor]
    divs = [u for u in _users(floor, aten.div.Tensor) if u.args[:2] == (grouped, floor)]
    outs = [u for u in floor.users if u not in divs]
    if len(divs) != 1 or len(outs) != 1 or not _is(outs[0], *VIEWS):
        return None
    quant = match_static_fp8(grouped, divs[0])
    if quant is None:
        return None
    out, _, quant_nodes = quant
    nodes += quant_nodes
    back = _only_user(out)
    if grouped is not start:  # the groups viewed back as rows
        if not (_is(back, *VIEWS) and static_int(_val(back).shape[-1]) == hidden):
            return None
        nodes.append(out)
        out = back
    return out, outs[0], group, nodes


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
    """Base of the pattern classes: a subclass says which steps its site has, each one required.

    In the order they apply to the all-reduced sum: ``scale`` (multiplied by a number: Gemma's
    embedding), ``bias`` (a row-parallel layer's bias, in every branch), ``branches`` (2: the sum of
    two all-reduces of the same group, Phi / GPT-NeoX's parallel attention and MLP), ``sum_norm``
    (an RMSNorm of the sum before the residual add: Gemma 2/3), ``residual``, then RMSNorm or
    ``layer_norm``, then ``quant``: None, "static" (one fp8 scale) or "dynamic" (per token or group).
    """

    scale: bool = False
    bias: bool = False
    branches: int = 1
    sum_norm: bool = False
    residual: bool = False
    layer_norm: bool = False
    quant: str | None = None

    @classmethod
    def steps(cls) -> int:
        """How many steps the pattern has: longer patterns are tried first."""
        return (cls.scale + cls.bias + (cls.branches - 1) + cls.sum_norm + cls.residual + cls.layer_norm
                + (cls.quant is not None))

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
        m = Match(all_reduce, x, group_name, reduce_op, chain[-1], chain[-1], None, 0.0, hidden)
        steps = list(chain)  # nodes from the sum to h

        def follow(node: Node) -> Node:  # the views after a step belong to it
            views = _row_views(node, hidden)
            steps.extend(views)
            return views[-1]

        cur = chain[-1]
        if cls.scale:
            mul = _only_user(cur)
            if not (_is(mul, aten.mul.Tensor) and _scalar(_other(mul, cur))):
                return None
            m.x_scale = _other(mul, cur)
            cur = follow(mul)
        if cls.bias:
            cur, bias = _bias_of(cur, hidden)
            if cur is None:
                return None
            m.biases.append(bias)
            cur = follow(cur)
        residual_add = None
        if cls.branches == 2:

            def branch_after(node: Node):  # (the add that node's only user is, the branch it adds or None)
                add = _only_user(node)
                if not _is_add(add):
                    return None, None
                return add, _branch(_other(add, node), group_name, reduce_op, hidden, cls.bias)

            add, branch = branch_after(cur)
            if add is not None and branch is None and cls.residual:  # (a + residual) + b: Cohere
                m.residual = _other(add, cur)
                m.problem = _residual_problem(m.residual, add, _val(x), hidden)
                residual_add, cur = add, follow(add)
                add, branch = branch_after(cur)
            if branch is None:
                return None
            other_reduce, nodes, bias, m.x_other_copies = branch
            m.x_other, m.merged = other_reduce.args[0], [other_reduce]
            m.biases += [bias] if bias is not None else []
            m.internal += nodes
            cur = follow(add)
        if cls.sum_norm:
            norm = match_rmsnorm(cur)
            if norm is None:
                return None
            out, m.sum_weight, sum_eps, nodes = norm
            steps += nodes + [out]
            cur = follow(out)
        if cls.residual and residual_add is None:
            # The pre-add sum may have no other user (the op cannot provide it): extra_check says so.
            adds = [u for u in cur.users if _is_add(u)]
            if len(adds) != 1:
                return None
            m.residual = _other(adds[0], cur)
            m.problem = _residual_problem(m.residual, adds[0], _val(x), hidden)
            steps.append(adds[0])
            cur = adds[0]
        m.h = cur
        if steps[-1] is chain[-1]:  # h is the sum itself: the views before it are the sum's aliases
            m.aliases = chain[:-1]
        else:
            m.internal += [n for n in steps if n is not cur]
        norm_input = _row_views(cur, hidden)[-1]
        if cls.layer_norm:
            norm = match_layernorm(norm_input)
            if norm is None:
                return None
            out, m.weight, m.eps, m.norm_bias, nodes = norm
        else:
            norm = match_rmsnorm(norm_input)
            if norm is None:
                return None
            out, m.weight, m.eps, nodes = norm
        if cls.sum_norm and sum_eps != m.eps:
            m.problem = m.problem or f"the post-norm's eps {sum_eps} differs from the norm's {m.eps}"
        if cls.quant == "static":
            quant = match_static_fp8(out)
            if quant is None:
                return None
            q_out, m.scale, quant_nodes = quant
            nodes = nodes + [out] + quant_nodes
            out = q_out
        elif cls.quant == "dynamic":
            quant = match_dynamic_fp8(out, hidden)
            if quant is None:
                return None
            q_out, m.scales, m.scale_group, quant_nodes = quant
            nodes = nodes + [out] + quant_nodes
            out = q_out
        m.out = out
        m.internal = [all_reduce] + m.merged + m.internal + nodes
        return m

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
        if m.x_other is not None and (_val(m.x_other).dtype != x.dtype or _numel(_val(m.x_other).shape)
                                      != m.x_other_copies * _numel(x.shape)):
            return "the two all-reduced branches differ in dtype or size"
        gains = [("the norm weight", m.weight), ("the post-norm weight", m.sum_weight),
                 ("the LayerNorm bias", m.norm_bias)] + [("the bias", b) for b in m.biases]
        for what, node in gains:
            if node is None and what != "the norm weight":
                continue
            w = _val(node) if isinstance(node, Node) else None
            if w is None or tuple(w.shape) != (m.hidden,) or w.dtype not in (x.dtype, torch.float32):
                return f"{what} is not a [hidden] tensor of the input's dtype or float32"
        if m.x_scale is not None and isinstance(m.x_scale, Node) and not _val(m.x_scale).is_floating_point():
            return "the sum is multiplied by an integer tensor"
        if m.scale is not None and (_val(m.scale) is None or _val(m.scale).dtype != torch.float32
                                    or _val(m.scale).numel() != 1):
            return "the fp8 scale is not a float32 tensor of one element"
        if _val(m.out).dtype != (torch.float8_e4m3fn if cls.quant else x.dtype):
            return "the norm's result dtype differs from the input's (e.g. an fp32 weight multiplied last)"
        allowed = set(m.internal) | {m.out, m.h} | ({m.scales} if m.scales is not None else set())
        for node in m.internal:
            if any(u not in allowed for u in node.users):
                what = "the pre-add sum" if node.target in (WAIT,) + VIEWS else "an intermediate value"
                return f"{what} of the pattern has users outside it"
        outputs = [m.out, m.h] + m.aliases + ([m.scales] if m.scales is not None else [])
        for node in outputs:
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

        def fake(a):
            if isinstance(a, list):
                return [fake(s) for s in a]
            return _val(a) if isinstance(a, Node) else a

        def call(target, *args, **kwargs) -> Node:
            node = graph.call_function(target, args, kwargs)
            if fake_mode is not None:  # Inductor lowers from these values
                with fake_mode:
                    node.meta["val"] = target(*map(fake, args), **{k: fake(v) for k, v in kwargs.items()})
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

        with graph.inserting_before(m.out):
            x2 = call(aten.reshape.default, m.x, [-1, hidden])
            if m.x_other is not None:  # one all-reduce of both branches
                other = call(aten.reshape.default, m.x_other, [m.x_other_copies, -1, hidden])
                if m.x_other_copies > 1:  # summing the copies is linear: before the all-reduce, not after
                    other = call(aten.sum.dim_IntList, other, [0])
                x2 = call(aten.add.Tensor, x2, call(aten.reshape.default, other, [-1, hidden]))
            if m.x_scale is not None:  # scaling each rank's part scales the sum
                x2 = call(aten.mul.Tensor, x2, m.x_scale)
            bias = None
            for b in m.biases:  # several branches' biases: summed once, in fp32
                b = call(prims.convert_element_type.default, b, torch.float32) if len(m.biases) > 1 else b
                bias = b if bias is None else call(aten.add.Tensor, bias, b)
            r2 = call(aten.reshape.default, m.residual, [-1, hidden]) if m.residual is not None else None
            steps = {"bias": bias, "sum_weight": m.sum_weight, "layer_norm": cls.layer_norm,
                     "norm_bias": m.norm_bias}
            if cls.quant == "dynamic":
                op = torch.ops.tpfuse.allreduce_add_rmsnorm_dynamic_fp8.default
                fused = call(op, x2, r2, m.weight, m.eps, m.group_name, scale_group=m.scale_group, **steps)
                y2, scales, h2 = (call(operator.getitem, fused, i) for i in range(3))
                scales = call(aten.reshape.default, scales, shape_args(_val(m.scales).shape))
                m.scales.replace_all_uses_with(scales)
            else:
                op = torch.ops.tpfuse.allreduce_add_rmsnorm.default
                fused = call(op, x2, r2, m.weight, m.eps, m.group_name, quant_scale=m.scale, **steps)
                y2, h2 = call(operator.getitem, fused, 0), call(operator.getitem, fused, 1)
            y = call(aten.reshape.default, y2, shape_args(_val(m.out).shape))
            h = call(aten.reshape.default, h2, shape_args(_val(m.h).shape))
            for alias in m.aliases:  # views of the sum that others read: the same rows of h
                if any(u not in m.aliases and u is not m.h for u in alias.users):
                    alias.replace_all_uses_with(call(aten.reshape.default, h2, shape_args(_val(alias).shape)))
        m.out.replace_all_uses_with(y)
        m.h.replace_all_uses_with(h)
        order = {node: i for i, node in enumerate(graph.nodes)}
        gone = set(m.internal) | set(m.aliases) | {m.h, m.out} | ({m.scales} - {None})
        for node in sorted(gone, key=order.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)

    @classmethod
    def example(cls, inputs: dict, eps: float, group=None):
        """The unfused pattern in plain torch (functional all-reduce, HF-style norms), from ``inputs``:
        ``x`` (and ``x_other`` with two branches), ``residual``, ``weight``, and where the pattern has
        them ``x_scale``, ``bias`` (and ``bias_other``), ``sum_weight``, ``norm_bias``, ``scale`` (static
        fp8), ``scale_group`` (dynamic fp8). Returns ``(y, h)``, or ``(y, scales, h)`` for dynamic fp8."""
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        group = group or dist.group.WORLD
        x = inputs["x"]

        def branch(part, bias):
            s = fc.all_reduce(part, "sum", group)
            if cls.scale:
                s = s * inputs["x_scale"]
            return s + bias if cls.bias else s

        h = branch(x, inputs.get("bias"))
        if cls.branches == 2:
            h = h + branch(inputs["x_other"], inputs.get("bias_other"))
        if cls.sum_norm:
            h = _example_rmsnorm(h, inputs["sum_weight"], eps, gemma=True)
        if cls.residual:
            h = h + inputs["residual"]
        if cls.layer_norm:
            y = torch.nn.functional.layer_norm(h, (h.shape[-1],), inputs["weight"], inputs.get("norm_bias"),
                                               eps)
        else:
            y = _example_rmsnorm(h, inputs["weight"], eps, gemma=cls.sum_norm)
        if cls.quant == "static":
            y = (y.float() / inputs["scale"]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        elif cls.quant == "dynamic":
            y, scales = dynamic_fp8(y, inputs["scale_group"])
            return y, scales, h
        return y, h


def _example_rmsnorm(h: torch.Tensor, weight: torch.Tensor, eps: float, gemma: bool) -> torch.Tensor:
    """HF Llama's RMSNorm (cast back, then the weight), or Gemma's (times ``1 + weight`` in fp32, then cast
    back)."""
    c = h.float()
    normed = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (normed * (1.0 + weight.float())).to(h.dtype)
    return normed.to(h.dtype) * weight


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
    """all-reduce -> + residual -> RMSNorm, returning the norm and the new residual (Llama, Qwen, Mistral)."""

    residual = True


class AllReduceRMSNormQuant(FusionPattern):
    """all-reduce -> RMSNorm -> static fp8."""

    quant = "static"


class AllReduceAddRMSNormQuant(FusionPattern):
    """all-reduce -> + residual -> RMSNorm -> static fp8."""

    residual = True
    quant = "static"


class AllReduceAddRMSNormDynamicQuant(FusionPattern):
    """all-reduce -> + residual -> RMSNorm -> fp8 with a scale per token or per group (DeepSeek-V3 /
    Llama-4 fp8 checkpoints)."""

    residual = True
    quant = "dynamic"


class AllReduceRMSNormDynamicQuant(FusionPattern):
    """all-reduce -> RMSNorm -> fp8 with a scale per token or per group."""

    quant = "dynamic"


class AllReducePostNormAddRMSNorm(FusionPattern):
    """all-reduce -> RMSNorm -> + residual -> RMSNorm: Gemma 2/3's post-norm and the next pre-norm."""

    sum_norm = True
    residual = True


class AllReduceScaledRMSNorm(FusionPattern):
    """all-reduce -> * a number -> RMSNorm: Gemma's row-parallel embedding, scaled by sqrt(hidden)."""

    scale = True


class AllReduceScaledAddRMSNorm(FusionPattern):
    """all-reduce -> * a number -> + residual -> RMSNorm: Granite's ``residual + out * multiplier``."""

    scale = True
    residual = True


class AllReduceBiasAddRMSNorm(FusionPattern):
    """all-reduce -> + bias -> + residual -> RMSNorm: a row-parallel layer with a bias (HF adds it after
    the all-reduce)."""

    bias = True
    residual = True


class AllReduceLayerNorm(FusionPattern):
    """all-reduce -> LayerNorm (StarCoder2's row-parallel embedding into the first norm)."""

    layer_norm = True


class AllReduceAddLayerNorm(FusionPattern):
    """all-reduce -> + residual -> LayerNorm."""

    residual = True
    layer_norm = True


class AllReduceBiasAddLayerNorm(FusionPattern):
    """all-reduce -> + bias -> + residual -> LayerNorm (StarCoder2, GPT-NeoX without parallel residual)."""

    bias = True
    residual = True
    layer_norm = True


class TwoAllReducesBiasAddLayerNorm(FusionPattern):
    """(all-reduce + bias) + (all-reduce + bias) -> + residual -> LayerNorm: Phi-2 and GPT-NeoX's parallel
    attention and MLP, as one all-reduce of their sum."""

    bias = True
    branches = 2
    residual = True
    layer_norm = True


class TwoAllReducesAddLayerNorm(FusionPattern):
    """all-reduce + all-reduce -> + residual (between them or after) -> LayerNorm: Cohere's
    parallel attention and MLP (``residual + attention + mlp``, a LayerNorm without bias)."""

    branches = 2
    residual = True
    layer_norm = True


class TwoAllReducesAddRMSNorm(FusionPattern):
    """all-reduce + all-reduce -> + residual -> RMSNorm: two branches of one block (routed and shared
    experts: DeepSeek-V3, Llama 4, whose routed output is summed over its experts' copies after its
    all-reduce), as one all-reduce of their sum."""

    branches = 2
    residual = True


# Longest first: a site that continues into more steps takes the larger pattern.
PATTERNS = sorted([
    AllReduceRMSNorm, AllReduceAddRMSNorm, AllReduceRMSNormQuant, AllReduceAddRMSNormQuant,
    AllReduceRMSNormDynamicQuant, AllReduceAddRMSNormDynamicQuant, AllReducePostNormAddRMSNorm,
    AllReduceScaledRMSNorm, AllReduceScaledAddRMSNorm, AllReduceBiasAddRMSNorm, AllReduceLayerNorm,
    AllReduceAddLayerNorm, AllReduceBiasAddLayerNorm, TwoAllReducesBiasAddLayerNorm,
    TwoAllReducesAddLayerNorm, TwoAllReducesAddRMSNorm,
], key=lambda pattern: -pattern.steps())


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
    return ("no norm follows the all-reduce as a pattern has it (RMSNorm or LayerNorm, after a residual add, "
            "a bias or a post-norm: tpfuse.compiler.PATTERNS); its result goes to "
            f"{', '.join(str(getattr(t, '__name__', t)) for t in users) or 'nothing'} (if the model has "
            "a norm here: is eps a graph input? tpfuse.compile traces with specialize_float=True)")
