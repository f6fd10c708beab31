"""Graph utilities and sub-matchers over post-grad FX graphs: the pieces the patterns are built of.

Each ``match_*`` function walks forward from a node and returns what it found (the output, the
tensors it reads, the nodes it computes with) or None: an RMSNorm in any supported style, a
LayerNorm, static and dynamic fp8, a second all-reduced branch, a bias.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch.fx import Node

from tpfuse.blockend import outputs as output_formats
from tpfuse.blockend import stages
from tpfuse.compiler.reasons import Reason
from tpfuse.compiler.sizes import element_count, static_int
from tpfuse.targets import Fp8Format, fp8_format

aten, prims = torch.ops.aten, torch.ops.prims
ALL_REDUCE = torch.ops._c10d_functional.all_reduce.default
WAIT = torch.ops._c10d_functional.wait_tensor.default
#: Sequence parallel's collectives (over dim 0): ``reduce_scatter_tensor(x, op, W, group)`` and
#: ``all_gather_into_tensor(y, W, group)``.
REDUCE_SCATTER = torch.ops._c10d_functional.reduce_scatter_tensor.default
ALL_GATHER = torch.ops._c10d_functional.all_gather_into_tensor.default
#: Ops that change only how rows are grouped, looked through between the all-reduce, the add and the norm.
VIEWS = (aten.reshape.default, aten.view.default, aten._unsafe_view.default, aten.unsqueeze.default,
         aten.squeeze.dim, aten.squeeze.default, getattr(aten.squeeze, "dims", aten.squeeze.dim))


def is_call(node: object, *targets) -> bool:
    return isinstance(node, Node) and node.op == "call_function" and node.target in targets


def collective_args(node: Node) -> tuple[Node, str, str, int]:
    """(x, reduce op, group name, W or 0) of an all-reduce (0) or a reduce-scatter (its W) site."""
    if node.target == REDUCE_SCATTER:
        x, reduce_op, shards, group_name = node.args[:4]
        return x, reduce_op, group_name, shards
    x, reduce_op, group_name = node.args[:3]
    return x, reduce_op, group_name, 0


def sequence_first(reduce_scatter: Node) -> tuple[Node, Node, list[Node]] | None:
    """(x [B, S, H], the permute back after the wait, [the permute, the copy, the wait]) where the
    reduce-scatter's input is x permuted to [S, B, H] and copied, and its result is permuted back
    (torchtitan's plain-tensor backend); else None."""
    wait, copy = only_user(reduce_scatter), reduce_scatter.args[0]
    back = only_user(wait)
    before = copy.args[0] if is_call(copy, aten.clone.default) and len(copy.users) == 1 else None
    if not (all(is_call(n, aten.permute.default) and list(n.args[1]) == [1, 0, 2] for n in (back, before))
            and len(before.users) == 1):
        return None
    return before.args[0], back, [before, copy, wait]


def gathered(out: Node, group_name: str, shards: int, hidden: int) -> tuple[Node, list[Node]] | None:
    """The all-gather of ``out`` (through row views and a copy) over the group's ``shards`` ranks, waited on:
    (the wait, the nodes from ``out`` to it), or None."""
    views = row_views(out, hidden)
    gather = only_user(views[-1])
    if is_call(gather, aten.clone.default) and len(gather.users) == 1:  # a contiguous copy first
        views, gather = views + [gather], only_user(gather)
    if not is_call(gather, ALL_GATHER) or (gather.args[1], str(gather.args[2])) != (shards, str(group_name)):
        return None
    wait = only_user(gather)
    return (wait, views + [gather]) if is_call(wait, WAIT) else None


def is_add(node: object) -> bool:
    """``a + b`` of two tensors (no ``alpha``)."""
    return is_call(node, aten.add.Tensor) and node.kwargs.get("alpha", 1) == 1


def meta_val(node: Node):
    return node.meta.get("val")


def fp8_of(node: Node) -> Fp8Format:
    """The fp8 format of the device ``node``'s value is on (``targets.fp8_format``): what the fused op
    outputs there, so what a model's quantisation must convert to (float8_e4m3fnuz, +-240, on gfx942)."""
    val = meta_val(node)
    return fp8_format(val.device if isinstance(val, torch.Tensor) else None)


def only_user(node: Node) -> Node | None:
    users = list(node.users)
    return users[0] if len(users) == 1 else None


def users_of(node: Node, *targets) -> list[Node]:
    return [u for u in node.users if is_call(u, *targets)]


def converts_to(node: Node, dtype: torch.dtype) -> list[Node]:
    """The users of ``node`` that convert it to ``dtype``."""
    return [u for u in users_of(node, prims.convert_element_type.default) if u.args[1] == dtype]


def convert_to(node: Node, dtype: torch.dtype) -> Node | None:
    """The first user of ``node`` that converts it to ``dtype``, if any."""
    casts = converts_to(node, dtype)
    return casts[0] if casts else None


def other_arg(node: Node, known: Node) -> object:
    a, b = node.args[:2]
    return b if a is known else a


def row_views(node: Node, hidden: int) -> list[Node]:
    """``node`` and the chain of views that follows it while each is the only user and rows stay rows."""
    chain = [node]
    while True:
        view = only_user(chain[-1])
        if not (is_call(view, *VIEWS) and view.args[0] is chain[-1] and meta_val(view) is not None):
            return chain
        shape = meta_val(view).shape
        if (len(shape) < 1 or static_int(shape[-1]) != hidden
            or element_count(shape) != element_count(meta_val(node).shape)):
            return chain
        chain.append(view)


def is_scalar(node: object) -> bool:
    """A number, or a tensor node of one element."""
    if isinstance(node, (int, float)) and not isinstance(node, bool):
        return True
    return isinstance(node, Node) and isinstance(meta_val(node), torch.Tensor) and meta_val(node).numel() == 1


def is_row_vector(node: object, hidden: int) -> bool:
    """A tensor node that is one row of ``hidden`` for every token: a bias or a gain."""
    val = meta_val(node) if isinstance(node, Node) else None
    return (isinstance(val, torch.Tensor) and val.dim() >= 1 and static_int(val.shape[-1]) == hidden
            and val.numel() == hidden)


class Norm(NamedTuple):
    """A norm found by :func:`match_rmsnorm` / :func:`match_layernorm` (LayerNorm's first four)."""

    out: Node  # the norm's result (with the weight, and LayerNorm's bias)
    weight: Node
    eps: float
    nodes: list[Node]  # the norm's own nodes


class LayerNorm(NamedTuple):
    """A LayerNorm found by :func:`match_layernorm`."""

    out: Node
    weight: Node
    eps: float
    bias: object  # its bias (a node), or None
    nodes: list[Node]


class StaticFp8(NamedTuple):
    """A static fp8 quantisation found by :func:`match_static_fp8`."""

    out: Node  # the fp8 result
    scale: Node  # the one float32 scale
    nodes: list[Node]


class Branch(NamedTuple):
    """The second all-reduce of a sum of two, found by :func:`match_branch`."""

    all_reduce: Node
    nodes: list[Node]  # the views and add between it and the sum
    bias: object  # its bias, or None
    copies: int  # copies of the rows its tensor holds, summed after it (1: none)
    gate: Node | None  # a value a token ([..., 1]) its sum is multiplied by (Qwen2-MoE's shared expert gate)


def match_rmsnorm(h: Node, quantised: bool = False, dtype: torch.dtype | None = None) -> Norm | None:
    """The RMSNorm of ``h`` (:class:`Norm`) in any supported style, or None.
    ``quantised``: fp8 follows, and ``out`` may be the fp32 result (see :func:`_cast_back`). ``dtype``:
    the activations' dtype when ``h`` is an fp32 row the norm reads as it is (vLLM's native norm adds
    the residual in fp32); by default ``h``'s own, which the norm casts to fp32 first."""
    if dtype is not None and meta_val(h).dtype == torch.float32:
        casts = [h]
    else:
        dtype = meta_val(h).dtype
        # gpt-fast writes x.float() twice; the post-grad graph may keep both casts.
        casts = converts_to(h, torch.float32)
    for c in casts:
        for p in c.users:
            squares = (is_call(p, aten.pow.Tensor_Scalar) and p.args[1] == 2
                       or is_call(p, aten.mul.Tensor) and p.args[:2] == (c, c))
            if not squares:
                continue
            mean = only_user(p)
            if not is_call(mean, aten.mean.dim) or len(mean.args) < 3 or not mean.args[2]:
                continue
            if not _last_dim(mean.args[1], c):
                continue
            add_eps, rsqrt = _plus_eps_rsqrt(mean)
            if rsqrt is None:
                continue
            normed = only_user(rsqrt)
            if not is_call(normed, aten.mul.Tensor):
                continue
            other = other_arg(normed, rsqrt)
            if other not in casts:
                continue
            internal = list(dict.fromkeys([c, other, p, mean, add_eps, rsqrt, normed]))
            back = convert_to(normed, dtype)
            if back is not None and len(normed.users) == 1:  # HF / gpt-fast: cast back, then the weight
                out = only_user(back)
                if is_call(out, aten.mul.Tensor):
                    return Norm(out, other_arg(out, back), float(add_eps.args[1]), internal + [back])
            scaled = only_user(normed)  # torch rms_norm, Gemma: the weight in fp32, then cast back
            if is_call(scaled, aten.mul.Tensor):
                out, via = _cast_back(scaled, dtype, quantised)
                if out is not None:
                    return Norm(out, other_arg(scaled, normed), float(add_eps.args[1]),
                                internal + [scaled] + via)
    return None


def _cast_back(normed: Node, dtype: torch.dtype, quantised: bool) -> tuple[Node | None, list[Node]]:
    """(the norm's fp32 result ``normed`` cast back to the activations' ``dtype``, its only use; the nodes
    between). Or, when fp8 follows (``quantised``), ``normed`` itself where the graph has no cast. torch
    2.11's post-grad graph drops the ``.to(bf16).float()`` between a norm whose weight is applied in fp32
    (Gemma's, a LayerNorm) and the quantisation's division; the kernels quantise the fp32 row as that graph
    does. A contiguous copy before the cast is looked through (the norm of a permuted view: torchtitan's
    sequence-parallel rows)."""
    if len(normed.users) != 1:
        return None, []
    via = []
    copy = only_user(normed)
    if (is_call(copy, aten.clone.default) and len(copy.users) == 1
            and copy.kwargs.get("memory_format", torch.contiguous_format) == torch.contiguous_format):
        via, normed = [copy], copy
    out = convert_to(normed, dtype)
    if (out is None and quantised and not via and meta_val(normed).dtype == torch.float32
            and dtype != torch.float32):
        return normed, []
    return out, via


def _plus_eps_rsqrt(node: Node) -> tuple[Node | None, Node | None]:
    """(the add, the rsqrt) when ``node``'s only use is ``rsqrt(node + eps)`` with a constant eps."""
    add_eps = only_user(node)
    if is_call(add_eps, aten.add.Tensor, aten.add.Scalar) and isinstance(add_eps.args[1], (int, float)):
        rsqrt = only_user(add_eps)
        if is_call(rsqrt, aten.rsqrt.default):
            return add_eps, rsqrt
    return None, None


def _last_dim(dims, node: Node) -> bool:
    return list(dims) in ([-1], [meta_val(node).dim() - 1])


def match_layernorm(h: Node, quantised: bool = False) -> LayerNorm | None:
    """(out, weight, eps, bias or None, internal nodes) of a LayerNorm of ``h``, or None. Two styles:
    Inductor's decomposition of ``nn.LayerNorm`` / ``F.layer_norm`` (``var_mean`` in fp32), and the
    hand-written one of Cohere (``mean``, ``(c - mean) ** 2``, ``mean``); then the weight, an optional
    bias, and the cast back (``quantised``: see :func:`_cast_back`)."""
    for c in converts_to(h, torch.float32):
        for stats in _layernorm_statistics(c):
            add_eps, rsqrt = _plus_eps_rsqrt(stats.var)
            normed = only_user(rsqrt) if rsqrt is not None else None
            if not (is_call(normed, aten.mul.Tensor) and other_arg(normed, rsqrt) in stats.centred):
                continue
            scaled = only_user(normed)
            if not is_call(scaled, aten.mul.Tensor):
                continue
            internal = [c] + stats.nodes + [add_eps, rsqrt, normed, scaled]
            bias, last = None, scaled
            after = only_user(scaled)
            if is_add(after):
                bias, last = other_arg(after, scaled), after
                internal.append(after)
            out, via = _cast_back(last, meta_val(h).dtype, quantised)
            if out is not None:
                return LayerNorm(out, other_arg(scaled, normed), float(add_eps.args[1]), bias, internal + via)
    return None


@dataclass
class _Statistics:
    var: Node  # the variance, which ``rsqrt(var + eps)`` reads
    centred: list[Node]  # c - mean (Cohere writes it twice; the graph may keep both)
    nodes: list[Node]  # every node that computes them


def _layernorm_statistics(c: Node) -> list[_Statistics]:
    """The ways a LayerNorm computes the mean and variance of the fp32 row ``c``."""
    found = []
    for vm in users_of(c, aten.var_mean.correction):
        if not (vm.kwargs.get("correction") == 0 and vm.kwargs.get("keepdim") and len(vm.args) > 1
                and _last_dim(vm.args[1], c)):
            continue
        parts = {u.args[1]: u for u in vm.users if is_call(u, operator.getitem)}
        var, mean = parts.get(0), parts.get(1)
        subs = [u for u in users_of(c, aten.sub.Tensor) if u.args[:2] == (c, mean)]
        if var is not None and mean is not None and len(subs) == 1 and len(mean.users) == 1:
            found.append(_Statistics(var, subs, [vm, var, mean, subs[0]]))
    for mean in users_of(c, aten.mean.dim):
        if not (len(mean.args) > 2 and mean.args[2] and _last_dim(mean.args[1], c)):
            continue
        subs = [u for u in users_of(c, aten.sub.Tensor) if u.args[:2] == (c, mean)]
        if not subs or len(mean.users) != len(subs):
            continue
        for sub in subs:
            for square in sub.users:
                if not (is_call(square, aten.pow.Tensor_Scalar) and square.args[1] == 2
                        or is_call(square, aten.mul.Tensor) and square.args[:2] == (sub, sub)):
                    continue
                var = only_user(square)
                if (is_call(var, aten.mean.dim) and len(var.args) > 2 and var.args[2]
                        and _last_dim(var.args[1], square)):
                    found.append(_Statistics(var, subs, [mean] + subs + [square, var]))
    return found


def match_static_fp8(y: Node, div: Node | None = None) -> StaticFp8 | None:
    """``clamp(y.float() / scale, -448, 448).to(fp8)`` (:class:`StaticFp8`), or None; on a
    device whose fp8 is float8_e4m3fnuz (gfx942), ``clamp(..., -240, 240).to(float8_e4m3fnuz)``.
    ``div``: the division to start from, when ``y`` has other users (dynamic fp8)."""
    fmt = fp8_of(y)
    start = convert_to(y, torch.float32) if div is None else None  # y may have other users: the norm's copy
    start = start if start is not None else y
    div = div if div is not None else only_user(start)
    if not is_call(div, aten.div.Tensor) or div.args[0] is not start or not isinstance(div.args[1], Node):
        return None
    nodes, cur = [div], only_user(div)
    if is_call(cur, aten.clamp.default) and tuple(cur.args[1:3]) == (-fmt.max, fmt.max):
        nodes.append(cur)
    else:
        lo, hi = cur, only_user(cur) if isinstance(cur, Node) else None
        if not (is_call(lo, aten.clamp_min.default) and lo.args[1] == -fmt.max
                and is_call(hi, aten.clamp_max.default) and hi.args[1] == fmt.max):
            return None
        nodes += [lo, hi]
        cur = hi
    out = convert_to(cur, fmt.dtype) if len(cur.users) == 1 else None
    if out is None:
        return None
    return StaticFp8(out, div.args[1], ([start] if start is not y else []) + nodes)


def bias_of(node: Node, hidden: int) -> tuple[Node | None, object]:
    """(the add, the bias) when ``node``'s only user adds a [hidden] row to it, else (None, None)."""
    add = only_user(node)
    if is_add(add) and is_row_vector(other_arg(add, node), hidden):
        return add, other_arg(add, node)
    return None, None


def match_branch(node: object, group_name: str, reduce_op: str, hidden: int,
                 with_bias: bool) -> Branch | None:
    """The :class:`Branch` when ``node`` is another all-reduce of the same group (+ its bias, views
    between), the second term of a sum of two; else None. ``copies`` > 1: the all-reduced tensor
    holds that many copies of the rows, summed after it (Llama 4's experts: ``[E * T, H]`` viewed as
    ``[E, T, H]``, then ``.sum(0)``), which the fusion sums before the all-reduce instead."""
    nodes, bias, copies, gate = [], None, 1, None
    if with_bias:
        peeled = _operand_that(node, lambda t: is_row_vector(t, hidden)) if is_add(node) else None
        if peeled is None:
            return None
        nodes.append(node)
        bias, node = peeled
    if is_call(node, aten.mul.Tensor) and len(node.users) == 1:
        product = node
        peeled = _operand_that(product, lambda t: _is_token_gate(t, product))
        if peeled is None:
            return None
        nodes.append(node)
        gate, node = peeled
    if (is_call(node, aten.sum.dim_IntList) and list(node.args[1]) == [0] and node.args[2:] in ((), (False,))
            and not node.kwargs and len(node.users) == 1 and isinstance(meta_val(node.args[0]), torch.Tensor)
            and meta_val(node.args[0]).dim() == 3):
        copies = static_int(meta_val(node.args[0]).shape[0])
        if copies is None:
            return None
        nodes.append(node)
        node = node.args[0]
    while is_call(node, *VIEWS) and len(node.users) == 1:
        nodes.append(node)
        node = node.args[0]
    if not (is_call(node, WAIT) and len(node.users) == 1 and static_int(meta_val(node).shape[-1]) == hidden):
        return None
    reduce = node.args[0]
    if not (is_call(reduce, ALL_REDUCE) and tuple(reduce.args[1:3]) == (reduce_op, group_name)):
        return None
    if gate is not None and _reads(gate, reduce.args[0]):
        return None  # a gate made from the rank's own partial sum: not the same on every rank
    return Branch(reduce, nodes + [node], bias, copies, gate)


def _operand_that(node: Node, test) -> tuple[object, object] | None:
    """(the operand of the binary op ``node`` that passes ``test``, the other one): the second operand
    first; None when neither passes."""
    a, b = node.args[:2]
    if test(b):
        return b, a
    if test(a):
        return a, b
    return None


def _is_token_gate(gate: object, product: Node) -> bool:
    """Whether ``gate`` multiplies a sum by one value a token (or one value): a floating tensor node of
    last dimension 1, whose product keeps the sum's dtype and size (Qwen2-MoE's
    ``sigmoid(gate(x)) * shared``).

    Such a gate is the same on every rank in a tensor-parallel model: it scales an all-reduced value
    (the same on every rank) that goes into the residual stream, which every rank holds alike. So
    ``gate * all_reduce(b)`` is ``all_reduce(gate * b)``, and the fusion multiplies before the sum."""
    summed = product.args[1] if product.args[0] is gate else product.args[0]
    val = meta_val(gate) if isinstance(gate, Node) else None
    total, out = meta_val(summed) if isinstance(summed, Node) else None, meta_val(product)
    if not (isinstance(val, torch.Tensor) and val.is_floating_point() and val.dim() >= 1
            and static_int(val.shape[-1]) == 1 and isinstance(total, torch.Tensor) and total.dim() >= 1):
        return False
    rows = element_count(total.shape[:-1])
    return (out.dtype == total.dtype and element_count(out.shape) == element_count(total.shape)
            and (val.numel() == 1 or str(element_count(val.shape)) == str(rows)))


def _reads(node: Node, value: Node, limit: int = 10_000) -> bool:
    """Whether ``node`` is computed from ``value`` (a walk over at most ``limit`` of its ancestors; past it,
    assumed so)."""
    seen, todo = set(), [node]
    while todo:
        n = todo.pop()
        if n is value:
            return True
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > limit:
            return True
        todo.extend(n.all_input_nodes)
    return False


class DynamicFp8(NamedTuple):
    """A dynamic fp8 quantisation found by :func:`match_dynamic_fp8`."""

    out: Node  # the fp8 output, viewed as the rows
    scales: Node  # the scales output
    group: int  # elements a scale
    pow2: bool  # scales rounded up to powers of two (UE8M0)
    nodes: list[Node]  # the quantisation's own nodes


def match_dynamic_fp8(y: Node, hidden: int) -> DynamicFp8 | None:
    """Dynamic fp8 in ``blockend.codecs.dynamic_fp8``'s form: ``g = y.float()`` (viewed as groups or
    not), ``s = clamp(amax(|g|, -1) / 448, min)``, optionally rounded up to a power of two as DeepGEMM's
    UE8M0 scales are made (``2 ** ceil(log2(|s|))``, ``pow`` or ``exp2``), ``out = clamp(g / s, -448,
    448).to(fp8)`` (viewed back), ``scales = s.squeeze(-1)``; or None. 240 and float8_e4m3fnuz where that
    is the device's fp8 (gfx942). ``y`` may have users besides the quantisation (the norm's copy)."""
    fmt = fp8_of(y)
    if meta_val(y).dtype == torch.float32:  # the norm's fp32 result, no cast between (_cast_back)
        start, nodes = y, []
    else:
        start = convert_to(y, torch.float32)
        if start is None:
            return None
        nodes = [start]
    grouped, group = start, hidden
    view = only_user(start)
    if is_call(view, *VIEWS) and len(meta_val(view).shape) == len(meta_val(start).shape) + 1:
        group = static_int(meta_val(view).shape[-1])
        nodes.append(view)
        grouped = view
    absolute = users_of(grouped, aten.abs.default)
    amax = only_user(absolute[0]) if len(absolute) == 1 else None
    if not (is_call(amax, aten.amax.default) and len(amax.args) > 2 and amax.args[2]
            and _last_dim(amax.args[1], grouped)):
        return None
    to_unit = only_user(amax)
    if not (is_call(to_unit, aten.div.Tensor) and to_unit.args[1] == fmt.max):
        return None
    floor = only_user(to_unit)
    if (not (is_call(floor, aten.clamp_min.default, aten.clamp.default)
             and floor.args[1] == fmt.min_dynamic_scale)):
        return None
    nodes += [absolute[0], amax, to_unit, floor]
    floor, pow2 = _pow2_scales(floor, nodes)
    divs = [u for u in users_of(floor, aten.div.Tensor) if u.args[:2] == (grouped, floor)]
    outs = [u for u in floor.users if u not in divs]
    if len(divs) != 1 or len(outs) != 1 or not is_call(outs[0], *VIEWS):
        return None
    quant = match_static_fp8(grouped, divs[0])
    if quant is None:
        return None
    out, _, quant_nodes = quant
    nodes += quant_nodes
    back = only_user(out)
    if grouped is not start:  # the groups viewed back as rows
        if not (is_call(back, *VIEWS) and static_int(meta_val(back).shape[-1]) == hidden):
            return None
        nodes.append(out)
        out = back
    return DynamicFp8(out, outs[0], group, pow2, nodes)


def _pow2_scales(scales: Node, nodes: list[Node]) -> tuple[Node, bool]:
    """``(2 ** ceil(log2(|scales|)), True)`` where the scales' only reader rounds them so (its nodes added
    to ``nodes``), else ``(scales, False)``."""
    chain, cur = [], only_user(scales)
    if is_call(cur, aten.abs.default):
        chain.append(cur)
        cur = only_user(cur)
    if not is_call(cur, aten.log2.default):
        return scales, False
    ceil = only_user(cur)
    power = only_user(ceil) if is_call(ceil, aten.ceil.default) else None
    if not (is_call(power, aten.exp2.default) or (is_call(power, aten.pow.Scalar) and power.args[0] == 2.0)):
        return scales, False
    nodes += chain + [cur, ceil, power]
    return power, True


class Fp4(NamedTuple):
    """An fp4 quantisation found by :func:`match_fp4`."""

    out: Node  # the codes [T, H / 2]
    scales: Node | None  # the scales, in the fused op's layout (None: not read)
    fp4: int  # blockend.bits.FP4_NVFP4 or FP4_MXFP4
    global_scale: Node | None  # NVFP4's
    scale_layout: int  # MXFP4's scales: blockend.bits.SCALES_ROWS or SCALES_SHUFFLED
    nodes: list[Node]  # the quantisation's own nodes (the op; its outputs are out and scales)


def match_fp4(y: Node) -> Fp4 | None:
    """fp4 as a model writes it in PyTorch: ``codes, scales = tpfuse.quantize_fp4(y, ...)`` (the op
    ``tpfuse::quantize_fp4``, whose codes and scales are the fused op's), its outputs read by index; or
    None. ``y`` may have users besides the quantisation (the norm's copy)."""
    quants = [u for u in y.users if is_call(u, torch.ops.tpfuse.quantize_fp4.default) and u.args[0] is y]
    if len(quants) != 1:
        return None
    quant = quants[0]
    items = {u.args[1]: u for u in quant.users if u.target is operator.getitem}
    if len(items) != len(quant.users) or 0 not in items:
        return None
    # (y, fp4, global_scale, scale_layout), defaults filled
    args = quant.args + (None, 0)[len(quant.args) - 2:]
    kw = quant.kwargs
    return Fp4(items[0], items.get(1), args[1], kw.get("global_scale", args[2]),
               kw.get("scale_layout", args[3]),
               [quant])


def residual_problem(residual: object, add: Node, x: torch.Tensor, hidden: int) -> Reason | None:
    """Why the other operand of the add is not a residual the op can take (None when it is)."""
    if not isinstance(residual, Node) or not isinstance(meta_val(residual), torch.Tensor):
        return Reason("operands", "the value added to the all-reduce result is not a tensor")
    r = meta_val(residual)
    if r.dtype != x.dtype:
        return Reason("operands", f"the residual's dtype {r.dtype} differs from the all-reduce's {x.dtype}")
    if (r.dim() < 1 or static_int(r.shape[-1]) != hidden
        or element_count(r.shape) != element_count(meta_val(add).shape)):
        return Reason("operands", f"the add broadcasts a {tuple(r.shape)} tensor (a bias?) over the "
                                  f"{tuple(meta_val(add).shape)} sum: not a residual of the same size")
    return None



@dataclass(frozen=True)
class Finalize:
    """A MoE block's finalize before an all-reduce, which the fused op does on each rank instead:
    ``experts`` [..., K, H] (or None: x itself), weighted by ``topk_weights`` (numel T * K, or None)
    and summed over K, plus ``shared`` (x's shape, or None). ``nodes``: what the rewrite leaves unread."""

    x: Node  # the summed part: the experts' outputs [.., K, H], or x's first term
    experts: int
    topk_weights: Node | None
    shared: Node | None
    nodes: tuple[Node, ...]


def match_finalize(x: Node, hidden: int) -> Finalize | None:
    """The MoE finalize that makes the all-reduced ``x``, where each node of it is read only by the next:
    ``sum(experts * w, dim=1)`` over a ``[T, K, H]`` view (Hugging Face's batched / grouped experts, the
    torch form of vLLM's ``moe_sum``; w may be ``[T * K, 1]`` against ``[T * K, H]`` outputs), cast to
    x's dtype or not, and/or ``routed + shared`` (vLLM's shared experts); else None. Only x's dtype for
    the outputs and the shared part, float32 or x's dtype for the weights."""
    dtype = meta_val(x).dtype
    shared, nodes, summed = None, [], x
    if is_add(x) and len(x.users) == 1 and not x.kwargs and len(x.args) == 2:
        a, b = x.args
        if all(isinstance(t, Node) and isinstance(meta_val(t), torch.Tensor) and meta_val(t).dtype == dtype
               and meta_val(t).shape == meta_val(x).shape for t in (a, b)):
            # The routed part is the side a finalize's sum makes, if one does.
            shared, summed = (a, b) if _experts_sum(b, dtype) is not None else (b, a)
            nodes.append(x)
    found = _experts_sum(summed, dtype) if len(summed.users) == 1 else None
    if found is None:
        return None if shared is None else Finalize(summed, 0, None, shared, tuple(nodes))
    experts, k, weights, sum_nodes = found
    if static_int(meta_val(experts).shape[-1]) != hidden:
        return None
    return Finalize(experts, k, weights, shared, tuple(nodes + sum_nodes))


def _experts_sum(node: Node, dtype: torch.dtype):
    """(experts, K, weights or None, nodes) when ``node`` is ``sum(view([T, K, H]) of (outputs [* w]), 1)``,
    cast to ``dtype`` or not; else None."""
    nodes = []
    if is_call(node, prims.convert_element_type.default) and node.args[1] == dtype and len(node.users) <= 1:
        nodes.append(node)
        node = node.args[0]
    if not (is_call(node, aten.sum.dim_IntList) and list(node.args[1]) in ([1], [-2])
            and node.args[2:] in ((), (False,)) and not node.kwargs):
        return None
    val = meta_val(node.args[0])
    if not (isinstance(val, torch.Tensor) and val.dim() == 3 and static_int(val.shape[1]) is not None
            and (meta_val(node).dtype == dtype or nodes)):
        return None
    k = static_int(val.shape[1])
    nodes.append(node)
    inner = node.args[0]
    while is_call(inner, *VIEWS) and len(inner.users) == 1:
        nodes.append(inner)
        inner = inner.args[0]
    weights = None
    if is_call(inner, aten.mul.Tensor) and len(inner.users) == 1:
        a, b = inner.args[:2]
        elements, hidden = element_count(val.shape), static_int(val.shape[-1])
        for outputs, w in ((a, b), (b, a)):  # a weight a row of T * K: [T * K, 1] or [T, K, 1]
            wv, ov = meta_val(w), meta_val(outputs)
            if (isinstance(wv, torch.Tensor) and isinstance(ov, torch.Tensor) and ov.dtype == dtype
                    and wv.dtype in (dtype, torch.float32) and wv.dim() >= 1 and wv.shape[-1] == 1
                    and element_count(wv.shape) * hidden == elements and element_count(ov.shape) == elements):
                nodes.append(inner)
                inner, weights = outputs, w
                break
    if meta_val(inner).dtype != dtype:
        return None
    return inner, k, weights, nodes


def read_besides(out: Node, nodes: list[Node]) -> bool:
    """Whether the norm's result ``out`` has readers besides its quantisation's ``nodes``: a normed row
    that also feeds something else, which the op writes as its normed copy (``stages.NormedCopy``)."""
    return any(u not in nodes for u in out.users)


def _stage_matchers() -> dict:
    return {
        stages.Finalize: match_finalize,
        stages.Bias: bias_of,
        stages.PostNorm: match_rmsnorm,
        stages.RmsNorm: match_rmsnorm,
        stages.LayerNorm: match_layernorm,
        # No norm after the sum: the plain all-reduce (patterns.plain_all_reduce_problem).
        stages.NoNorm: None,
        # No graph matcher yet: the backward graphs' norm backward is not matched (docs/training.md).
        stages.RmsNormBackward: None,
        output_formats.Unquantised: None,  # the norm's output is y
        output_formats.StaticFp8: match_static_fp8,
        output_formats.DynamicFp8: match_dynamic_fp8,
        output_formats.NvFp4: match_fp4,
        output_formats.MxFp4: match_fp4,
        stages.NormedCopy: read_besides,
    }


#: Each block-end stage's graph matcher, by the stage's class (``blockend.stages``, ``blockend.outputs``): the
#: compiler sits above the block end, so the table is here, one entry a stage; None where the stage is the
#: absence of a step in the graph. tests/compiler/test_patterns_fast.py checks that every stage has one.
STAGE_MATCHERS = _stage_matchers()
