"""The fusion pass on vLLM's graph dialect, in one process: ``vllm.all_reduce`` followed by vLLM's IR norms
(``vllm_ir.fused_add_rms_norm`` / ``vllm_ir.rms_norm``) becomes tpfuse's op, and sites that must stay
vLLM's say why. vLLM itself is not needed: where it is not installed, stand-in ops of the same names and
schemas take its place (the pass knows ops by name). vLLM running the pass: tests/engines/test_vllm.py."""

import operator

import pytest
import torch
from torch.fx.experimental.proxy_tensor import make_fx

from tpfuse.blockend.bits import SCALES_COLUMNS, SCALES_PACKED_UE8M0
from tpfuse.compiler import FusionPass
from tpfuse.compiler.vllm_sites import functionalized, op_name

HIDDEN, EPS = 64, 1e-6
FUSED = torch.ops.tpfuse.allreduce_add_rmsnorm.default
SCHEMAS = {
    ("vllm", "all_reduce"): "all_reduce(Tensor tensor, str group_name) -> Tensor",
    ("vllm_ir", "rms_norm"): ("rms_norm(Tensor x, Tensor? weight, float epsilon, SymInt? variance_size=None) "
                              "-> Tensor"),
    ("vllm_ir", "fused_add_rms_norm"): ("fused_add_rms_norm(Tensor x, Tensor x_residual, Tensor? weight, "
                                        "float epsilon, SymInt? variance_size=None) -> (Tensor, Tensor)"),
    ("vllm", "reduce_scatter"): ("reduce_scatter(Tensor tensor, int dim, int world_size, str group_name) "
                                 "-> Tensor"),
}
_libraries = []


def _vllm_ops():
    """vLLM's three ops: vLLM's own where it is installed, else stand-ins with their schemas."""
    try:
        import vllm._custom_ops  # noqa: F401
        import vllm.distributed.parallel_state  # noqa: F401  (registers vllm::all_reduce)
        import vllm.ir.ops  # noqa: F401
    except ImportError:
        pass
    for (namespace, name), schema in SCHEMAS.items():
        if hasattr(getattr(torch.ops, namespace), name):
            continue
        library = torch.library.Library(namespace, "FRAGMENT")
        library.define(schema)
        _libraries.append(library)
        if name == "fused_add_rms_norm":
            impl = lambda x, r, w, eps, variance_size=None: (torch.empty_like(x), torch.empty_like(x))  # noqa: E731
        elif name == "reduce_scatter":
            impl = lambda x, dim, world_size, group: x.new_empty((x.shape[0] // world_size, x.shape[1]))  # noqa: E731
        else:
            impl = lambda x, *args, **kwargs: torch.empty_like(x)  # noqa: E731
        library.impl(name, impl, "CompositeExplicitAutograd")
    return torch.ops.vllm.all_reduce, torch.ops.vllm_ir.fused_add_rms_norm, torch.ops.vllm_ir.rms_norm


def vllm_graph(model, *inputs) -> torch.fx.Graph:
    """``model`` traced as vLLM's post-grad graph holds it: its ops opaque, the token count (the first
    dimension of 2-D inputs) symbolic, every other size static."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

    mode = FakeTensorMode(shape_env=ShapeEnv())

    def fake(t):
        sizes = [DimDynamic.DYNAMIC if t.dim() == 2 and i == 0 and t.shape[1] != t.shape[0]
                 else DimDynamic.STATIC for i in range(t.dim())]
        return mode.from_tensor(t, symbolic_context=StatelessSymbolicContext(dynamic_sizes=sizes))

    from torch._inductor.decomposition import select_decomp_table

    with mode:  # Inductor's decompositions, as its post-grad graph has them (casts as convert_element_type)
        return make_fx(model, tracing_mode="fake",
                       decomposition_table=select_decomp_table())(*map(fake, inputs)).graph


def native_norm(x, weight, eps):
    """vLLM's ``rms_norm`` as its native implementation writes it (traced where its IR ops are off)."""
    orig = x.dtype
    x = x.to(torch.float32)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x.to(weight.dtype) * weight).to(orig)


def native_add_norm(x, residual, weight, eps):
    """vLLM's ``fused_add_rms_norm``, native: the residual added in fp32, the norm of that fp32 row."""
    orig = x.dtype
    x = x.to(torch.float32) + residual.to(torch.float32)
    residual = x.to(orig)
    x = x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + eps)
    return (x.to(weight.dtype) * weight).to(orig), residual


