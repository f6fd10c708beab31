"""vLLM's block ends in its post-grad graphs: found and handed to the same replacement as every pattern.

vLLM (0.32 and newer, ``VLLM_COMPILE`` with Inductor) keeps its collectives and norms as opaque ops
until after the custom post-grad passes; what the fusion pass sees at a block end is::

    s = vllm.all_reduce(x, "tp:0")                                    # x: [tokens, H]; "tp:0" names
    out, h = vllm_ir.fused_add_rms_norm(s, residual, weight, eps)     # vLLM's GroupCoordinator
    out = vllm_ir.rms_norm(s, weight, eps)                            # no residual: h is s itself

or, without vLLM's IR ops (``ir_enable_torch_wrap=False``, vLLM before its IR), the same norm traced::

    h32 = s.float() + residual.float();  out = (rmsnorm(h32)).to(bf16) * weight;  h = h32.to(bf16)

and with static fp8 output (one fp32 scale; vLLM's CUDA ops, inside ``auto_functionalized``)::

    q, h = _C.fused_add_rms_norm_static_fp8_quant(s, residual, weight, scale, eps)   # vLLM fused them
    q = _C.rms_norm_static_fp8_quant(s, weight, scale, eps)
    q = _C.static_scaled_fp8_quant(out, scale)                                        # after either norm

and, after either norm, dynamic fp8 with a scale a token (``_C.dynamic_per_token_scaled_fp8_quant``) or a
group (``_C.per_token_group_fp8_quant``, DeepSeek-V3's block fp8; ``_C.per_token_group_fp8_quant_packed``,
its UE8M0 scales packed for DeepGEMM on Blackwell), or NVFP4 (``_C.scaled_fp4_quant``,
Blackwell), whose scales the op writes where vLLM's were

(the kernels divide by the scale where vLLM's multiply by its reciprocal: one rounding apart).

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

from tpfuse.blockend.bits import FP4_GROUP, FP4_NVFP4, SCALES_COLUMNS, SCALES_PACKED_UE8M0, SCALES_ROWS
from tpfuse.compiler.matchers import (
    aten,
    converts_to,
    fp8_of,
    is_add,
    is_call,
    is_row_vector,
    is_scalar,
    match_finalize,
    match_rmsnorm,
    meta_val,
    only_user,
    other_arg,
    prims,
    residual_problem,
)
from tpfuse.compiler.patterns import PATTERNS_BY_NAME, FusionPattern, Match, site_problem
from tpfuse.compiler.reasons import DYNAMIC_HIDDEN, Reason
from tpfuse.compiler.sizes import describe_shape, static_int

ALL_REDUCE = "vllm::all_reduce"
ADD_NORM = "vllm_ir::fused_add_rms_norm"
NORM = "vllm_ir::rms_norm"
# vLLM's CUDA ops with static fp8 output (in the graph inside auto_functionalized; they write ``result``):
# the norm and quantisation vLLM fused itself (its norm + quant pass runs before ours), or the
# quantisation of a norm's output (QuantFP8 as a custom op).
ADD_NORM_QUANT = "_C::fused_add_rms_norm_static_fp8_quant"  # result, input, residual, weight, scale, epsilon
NORM_QUANT = "_C::rms_norm_static_fp8_quant"  # result, input, weight, scale, epsilon
QUANT = "_C::static_scaled_fp8_quant"  # result, input, scale, group_shape
# vLLM's dynamic fp8 with a scale a group of elements (DeepSeek-V3's block fp8): input, output_q, output_s,
# group_size, eps, fp8_min, fp8_max, scale_ue8m0 (and layout hints); output_s's strides give the layout.
GROUP_QUANT = "_C::per_token_group_fp8_quant"
# The same with UE8M0 scales packed four to an int32, column-major with the tokens padded to 4 (DeepGEMM's
# layout on Blackwell): input, output_q, output_s_packed, group_size, eps, fp8_min, fp8_max.
PACKED_GROUP_QUANT = "_C::per_token_group_fp8_quant_packed"
# vLLM's dynamic fp8 with a scale a token: result, input, scale ([T, 1] float32), scale_ub (an upper bound
# on each token's largest value, or None).
TOKEN_QUANT = "_C::dynamic_per_token_scaled_fp8_quant"
# vLLM's NVFP4 quantisation (Blackwell): output (uint8 codes), input, output_scale (e4m3 scales, four to an
# int32, in the 128 x 4 tiles of the FP4 GEMMs), input_scale (the global scale), is_sf_swizzled_layout.
FP4_QUANT = "_C::scaled_fp4_quant"


def op_name(node: Node) -> str | None:
    """``namespace::name`` of the operator a node calls (None for anything else)."""
    target = node.target if node.op == "call_function" else None
    return target.name() if isinstance(target, torch._ops.OpOverload) else None


def functionalized(node: Node) -> str | None:
    """``namespace::name`` of the mutating operator an ``auto_functionalized`` node runs (else None)."""
    if node.op != "call_function" or node.target is not torch.ops.higher_order.auto_functionalized:
        return None
    return node.args[0].name() if isinstance(node.args[0], torch._ops.OpOverload) else None


def all_reduces(graph: Graph) -> list[Node]:
    """The graph's ``vllm.all_reduce`` nodes, in order."""
    return [n for n in graph.nodes if op_name(n) == ALL_REDUCE]


