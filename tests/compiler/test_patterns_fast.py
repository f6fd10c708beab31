"""The fusion pass on post-grad graphs in one process (a fake process group, no ranks): every pattern's
example fuses whole, as one op with no add, norm or quantisation left beside it, and the sites that
must stay unfused say why. The numerics are the rank tests' (test_fusion_pass.py). The graph of all
192 examples skips dynamo's trace (post_grad_pass_without_dynamo: about 9 s instead of 25-30 s, here
and on torch 2.11); the single sites go through torch.compile as users' models do."""

import contextlib
import operator

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

from tpfuse.blockend.bits import FP4_MXFP4, FP4_NVFP4, SCALES_ROWS, SCALES_SHUFFLED
from tpfuse.blockend.codecs import dynamic_fp8
from tpfuse.blockend.outputs import DynamicFp8, Fp4, StaticFp8, Unquantised
from tpfuse.blockend.stages import LayerNorm, RmsNorm
from tpfuse.compiler import PATTERNS, FusionPass
from tpfuse.compiler.patterns import combinations, pattern_name
from tpfuse.models.llama import HFRMSNorm
from tpfuse.targets import fp8_format

HIDDEN, TOKENS = 64, 6
FUSED_OPS = (torch.ops.tpfuse.allreduce_add_rmsnorm.default,
             torch.ops.tpfuse.allreduce_add_rmsnorm_quant.default)
aten, prims = torch.ops.aten, torch.ops.prims
# What the replacement may put before the fused op (the branches' sum, the number, the biases' sum) and
# after it (the caller's shapes); anything else left in the graph is a step that did not fuse.
VIEWS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default, operator.getitem,
         aten.sym_size.int}
BEFORE = VIEWS | {aten.select.int, aten.add.Tensor, aten.mul.Tensor, aten.sum.dim_IntList,
                  prims.convert_element_type.default}


@pytest.fixture(scope="module", autouse=True)
def fake_group():
    """A world of 2 whose collectives only trace: what the pass needs to see, no processes."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    yield
    dist.destroy_process_group()


class _Stop(Exception):
    """Raised by the capturing pass: the post-grad graph is all the test needs, not Inductor's code."""


def post_grad_pass(module: nn.Module, *inputs, fusion_pass: FusionPass, dynamic: bool = False):
    """Run ``fusion_pass`` on ``module``'s post-grad graph; return the graph after it."""
    from torch._inductor.compile_fx import compile_fx

    graphs = []

    def capture(graph: torch.fx.Graph):
        fusion_pass(graph)
        graphs.append(graph)
        raise _Stop

    def backend(gm, example_inputs):
        return compile_fx(gm, example_inputs, config_patches={"post_grad_custom_post_pass": capture,
                                                              "fx_graph_cache": False})

    torch._dynamo.reset()
    compiled = torch.compile(module, backend=backend, dynamic=dynamic, fullgraph=True)
    # eps a constant, as tpfuse.compile traces; the compile stops at _Stop, wrapped by dynamo.
    with torch.no_grad(), torch._dynamo.config.patch(specialize_float=True), contextlib.suppress(Exception):
        compiled(*inputs)
    assert len(graphs) == 1, "the post-grad pass did not run (or ran twice)"
    return graphs[0]