def decoder(group="tp:0", ir=True):
    """Two layers of a vLLM decoder as the graph has them: the embedding's all-reduce into the first norm
    (no residual), then attention and MLP outputs into ``fused_add_rms_norm``, the model's last norm after;
    ``ir``: vLLM's IR norms, else the norms traced (``native_norm``, ``native_add_norm``)."""
    all_reduce, add_norm, norm = _vllm_ops()
    if not ir:
        add_norm, norm = native_add_norm, native_norm

    def forward(emb, w_in, w_out, *weights):
        s = all_reduce(emb, group)
        out, residual = norm(s, weights[0], EPS), s
        for weight in weights[1:]:
            partial = (out @ w_in) @ w_out  # a layer's row-parallel output
            out, residual = add_norm(all_reduce(partial, group), residual, weight, EPS)
        return out

    return forward


def inputs(tokens=6, norms=4):
    emb = torch.randn(tokens, HIDDEN, dtype=torch.bfloat16)
    w_in, w_out = (torch.randn(HIDDEN, HIDDEN, dtype=torch.bfloat16) for _ in range(2))
    return (emb, w_in, w_out) + tuple(torch.randn(HIDDEN, dtype=torch.bfloat16) for _ in range(norms))


def targets(graph: torch.fx.Graph) -> list:
    return [op_name(n) or n.target for n in graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("ir", [True, False], ids=["ir-norms", "traced-norms"])
def test_every_site_of_a_decoder_fuses_whole(ir):
    graph = vllm_graph(decoder(ir=ir), *inputs())
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    norm_ops = {torch.ops.aten.rsqrt.default, torch.ops.aten.mean.dim, torch.ops.aten.pow.Tensor_Scalar}
    left = [t for t in targets(graph) if str(t).startswith(("vllm::", "vllm_ir::")) or t in norm_ops]
    assert left == [], f"vLLM ops or a norm's steps left beside the fused op: {left}"
    fused = [n for n in graph.nodes if n.target is FUSED]
    assert len(fused) == 4 and fusion.fused_sites == 4 and fusion.unfused_sites == 0
    assert [n.args[1] is None for n in fused] == [True, False, False, False]  # the embedding has no residual
    assert all(n.args[4] == "7" and n.args[3] == EPS for n in fused)  # the c10d group, vLLM's eps
    # Each layer's residual is the h of the fused op before it (through the op's reshapes).
    for before, after in zip(fused, fused[1:]):
        residual = after.args[1]
        while residual.target is torch.ops.aten.reshape.default:
            residual = residual.args[0]
        assert residual.target is operator.getitem and residual.args == (before, 1)


@pytest.mark.parametrize("ir", [True, False], ids=["ir-norms", "traced-norms"])
def test_the_model_output_is_the_last_fused_norm(ir):
    graph = vllm_graph(decoder(ir=ir), *inputs(norms=2))
    FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})(graph)
    output = next(n for n in graph.nodes if n.op == "output").args[0]
    node = output[0] if isinstance(output, (tuple, list)) else output
    while node.target is torch.ops.aten.reshape.default:
        node = node.args[0]
    assert node.target is operator.getitem and node.args[0].target is FUSED and node.args[1] == 0