#: vLLM's sequence-parallelism pass makes an all-reduce -> norm a reduce-scatter -> norm -> all-gather of
#: its own ops (``vllm.reduce_scatter(x, dim, W, group)``): reported, not fused yet
#: (docs/sequence-parallel.md).
REDUCE_SCATTER = "vllm::reduce_scatter"
SEQUENCE_PARALLEL = Reason(
    "vllm-form", "vLLM's sequence-parallelism pass made this block end a reduce-scatter of vLLM's "
                 "own; tpfuse fuses sequence parallel's block end on torch's collectives, not vLLM's yet "
                 "(leave the pass off to fuse the all-reduce)")


def reduce_scatters(graph: Graph) -> list[Node]:
    """The graph's ``vllm.reduce_scatter`` nodes (vLLM's sequence-parallelism pass), in order."""
    return [n for n in graph.nodes if op_name(n) == REDUCE_SCATTER]


def group_names(graph: Graph) -> set[str]:
    """vLLM's names of the groups the graph's all-reduces run on (``"tp:0"``)."""
    return {str(n.args[1]) for n in all_reduces(graph)}


def describe(site: Node) -> dict:
    """A vLLM site's SiteReport fields: shape, dtype, vLLM's group name, which collective."""
    val = meta_val(site)
    shape = describe_shape(val.shape) if isinstance(val, torch.Tensor) else ()
    scattered = op_name(site) == REDUCE_SCATTER
    return dict(shape=shape, dtype=getattr(val, "dtype", None),
                group_name=str(site.args[3 if scattered else 1]),
                collective="reduce-scatter" if scattered else "all-reduce")