def post_grad_pass_without_dynamo(module: nn.Module, *inputs, fusion_pass: FusionPass):
    """:func:`post_grad_pass` for a graph of many examples, without dynamo's trace (two thirds of the
    time for the 192 examples): the module traced by ``make_fx`` on fake tensors, functionalized, with
    Inductor's decompositions, dead code removed (as AOT autograd leaves it), then Inductor's joint-graph
    and post-grad passes with ``fusion_pass`` as its custom post pass, as ``compile_fx`` runs them."""
    from torch._guards import detect_fake_mode
    from torch._inductor import config as inductor_config
    from torch._inductor.decomposition import select_decomp_table
    from torch._inductor.fx_passes.joint_graph import joint_graph_passes
    from torch._inductor.fx_passes.post_grad import post_grad_passes
    from torch._inductor.virtualized import V
    from torch.fx.experimental.proxy_tensor import make_fx

    state = {**dict(module.named_parameters()), **dict(module.named_buffers())}

    def forward(state, *args):
        return torch.func.functional_call(module, state, args)

    with torch.no_grad():
        gm = make_fx(torch.func.functionalize(forward, remove="mutations"),
                     decomposition_table=select_decomp_table(), tracing_mode="fake")(state, *inputs)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    graphs = []

    def capture(graph: torch.fx.Graph):
        fusion_pass(graph)
        graphs.append(graph)

    fake_mode = detect_fake_mode([n.meta.get("val") for n in gm.graph.nodes if n.op == "placeholder"])
    with V.set_fake_mode(fake_mode), inductor_config.patch(post_grad_custom_post_pass=capture):
        joint_graph_passes(gm)
        post_grad_passes(gm, is_inference=True)
    assert len(graphs) == 1, "the post-grad pass did not run (or ran twice)"
    return graphs[0]


def _inputs(pattern, index: int, x, x_other, residual, params) -> dict:
    group = (64, 16)[index % 2]  # dynamic fp8: a scale per token or per group of 16, alternately
    fp4 = (FP4_NVFP4, FP4_MXFP4)[index % 2]  # fp4: NVFP4 and MXFP4, alternately
    return {"x": x, "x_other": x_other, "residual": residual, "scale_group": group, "fp4": fp4,
            "scale_layout": _mxfp4_layout(index), **params}


def _mxfp4_layout(index: int) -> int:
    """MXFP4's scales (odd sites): AITER's shuffled order at every other one, rows at the rest."""
    return SCALES_SHUFFLED if index % 4 == 1 else SCALES_ROWS


class AllExamples(nn.Module):
    """Every pattern's example in one graph (one trace for all): site ``i`` reads ``x[i]``."""

    def __init__(self, patterns):
        super().__init__()
        self.patterns = patterns

        def row(centre):
            return nn.Parameter(centre + 0.1 * torch.randn(HIDDEN).bfloat16())

        self.weight, self.sum_weight, self.norm_bias = row(1.0), row(0.0), row(0.0)
        self.bias, self.bias_other = row(0.0), row(0.0)
        self.register_buffer("scale", torch.tensor([0.05]))
        self.register_buffer("x_scale", torch.tensor(8.0).bfloat16())
        self.register_buffer("global_scale", torch.tensor([200.0]))

    def forward(self, x, x_other, residual):
        params = {"weight": self.weight, "sum_weight": self.sum_weight, "norm_bias": self.norm_bias,
                  "bias": self.bias, "bias_other": self.bias_other, "scale": self.scale,
                  "x_scale": self.x_scale, "global_scale": self.global_scale}
        return [p.example(_inputs(p, i, x[i], x_other[i], residual, params), 1e-6)
                for i, p in enumerate(self.patterns)]


def _ancestors(nodes) -> set:
    seen, todo = set(), list(nodes)
    while todo:
        node = todo.pop()
        for arg in node.all_input_nodes:
            if arg not in seen:
                seen.add(arg)
                todo.append(arg)
    return seen


def leftovers(graph: torch.fx.Graph) -> list[str]:
    """Nodes beside the fused ops that compute a step: anything but views after them, and anything but
    what the replacement folds into x (and the biases) before them."""
    fused = [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_OPS]
    before = _ancestors(fused)
    left = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target in FUSED_OPS:
            continue
        allowed = BEFORE if node in before else VIEWS
        if node.target not in allowed:
            left.append(f"{node.name} = {node.target}")
    return left