@pytest.mark.parametrize("case, reason, code", [
    ("over the limit", "token range up to 128 exceeds the fusion limit 64", "tokens"),
    ("no bound", "unbounded", "tokens"),
    ("unknown group", "has no process group known to the pass", "no-communicator"),
    ("no communicator", "has no tpfuse communicator", "no-communicator"),
])
def test_sites_that_cannot_fuse_stay_vllms_and_say_why(case, reason, code):
    graph = vllm_graph(decoder(), *inputs(norms=2))
    before = targets(graph)
    settings = {"over the limit": dict(max_tokens=128, fusion_limit=64, vllm_groups={"tp:0": "7"}),
                "no bound": dict(fusion_limit=64, vllm_groups={"tp:0": "7"}),
                "unknown group": dict(max_tokens=32, fusion_limit=64),
                "no communicator": dict(max_tokens=32, vllm_groups={"tp:0": "7"})}[case]
    fusion = FusionPass(**settings)
    fusion(graph)
    assert targets(graph) == before
    sites = fusion.reports[-1]
    assert len(sites) == 2 and not any(s.fused for s in sites)
    assert all(reason in s.reason for s in sites), [s.reason for s in sites]
    assert [s.code for s in sites] == [code, code]
    assert sites[0].group_name == "tp:0"