def _arg(node: Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _output(graph: Graph, node: Node, index: int) -> Node:
    """The one ``node[index]`` (a tuple-valued op's output)."""
    found = [u for u in node.users if u.target is operator.getitem and u.args[1] == index]
    return _the_one(graph, node, found, operator.getitem, (node, index), meta_val(node)[index])


def _cast(graph: Graph, node: Node, dtype: torch.dtype) -> Node:
    """The one ``node.to(dtype)``."""
    return _the_one(graph, node, converts_to(node, dtype), prims.convert_element_type.default, (node, dtype),
                    meta_val(node).to(dtype))


def _drop_unread_outputs(node: Node) -> None:
    """Remove the ``getitem`` nodes of ``node`` that nothing reads (the op's own ``None`` result)."""
    for item in [u for u in node.users if u.target is operator.getitem and not u.users]:
        node.graph.erase_node(item)


def _the_one(graph: Graph, node: Node, found: list[Node], target, args: tuple, val) -> Node:
    """``found[0]`` with the other nodes of ``found`` (equal to it) merged into it; when ``found`` is
    empty, ``target(*args)`` made after ``node``, its value ``val``."""
    for extra in found[1:]:
        extra.replace_all_uses_with(found[0])
        graph.erase_node(extra)
    if found:
        return found[0]
    with graph.inserting_after(node):
        made = graph.call_function(target, args)
    made.meta["val"] = val
    return made


def find_site(all_reduce: Node, group_name: str) -> tuple[Match | None, Reason | None]:
    """(the site as a :class:`Match` in the c10d group ``group_name``, None) or (None, why no site starts
    here); the pattern's ``extra_check`` then says whether it may fuse (:func:`pattern_of`). A norm's
    outputs that nothing reads get a node (the match names both); a site that does not fuse leaves it
    to dead-code removal."""
    val = meta_val(all_reduce)
    if not isinstance(val, torch.Tensor) or val.dim() < 1 or static_int(val.shape[-1]) is None:
        return None, DYNAMIC_HIDDEN
    hidden = static_int(val.shape[-1])
    problem = site_problem("sum", hidden, val.dtype)
    if problem is not None:  # said first: an fp32 model's norm has no casts, so no norm is found either
        return None, problem
    users = list(all_reduce.users)
    # vLLM passes the new sum first and the residual second; a sum that is some later add's residual
    # (the embedding's, read by the first norm and the next layer's add) is a site of the norm.
    norms = [u for u in users if op_name(u) == NORM and u.args[0] is all_reduce]
    add_norms = [u for u in users if op_name(u) == ADD_NORM and all_reduce in u.args[:(1 if norms else 2)]]
    if add_norms or norms:
        match, reason = _ir_site(all_reduce, group_name, hidden, add_norms[0] if add_norms else norms[0])
        match = _with_quant(match) if match is not None else None
    elif quantised := [u for u in users if functionalized(u) in (NORM_QUANT, ADD_NORM_QUANT)
                       and u.kwargs["input"] is all_reduce]:
        match, reason = _quantised_site(all_reduce, group_name, hidden, quantised[0])
    elif (scaled := _scaled(all_reduce, hidden)) is not None:
        match, reason = _scaled_site(all_reduce, group_name, hidden, *scaled)
    else:
        match, reason = _native_site(all_reduce, group_name, hidden), None
    if match is not None:
        if match.x_scale is None:  # (a number times the sum is folded into x, which keeps its form)
            match.finalize = match_finalize(match.x, hidden)  # routed + shared experts: added in the op
        return match, None
    if reason is not None:
        return None, reason
    targets = ", ".join(op_name(u) or str(getattr(u.target, "__name__", u.target)) for u in users)
    return None, Reason("no-pattern", f"no vLLM RMSNorm follows the all-reduce; its result goes to "
                                      f"{targets or 'nothing'}")


def _ir_site(all_reduce: Node, group_name: str, hidden: int,
             norm: Node) -> tuple[Match | None, Reason | None]:
    """The site of vLLM's IR norm ``norm`` (``fused_add_rms_norm`` or ``rms_norm``) of the sum."""
    x, val = all_reduce.args[0], meta_val(all_reduce)
    if op_name(norm) == ADD_NORM:
        if len(all_reduce.users) != 1:
            return None, Reason("outside-users", "the all-reduce's result has users besides vLLM's "
                                                 "fused_add_rms_norm (the fused op gives the sum only after "
                                                 "the residual add)")
        residual = norm.args[1] if norm.args[0] is all_reduce else norm.args[0]
        weight, eps, variance_size = (_arg(norm, 2, "weight"), _arg(norm, 3, "epsilon"),
                                      _arg(norm, 4, "variance_size"))
    else:
        residual = None
        weight, eps, variance_size = (_arg(norm, 1, "weight"), _arg(norm, 2, "epsilon"),
                                      _arg(norm, 3, "variance_size"))
    if weight is None:
        return None, Reason("vllm-form", "vLLM's norm has no weight")
    if variance_size is not None:
        return None, Reason("vllm-form",
                            "vLLM's norm takes its variance over part of the row (variance_size)")
    graph = all_reduce.graph
    after = next(iter(norm.users)) if residual is None and len(norm.users) == 1 else None
    if (after is not None and op_name(after) == ADD_NORM and after.args[0] is norm
            and len(all_reduce.users) == 1):
        # Gemma 2/3: the norm of the sum (its post-norm) is what the next add takes: one site, the
        # post-norm's gain the op's sum_weight (vLLM rounds the post-norm's output first, the kernels not)
        gain, norm_eps = _arg(after, 2, "weight"), _arg(after, 3, "epsilon")
        if gain is not None and _arg(after, 4, "variance_size") is None:
            match = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum",
                          h=_output(graph, after, 1), out=_output(graph, after, 0), weight=gain,
                          eps=float(norm_eps), hidden=hidden, residual=after.args[1],
                          internal=[all_reduce, norm, after], sum_weight=weight)
            match.problem = residual_problem(match.residual, all_reduce, val, hidden) or (
                Reason("operands", f"the post-norm's eps {float(eps)} differs from the norm's "
                                   f"{float(norm_eps)}")
                if float(eps) != float(norm_eps) else None)
            return match, None
    if residual is None:  # h is the sum itself; its other users read the op's h
        match = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum", h=all_reduce,
                      out=norm, weight=weight, eps=float(eps), hidden=hidden)
    else:
        match = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum",
                      h=_output(graph, norm, 1), out=_output(graph, norm, 0), weight=weight, eps=float(eps),
                      hidden=hidden, residual=residual, internal=[all_reduce, norm])
        match.problem = residual_problem(residual, all_reduce, val, hidden)
    return match, None