def test_every_combination_of_steps_is_a_pattern_named_from_its_steps():
    names = [p.name for p in PATTERNS]
    assert len(names) == len(set(names)) == len(combinations())
    assert [p.length for p in PATTERNS] == sorted((p.length for p in PATTERNS), reverse=True)
    # The names the README, the clients' tests and users' reports use stay what they were.
    for name in ("AllReduceRMSNorm", "AllReduceAddRMSNorm", "AllReduceRMSNormQuant",
                 "AllReduceAddRMSNormQuant",
                 "AllReduceAddRMSNormDynamicQuant", "AllReduceRMSNormDynamicQuant",
                 "AllReducePostNormAddRMSNorm",
                 "AllReduceScaledRMSNorm", "AllReduceScaledAddRMSNorm", "AllReduceBiasAddRMSNorm",
                 "AllReduceLayerNorm", "AllReduceAddLayerNorm", "AllReduceBiasAddLayerNorm",
                 "TwoAllReducesBiasAddLayerNorm", "TwoAllReducesAddLayerNorm", "TwoAllReducesAddRMSNorm"):
        assert name in names
    steps = dict(scaled=False, branches=1, bias=True, post_norm=False, residual=True, norm=RmsNorm,
                 output=StaticFp8)
    assert pattern_name(steps) == "AllReduceBiasAddRMSNormQuant"


def _fuse_whole(patterns, trace=post_grad_pass_without_dynamo) -> None:
    """Every pattern's example, in one graph, fuses whole as that pattern: one op each, its steps."""
    torch.manual_seed(0)
    module = AllExamples(patterns)
    n = len(patterns)
    x = torch.randn(n, TOKENS, HIDDEN).bfloat16()
    x_other = torch.randn(n, TOKENS, HIDDEN).bfloat16()
    residual = torch.randn(TOKENS, HIDDEN).bfloat16()
    fusion_pass = FusionPass(fusion_limit=16)
    graph = trace(module, x, x_other, residual, fusion_pass=fusion_pass)
    [sites] = fusion_pass.reports
    expected = [p.name for p in patterns for _ in range(p.branches)]
    assert [s.pattern if s.fused else f"not fused: {s.reason}" for s in sites] == expected
    fused = [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_OPS]
    assert len(fused) == n
    assert leftovers(graph) == []
    # Each op does its own pattern's steps (site i reads x[i]), passed by keyword.
    for node in fused:
        [index] = {a.args[2] for a in _ancestors([node]) if a.op == "call_function"
                   and a.target == aten.select.int}
        pattern, steps = patterns[index], node.kwargs
        output = (Fp4 if steps.get("fp4") else DynamicFp8 if steps.get("scale_group") else
                  StaticFp8 if steps.get("quant_scale") is not None else Unquantised)
        if output is Fp4:  # NVFP4 with the model's global scale, MXFP4 without
            assert steps["fp4"] == (FP4_NVFP4, FP4_MXFP4)[index % 2], (pattern.name, steps)
            assert (steps.get("global_scale") is not None) == (steps["fp4"] == FP4_NVFP4), (pattern.name,
                                                                                            steps)
            assert steps.get("scale_layout", SCALES_ROWS) == _mxfp4_layout(index), (pattern.name, steps)
        does = (steps.get("bias") is not None, steps.get("sum_weight") is not None, node.args[1] is not None,
                LayerNorm if steps.get("layer_norm", False) else RmsNorm, steps.get("norm_bias") is not None,
                output, steps.get("shared_expert") is not None)
        wants = (pattern.bias, pattern.post_norm, pattern.residual, pattern.norm, pattern.norm is LayerNorm,
                 pattern.output, pattern.branches == 2)
        assert does == wants, (pattern.name, steps)


# torch 2.11 (the GPU machine's image) drops the .to(bf16).float() between a norm whose weight is applied
# in fp32 (Gemma's RMSNorm, a LayerNorm) and fp8's division; those sites fuse there too
# (matchers._cast_back). test_fp8_reads_the_norms_fp32_result_directly checks that graph on any torch.


def test_every_pattern_fuses_its_example_whole():
    _fuse_whole(PATTERNS)


class Site(nn.Module):
    """One block end in a form that must stay unfused (or, for ``plain``, fuses)."""

    def __init__(self, kind: str):
        super().__init__()
        self.kind = kind
        self.norm = HFRMSNorm(HIDDEN, 1e-5)
        self.register_buffer("scale", torch.tensor([0.02]))

    def forward(self, x, residual):
        op = "max" if self.kind == "max_all_reduce" else "sum"
        a = funcol.all_reduce(x, op, dist.group.WORLD)
        if self.kind == "op_between":  # no pattern has a tanh (a number times the sum would fuse)
            a = torch.tanh(a)
        h = residual + a
        y = self.norm(h)
        if self.kind == "sum_used_elsewhere":
            return y, h, a * 3
        return y, h


