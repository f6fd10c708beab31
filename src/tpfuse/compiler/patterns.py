"""Fusion patterns over post-grad FX graphs, generated from the block end's steps.

Before (what Inductor's post-grad graph holds for a tensor-parallel block end; any rank >= 2, the
last dimension is the hidden size H, the others are tokens; every step but the all-reduce and the
norm optional, in this order)::

    x  = sum(experts * w, dim=1) (+ shared)          # a MoE finalize (matchers.match_finalize), or any x
    a  = wait_tensor(all_reduce(x, "sum", group))   # x: [..., H]
    a  = reshape(a, ...)                            # any views that keep rows of H (or none)
    a  = a * x_scale                                # scaled: a number (Gemma's embedding, Granite)
    a  = a + bias                                   # bias: a row-parallel layer's [H] bias
    a  = a + (all-reduce of x_other (+ its bias))   # branches: two all-reduces of one group summed
                                                    #   (the second may be multiplied by a value a
                                                    #   token: Qwen2-MoE's shared expert gate)
    a  = rmsnorm(a) * sum_weight                    # post_norm: Gemma 2/3's post-norm
    h  = a + residual | residual + a                # residual; may broadcast [S,H]+[1,S,H]; or
    h  = (a + t) + residual                         #   t a second [T, H] term the ranks hold alike
                                                    #   (Qwen2-MoE's gated shared expert, not split)
    y  = rmsnorm(h) * weight | layer_norm(h, weight, norm_bias)     # HF, gpt-fast and torch styles
    q  = fp8(y / scale) | fp8(y / s_g), s_g from amax per token or group   # quant: static | dynamic
                                                    #   (s_g may be rounded up to a power of two: UE8M0;
                                                    #   y may be read besides q: the op's normed copy)
    q, s = tpfuse.quantize_fp4(y, "nvfp4" | "mxfp4")   # or fp4 as tpfuse's quantiser writes it

After::

    y2, h2 = torch.ops.tpfuse.allreduce_add_rmsnorm(
        x.reshape(-1, H), residual.reshape(-1, H) or None, weight, eps, group, quant_scale=..., bias=...)
        # a MoE finalize: experts.reshape(-1, K, H), experts=K, topk_weights=w, shared_expert=shared;
        # a second branch's x as shared_expert
    y, h = y2.reshape(y.shape), h2.reshape(h.shape)  # the caller's shapes; views of the sum reuse h

:data:`PATTERNS` holds one :class:`FusionPattern` (a value) per combination of steps
(:func:`combinations`), longest first, each named from its steps (``AllReduceBiasAddRMSNormQuant``;
:data:`PATTERNS_BY_NAME`). A pattern's ``search`` walks from an all-reduce node and returns a
:class:`Match` (with a ``problem`` when the structure is there but cannot be fused), ``extra_check``
returns why a match must not be fused (or None), ``replace`` rewrites the graph, and ``example`` is the
pattern in plain torch, for tests and documentation. Any eps value matches.
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from tpfuse import select
from tpfuse.compiler.matchers import (
    ALL_REDUCE,
    REDUCE_SCATTER,
    VIEWS,
    WAIT,
    Finalize,
    aten,
    bias_of,
    collective_args,
    fp8_of,
    gathered,
    is_add,
    sequence_first,
    is_call,
    is_scalar,
    match_branch,
    match_dynamic_fp8,
    match_finalize,
    match_fp4,
    match_layernorm,
    match_rmsnorm,
    match_static_fp8,
    meta_val,
    only_user,
    other_arg,
    prims,
    read_besides,
    residual_problem,
    row_views,
)
from tpfuse.compiler.reasons import DYNAMIC_HIDDEN, Reason, no_communicator
from tpfuse.compiler.sizes import element_count, size_expr, static_int, token_count
from tpfuse.blockend.bits import FP4_NVFP4, MAX_EXPERTS, SCALES_ROWS
from tpfuse.blockend.outputs import DynamicFp8, Fp4, Output, StaticFp8, Unquantised
from tpfuse.blockend.stages import LayerNorm, Norm, RmsNorm
from tpfuse.blockend.codecs import dynamic_fp8
from tpfuse.targets import fp8_format


def site_problem(reduce_op: str, hidden: int, dtype: torch.dtype) -> Reason | None:
    """Why no all-reduce of this op, hidden size and dtype can fuse, whatever its group (None: it can).

    The backend asks it of dynamo's graph and the patterns of the post-grad graph, so both give the
    same reasons.
    """
    if reduce_op != "sum":
        return Reason("reduce-op", f"all-reduce op is {reduce_op!r}, not 'sum'")
    if dtype not in select.KERNEL_DTYPES:
        return Reason("dtype", f"{hidden} x {dtype} is not supported by the kernels")
    if not select.kernel_supports(hidden, dtype):
        return Reason("hidden", f"hidden size {hidden} is not supported (a multiple of 8 up to "
                                f"{select.MAX_KERNEL_HIDDEN})")
    return None


@dataclass(kw_only=True)
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
    also_added: Node | None = None  # a second [T, H] term added to the sum with the residual
    quant_scale: Node | None = None  # static fp8: its scale
    internal: list[Node] = field(default_factory=list)  # may only be used inside the match
    aliases: list[Node] = field(default_factory=list)  # views of the sum before h: may have other users
    problem: Reason | None = None  # the structure matched but cannot be fused (why)
    x_scale: object = None  # a number or one-element tensor the sum is multiplied by (Gemma's embedding)
    biases: list = field(default_factory=list)  # [H] tensors added to the sum (one a branch)
    x_other: Node | None = None  # the second branch's all-reduce input: x + x_other is all-reduced once
    x_other_copies: int = 1  # x_other holds this many copies of the rows, summed (Llama 4's experts)
    x_other_gate: Node | None = None  # x_other's sum is multiplied by this value a token ([..., 1])
    merged: list[Node] = field(default_factory=list)  # other all-reduces this site takes in
    sum_weight: object = None  # the post-norm's gain (Gemma)
    norm_bias: object = None  # LayerNorm's bias
    scales: Node | None = None  # dynamic fp8: the node of the scales
    scale_group: int = 0  # dynamic fp8: elements per scale
    ue8m0: bool = False  # dynamic fp8: scales rounded up to powers of two
    scale_layout: int = 0  # dynamic fp8's and MXFP4's: where the scales go (blockend.bits.SCALES_*)
    normed: Node | None = None  # a quantised site's norm result, read besides the quantisation
    fp4: int = 0  # fp4 output (blockend.bits.FP4_*): the scales are the op's in their own layout
    global_scale: Node | None = None  # NVFP4: the global scale
    finalize: Finalize | None = None  # the MoE finalize that makes x, done in the op instead
    # Sequence parallel: the site is a reduce-scatter over this many ranks (0: an all-reduce); x holds their
    # rows, h this rank's, and ``out`` is the all-gather of the normed rows
    shards: int = 0
    # ... with the rows reduce-scattered sequence-first: x [B, S, H] permuted to [S, B, H] and copied before
    # the reduce-scatter, the result permuted back (torchtitan's plain-tensor backend)
    sequence_first: bool = False

    @property
    def tokens(self):
        """The site's token count: an int, or a sympy expression of the graph's size symbols."""
        return token_count(meta_val(self.h).shape)

#: The fusion limit of a site in batch-invariant mode (``ops.determinism``): the op serves every token
#: count there (in parts of the workspace's rows, or on the gathered path), so no compile range may hand
#: a site back to the group's all-reduce.
UNBOUNDED_LIMIT = 2**62


def token_limit_problem(tokens, token_bound, fusion_limit: int, how_to_bound: str) -> Reason | None:
    """Why a site of ``tokens`` (an int or an expression) may run with more than ``fusion_limit`` (None: it
    may not); ``token_bound`` as for :meth:`FusionPattern.extra_check`, ``how_to_bound`` what gives a
    graph a bound (for the reason)."""
    if fusion_limit >= UNBOUNDED_LIMIT:
        return None
    bound = tokens if isinstance(tokens, int) else token_bound(tokens)
    if bound is None:
        return Reason("tokens", f"the token count {tokens} of this graph is unbounded ({how_to_bound})")
    if bound > fusion_limit:
        return Reason("tokens", f"token range up to {bound} exceeds the fusion limit {fusion_limit}")
    return None


@dataclass(frozen=True)
class FusionPattern:
    """A block end the pass fuses, as data: which steps its site has, each one required (one instance a
    combination, :data:`PATTERNS`), named as the block end's stages name them (``blockend.stages``,
    ``blockend.outputs``).

    In the order they apply to the all-reduced sum: ``scaled`` (multiplied by a number: Gemma's
    embedding), ``bias`` (the :class:`~tpfuse.blockend.stages.Bias` stage: a row-parallel layer's bias,
    in every branch), ``branches`` (2: the sum of two all-reduces of the same group, Phi / GPT-NeoX's
    parallel attention and MLP), ``post_norm`` (the ``PostNorm`` stage: Gemma 2/3), ``residual``, then
    ``norm`` (the ``RmsNorm`` or ``LayerNorm`` stage), then ``output`` (y's format: ``Unquantised``,
    ``StaticFp8``, ``DynamicFp8`` or ``Fp4``, which the site's quantiser makes NVFP4 or MXFP4). ``scaled``
    and ``branches`` are steps of the graph, not of the kernel: the replacement folds them into the op's
    inputs (each rank's x times the number; the second branch's x as the finalize's ``shared_expert``).
    ``name`` reads the steps in order (:func:`pattern_name`); ``description`` says what the site is and
    which models write it.
    """

    name: str
    description: str
    scaled: bool = False
    bias: bool = False
    branches: int = 1
    post_norm: bool = False
    residual: bool = False
    norm: type[Norm] = RmsNorm
    output: type[Output] = Unquantised

    @property
    def length(self) -> int:
        """How many steps the pattern has: longer patterns are tried first."""
        return (self.scaled + self.bias + (self.branches - 1) + self.post_norm + self.residual
                + (self.norm is LayerNorm) + self.quantised)

    @property
    def quantised(self) -> bool:
        return self.output is not Unquantised

    def search(self, all_reduce: Node) -> Match | None:
        """The site at ``all_reduce`` (or at a reduce-scatter whose normed rows are all-gathered: sequence
        parallel's block end, unquantised and of one branch) as this pattern has it, or None."""
        if not is_call(all_reduce, ALL_REDUCE, REDUCE_SCATTER):
            return None
        wait = only_user(all_reduce)
        if not is_call(wait, WAIT) or not isinstance(meta_val(wait), torch.Tensor) or meta_val(wait).dim() < 1:
            return None
        x, reduce_op, group_name, shards = collective_args(all_reduce)
        hidden = static_int(meta_val(wait).shape[-1])
        if hidden is None or (shards and (self.quantised or self.branches > 1)):
            return None
        start, around = wait, []
        if shards and (permuted := sequence_first(all_reduce)) is not None:  # x's rows as [B, S, H]
            x, start, around = permuted
        chain = row_views(start, hidden)
        m = Match(all_reduce=all_reduce, x=x, group_name=group_name, reduce_op=reduce_op, h=chain[-1],
                  out=chain[-1], weight=None, eps=0.0, hidden=hidden, shards=shards, sequence_first=bool(around),
                  internal=around)
        steps = list(chain)  # nodes from the sum to h

        def follow(node: Node) -> Node:  # the views after a step belong to it
            views = row_views(node, hidden)
            steps.extend(views)
            return views[-1]

        if not self.scaled and self.branches == 1 and not shards:  # a number times the sum, a branch: x as it is
            m.finalize = match_finalize(x, hidden)
        cur = chain[-1]
        if self.scaled:
            mul = only_user(cur)
            if not (is_call(mul, aten.mul.Tensor) and is_scalar(other_arg(mul, cur))):
                return None
            m.x_scale = other_arg(mul, cur)
            cur = follow(mul)
        if self.bias:
            cur, bias = bias_of(cur, hidden)
            if cur is None:
                return None
            m.biases.append(bias)
            cur = follow(cur)
        residual_add = None
        if self.branches == 2:

            def branch_after(node: Node):  # (the add that node's only user is, the branch it adds or None)
                add = only_user(node)
                if not is_add(add):
                    return None, None
                return add, match_branch(other_arg(add, node), group_name, reduce_op, hidden, self.bias)

            add, branch = branch_after(cur)
            if add is not None and branch is None and self.residual:  # (a + residual) + b: Cohere
                m.residual = other_arg(add, cur)
                m.problem = residual_problem(m.residual, add, meta_val(x), hidden)
                residual_add, cur = add, follow(add)
                add, branch = branch_after(cur)
            if branch is None:
                return None
            other_reduce, nodes, bias, m.x_other_copies, m.x_other_gate = branch
            m.x_other, m.merged = other_reduce.args[0], [other_reduce]
            m.biases += [bias] if bias is not None else []
            m.internal += nodes
            cur = follow(add)
        if self.post_norm:
            norm = match_rmsnorm(cur)
            if norm is None:
                return None
            out, m.sum_weight, sum_eps, nodes = norm
            steps += nodes + [out]
            cur = follow(out)
        if self.residual and residual_add is None:
            # The pre-add sum may have no other user (the op cannot provide it): extra_check says so.
            adds = [u for u in cur.users if is_add(u)]
            if len(adds) != 1:
                return None
            m.residual = other_arg(adds[0], cur)
            m.problem = residual_problem(m.residual, adds[0], meta_val(x), hidden)
            steps.append(adds[0])
            cur = adds[0]
            views = row_views(cur, hidden)
            then = only_user(views[-1])
            if is_add(then) and residual_problem(other_arg(then, views[-1]), then, meta_val(x), hidden) is None:
                # (sum + t) + residual, views between: two terms added to the sum (Qwen2-MoE's gated shared
                # expert, which transformers' plan leaves whole on every rank), added before the op as one
                m.also_added = other_arg(then, views[-1])
                steps.extend(views[1:] + [then])
                cur = then
        m.h = cur
        if steps[-1] is chain[-1]:  # h is the sum itself: the views before it are the sum's aliases
            m.aliases = chain[:-1]
        else:
            m.internal += [n for n in steps if n is not cur]
        norm_input = row_views(cur, hidden)[-1]
        if self.norm is LayerNorm:
            norm = match_layernorm(norm_input, quantised=self.quantised)
            if norm is None:
                return None
            out, m.weight, m.eps, m.norm_bias, nodes = norm
        else:
            norm = match_rmsnorm(norm_input, quantised=self.quantised)
            if norm is None:
                return None
            out, m.weight, m.eps, nodes = norm
        if self.post_norm and sum_eps != m.eps:
            m.problem = m.problem or Reason("operands", f"the post-norm's eps {sum_eps} differs from the norm's "
                                                        f"{m.eps}")
        if self.output is StaticFp8:
            quant = match_static_fp8(out)
            if quant is None:
                return None
            q_out, m.quant_scale, quant_nodes = quant
        elif self.output is DynamicFp8:
            quant = match_dynamic_fp8(out, hidden)
            if quant is None:
                return None
            q_out, m.scales, m.scale_group, m.ue8m0, quant_nodes = quant
        elif self.output is Fp4:
            quant = match_fp4(out)
            if quant is None:
                return None
            q_out, m.scales, m.fp4, m.global_scale, m.scale_layout, quant_nodes = quant
        if self.quantised:
            # The norm's result read besides its quantisation (a normed row that also feeds something
            # else): the op writes it too, in the input's dtype (normed_copy).
            if read_besides(out, quant_nodes):
                m.normed = out
                if meta_val(out).dtype != meta_val(x).dtype:
                    m.problem = m.problem or Reason("operands", "the norm's result is read besides its "
                                                    f"quantisation in {meta_val(out).dtype}, not the input's dtype")
            nodes = nodes + ([out] if m.normed is None else []) + quant_nodes
            out = q_out
        if shards:  # the normed rows all-gathered: the op gives them gathered
            gather = gathered(out, group_name, shards, hidden)
            if gather is None:
                return None
            nodes = nodes + [out] + gather[1]
            out = gather[0]
        m.out = out
        # A norm's fp32 result that fp8 reads directly (matchers._cast_back) is both its out and a node.
        m.internal = list(dict.fromkeys([all_reduce] + m.merged + m.internal + nodes))
        return m

    def extra_check(self, m: Match, token_bound, fusion_limit: int) -> Reason | None:
        """Why ``m`` must stay unfused (a reason for the log), or None to fuse it.

        ``token_bound(tokens)`` gives the largest token count the graph runs this site with (or None
        when unknown); ``tokens`` is an int or a sympy expression of the graph's size symbols.
        ``fusion_limit``: the most tokens the site's group can fuse at its hidden size and dtype (0:
        none; the pass asks the group's communicator).
        """
        if m.problem is not None:
            return m.problem
        x = meta_val(m.x)
        reason = site_problem(m.reduce_op, m.hidden, x.dtype)
        if reason is not None:
            return reason
        if fusion_limit <= 0:
            return no_communicator(m.group_name, m.hidden, x.dtype)
        if m.finalize is not None and m.finalize.experts > MAX_EXPERTS:  # K travels in the call descriptor
            return Reason("operands", f"a MoE finalize of {m.finalize.experts} experts a token: the op takes at "
                                      f"most {MAX_EXPERTS}")
        if (element_count(x.shape) != max(m.shards, 1) * element_count(meta_val(m.h).shape)
                and not (m.shards and _sharded_shapes(m) is not None)):  # sizes the reduce-scatter divides
            return Reason("operands", f"the all-reduced {tuple(x.shape)} is broadcast by the add to "
                                      f"{tuple(meta_val(m.h).shape)}")
        if m.x_other is not None and (meta_val(m.x_other).dtype != x.dtype or element_count(meta_val(m.x_other).shape)
                                      != m.x_other_copies * element_count(x.shape)):
            return Reason("operands", "the two all-reduced branches differ in dtype or size")
        gains = [("the norm weight", m.weight), ("the post-norm weight", m.sum_weight),
                 ("the LayerNorm bias", m.norm_bias)] + [("the bias", b) for b in m.biases]
        for what, node in gains:
            if node is None and what != "the norm weight":
                continue
            w = meta_val(node) if isinstance(node, Node) else None
            if w is None or tuple(w.shape) != (m.hidden,) or w.dtype not in (x.dtype, torch.float32):
                return Reason("operands", f"{what} is not a [hidden] tensor of the input's dtype or float32")
        if m.x_scale is not None and isinstance(m.x_scale, Node) and not meta_val(m.x_scale).is_floating_point():
            return Reason("operands", "the sum is multiplied by an integer tensor")
        if m.quant_scale is not None and (meta_val(m.quant_scale) is None
                                          or meta_val(m.quant_scale).dtype != torch.float32
                                          or meta_val(m.quant_scale).numel() != 1):
            return Reason("operands", "the fp8 scale is not a float32 tensor of one element")
        if meta_val(m.out).dtype != (torch.uint8 if m.fp4 else fp8_of(m.out).dtype if self.quantised else x.dtype):
            return Reason("operands", "the norm's result dtype differs from the input's (e.g. an fp32 weight "
                                      "multiplied last)")
        allowed = set(m.internal) | {m.out, m.h} | ({m.scales, m.normed} - {None})
        for node in m.internal:
            if any(u not in allowed for u in node.users):
                what = "the pre-add sum" if node.target in (WAIT,) + VIEWS else "an intermediate value"
                return Reason("outside-users", f"{what} of the pattern has users outside it")
        # (fp4 scales are the op's own tensor, its rows padded: no size of theirs is looked for)
        outputs = [m.out, m.h] + m.aliases + [n for n in (None if m.fp4 else m.scales, m.normed) if n is not None]
        if m.shards and _sharded_shapes(m) is not None:  # y's and h's sizes follow from x's (replace)
            outputs = outputs[2:]
        for node in outputs:
            if any(static_int(s) is None and _size_source(m.all_reduce.graph, s, m) is None
                   for s in meta_val(node).shape):
                return Reason("sizes", f"no input of the graph carries the sizes of {tuple(meta_val(node).shape)}")
        if m.shards:  # the op takes any size, in sharded parts of the workspace's rows
            return None
        return token_limit_problem(m.tokens, token_bound, fusion_limit, "compile with tpfuse.compile")

    def replace(self, graph: Graph, m: Match) -> None:
        """Rewrite the site to the fused op; the caller re-sorts the graph (``stable_topological_sort``)."""
        hidden = m.hidden
        call = graph_caller(graph, m.x)

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
            x2, finalize = _finalized_x(call, m)
            if m.sequence_first:
                x2 = rank_major_rows(call, m.x, m.shards, hidden)
            if m.x_other is not None:  # one all-reduce of both branches: the second one's x added in the op
                other = call(aten.reshape.default, m.x_other, [m.x_other_copies, -1, hidden])
                if m.x_other_copies > 1:  # summing the copies is linear: before the all-reduce, not after
                    other = call(aten.sum.dim_IntList, other, [0])
                other = call(aten.reshape.default, other, [-1, hidden])
                if m.x_other_gate is not None:  # the same gate on every rank: it multiplies each rank's part
                    other = call(aten.mul.Tensor, call(aten.reshape.default, m.x_other_gate, [-1, 1]), other)
                finalize["shared_expert"] = other
            if m.x_scale is not None:  # scaling each rank's part scales the sum
                x2 = call(aten.mul.Tensor, x2, m.x_scale)
            bias = None
            for b in m.biases:  # several branches' biases: summed once, in fp32
                b = call(prims.convert_element_type.default, b, torch.float32) if len(m.biases) > 1 else b
                bias = b if bias is None else call(aten.add.Tensor, bias, b)
            r2 = call(aten.reshape.default, m.residual, [-1, hidden]) if m.residual is not None else None
            if m.also_added is not None:  # both terms in one residual (one rounding, as the model's second add)
                r2 = call(aten.add.Tensor, r2, call(aten.reshape.default, m.also_added, [-1, hidden]))
            steps = {"bias": bias, "sum_weight": m.sum_weight, "layer_norm": self.norm is LayerNorm,
                     "norm_bias": m.norm_bias, **finalize}
            if self.output in (DynamicFp8, Fp4) or m.normed is not None:  # the op of every quantised output
                op = torch.ops.tpfuse.allreduce_add_rmsnorm_quant.default
                fused = call(op, x2, r2, m.weight, m.eps, m.group_name, quant_scale=m.quant_scale,
                             scale_group=m.scale_group, ue8m0_scales=m.ue8m0, scale_layout=m.scale_layout,
                             normed_copy=m.normed is not None, fp4=m.fp4, global_scale=m.global_scale, **steps)
                y2, scales, h2, normed = (call(operator.getitem, fused, i) for i in range(4))
                if m.normed is not None:
                    m.normed.replace_all_uses_with(call(aten.reshape.default, normed,
                                                        shape_args(meta_val(m.normed).shape)))
            else:
                op = (torch.ops.tpfuse.reduce_scatter_add_rmsnorm_all_gather.default if m.shards
                      else torch.ops.tpfuse.allreduce_add_rmsnorm.default)
                fused = call(op, x2, r2, m.weight, m.eps, m.group_name, quant_scale=m.quant_scale, **steps)
                y2, h2 = call(operator.getitem, fused, 0), call(operator.getitem, fused, 1)
            if m.scales is not None and m.fp4:  # the op's scales, as the bytes of the dtype the graph had
                wanted = meta_val(m.scales).dtype
                m.scales.replace_all_uses_with(scales if meta_val(scales).dtype == wanted else
                                               call(aten.view.dtype, scales, wanted))
            elif m.scales is not None:
                m.scales.replace_all_uses_with(call(aten.reshape.default, scales,
                                                    shape_args(meta_val(m.scales).shape)))
            shapes = _sharded_shapes(m) if m.shards else None
            if shapes is not None:  # y's and h's sizes from x's (symbolic ones no input carries as they are)
                sizes = {d: static_int(n) if static_int(n) is not None else call(aten.sym_size.int, m.x, d)
                         for d, n in enumerate(meta_val(m.x).shape)}
                def times_shards(size):
                    return m.shards * size if isinstance(size, int) else call(operator.mul, m.shards, size)

                y_sizes, h_sizes = ([size if isinstance(size, int) else sizes[size[1]] if size[0] == "x"
                                     else times_shards(sizes[size[1]]) for size in shape] for shape in shapes)
                y = call(aten.reshape.default, y2, y_sizes)
                h = call(aten.reshape.default, h2, h_sizes)
            else:
                y = call(aten.reshape.default, y2, shape_args(meta_val(m.out).shape))
                h = call(aten.reshape.default, h2, shape_args(meta_val(m.h).shape))
            for alias in m.aliases:  # views of the sum that others read: the same rows of h
                if any(u not in m.aliases and u is not m.h for u in alias.users):
                    alias.replace_all_uses_with(call(aten.reshape.default, h2, shape_args(meta_val(alias).shape)))
        m.out.replace_all_uses_with(y)
        m.h.replace_all_uses_with(h)
        order = {node: i for i, node in enumerate(graph.nodes)}
        gone = set(m.internal) | set(m.aliases) | {m.h, m.out} | ({m.scales, m.normed} - {None})
        gone |= set(m.finalize.nodes) if m.finalize is not None else set()
        for node in sorted(gone, key=order.__getitem__, reverse=True):
            if not node.users:
                graph.erase_node(node)

    def example(self, inputs: dict, eps: float, group=None):
        """The unfused pattern in plain torch (functional all-reduce, HF-style norms), from ``inputs``:
        ``x`` (and ``x_other`` with two branches), ``residual``, ``weight``, and where the pattern has
        them ``x_scale``, ``bias`` (and ``bias_other``), ``sum_weight``, ``norm_bias``, ``scale`` (static
        fp8), ``scale_group`` (dynamic fp8), ``fp4`` (``FP4_NVFP4``, the default, or ``FP4_MXFP4``),
        ``global_scale`` (NVFP4) and ``scale_layout`` (MXFP4's, ``SCALES_ROWS`` by default). Returns
        ``(y, h)``, or ``(y, scales, h)`` for dynamic fp8 and fp4."""
        import torch.distributed as dist
        import torch.distributed._functional_collectives as fc

        group = group or dist.group.WORLD
        x = inputs["x"]

        def branch(part, bias):
            s = fc.all_reduce(part, "sum", group)
            if self.scaled:
                s = s * inputs["x_scale"]
            return s + bias if self.bias else s

        h = branch(x, inputs.get("bias"))
        if self.branches == 2:
            h = h + branch(inputs["x_other"], inputs.get("bias_other"))
        if self.post_norm:
            h = _example_rmsnorm(h, inputs["sum_weight"], eps, gemma=True)
        if self.residual:
            h = h + inputs["residual"]
        if self.norm is LayerNorm:
            y = torch.nn.functional.layer_norm(h, (h.shape[-1],), inputs["weight"], inputs.get("norm_bias"),
                                               eps)
        else:
            y = _example_rmsnorm(h, inputs["weight"], eps, gemma=self.post_norm)
        if self.output is StaticFp8:
            fmt = fp8_format(y.device)  # the device's fp8, as the op gives it (targets.fp8_format)
            y = (y.float() / inputs["scale"]).clamp(-fmt.max, fmt.max).to(fmt.dtype)
        elif self.output is DynamicFp8:
            y, scales = dynamic_fp8(y, inputs["scale_group"])
            return y, scales, h
        elif self.output is Fp4:  # tpfuse.quantize_fp4 as the op it calls
            fp4 = inputs.get("fp4", FP4_NVFP4)
            y, scales = torch.ops.tpfuse.quantize_fp4(y, fp4, inputs["global_scale"] if fp4 == FP4_NVFP4 else None,
                                                      inputs.get("scale_layout", SCALES_ROWS))
            return y, scales, h
        return y, h


def rank_major_rows(call, x: Node, shards: int, hidden: int) -> Node:
    """x [B, S, H] as the sharded op takes it: each rank's rows [B, S / W, H] in turn, [W * B * S / W, H]
    (one copy, as the graph's own permute and copy before its reduce-scatter)."""
    batch = static_int(meta_val(x).shape[0])
    batch = batch if batch is not None else call(aten.sym_size.int, x, 0)
    x = call(aten.permute.default, call(aten.reshape.default, x, [batch, shards, -1, hidden]), [1, 0, 2, 3])
    return call(aten.reshape.default, x, [-1, hidden])


def _sharded_shapes(m: Match) -> tuple[list, list] | None:
    """A sharded site's y and h shapes in terms of x's dimensions, where they have x's form: ``("x", d)``
    is x's size d, ``("W*x", d)`` W times it, an int itself (-1: what is left); None where y and h are
    shaped otherwise (views between: the sizes are then looked for as any site's).

    DTensor's form reduce-scatters x [W*B, S/W, H] to h [B, S/W, H] and gathers y back to x's shape;
    torchtitan's plain tensors hand x as [B, S, H] (permuted to [S, B, H] for the reduce-scatter): h is
    [B, S/W, H], y [W*B, S/W, H]."""
    x, h, y = (meta_val(n).shape for n in (m.x, m.h, m.out))
    if len(x) < 2 or len(h) != len(x) or len(y) != len(x):
        return None
    def same(a, b) -> bool:
        return size_expr(a) == size_expr(b)

    rest = [("x", d) for d in range(1, len(x) - 1)]
    if m.sequence_first and len(x) == 3 and same(h[0], x[0]) and same(y[1], h[1]):
        return [("W*x", 0), -1, m.hidden], [("x", 0), -1, m.hidden]
    if not m.sequence_first and all(same(y[d], x[d]) for d in range(len(x))) and all(
            same(h[d], x[d]) for d in range(1, len(x))):
        return [("x", 0), *rest, m.hidden], [-1, *rest, m.hidden]
    return None


def _finalized_x(call, m: Match) -> tuple[Node, dict]:
    """The op's x and its MoE finalize's keyword arguments: x as [T, H]; or a finalize's experts'
    outputs [T, K, H], weights [T, K] and shared part [T, H]."""
    fin, hidden = m.finalize, m.hidden
    if fin is None:
        return call(aten.reshape.default, m.x, [-1, hidden]), {}
    steps = {}
    if fin.experts:
        x = call(aten.reshape.default, fin.x, [-1, fin.experts, hidden])
        steps["experts"] = fin.experts
        if fin.topk_weights is not None:
            steps["topk_weights"] = call(aten.reshape.default, fin.topk_weights, [-1, fin.experts])
    else:
        x = call(aten.reshape.default, fin.x, [-1, hidden])
    if fin.shared is not None:
        steps["shared_expert"] = call(aten.reshape.default, fin.shared, [-1, hidden])
    return x, steps


def graph_caller(graph: Graph, like: Node):
    """``call(target, *args, **kwargs)``: a new node of ``graph`` with its fake value (what Inductor
    lowers from), computed in the fake mode of ``like``'s value."""
    from torch._guards import detect_fake_mode

    fake_mode = detect_fake_mode([meta_val(like)])

    def fake(a):
        if isinstance(a, list):
            return [fake(s) for s in a]
        return meta_val(a) if isinstance(a, Node) else a

    def call(target, *args, **kwargs) -> Node:
        node = graph.call_function(target, args, kwargs)
        if fake_mode is not None:
            with fake_mode:
                node.meta["val"] = target(*map(fake, args), **{k: fake(v) for k, v in kwargs.items()})
        return node

    return call


def plain_all_reduce_problem(x: Node, reduce_op: str, token_bound, fusion_limit: int) -> Reason | None:
    """Why the all-reduce of ``x`` cannot run on tpfuse's plain all-reduce (None: it can): the kernels'
    dtypes and sizes, and the most tokens the graph runs it with against ``fusion_limit``."""
    val = meta_val(x)
    hidden = static_int(val.shape[-1]) if isinstance(val, torch.Tensor) and val.dim() else None
    if hidden is None:
        return DYNAMIC_HIDDEN
    problem = site_problem(reduce_op, hidden, val.dtype)
    if problem is not None:
        return problem
    if fusion_limit <= 0:
        return Reason("no-communicator", "its group has no tpfuse communicator")
    return token_limit_problem(token_count(val.shape), token_bound, fusion_limit, "no bound given")


def replace_with_plain_all_reduce(graph: Graph, x: Node, group_name: str, result: Node) -> None:
    """Replace the all-reduce of ``x`` whose value ``result`` is (the wait, or vLLM's op) with
    ``tpfuse.all_reduce`` on ``[tokens, hidden]``, reshaped back to x's shape."""
    call = graph_caller(graph, x)
    shape = meta_val(x).shape
    with graph.inserting_before(result):
        sizes = [static_int(size) if static_int(size) is not None else call(aten.sym_size.int, x, dim)
                 for dim, size in enumerate(shape)]
        summed = call(torch.ops.tpfuse.all_reduce.default, call(aten.reshape.default, x, [-1, shape[-1]]), group_name)
        out = call(aten.reshape.default, summed, sizes)
    result.replace_all_uses_with(out)
    for node in [result] + [a for a in result.args if isinstance(a, Node) and a is not x]:
        if not node.users:
            graph.erase_node(node)


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
        val = meta_val(node)
        if isinstance(val, torch.SymInt) and size_expr(val) == expr:
            return node, None
        if isinstance(val, torch.Tensor):
            for dim, s in enumerate(val.shape):
                if static_int(s) is None and size_expr(s) == expr:
                    return node, dim
    return None



# y's formats a pattern may require, and what each contributes to its name.
_OUTPUT_WORDS = {Unquantised: "", StaticFp8: "Quant", DynamicFp8: "DynamicQuant", Fp4: "Fp4Quant"}


def combinations() -> list[dict]:
    """Every combination of steps the fused op runs, as a pattern's fields.

    The kernels run any subset of bias, post-norm, residual, RMSNorm or LayerNorm, and no, static or
    dynamic fp8 or fp4 output (``blockend.stages``); the all-reduced input may be multiplied by a number or be the
    sum of two all-reduces, which the replacement folds into x before the one all-reduce. A number
    times a sum of two branches is left out: no model writes it, and ``search`` finds the number on
    the first branch only.
    """
    found = []
    for scaled, branches, bias, post_norm, residual, norm, output in itertools.product(
            (False, True), (1, 2), (False, True), (False, True), (False, True), (RmsNorm, LayerNorm),
            _OUTPUT_WORDS):
        if scaled and branches == 2:
            continue
        found.append(dict(scaled=scaled, branches=branches, bias=bias, post_norm=post_norm, residual=residual,
                          norm=norm, output=output))
    return found


def pattern_name(steps: dict) -> str:
    """The name of a combination, read in the order of its steps: ``TwoAllReducesBiasAddLayerNorm``,
    ``AllReduceScaledPostNormAddRMSNormDynamicQuant``."""
    return "".join([
        "TwoAllReduces" if steps["branches"] == 2 else "AllReduce",
        "Scaled" if steps["scaled"] else "",
        "Bias" if steps["bias"] else "",
        "PostNorm" if steps["post_norm"] else "",
        "Add" if steps["residual"] else "",
        "LayerNorm" if steps["norm"] is LayerNorm else "RMSNorm",
        _OUTPUT_WORDS[steps["output"]],
    ])


# Where a step is named after the models that write it (the docstrings users see in reports and docs).
_MODELS = {
    "AllReduceAddRMSNorm": "Llama, Qwen, Mistral",
    "AllReducePostNormAddRMSNorm": "Gemma 2/3's post-norm and the next pre-norm",
    "AllReduceScaledRMSNorm": "Gemma's row-parallel embedding, scaled by sqrt(hidden)",
    "AllReduceScaledAddRMSNorm": "Granite's ``residual + out * multiplier``",
    "AllReduceBiasAddRMSNorm": "a row-parallel layer with a bias, added after the all-reduce",
    "AllReduceLayerNorm": "StarCoder2's row-parallel embedding into the first norm",
    "AllReduceBiasAddLayerNorm": "StarCoder2, GPT-NeoX without parallel residual",
    "TwoAllReducesBiasAddLayerNorm": "Phi-2 and GPT-NeoX's parallel attention and MLP",
    "TwoAllReducesAddLayerNorm": "Cohere's parallel attention and MLP",
    "TwoAllReducesAddRMSNorm": "routed and shared experts: DeepSeek-V3, Llama 4",
    "TwoAllReducesAddRMSNormDynamicQuant": "an fp8 MoE block with a shared expert",
    "AllReduceAddRMSNormDynamicQuant": "DeepSeek-V3 / Llama-4 fp8 checkpoints",
}


def _describe(steps: dict) -> str:
    parts = ["all-reduce + all-reduce" if steps["branches"] == 2 else "all-reduce"]
    parts += ["* a number"] * steps["scaled"] + ["+ bias"] * steps["bias"] + ["RMSNorm"] * steps["post_norm"]
    parts += ["+ residual"] * steps["residual"] + ["LayerNorm" if steps["norm"] is LayerNorm else "RMSNorm"]
    parts += {Unquantised: [], StaticFp8: ["static fp8"], DynamicFp8: ["fp8 with a scale per token or group"],
              Fp4: ["NVFP4 or MXFP4 (tpfuse.quantize_fp4)"]}[steps["output"]]
    return " -> ".join(parts)


def _pattern(steps: dict) -> FusionPattern:
    name = pattern_name(steps)
    models = _MODELS.get(name)
    return FusionPattern(name, _describe(steps) + (f" ({models})." if models else "."), **steps)


# Longest first: a site that continues into more steps takes the larger pattern; of equal lengths, two
# all-reduces first (else the sum of two, with no residual, would take the second as a residual and leave
# its all-reduce apart); a stable sort: otherwise the order of ``combinations``.
PATTERNS: list[FusionPattern] = sorted((_pattern(s) for s in combinations()),
                                       key=lambda pattern: (-pattern.length, -pattern.branches))
#: The patterns by name (``AllReduceAddRMSNorm``, ...): what site reports, the README and users say.
PATTERNS_BY_NAME: dict[str, FusionPattern] = {pattern.name: pattern for pattern in PATTERNS}


def unmatched_reason(all_reduce: Node) -> Reason:
    """Why no pattern starts at ``all_reduce`` (the first thing the site lacks)."""
    wait = only_user(all_reduce)
    if not is_call(wait, WAIT):
        return Reason("no-pattern", "the all-reduce's result is not waited on directly")
    hidden = static_int(meta_val(wait).shape[-1]) if meta_val(wait) is not None and meta_val(wait).dim() else None
    if hidden is None:
        return DYNAMIC_HIDDEN
    problem = site_problem(all_reduce.args[1], hidden, meta_val(wait).dtype)
    if problem is not None:  # said first: an fp32 model's norm has no casts, so no norm is found either
        return problem
    end = row_views(wait, hidden)[-1]
    if any(u.op == "output" for u in end.users):
        return Reason("graph-break", "the all-reduce's result leaves the compiled graph before its add and norm "
                                     "(a graph break between them? torch._dynamo.explain(model)(...) lists the "
                                     "breaks)")
    users = [u.target for u in end.users]
    if all_reduce.target == REDUCE_SCATTER:
        return Reason("no-pattern", "no norm whose rows are all-gathered follows the reduce-scatter (sequence "
                                    "parallel's block end: reduce-scatter -> a residual add -> RMSNorm or "
                                    "LayerNorm -> all-gather, unquantised); its result goes to "
                                    f"{', '.join(str(getattr(t, '__name__', t)) for t in users) or 'nothing'}")
    return Reason("no-pattern", "no norm follows the all-reduce as a pattern has it (RMSNorm or LayerNorm, after "
                                "a residual add, a bias or a post-norm: tpfuse.compiler.PATTERNS); its result goes "
                                f"to {', '.join(str(getattr(t, '__name__', t)) for t in users) or 'nothing'} (if "
                                "the model has a norm here: is eps a graph input? tpfuse.compile traces with "
                                "specialize_float=True)")