def _quantised_site(all_reduce: Node, group_name: str, hidden: int,
                    fused: Node) -> tuple[Match | None, Reason | None]:
    """The site of vLLM's own norm + static fp8 op ``fused`` (auto_functionalized) of the sum."""
    x, kw = all_reduce.args[0], fused.kwargs
    graph = all_reduce.graph
    _drop_unread_outputs(fused)
    if functionalized(fused) == ADD_NORM_QUANT:
        if len(all_reduce.users) != 1:
            return None, Reason("outside-users", "the all-reduce's result has users besides vLLM's "
                                                 "fused_add_rms_norm_static_fp8_quant (the fused op gives "
                                                 "the sum only after the residual add)")
        return Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum",
                     h=_output(graph, fused, 2), out=_output(graph, fused, 1), weight=kw["weight"],
                     eps=float(kw["epsilon"]), hidden=hidden, residual=kw["residual"],
                     quant_scale=kw["scale"], internal=[all_reduce, fused]), None
    return Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum", h=all_reduce,
                 out=_output(graph, fused, 1), weight=kw["weight"], eps=float(kw["epsilon"]), hidden=hidden,
                 quant_scale=kw["scale"], internal=[fused]), None


def _with_quant(match: Match) -> Match:
    """``match`` continued into the quantisation of its output, where one of vLLM's custom quant ops is
    the output's only user: static fp8 (one scale for the tensor), or one that writes scales
    (:data:`_SCALED_QUANTS`); the quant op's outputs become the match's."""
    quant = next(iter(match.out.users)) if len(match.out.users) == 1 else None
    kind = functionalized(quant) if quant is not None else None
    if kind not in (QUANT, *_SCALED_QUANTS) or quant.kwargs["input"] is not match.out:
        return match
    if kind == QUANT:
        if quant.kwargs.get("group_shape") is not None:
            return match
        match.quant_scale = quant.kwargs["scale"]
    else:
        _SCALED_QUANTS[kind](match, quant)  # reads the norm's output (its fp8 format) before it is replaced
    _drop_unread_outputs(quant)
    match.internal = match.internal + [match.out, quant]
    graph = match.all_reduce.graph
    match.out = _output(graph, quant, 1)
    if kind != QUANT:
        match.scales = _output(graph, quant, 2)
    return match