NOT_FUSED = [  # kind, dtype, the pass's arguments, what the report says, on tpfuse's plain all-reduce
    ("plain", torch.bfloat16, {}, "fused (AllReduceAddRMSNorm)", False),
    ("op_between", torch.bfloat16, {}, "no norm follows the all-reduce as a pattern has it (RMSNorm or "
                                       "LayerNorm, after a residual add, a bias or a post-norm: "
                                       "tpfuse.compiler.PATTERNS); its result goes to tanh", True),
    ("max_all_reduce", torch.bfloat16, {}, "all-reduce op is 'max', not 'sum'", False),
    ("plain", torch.float32, {}, "64 x torch.float32 is not supported by the kernels", False),
    ("sum_used_elsewhere", torch.bfloat16, {}, "the pre-add sum of the pattern has users outside it", True),
    ("fp32_weight", torch.bfloat16, {}, "the norm's result dtype differs from the input's", True),
    ("plain", torch.bfloat16, {"fusion_limit": 4}, "token range up to 6 exceeds the fusion limit 4", False),
    ("plain", torch.bfloat16, {"fusion_limit": None}, "has no tpfuse communicator that can fuse 64 x "
                                                      "torch.bfloat16 (call tpfuse.get_communicator", False),
]


@pytest.mark.parametrize("kind,dtype,options,says,plain", NOT_FUSED)
def test_sites_that_must_stay_unfused_say_why(kind, dtype, options, says, plain):
    """... and those the kernels can still sum run on tpfuse's plain all-reduce, the rest as they were."""
    torch.manual_seed(0)
    module = Site(kind).to(dtype)
    module.scale = module.scale.float()
    if kind == "fp32_weight":  # HF style with an fp32 gamma: the result becomes fp32, not x's dtype
        module.norm.float()
    fusion_pass = FusionPass(**{"fusion_limit": 16, **options})
    x, residual = torch.randn(TOKENS, HIDDEN).to(dtype), torch.randn(TOKENS, HIDDEN).to(dtype)
    graph = post_grad_pass(module, x, residual, fusion_pass=fusion_pass)
    [[site]] = fusion_pass.reports
    assert says in str(site) and site.plain is plain, str(site)
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert (torch.ops.tpfuse.all_reduce.default in ops) is plain
    assert (torch.ops._c10d_functional.all_reduce.default in ops) is (not plain and not site.fused)
    if plain:
        assert "runs on tpfuse's plain all-reduce" in str(site)


def test_a_dynamic_token_count_fuses_only_with_a_bound():
    x, residual = torch.randn(TOKENS, HIDDEN).bfloat16(), torch.randn(TOKENS, HIDDEN).bfloat16()
    for max_tokens, says in ((16, "fused (AllReduceAddRMSNorm)"), (None, "is unbounded")):
        fusion_pass = FusionPass(max_tokens=max_tokens, fusion_limit=16)
        post_grad_pass(Site("plain").bfloat16(), x, residual, fusion_pass=fusion_pass, dynamic=True)
        [[site]] = fusion_pass.reports
        assert says in str(site) and "[s" in str(site), str(site)


class Fp32NormThenFp8(nn.Module):
    """A block end whose norm's fp32 result fp8 reads directly, with no cast to bf16 between: what torch
    2.11's post-grad graph makes of Gemma's norm or a LayerNorm followed by fp8 (it drops the
    ``.to(bf16).float()``), written so that any torch's graph has it."""

    def __init__(self, layer_norm: bool, quant: str):
        super().__init__()
        self.layer_norm, self.quant = layer_norm, quant
        self.weight = nn.Parameter(1.0 + 0.1 * torch.randn(HIDDEN).bfloat16())
        self.norm_bias = nn.Parameter(0.1 * torch.randn(HIDDEN).bfloat16())
        self.register_buffer("scale", torch.tensor([0.05]))

    def forward(self, x, residual):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        c = h.float()
        if self.layer_norm:
            y = torch.nn.functional.layer_norm(c, (HIDDEN,), self.weight.float(), self.norm_bias.float(),
                                               1e-6)
        else:  # Gemma's: the weight (1 + w) applied in fp32
            y = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + 1e-6) * (1.0 + self.weight.float())
        if self.quant == "dynamic":
            q, scales = dynamic_fp8(y, 16)
            return q, scales, h
        fmt = fp8_format(y.device)
        return (y / self.scale).clamp(-fmt.max, fmt.max).to(fmt.dtype), h