def test_an_all_reduce_without_a_norm_after_it_says_where_it_goes():
    all_reduce, _, _ = _vllm_ops()
    graph = vllm_graph(lambda x: all_reduce(x, "tp:0") * 2, torch.randn(4, HIDDEN, dtype=torch.bfloat16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert not site.fused and ("no vLLM RMSNorm follows the all-reduce; its result goes to aten::mul"
                               in site.reason)
    assert site.code == "no-pattern"
    # ... and it runs on tpfuse's plain all-reduce, in vLLM's group's process group
    assert site.plain
    (plain,) = [n for n in graph.nodes if n.target is torch.ops.tpfuse.all_reduce.default]
    assert plain.args[1] == "7" and not [t for t in targets(graph) if str(t).startswith("vllm::")]


def test_vllms_sequence_parallel_reduce_scatter_is_reported_with_its_reason():
    _, add_norm, _ = _vllm_ops()
    reduce_scatter = torch.ops.vllm.reduce_scatter

    def forward(x, residual, weight):
        return add_norm(reduce_scatter(x, 0, 2, "tp:0"), residual, weight, EPS)

    bf16 = torch.bfloat16
    graph = vllm_graph(forward, torch.randn(8, HIDDEN, dtype=bf16), torch.randn(4, HIDDEN, dtype=bf16),
                       torch.randn(HIDDEN, dtype=bf16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert not site.fused and site.code == "vllm-form" and site.collective == "reduce-scatter"
    assert str(site).startswith("reduce-scatter [") and "sequence-parallelism pass" in site.reason


def test_a_sum_read_besides_the_residual_add_is_not_fused():
    all_reduce, add_norm, _ = _vllm_ops()

    def forward(x, residual, weight):
        s = all_reduce(x, "tp:0")
        out, h = add_norm(s, residual, weight, EPS)
        return out, h, s * 2  # the pre-add sum has another user: the op cannot give it

    graph = vllm_graph(forward, *(torch.randn(4, HIDDEN, dtype=torch.bfloat16) for _ in range(2)),
                       torch.randn(HIDDEN, dtype=torch.bfloat16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert not site.fused and "has users besides vLLM's fused_add_rms_norm" in site.reason
    assert site.code == "outside-users"


@pytest.mark.parametrize("hidden, dtype, reason, code", [
    (60, torch.bfloat16, "hidden size 60 is not supported", "hidden"),
    (HIDDEN, torch.float32, "is not supported by the kernels", "dtype")])
def test_sizes_and_dtypes_the_kernels_lack_are_named(hidden, dtype, reason, code):
    all_reduce, _, norm = _vllm_ops()
    graph = vllm_graph(lambda x, w: norm(all_reduce(x, "tp:0"), w, EPS), torch.randn(4, hidden, dtype=dtype),
                       torch.randn(hidden, dtype=dtype))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert not site.fused and reason in site.reason and site.code == code


def test_gemmas_fp32_weight_plus_one_fuses():
    """vLLM's GemmaRMSNorm hands its IR ops ``weight.float() + 1``: an fp32 weight, applied in fp32 as
    the kernels apply it."""
    all_reduce, add_norm, _ = _vllm_ops()

    def forward(x, weight):
        residual = x * 2  # the same symbolic token count as the sum, as vLLM's graphs have
        return add_norm(all_reduce(x, "tp:0"), residual, weight.float() + 1.0, EPS)

    graph = vllm_graph(forward, torch.randn(4, HIDDEN, dtype=torch.bfloat16),
                       torch.randn(HIDDEN, dtype=torch.bfloat16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (fused,) = [n for n in graph.nodes if n.target is FUSED]
    assert fusion.fused_sites == 1 and fused.args[2].meta["val"].dtype == torch.float32


C_SCHEMAS = {
    "fused_add_rms_norm_static_fp8_quant": ("(Tensor(a!) result, Tensor input, Tensor(b!) residual, "
                                            "Tensor weight, Tensor scale, float epsilon) -> ()"),
    "rms_norm_static_fp8_quant": ("(Tensor(a!) result, Tensor input, Tensor weight, Tensor scale, "
                                  "float epsilon) -> ()"),
    "static_scaled_fp8_quant": ("(Tensor(a!) result, Tensor input, Tensor scale, "
                                "int[]? group_shape=None) -> ()"),
    "per_token_group_fp8_quant": ("(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s, int group_size, "
                                  "float eps, float fp8_min, float fp8_max, bool scale_ue8m0, "
                                  "bool dummy_is_scale_transposed, bool dummy_is_tma_aligned) -> ()"),
    "per_token_group_fp8_quant_packed": ("(Tensor input, Tensor(a!) output_q, Tensor(b!) output_s_packed, "
                                         "int group_size, float eps, float fp8_min, float fp8_max) -> ()"),
    "scaled_fp4_quant": ("(Tensor(a!) output, Tensor input, Tensor(b!) output_scale, Tensor input_scale, "
                         "bool is_sf_swizzled_layout) -> ()"),
    "dynamic_per_token_scaled_fp8_quant": ("(Tensor(a!) result, Tensor input, Tensor(b!) scale, "
                                           "Tensor? scale_ub) -> ()"),
}


def _vllm_fp8_ops():
    """vLLM's CUDA fp8 ops (the CPU build has none): stand-ins with their schemas, which write nothing."""
    for name, schema in C_SCHEMAS.items():
        if not hasattr(torch.ops._C, name):
            library = torch.library.Library("_C", "FRAGMENT")
            library.define(name + schema)
            library.impl(name, lambda *args, **kwargs: None, "CompositeExplicitAutograd")
            _libraries.append(library)
    return torch.ops._C


@pytest.mark.parametrize("form", ["vllm-fused-add", "vllm-fused", "ir-add-then-quant", "ir-then-quant"])
def test_static_fp8_as_vllm_writes_it_fuses_whole(form):
    """vLLM's norm + quant ops (its own fusion ran first) and its custom quant op after an IR norm: one
    fused op with ``quant_scale``, its fp8 output where vLLM's was, the residual where vLLM's was."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    all_reduce, add_norm, norm = _vllm_ops()
    ops = _vllm_fp8_ops()

    def forward(x, weight, scale):
        residual = x * 2  # a [tokens, H] residual with the same symbolic token count, as vLLM's graphs have
        s = all_reduce(x, "tp:0")
        q = torch.empty_like(s, dtype=torch.float8_e4m3fn)
        if form == "vllm-fused-add":
            _, q, h = auto_functionalized(ops.fused_add_rms_norm_static_fp8_quant.default, result=q, input=s,
                                          residual=residual, weight=weight, scale=scale, epsilon=EPS)
            return q, h
        if form == "vllm-fused":
            _, q = auto_functionalized(ops.rms_norm_static_fp8_quant.default, result=q, input=s,
                                       weight=weight, scale=scale, epsilon=EPS)
            return q, s
        out, h = (add_norm(s, residual, weight, EPS) if form == "ir-add-then-quant"
                  else (norm(s, weight, EPS), s))
        _, q = auto_functionalized(ops.static_scaled_fp8_quant.default, result=q, input=out, scale=scale,
                                   group_shape=None)
        return q, h

    x = torch.randn(6, HIDDEN, dtype=torch.bfloat16)
    graph = vllm_graph(forward, x, torch.randn(HIDDEN, dtype=torch.bfloat16), torch.ones(1))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert site.fused and site.pattern == ("AllReduceAddRMSNormQuant" if "add" in form
                                           else "AllReduceRMSNormQuant")
    left = [t for t in targets(graph)
            if str(t).startswith(("vllm", "_C::")) or t is torch.ops.higher_order.auto_functionalized]
    assert left == [], left
    (fused,) = [n for n in graph.nodes if n.target is FUSED]
    assert fused.kwargs["quant_scale"].op == "placeholder" and (fused.args[1] is None) == ("add" not in form)
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    q, h = outputs
    while q.target is torch.ops.aten.reshape.default:
        q = q.args[0]
    assert (q.target is operator.getitem and q.args == (fused, 0)
            and q.meta["val"].dtype == torch.float8_e4m3fn)


def test_gemmas_post_norm_into_the_next_add_fuses_as_one_site():
    """Gemma 2/3 in vLLM: ``rms_norm`` of the sum (the post-norm, ``1 + w`` in fp32) read by the next
    ``fused_add_rms_norm``: one fused op with the post-norm's gain as ``sum_weight``."""
    all_reduce, add_norm, norm = _vllm_ops()

    def forward(x, post_weight, weight):
        residual = x * 2
        post = norm(all_reduce(x, "tp:0"), post_weight.float() + 1.0, EPS)
        return add_norm(post, residual, weight.float() + 1.0, EPS)

    graph = vllm_graph(forward, torch.randn(4, HIDDEN, dtype=torch.bfloat16),
                       *(torch.randn(HIDDEN, dtype=torch.bfloat16) for _ in range(2)))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert site.fused and site.pattern == "AllReducePostNormAddRMSNorm", str(site)
    (fused,) = [n for n in graph.nodes if n.target is FUSED]
    assert fused.kwargs["sum_weight"] is not None and fused.args[1] is not None
    assert not [t for t in targets(graph) if str(t).startswith(("vllm::", "vllm_ir::"))]


@pytest.mark.parametrize("form", ["rows", "columns", "ue8m0", "packed", "range of 224", "groups of 48",
                                  "packed rows"])
def test_group_fp8_as_vllm_writes_it_fuses_whole(form):
    """vLLM's ``per_token_group_fp8_quant`` after its norm (DeepSeek-V3's block fp8): one op with the
    group, UE8M0 rounding and the scales' layout taken from vLLM's ``output_s``; its ``..._packed`` op
    (UE8M0 bytes four to an int32, column-major: DeepGEMM on Blackwell) the same with the packed layout;
    a clamp, group or scale layout the op does not make stays vLLM's, saying why."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    all_reduce, add_norm, _ = _vllm_ops()
    ops = _vllm_fp8_ops()
    group = (48 if form == "groups of 48"
             else 8 if form.startswith("packed") else 16)  # packed: two words a row
    fp8_max = 224.0 if form == "range of 224" else 448.0

    def forward(x, weight):
        residual = x * 2
        out, h = add_norm(all_reduce(x, "tp:0"), residual, weight, EPS)
        q = torch.empty_like(out, dtype=torch.float8_e4m3fn)
        tokens, groups = out.shape[0], HIDDEN // group
        if form == "columns":  # DeepGEMM's on Hopper: column-major, the tokens padded to 4
            scales = torch.empty((groups, (tokens + 3) // 4 * 4), dtype=torch.float32).t()[:tokens]
        elif form.startswith("packed"):
            # as vLLM's per_token_group_quant_fp8_packed_for_deepgemm allocates them
            words, padded = (groups + 3) // 4, (tokens + 3) // 4 * 4
            scales = torch.empty_strided((tokens, words), (1, padded) if form == "packed" else (words, 1),
                                         dtype=torch.int32)
            _, q, scales = auto_functionalized(ops.per_token_group_fp8_quant_packed.default, input=out,
                                               output_q=q, output_s_packed=scales, group_size=group,
                                               eps=1e-10, fp8_min=-fp8_max, fp8_max=fp8_max)
            return q, scales, h
        else:
            scales = torch.empty((tokens, groups), dtype=torch.float32)
        _, q, scales = auto_functionalized(ops.per_token_group_fp8_quant.default, input=out, output_q=q,
                                           output_s=scales, group_size=group, eps=1e-10, fp8_min=-fp8_max,
                                           fp8_max=fp8_max, scale_ue8m0=form == "ue8m0",
                                           dummy_is_scale_transposed=form == "columns",
                                           dummy_is_tma_aligned=False)
        return q, scales, h

    graph = vllm_graph(forward, torch.randn(6, HIDDEN, dtype=torch.bfloat16),
                       torch.randn(HIDDEN, dtype=torch.bfloat16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    if form in ("range of 224", "groups of 48", "packed rows"):
        assert not site.fused and {"range of 224": "+-224", "groups of 48": "groups of 48",
                                   "packed rows": "packed column-major"}[form] in site.reason, site
        assert site.code == "vllm-form"
        return
    assert site.fused and site.pattern == "AllReduceAddRMSNormDynamicQuant", site
    left = [t for t in targets(graph)
            if str(t).startswith(("vllm", "_C::")) or t is torch.ops.higher_order.auto_functionalized]
    assert left == [], left
    fused = [n for n in graph.nodes
             if n.op == "call_function" and n.target is torch.ops.tpfuse.allreduce_add_rmsnorm_quant.default]
    (op,) = fused
    assert op.kwargs["scale_group"] == group
    assert op.kwargs.get("ue8m0_scales", False) is (form in ("ue8m0", "packed"))
    assert op.kwargs.get("scale_layout", 0) == {"columns": SCALES_COLUMNS,
                                                 "packed": SCALES_PACKED_UE8M0}.get(form, 0)
    # The graph's scales output is the op's, with vLLM's layout (its strides) and dtype.
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    assert outputs[1].meta["val"].stride() == (
        (1, 8) if form in ("columns", "packed") else (HIDDEN // group, 1)), outputs[1].meta["val"].stride()
    assert outputs[1].meta["val"].dtype == (torch.int32 if form == "packed" else torch.float32)


@pytest.mark.parametrize("form", ["swizzled", "linear", "global scale of two"])
def test_nvfp4_as_vllm_writes_it_fuses_whole(form):
    """vLLM's ``scaled_fp4_quant`` after its norm (NVFP4 on Blackwell): one ``allreduce_add_rmsnorm_quant``
    with ``fp4=NVFP4`` and vLLM's ``input_scale`` as the global scale; its codes where vLLM's were, its
    swizzled scales as the int32 words vLLM allocates. Linear scales, or a global scale that is not one
    float, stay vLLM's, saying why."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    from tpfuse.blockend.bits import FP4_NVFP4

    all_reduce, add_norm, _ = _vllm_ops()
    ops = _vllm_fp8_ops()
    swizzled = form != "linear"

    def forward(x, weight, global_scale):
        residual = x * 2
        out, h = add_norm(all_reduce(x, "tp:0"), residual, weight, EPS)
        tokens = out.shape[0]
        q = torch.empty((tokens, HIDDEN // 2), dtype=torch.uint8)
        if swizzled:  # as vLLM's scaled_fp4_quant allocates them: rows to 128, groups to 4, four an int32
            rows, groups = (tokens + 127) // 128 * 128, (HIDDEN // 16 + 3) // 4 * 4
            scales = torch.empty((rows, groups // 4), dtype=torch.int32)
        else:
            scales = torch.empty((tokens, HIDDEN // 16), dtype=torch.uint8)
        _, q, scales = auto_functionalized(ops.scaled_fp4_quant.default, output=q, input=out,
                                           output_scale=scales, input_scale=global_scale,
                                           is_sf_swizzled_layout=swizzled)
        return q, scales, h

    global_scale = torch.full((2,) if form == "global scale of two" else (1,), 448.0 * 6)
    graph = vllm_graph(forward, torch.randn(6, HIDDEN, dtype=torch.bfloat16),
                       torch.randn(HIDDEN, dtype=torch.bfloat16), global_scale)
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    if form != "swizzled":
        assert not site.fused and site.code == "vllm-form", site
        assert ("linear" if form == "linear" else "global scale") in site.reason, site
        assert [n for n in graph.nodes if functionalized(n) == "_C::scaled_fp4_quant"], \
            "vLLM's quant op is gone"
        return
    assert site.fused and site.pattern == "AllReduceAddRMSNormFp4Quant", site
    left = [t for t in targets(graph)
            if str(t).startswith(("vllm", "_C::")) or t is torch.ops.higher_order.auto_functionalized]
    assert left == [], left
    (op,) = [n for n in graph.nodes if n.target is torch.ops.tpfuse.allreduce_add_rmsnorm_quant.default]
    assert op.kwargs["fp4"] == FP4_NVFP4 and op.kwargs["global_scale"].op == "placeholder"
    assert op.args[1] is not None  # the residual
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    codes, scales = (o.meta["val"] for o in outputs[:2])
    assert codes.dtype == torch.uint8 and codes.shape[-1] == HIDDEN // 2
    # vLLM's output_scale: the op's e4m3 scales as int32 words, four to a word, rows padded to 128
    assert scales.dtype == torch.int32 and scales.shape[-1] == (HIDDEN // 16 + 3) // 4
    base = outputs[1]
    while base.target is torch.ops.aten.view.dtype:
        base = base.args[0]
    assert (base.target is operator.getitem and base.args[0] is op
            and base.meta["val"].dtype == torch.float8_e4m3fn)


@pytest.mark.parametrize("form", ["per token", "bounded"])
def test_per_token_fp8_as_vllm_writes_it_fuses_whole(form):
    """vLLM's ``dynamic_per_token_scaled_fp8_quant`` after its norm: one op with a scale a token
    (``scale_group`` the hidden size), its ``[T, 1]`` scales vLLM's; with an upper bound on the scales
    (``scale_ub``) it stays vLLM's, saying why."""
    from torch._higher_order_ops.auto_functionalize import auto_functionalized

    all_reduce, add_norm, _ = _vllm_ops()
    ops = _vllm_fp8_ops()

    def forward(x, weight, bound):
        residual = x * 2
        out, h = add_norm(all_reduce(x, "tp:0"), residual, weight, EPS)
        q = torch.empty_like(out, dtype=torch.float8_e4m3fn)
        scales = torch.empty((out.shape[0], 1), dtype=torch.float32)
        _, q, scales = auto_functionalized(ops.dynamic_per_token_scaled_fp8_quant.default, result=q,
                                           input=out, scale=scales,
                                           scale_ub=bound if form == "bounded" else None)
        return q, scales, h

    graph = vllm_graph(forward, torch.randn(6, HIDDEN, dtype=torch.bfloat16),
                       torch.randn(HIDDEN, dtype=torch.bfloat16), torch.ones(1))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    if form == "bounded":
        assert not site.fused and site.code == "vllm-form" and "scale_ub" in site.reason, site
        return
    assert site.fused and site.pattern == "AllReduceAddRMSNormDynamicQuant", site
    left = [t for t in targets(graph)
            if str(t).startswith(("vllm", "_C::")) or t is torch.ops.higher_order.auto_functionalized]
    assert left == [], left
    (op,) = [n for n in graph.nodes if n.target is torch.ops.tpfuse.allreduce_add_rmsnorm_quant.default]
    assert op.kwargs["scale_group"] == HIDDEN and op.args[1] is not None
    outputs = next(n for n in graph.nodes if n.op == "output").args[0]
    scales = outputs[1].meta["val"]
    assert (scales.dtype == torch.float32 and scales.shape[-1] == 1
            and outputs[0].meta["val"].dtype == torch.float8_e4m3fn)


def _through_reshapes(node: torch.fx.Node) -> torch.fx.Node:
    while node.target is torch.ops.aten.reshape.default:
        node = node.args[0]
    return node


def _x_of(fused: torch.fx.Node) -> torch.fx.Node:
    """The op's x argument, through its reshapes."""
    return _through_reshapes(fused.args[0])


@pytest.mark.parametrize("factor", ["number", "0-dim buffer", "[H] buffer"])
def test_a_scaled_embedding_into_the_first_norm_fuses(factor):
    """Gemma's ``embed_tokens(ids) * normalizer`` (a 0-dim fp32 buffer) and Granite's ``*=
    embedding_multiplier`` (a number) in vLLM: ``all_reduce -> mul -> rms_norm``, the product the first
    residual (read by the next ``fused_add_rms_norm``): each rank's part is scaled before the sum."""
    all_reduce, add_norm, norm = _vllm_ops()

    def forward(x, y, scale, weight, weight2):
        by = 12.0 if factor == "number" else scale
        embedded = all_reduce(x, "tp:0") * by
        out = norm(embedded, weight, EPS)
        return add_norm(all_reduce(y + out, "tp:0"), embedded, weight2, EPS)

    scale = torch.tensor(16.0) if factor == "0-dim buffer" else torch.randn(HIDDEN, dtype=torch.bfloat16)
    graph = vllm_graph(forward, *(torch.randn(6, HIDDEN, dtype=torch.bfloat16) for _ in range(2)), scale,
                       *(torch.randn(HIDDEN, dtype=torch.bfloat16) for _ in range(2)))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    first, second = fusion.reports[-1]
    assert first.fused and first.pattern == "AllReduceScaledRMSNorm", str(first)
    assert second.fused and second.pattern == "AllReduceAddRMSNorm", str(second)
    assert not [t for t in targets(graph) if str(t).startswith(("vllm::", "vllm_ir::"))]
    scaled_op, add_op = [n for n in graph.nodes if n.target is FUSED]
    x = _x_of(scaled_op)  # x * factor, before the op's all-reduce
    assert x.target is torch.ops.aten.mul.Tensor and _through_reshapes(x.args[0]).op == "placeholder"
    assert x.args[1] == 12.0 if factor == "number" else x.args[1].op == "placeholder"
    assert scaled_op.args[1] is None  # no residual: the scaled sum is the op's h ...
    residual = _through_reshapes(add_op.args[1])  # ... which the next site takes as its residual
    assert residual.target is operator.getitem and residual.args == (scaled_op, 1)


@pytest.mark.parametrize("form", ["granite-add", "fused_add_rms_norm"])
def test_a_scaled_sum_added_to_the_residual_fuses(form):
    """Granite's layers in vLLM, ``residual + out * residual_multiplier`` then ``rms_norm`` of it (the new
    residual, read again by the next add), and the same through vLLM's ``fused_add_rms_norm``."""
    all_reduce, add_norm, norm = _vllm_ops()

    def forward(x, weight):
        residual = x * 2  # the same symbolic token count as the sum, as vLLM's graphs have
        scaled = all_reduce(x, "tp:0") * 0.22
        if form == "granite-add":
            h = residual + scaled
            return norm(h, weight, EPS), h * 2
        return add_norm(scaled, residual, weight, EPS)

    graph = vllm_graph(forward, torch.randn(6, HIDDEN, dtype=torch.bfloat16),
                       torch.randn(HIDDEN, dtype=torch.bfloat16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert site.fused and site.pattern == "AllReduceScaledAddRMSNorm", str(site)
    (fused,) = [n for n in graph.nodes if n.target is FUSED]
    assert _x_of(fused).target is torch.ops.aten.mul.Tensor and _x_of(fused).args[1] == 0.22
    assert _through_reshapes(fused.args[1]).target is torch.ops.aten.mul.Tensor  # the residual, x * 2
    left = [t for t in targets(graph) if str(t).startswith(("vllm::", "vllm_ir::"))]
    assert left == [] and torch.ops.aten.add.Tensor not in targets(graph), targets(graph)


def test_a_sum_scaled_by_a_value_computed_in_the_graph_stays_vllms():
    """A factor the graph computes (here from the rank's own input) may differ between ranks: scaling
    each rank's part would not scale the sum by it. The site stays vLLM's, saying why."""
    all_reduce, _, norm = _vllm_ops()

    def forward(x, weight):
        return norm(all_reduce(x, "tp:0") * x.float().mean().to(torch.bfloat16), weight, EPS)

    graph = vllm_graph(forward, torch.randn(6, HIDDEN, dtype=torch.bfloat16),
                       torch.randn(HIDDEN, dtype=torch.bfloat16))
    fusion = FusionPass(max_tokens=32, fusion_limit=64, vllm_groups={"tp:0": "7"})
    fusion(graph)
    (site,) = fusion.reports[-1]
    assert not site.fused and site.code == "operands" and "computed in the graph" in site.reason, str(site)