def _with_group_quant(match: Match, quant: Node) -> None:
    """On ``match``, the quantisation of vLLM's ``per_token_group_fp8_quant`` (or ``..._packed``) of its
    output: dynamic fp8 with a scale a ``group_size`` elements (rounded up to powers of two with
    ``scale_ue8m0``, always in the packed op), the scales where vLLM's ``output_s`` has them (row-major, or
    column-major with the tokens padded to 4; the packed op's ``output_s_packed`` as UE8M0 bytes four to an
    int32, group ``4j + k`` in byte ``k`` of word ``j``, in the same column-major layout: the op's
    ``scale_layout``). vLLM floors each group's largest value at ``eps`` (1e-10), the op each scale at
    ``1 / (448 * 512)``: they differ only for a group whose largest value is below 1 / 512, where both scales
    stand for the values (``q * scale``). A clamp other than the device's fp8 range (vLLM's 224 on ROCm's
    fnuz) stays unfused."""
    kw, fmt, hidden = quant.kwargs, fp8_of(match.out), match.hidden
    packed = functionalized(quant) == PACKED_GROUP_QUANT
    group = int(kw["group_size"])
    if not (group == hidden or (group >= 8 and group & (group - 1) == 0 and hidden % group == 0)):
        match.problem = Reason("vllm-form", f"vLLM's fp8 groups of {group} are not the hidden size {hidden} "
                                            "or a power of two dividing it")
    # (some vLLM builds name the packed op's range min_8bit / max_8bit)
    low, high = kw.get("fp8_min", kw.get("min_8bit")), kw.get("fp8_max", kw.get("max_8bit"))
    if float(high) != fmt.max or float(low) != -fmt.max:
        match.problem = match.problem or Reason("vllm-form", f"vLLM quantises to +-{high}, not the fp8 "
                                                             f"range of the op on this device (+-{fmt.max})")
    scales_val = meta_val(kw["output_s_packed" if packed else "output_s"])
    layout = _scale_layout(scales_val, hidden // group if group and hidden % group == 0 else 0, packed)
    if layout is None:
        match.problem = match.problem or Reason(
            "vllm-form", f"vLLM's fp8 scales {tuple(scales_val.shape)} {scales_val.dtype} with strides "
                         f"{tuple(scales_val.stride())} are not the op's "
                         + ("packed column-major int32 (tokens padded to 4)" if packed else
                            "row-major or column-major layout (tokens padded to 4)"))
    match.scale_group, match.ue8m0 = group, packed or bool(kw["scale_ue8m0"])
    match.scale_layout = layout or SCALES_ROWS


def _with_token_quant(match: Match, quant: Node) -> None:
    """On ``match``, the quantisation of vLLM's ``dynamic_per_token_scaled_fp8_quant`` of its output: a scale
    a token, ``max(amax / 448, 1 / (448 * 512))`` as the op's (``scale_group`` = the hidden size), vLLM's
    ``[T, 1]`` scales the op's. vLLM multiplies by the scale's reciprocal, the kernels divide: one rounding
    apart. An upper bound on the scales (``scale_ub``) or another fp8 range (vLLM's 224 on ROCm's fnuz) stays
    vLLM's."""
    kw, fmt = quant.kwargs, fp8_of(match.out)
    if kw.get("scale_ub") is not None:
        match.problem = Reason("vllm-form",
                               "vLLM bounds the per-token fp8 scales (scale_ub); the op does not")
    elif fmt.max != 448.0:
        match.problem = Reason("vllm-form", f"vLLM's per-token fp8 on this device quantises to +-224, "
                                            f"the op to +-{fmt.max}")
    match.scale_group = match.hidden


def _with_fp4_quant(match: Match, quant: Node) -> None:
    """On ``match``, the quantisation of vLLM's ``scaled_fp4_quant`` of its output: NVFP4 codes and e4m3
    scales a 16 elements in the swizzled 128 x 4 tiles (the op's ``fp4=FP4_NVFP4`` with vLLM's ``input_scale``
    as ``global_scale``); the op's scales replace vLLM's ``output_scale`` as the same bytes, four to an int32
    as vLLM allocates them. vLLM multiplies each group by ``1 / (s / g)``, the kernels by ``g / s``: one
    rounding apart. Linear (unswizzled) scales or scales of another size stay vLLM's."""
    kw, hidden, group = quant.kwargs, match.hidden, FP4_GROUP[FP4_NVFP4]
    scales_val, global_val = meta_val(kw["output_scale"]), meta_val(kw["input_scale"])
    columns = -(-(hidden // group) // 4) * 4  # the op's scale bytes a row: the groups rounded up to 4
    if hidden % group:
        match.problem = Reason("vllm-form", f"NVFP4 scales {group} elements each: the hidden size {hidden} "
                                            "is not a multiple")
    elif not kw.get("is_sf_swizzled_layout", True):
        match.problem = Reason("vllm-form", "vLLM's NVFP4 scales are linear here; the op writes the swizzled "
                                            "128 x 4 tiles of the FP4 GEMMs")
    elif scales_val.dim() != 2 or scales_val.stride()[-1] != 1 or \
            static_int(scales_val.shape[1]) != columns // scales_val.element_size():
        match.problem = Reason("vllm-form", f"vLLM's NVFP4 scales {tuple(scales_val.shape)} "
                                            f"{scales_val.dtype} are not {columns} bytes a row, contiguous")
    elif global_val is None or global_val.dtype != torch.float32 or global_val.numel() != 1:
        match.problem = Reason("vllm-form",
                               "vLLM's NVFP4 global scale is not a float32 tensor of one element")
    match.fp4, match.global_scale = FP4_NVFP4, kw["input_scale"]


#: vLLM's quant ops that write scales, by name: each sets the op's quantisation on the match (and any
#: problem); the op's y and scales take the places of the quant op's outputs 1 and 2.
_SCALED_QUANTS = {GROUP_QUANT: _with_group_quant, PACKED_GROUP_QUANT: _with_group_quant,
                  TOKEN_QUANT: _with_token_quant, FP4_QUANT: _with_fp4_quant}


def _scale_layout(scales: torch.Tensor, groups: int, packed: bool = False) -> int | None:
    """The op's ``scale_layout`` of vLLM's ``[T, groups]`` scales (by their strides; ``packed``: int32
    ``[T, ceil(groups / 4)]``, column-major), or None."""
    columns_wanted = (groups + 3) // 4 if packed else groups
    if scales.dim() != 2 or groups == 0 or static_int(scales.shape[1]) != columns_wanted or \
            (scales.dtype == torch.int32) != packed:
        return None
    rows, columns = scales.stride()
    if not packed and columns == 1 and (groups == 1 or static_int(rows) == groups):
        return SCALES_ROWS
    if rows == 1:  # column-major: a column is the tokens, padded to 4 as the op pads them
        padded = (scales.shape[0] + 3) // 4 * 4
        if columns_wanted == 1 or str(columns) == str(padded) or static_int(columns) == static_int(padded):
            return SCALES_PACKED_UE8M0 if packed else SCALES_COLUMNS
    return None


def _scaled(all_reduce: Node, hidden: int) -> tuple[Node, object] | None:
    """(the product, the factor) where the sum's only use is ``sum * factor``: a number, or a one-element
    or ``[H]`` tensor (Gemma's ``normalizer`` buffer, Granite's ``embedding_multiplier`` and
    ``residual_multiplier``), else None."""
    mul = only_user(all_reduce)
    if not is_call(mul, aten.mul.Tensor) or all_reduce not in mul.args[:2]:
        return None
    factor = other_arg(mul, all_reduce)
    if factor is all_reduce or not (is_scalar(factor) or is_row_vector(factor, hidden)):
        return None
    return mul, factor


def _factor_problem(factor: object, product: Node, all_reduce: Node) -> Reason | None:
    """Why the op may not take ``factor`` as each rank's ``x_scale`` (None: it may). Scaling every rank's
    part scales the sum only where the factor is the same on every rank: a number, or a tensor the graph
    takes as an input (a model's buffer or parameter: replicated), seen through views; a tensor computed
    in the graph may differ between ranks. The product must keep the sum's dtype (vLLM's next norm reads
    it)."""
    if meta_val(product).dtype != meta_val(all_reduce).dtype:
        return Reason("operands", f"the sum times a {meta_val(factor).dtype} tensor is "
                                  f"{meta_val(product).dtype}, not the sum's {meta_val(all_reduce).dtype}")
    node = factor
    while isinstance(node, Node) and node.op == "call_function" and node.target in _VIEWS_OF_INPUTS:
        node = node.args[0]
    if isinstance(node, Node) and node.op not in ("placeholder", "get_attr"):
        return Reason("operands", "the sum is multiplied by a tensor computed in the graph, which may differ "
                                  "between ranks (tpfuse scales each rank's part)")
    if isinstance(node, Node) and not meta_val(node).is_floating_point():
        return Reason("operands", "the sum is multiplied by an integer tensor")
    return None


# Views and casts of a graph input that keep it the same on every rank.
_VIEWS_OF_INPUTS = (aten.view.default, aten.reshape.default, aten.expand.default, aten.unsqueeze.default,
                    aten.squeeze.dim, aten.squeeze.default, prims.convert_element_type.default)


def _scaled_site(all_reduce: Node, group_name: str, hidden: int, product: Node,
                 factor: object) -> tuple[Match | None, Reason | None]:
    """The site of ``sum * factor`` (:func:`_scaled`) followed by vLLM's norm, the factor the op's
    ``x_scale`` (each rank's part is scaled before the sum):

    - ``rms_norm(product)``: Gemma's and Granite's embedding into the first norm (the product stays the
      residual: its other readers read the op's h);
    - ``fused_add_rms_norm(product, residual)``;
    - ``rms_norm(product + residual)`` (aten's add): Granite's ``residual + out * residual_multiplier``
      (the new residual, the add, read by the next layer's add).

    vLLM rounds the sum, then the product, then the add to the activations' dtype; the op rounds each rank's
    scaled part, then once after the residual (within rounding of vLLM's)."""
    x, val = all_reduce.args[0], meta_val(all_reduce)
    graph = all_reduce.graph
    problem = _factor_problem(factor, product, all_reduce)
    norms = [u for u in product.users if op_name(u) == NORM and u.args[0] is product]
    add_norms = [u for u in product.users
                 if op_name(u) == ADD_NORM and product in u.args[:(1 if norms else 2)]]
    adds = [u for u in product.users if is_add(u)] if not (norms or add_norms) else []
    match = None
    if norms:
        norm = norms[0]
        weight, eps, variance_size = (_arg(norm, 1, "weight"), _arg(norm, 2, "epsilon"),
                                      _arg(norm, 3, "variance_size"))
        match = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum", h=product, out=norm,
                      weight=weight, eps=float(eps), hidden=hidden, internal=[all_reduce])
    elif add_norms:
        norm = add_norms[0]
        if len(product.users) != 1:
            return None, Reason("outside-users", "the scaled sum has users besides vLLM's "
                                                 "fused_add_rms_norm (the fused op gives the sum only after "
                                                 "the residual add)")
        residual = norm.args[1] if norm.args[0] is product else norm.args[0]
        weight, eps, variance_size = (_arg(norm, 2, "weight"), _arg(norm, 3, "epsilon"),
                                      _arg(norm, 4, "variance_size"))
        match = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum",
                      h=_output(graph, norm, 1), out=_output(graph, norm, 0), weight=weight, eps=float(eps),
                      hidden=hidden, residual=residual, internal=[all_reduce, product, norm])
        match.problem = residual_problem(residual, all_reduce, val, hidden)
    elif len(adds) == 1 and len(product.users) == 1:
        add = adds[0]
        after = [u for u in add.users if op_name(u) == NORM and u.args[0] is add]
        if not after:
            return None, None
        norm = after[0]
        weight, eps, variance_size = (_arg(norm, 1, "weight"), _arg(norm, 2, "epsilon"),
                                      _arg(norm, 3, "variance_size"))
        residual = other_arg(add, product)
        match = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum", h=add, out=norm,
                      weight=weight, eps=float(eps), hidden=hidden, residual=residual,
                      internal=[all_reduce, product])
        match.problem = residual_problem(residual, add, val, hidden)
    if match is None:
        return None, None
    if weight is None:
        return None, Reason("vllm-form", "vLLM's norm has no weight")
    if variance_size is not None:
        return None, Reason("vllm-form",
                            "vLLM's norm takes its variance over part of the row (variance_size)")
    match.x_scale = factor
    match.problem = problem or match.problem
    return match, None