@pytest.mark.parametrize("layer_norm", [True, False], ids=["layernorm", "gemma-rmsnorm"])
@pytest.mark.parametrize("quant", ["static", "dynamic"])
def test_fp8_reads_the_norms_fp32_result_directly(layer_norm, quant):
    x, residual = torch.randn(TOKENS, HIDDEN).bfloat16(), torch.randn(TOKENS, HIDDEN).bfloat16()
    fusion_pass = FusionPass(fusion_limit=16)
    graph = post_grad_pass_without_dynamo(Fp32NormThenFp8(layer_norm, quant), x, residual,
                                          fusion_pass=fusion_pass)
    [[site]] = fusion_pass.reports
    norm = "LayerNorm" if layer_norm else "RMSNorm"
    assert site.pattern == f"AllReduceAdd{norm}{'DynamicQuant' if quant == 'dynamic' else 'Quant'}", str(site)
    assert leftovers(graph) == []


EXPERTS = 4


class MoeBlockEnd(nn.Module):
    """A MoE block's end: the top-k experts' outputs ``[T * K, H]`` weighted (float32 weights, as routers
    give them) and summed over K as Hugging Face's batched / grouped experts do (``view(T, K, H).sum(1)``),
    cast back, plus the shared expert's part as vLLM adds it before its all-reduce; then the residual
    add and the norm. ``form`` leaves out the weights or the shared part."""

    def __init__(self, form: str):
        super().__init__()
        self.form = form
        self.norm = HFRMSNorm(HIDDEN, 1e-5)

    def forward(self, outputs, weights, shared, residual):
        if self.form != "unweighted":
            outputs = outputs * weights.reshape(-1).unsqueeze(-1)
        x = outputs.view(TOKENS, EXPERTS, HIDDEN).sum(dim=1).to(torch.bfloat16)
        if self.form != "routed only":
            x = x + shared
        h = residual + funcol.all_reduce(x, "sum", dist.group.WORLD)
        return self.norm(h), h


@pytest.mark.parametrize("form", ["weighted + shared", "unweighted", "routed only"])
def test_a_moe_finalize_fuses_into_the_op(form):
    """The experts' weighted sum and the shared part go into the op (x [T, K, H], topk_weights,
    shared_expert): nothing but views before it."""
    outputs = torch.randn(TOKENS * EXPERTS, HIDDEN).bfloat16()
    weights = torch.randn(TOKENS, EXPERTS).softmax(-1)
    shared, residual = torch.randn(TOKENS, HIDDEN).bfloat16(), torch.randn(TOKENS, HIDDEN).bfloat16()
    fusion_pass = FusionPass(fusion_limit=16)
    graph = post_grad_pass(MoeBlockEnd(form).bfloat16(), outputs, weights, shared, residual,
                           fusion_pass=fusion_pass)
    [[site]] = fusion_pass.reports
    assert site.fused, str(site)
    [op] = [n for n in graph.nodes if n.target in FUSED_OPS]
    assert tuple(op.args[0].meta["val"].shape) == (TOKENS, EXPERTS,
                                                   HIDDEN) and op.kwargs["experts"] == EXPERTS
    assert (op.kwargs.get("topk_weights") is not None) is (form != "unweighted")
    assert (op.kwargs.get("shared_expert") is not None) is (form != "routed only")
    before = {n.target for n in _ancestors([op]) if n.op == "call_function"}
    assert before <= VIEWS | {aten.unsqueeze.default}, before  # the weights' views: no copy, no sum