def _native_site(all_reduce: Node, group_name: str, hidden: int) -> Match | None:
    """The site of vLLM's norm traced as aten ops (vLLM's graphs without its IR ops): the residual added
    in fp32 (``sum.float() + residual.float()``), the norm of that fp32 row, the weight after the cast
    back, and the new residual as the fp32 row cast back (wherever the graph has it; made if nowhere);
    or no residual: the norm of the sum, which stays the residual."""
    x, dtype = all_reduce.args[0], meta_val(all_reduce).dtype
    norm = match_rmsnorm(all_reduce)
    if norm is not None:  # the sum normed as it is; it stays the residual (the embedding's)
        out, weight, eps, internal = norm
        # The sum's fp32 cast may also be the next layer's residual cast (one node after CSE): it stays
        # and reads the op's h, which the sum's other users read too.
        internal = [n for n in internal
                    if not (is_call(n, prims.convert_element_type.default) and n.args[0] is all_reduce)]
        return Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum", h=all_reduce,
                     out=out, weight=weight, eps=eps, hidden=hidden, internal=internal)
    # Else the sum is read only through its fp32 cast, added to the residual's (the add is symmetric: the
    # sum is the side whose only reader it is; an earlier sum that is this add's residual is read twice).
    cast = only_user(all_reduce)
    add = only_user(cast) if cast in converts_to(all_reduce, torch.float32) else None
    if not is_add(add):
        return None
    other = other_arg(add, cast)
    if not (is_call(other, prims.convert_element_type.default) and meta_val(other.args[0]).dtype == dtype):
        return None
    norm = match_rmsnorm(add, dtype=dtype)
    if norm is None:
        return None
    out, weight, eps, internal = norm
    own = [all_reduce, cast] + ([other] if len(other.users) == 1 else [])
    return Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op="sum",
                 h=_cast(all_reduce.graph, add, dtype), out=out, weight=weight, eps=eps, hidden=hidden,
                 residual=other.args[0], internal=own + [add] + internal)


def pattern_of(match: Match) -> FusionPattern:
    """The pattern whose checks and replacement serve a vLLM site: scaled or not, with or without a residual
    and fp8."""
    quant = ("Fp4Quant" if match.fp4 else "DynamicQuant" if match.scales is not None else
             "Quant" if match.quant_scale is not None else "")
    return PATTERNS_BY_NAME[f"AllReduce{'Scaled' if match.x_scale is not None else ''}"
                            f"{'PostNorm' if match.sum_weight is not None else ''}"
                            f"{'Add' if match.residual is not None else ''}RMSNorm{quant}"]