class NormQuantisedAndRead(nn.Module):
    """A norm whose result is quantised for the next GEMM and also read as it is (DeepSeek-V3.2's indexer,
    MLA): static or dynamic fp8, the dynamic scales rounded up to powers of two as DeepGEMM's UE8M0
    scales are made (``pow(2, ceil(log2(|s|)))`` or ``exp2``) or not."""

    def __init__(self, quant: str, ue8m0: str, copy: bool):
        super().__init__()
        self.quant, self.ue8m0, self.copy = quant, ue8m0, copy
        self.norm = HFRMSNorm(HIDDEN, 1e-5)
        self.register_buffer("scale", torch.tensor([0.05]))

    def forward(self, x, residual):
        h = funcol.all_reduce(x, "sum", dist.group.WORLD) + residual
        y = self.norm(h)
        fmt = fp8_format(y.device)
        if self.quant == "static":
            outputs = ((y.float() / self.scale.float()).clamp(-fmt.max, fmt.max).to(fmt.dtype), h)
        else:
            groups = y.float().unflatten(-1, (-1, 16))
            scales = (groups.abs().amax(-1, keepdim=True) / fmt.max).clamp(min=fmt.min_dynamic_scale)
            if self.ue8m0 == "pow":
                scales = torch.pow(2.0, torch.ceil(torch.log2(scales.abs())))
            elif self.ue8m0 == "exp2":
                scales = torch.exp2(torch.ceil(torch.log2(scales)))
            q = (groups / scales).clamp(-fmt.max, fmt.max).to(fmt.dtype).flatten(-2)
            outputs = (q, scales.squeeze(-1), h)
        return outputs + ((y,) if self.copy else ())


@pytest.mark.parametrize("quant, ue8m0, copy",
                         [("static", "", True), ("dynamic", "", True), ("dynamic", "pow", False),
                                                ("dynamic", "exp2", True)])
def test_the_norms_copy_and_ue8m0_scales_fuse_into_the_op(quant, ue8m0, copy):
    x, residual = torch.randn(TOKENS, HIDDEN).bfloat16(), torch.randn(TOKENS, HIDDEN).bfloat16()
    fusion_pass = FusionPass(fusion_limit=16)
    graph = post_grad_pass_without_dynamo(NormQuantisedAndRead(quant, ue8m0, copy).bfloat16(), x, residual,
                                          fusion_pass=fusion_pass)
    [[site]] = fusion_pass.reports
    quantised = "DynamicQuant" if quant == "dynamic" else "Quant"
    assert site.pattern == f"AllReduceAddRMSNorm{quantised}", str(site)
    assert leftovers(graph) == []
    [op] = [n for n in graph.nodes if n.op == "call_function" and n.target in FUSED_OPS]
    assert op.target == torch.ops.tpfuse.allreduce_add_rmsnorm_quant.default
    assert op.kwargs["normed_copy"] is copy and op.kwargs["ue8m0_scales"] is bool(ue8m0), op.kwargs
    # Every output the module returns comes from the op: its y, scales, h and the norm's copy.
    returned = [a for a in graph.output_node().args[0]]
    assert all(op in _ancestors([r]) | {r} for r in returned if isinstance(r, torch.fx.Node))


class GatedSharedExpert(nn.Module):
    """Qwen2-MoE's block end: the routed experts' all-reduce plus ``sigmoid(gate) * `` the shared expert's,
    the gate one value a token; ``own_gate``: the gate made from the shared expert's own partial sum (not
    the same on every rank)."""

    def __init__(self, own_gate: bool):
        super().__init__()
        self.own_gate = own_gate
        self.norm = HFRMSNorm(HIDDEN, 1e-5)

    def forward(self, routed, shared, gate_input, residual):
        gate = torch.sigmoid((shared if self.own_gate else gate_input).sum(-1, keepdim=True))
        h = funcol.all_reduce(routed, "sum", dist.group.WORLD) + gate * funcol.all_reduce(shared, "sum",
                                                                                          dist.group.WORLD)
        h = residual + h
        return self.norm(h), h


@pytest.mark.parametrize("own_gate", [False, True], ids=["replicated gate", "gate of the partial sum"])
def test_a_gated_second_all_reduce_goes_into_the_op(own_gate):
    """``all_reduce(a) + gate * all_reduce(b)`` is one op whose shared part is ``gate * b`` (the gate scales
    each rank's part); a gate computed from ``b`` itself differs by rank: ``b`` is all-reduced on its own
    (tpfuse's plain all-reduce) and its gated sum added with the residual."""
    routed, shared, gate_input, residual = (torch.randn(TOKENS, HIDDEN).bfloat16() for _ in range(4))
    fusion_pass = FusionPass(fusion_limit=16)
    graph = post_grad_pass(GatedSharedExpert(own_gate).bfloat16(), routed, shared, gate_input, residual,
                           fusion_pass=fusion_pass)
    [sites] = fusion_pass.reports
    ops = [n for n in graph.nodes if n.target in FUSED_OPS]
    if own_gate:
        assert [(s.pattern, s.plain) for s in sites] == [("AllReduceAddRMSNorm", False), (None, True)], sites
        [op] = ops
        # gate * b + residual
        assert "shared_expert" not in op.kwargs and op.args[1].target is aten.add.Tensor
        return
    assert [s.pattern for s in sites] == ["TwoAllReducesAddRMSNorm"] * 2, [str(s) for s in sites]
    [op] = ops
    shared_part = op.kwargs["shared_expert"]
    assert aten.mul.Tensor in {n.target for n in _ancestors([shared_part]) | {shared_part}}
    assert leftovers(graph) == ["sigmoid = aten.sigmoid.default"]  # the gate's own computation, before the op


class SequenceParallelSite(nn.Module):
    """Sequence parallel's block end as functional collectives write it: the rows reduce-scattered, this
    rank's residual rows added, RMSNorm, the normed rows all-gathered (or not: ``gathered``)."""

    def __init__(self, gathered: bool = True, sequence_first: bool = False):
        super().__init__()
        self.norm = nn.RMSNorm(HIDDEN, eps=1e-5)
        self.gathered, self.sequence_first = gathered, sequence_first

    def forward(self, x, residual):
        if self.sequence_first:  # torchtitan's plain tensors: x [B, S, H] scattered over S
            sequence_major = x.transpose(0, 1).contiguous()
            scattered = funcol.reduce_scatter_tensor(sequence_major, "sum", 0, dist.group.WORLD)
            h = scattered.transpose(0, 1) + residual
        else:
            h = funcol.reduce_scatter_tensor(x, "sum", 0, dist.group.WORLD) + residual
        y = self.norm(h).contiguous()
        return (funcol.all_gather_tensor(y, 0, dist.group.WORLD) if self.gathered else y * 2), h


@pytest.mark.parametrize("gathered, sequence_first", [(True, False), (False, False), (True, True)])
def test_a_reduce_scatter_into_a_gathered_norm_fuses_into_the_sharded_op(gathered, sequence_first):
    """At any token count (the sharded op runs in parts over the workspace): no bound is needed. Rows
    scattered sequence-first (permuted before the reduce-scatter and back after) fuse too (their numbers:
    tests/compiler/test_torchtitan.py)."""
    module = SequenceParallelSite(gathered, sequence_first).bfloat16()
    fusion_pass = FusionPass(fusion_limit=4)
    x, residual = torch.randn(2 * TOKENS, HIDDEN).bfloat16(), torch.randn(TOKENS, HIDDEN).bfloat16()
    if sequence_first:
        x, residual = x.view(2, TOKENS, HIDDEN), residual.view(2, TOKENS // 2, HIDDEN)
    graph = post_grad_pass(module, x, residual, fusion_pass=fusion_pass)
    [[site]] = fusion_pass.reports
    ops = [n.target for n in graph.nodes if n.op == "call_function"]
    assert site.collective == "reduce-scatter" and str(site).startswith("reduce-scatter [")
    if gathered:
        assert site.fused and site.pattern == "ReduceScatterAddRMSNormAllGather", str(site)
        assert torch.ops.tpfuse.reduce_scatter_add_rmsnorm_all_gather.default in ops
        assert not [t for t in ops if "_c10d_functional" in str(t)], ops
    else:
        assert not site.fused and site.code == "no-pattern" and "all-gathered" in site.reason, str(site)
