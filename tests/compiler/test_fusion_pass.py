"""The compiler pass on a 4-layer tensor-parallel Llama and on sites that must stay unfused (2 gloo ranks)."""

import logging

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch import nn

import tpfuse
from tpfuse.models import Transformer
from tpfuse.models.llama import HFRMSNorm
from tpfuse.testing import fused_calls, rank_backends, rank_device

BACKENDS = rank_backends()

SMALL, LARGE = (5, 11), (24, 37)  # token counts below and above the fusion limit (16)


def _sites_fused(backend) -> tuple[int, int]:
    return sum(p.fused_sites for p in backend.passes), sum(p.unfused_sites for p in backend.passes)


LAYERS = 2  # the second layer's norm takes the first layer's MLP all-reduce
SITES = 2 * LAYERS


def _llama(rank, world_size, backend, norm_style, all_reduce_style, mode=None):
    device = rank_device(backend, rank)
    tpfuse.destroy_all()  # the limit must be 16 (SMALL / LARGE), whatever an earlier test of the pool grew
    tpfuse.get_communicator(max_tokens=16, hidden=64)
    model = Transformer.build("tiny", norm_style=norm_style, all_reduce_style=all_reduce_style, device=device,
                              n_layers=LAYERS)
    compiled = tpfuse.compile(model, mode=mode)
    runs = {}
    for tokens in SMALL + LARGE:
        ids = torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(tokens)).to(device)
        with torch.no_grad():
            expected = model(ids).cpu()
            tpfuse.reset_stats()
            got = compiled(ids).cpu()
            calls = tpfuse.stats().get("triton.oneshot", 0)
            replayed = compiled(ids).cpu()  # a second call: with CUDA graphs, a replay
        runs[tokens] = (expected, got, calls, replayed)
    return runs, dict(compiled.tpfuse_backend.compiles), _sites_fused(compiled.tpfuse_backend)


@pytest.mark.parametrize("backend", BACKENDS)
# The gpt-fast and torch norm styles are also the real clients' (test_clients.py): extended lane in CI.
@pytest.mark.parametrize("norm_style,all_reduce_style",
                         [("hf", "functional"),
                          pytest.param("gptfast", "inplace", marks=pytest.mark.extended),
                          pytest.param("torch", "functional", marks=pytest.mark.extended)])
def test_every_site_of_a_tp_llama_is_fused_below_the_limit(rank_pool, backend, norm_style, all_reduce_style):
    results = rank_pool(2, backend).run(_llama, backend, norm_style, all_reduce_style, timeout=900)
    for runs, compiles, (fused, unfused) in results:
        assert compiles == {"fused": 1, "plain": 1}  # one compilation per range
        assert (fused, unfused) == (SITES, 0)  # 2 sites a layer, no all-reduce left in the fused graph
        for tokens, (expected, got, kernel_calls, replayed) in runs.items():
            assert kernel_calls == (SITES if tokens in SMALL else 0), (tokens, kernel_calls)
            # The model's own matmuls are not bit-stable from call to call on a loaded CPU, so the
            # compiled model is held to eager by tolerance; the op's bit-identity is tested in tests/ops.
            for out in (got, replayed):
                torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.skipif("nccl" not in BACKENDS, reason="needs 2 GPUs")
def test_reduce_overhead_mode_on_gpus(rank_pool):
    for runs, compiles, (fused, _) in rank_pool(2, "nccl").run(_llama, "nccl", "hf", "functional",
                                                                "reduce-overhead", timeout=900):
        assert compiles == {"fused": 1, "plain": 1} and fused == SITES
        for tokens, (expected, got, kernel_calls, replayed) in runs.items():
            assert kernel_calls == (SITES if tokens in SMALL else 0), (tokens, kernel_calls)
            for out in (got, replayed):
                torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=3e-2)


def test_pass_identity_is_stable_for_inductors_cache():
    from tpfuse.compiler import FusionPass

    assert FusionPass(16).uuid() == FusionPass(16).uuid() != FusionPass(32).uuid()
    assert FusionPass(token_bounds={"s0": 16}).uuid() != FusionPass(token_bounds={"s0*s1": 16}).uuid()


def _pass_keys(rank, world_size):
    """The pass's cache key under different communicators of the same group."""
    from tpfuse.compiler import FusionPass

    keys = {}
    settings = [("triton-16", {"max_tokens": 16}), ("triton-16-again", {"max_tokens": 16}),
                ("triton-32", {"max_tokens": 32}), ("reference", {"max_tokens": 16, "backend": "reference"}),
                ("none", None)]
    for name, kwargs in settings:
        tpfuse.destroy_all()
        if kwargs is not None:
            tpfuse.get_communicator(hidden=64, **kwargs)
        keys[name] = FusionPass(16).uuid()
    tpfuse.destroy_all()
    return keys


def test_pass_cache_key_covers_the_communicators(rank_pool):
    # Inductor reuses a compiled graph whose key matches: a key blind to the communicators would
    # replay a graph fused for one backend or size under another.
    keys = rank_pool(2).run(_pass_keys)[0]
    assert keys["triton-16"] == keys["triton-16-again"]
    assert len({keys[k] for k in ("triton-16", "triton-32", "reference", "none")}) == 4


def _fused_on_a_fresh_cache(rank, world_size, backend, comm_backend):
    """Compile the tiny TP Llama with Inductor's caches off: the pass must run and decide by itself."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    tpfuse.destroy_all()
    device = rank_device(backend, rank)
    tpfuse.get_communicator(max_tokens=16, hidden=64, backend=comm_backend)
    model = Transformer.build("tiny", device=device)
    compiled = tpfuse.compile(model)
    ids = torch.randint(0, 256, (6,), generator=torch.Generator().manual_seed(6)).to(device)
    with (torch.no_grad(), inductor_config.patch(fx_graph_cache=False),
          functorch_config.patch(enable_autograd_cache=False)):
        tpfuse.reset_stats()
        compiled(ids)
    calls = fused_calls()
    tpfuse.destroy_all()
    return _sites_fused(compiled.tpfuse_backend)[0], calls


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("comm_backend", ["triton", "flashinfer", "reference"])
def test_each_communicator_backend_fuses_on_an_empty_cache(rank_pool, backend, comm_backend):
    if comm_backend == "flashinfer":
        from tpfuse.comm.flashinfer import load_flashinfer

        if backend != "nccl":
            pytest.skip("FlashInfer runs on GPUs")
        try:
            load_flashinfer()
        except ImportError as exc:
            pytest.skip(str(exc))
    expected = 0 if comm_backend == "reference" else 8  # 4 layers, 2 sites each
    results = rank_pool(2, backend).run(_fused_on_a_fresh_cache, backend, comm_backend, timeout=900)
    for fused, calls in results:
        assert (fused, calls) == (expected, expected)


class Site(nn.Module):
    """One block end, in a form chosen by ``kind``: fusable ones and ones that must stay unfused."""

    def __init__(self, kind: str, hidden: int = 64):
        super().__init__()
        self.kind = kind
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm = HFRMSNorm(hidden, 1e-5)
        self.register_buffer("scale", torch.tensor([0.02]))

    def forward(self, x, residual):
        partial = self.proj(x)
        op = "max" if self.kind == "max_all_reduce" else "sum"
        a = funcol.all_reduce(partial, op, dist.group.WORLD)
        if self.kind == "no_residual":
            return (self.norm(a),)
        if self.kind == "op_between":  # no pattern has a tanh (a number times the sum would fuse)
            a = torch.tanh(a)
        h = residual + a
        y = self.norm(h)
        if self.kind == "fp8":
            return (y.float() / self.scale).clamp(-448.0, 448.0).to(torch.float8_e4m3fn), h
        if self.kind == "sum_used_elsewhere":
            return y, h, a * 3
        return y, h


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.messages = []

    def emit(self, record):
        self.messages.append(f"{record.levelname}: {record.getMessage()}")


def _site(rank, world_size, kind, dtype):
    records = _Records()
    logger = logging.getLogger("tpfuse.compiler")
    logger.setLevel(logging.INFO)
    logger.addHandler(records)
    tpfuse.get_communicator(max_tokens=16, hidden=64)
    torch.manual_seed(rank)
    module = Site(kind).to(dtype)
    module.scale = module.scale.float()  # a static fp8 scale stays float32
    if kind == "fp32_weight":  # HF style with an fp32 gamma: the result becomes fp32, not x's dtype
        module.norm.float()
    nn.init.normal_(module.norm.weight, 1.0, 0.1)
    compiled = tpfuse.compile(module)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(rank)).to(dtype)
    residual = torch.randn(6, 64, generator=torch.Generator().manual_seed(99)).to(dtype)
    with torch.no_grad():
        expected = module(x, residual)
        tpfuse.reset_stats()
        got = compiled(x, residual)
    logger.removeHandler(records)
    return (expected, got, _sites_fused(compiled.tpfuse_backend), tpfuse.stats().get("triton.oneshot", 0),
            records.messages)


@pytest.mark.parametrize("kind,dtype,fused,logged", [
    ("no_residual", torch.bfloat16, 1, "fused 1 of 1"),
    ("fp8", torch.bfloat16, 1, "fused 1 of 1"),
    ("plain", torch.float16, 1, "fused 1 of 1"),
    ("op_between", torch.bfloat16, 0, "WARNING: tpfuse: fused 0 of 1 all-reduce sites; not fused: 1 x "
                                      "no norm follows the all-reduce as a pattern has it (RMSNorm or "
                                      "LayerNorm, after a residual add, a bias or a post-norm: "
                                      "tpfuse.compiler.PATTERNS); its result goes to tanh"),
    ("max_all_reduce", torch.bfloat16, 0, "WARNING: tpfuse: fused 0 of 1 all-reduce sites; not fused: 1 x "
                                          "all-reduce op is 'max'"),
    ("plain", torch.float32, 0, "WARNING: tpfuse: fused 0 of 1 all-reduce sites; not fused: 1 x "
                                "64 x torch.float32 is not supported"),  # dtype the kernels do not take
    ("sum_used_elsewhere", torch.bfloat16, 0, "WARNING: tpfuse: fused 0 of 1 all-reduce sites; "
                                              "not fused: 1 x the pre-add sum of the pattern has users "
                                              "outside it"),
    ("fp32_weight", torch.bfloat16, 0, "WARNING: tpfuse: fused 0 of 1 all-reduce sites; not fused: 1 x the "
                                       "norm's result dtype differs"),
])
def test_sites_fuse_only_when_they_may_and_stay_right(rank_pool, kind, dtype, fused, logged):
    results = rank_pool(2).run(_site, kind, dtype)
    for expected, got, (fused_sites, unfused_sites), kernel_calls, messages in results:
        if logged:
            assert any(logged in m for m in messages), messages
        # Sites the backend already knows to be ineligible (max, fp32) get no fused graph at all.
        assert fused_sites == fused and unfused_sites <= 1 - fused, (fused_sites, unfused_sites, kernel_calls)
        assert kernel_calls == fused
        for e, g in zip(expected, got):
            if e.dtype == torch.float8_e4m3fn:
                torch.testing.assert_close(g.float(), e.float(), atol=0.05, rtol=0.13)
            else:
                torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)


class SiteBesideAWiderAllReduce(nn.Module):
    """A fusable block end beside an all-reduce of 4 rows a token that no pattern takes (as an MoE's
    expert copies are in a block end of a form tpfuse does not know)."""

    def __init__(self, hidden: int = 64):
        super().__init__()
        self.proj = nn.Linear(hidden, hidden, bias=False)
        self.norm = HFRMSNorm(hidden, 1e-5)

    def forward(self, x, residual):
        h = residual + funcol.all_reduce(self.proj(x), "sum", dist.group.WORLD)
        wide = funcol.all_reduce(x.repeat(4, 1), "sum", dist.group.WORLD)
        return self.norm(h), h, torch.tanh(wide).sum(0)


def _beside_a_wider_all_reduce(rank, world_size):
    tpfuse.get_communicator(max_tokens=16, hidden=64)
    torch.manual_seed(0)
    module = SiteBesideAWiderAllReduce().bfloat16()
    compiles = []
    for _ in range(2):  # the second time Inductor serves both graphs from its cache: the pass does not run
        torch._dynamo.reset()
        compiled = tpfuse.compile(module)
        runs = {}
        for tokens in (6, 14, 20):
            x = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
            residual = torch.randn(tokens, 64, generator=torch.Generator().manual_seed(99)).bfloat16()
            with torch.no_grad():
                expected = module(x, residual)
                tpfuse.reset_stats()
                got = compiled(x, residual)
            runs[tokens] = (expected, got, tpfuse.stats().get("triton.oneshot", 0))
        backend = compiled.tpfuse_backend
        compiles.append((runs, dict(backend.compiles), sum(len(p.reports) for p in backend.passes)))
    return compiles


def test_a_site_left_alone_does_not_narrow_the_fused_range(rank_pool):
    # The fused graph serves every token count its fused sites can take (16); the wider all-reduce
    # (4 x tokens rows) stays a plain collective at any size. It used to bound the fused graph to
    # 4 tokens: at 6 and 14 the plain graph ran, with no kernel call and no word said. The range holds
    # when the graph comes from Inductor's cache too (tpfuse keeps its record beside the cache).
    for compiles in rank_pool(2).run(_beside_a_wider_all_reduce):
        assert [graphs for _, _, graphs in compiles] == [1, 0]  # the pass ran once, then the cache served
        for runs, counts, _ in compiles:
            assert counts == {"fused": 1, "plain": 1}
            for tokens, (expected, got, calls) in runs.items():
                assert calls == (1 if tokens <= 16 else 0), (tokens, calls)
                for e, g in zip(expected, got):
                    torch.testing.assert_close(g.float(), e.float(), atol=2e-2, rtol=2e-2)


class _Example(nn.Module):
    """A pattern's example as a model holds it: gains and biases parameters, the scales buffers."""

    PARAMETERS = ("weight", "bias", "bias_other", "sum_weight", "norm_bias")

    def __init__(self, pattern, inputs):
        super().__init__()
        self.pattern = pattern
        for name in self.PARAMETERS:
            setattr(self, name, nn.Parameter(inputs[name]))
        for name in ("scale", "x_scale"):
            self.register_buffer(name, inputs[name])
        self.scale_group = inputs["scale_group"]

    def forward(self, x, x_other, residual):
        inputs = {"x": x, "x_other": x_other, "residual": residual, "weight": self.weight, "bias": self.bias,
                  "bias_other": self.bias_other, "sum_weight": self.sum_weight, "norm_bias": self.norm_bias,
                  "scale": self.scale, "x_scale": self.x_scale, "scale_group": self.scale_group}
        return self.pattern.example(inputs, 1e-6)


def _example_inputs(rank, pattern, scale_group):
    g = torch.Generator().manual_seed(rank)

    def row(centre=0.0):
        noise = torch.randn(64, generator=torch.Generator().manual_seed(len(inputs)))
        return (centre + 0.5 * noise).bfloat16()

    inputs = {"x": torch.randn(6, 64, generator=g).bfloat16()}
    inputs.update(x_other=torch.randn(6, 64, generator=g).bfloat16() if pattern.branches == 2 else None,
                  residual=torch.randn(6, 64, generator=torch.Generator().manual_seed(99)).bfloat16()
                  if pattern.residual else None,
                  weight=row(1.0), sum_weight=row(), norm_bias=row(), bias=row(), bias_other=row(),
                  scale=torch.tensor([0.05]), x_scale=torch.tensor(8.0).bfloat16(), scale_group=scale_group)
    return inputs


def _pattern_example(rank, world_size, name, scale_group):
    from tpfuse.compiler import patterns

    torch._dynamo.reset()
    pattern = getattr(patterns, name)
    tpfuse.get_communicator(max_tokens=16, hidden=64)
    inputs = _example_inputs(rank, pattern, scale_group)
    compiled = tpfuse.compile(_Example(pattern, inputs))
    with torch.no_grad():
        expected = pattern.example(inputs, 1e-6)
        tpfuse.reset_stats()
        got = compiled(inputs["x"], inputs["x_other"], inputs["residual"])
    reports = [[str(s) for s in graph] for graph in compiled.tpfuse_backend.reports]
    return {"expected": expected, "got": got, "calls": tpfuse.stats().get("triton.oneshot", 0),
            "reports": reports}


EXAMPLES = [("AllReduceRMSNorm", 0), ("AllReduceAddRMSNorm", 0), ("AllReduceRMSNormQuant", 0),
            ("AllReduceAddRMSNormQuant", 0), ("AllReduceAddRMSNormDynamicQuant", 64),
            ("AllReduceAddRMSNormDynamicQuant", 16), ("AllReduceRMSNormDynamicQuant", 32),
            ("AllReducePostNormAddRMSNorm", 0), ("AllReduceScaledRMSNorm", 0),
            ("AllReduceScaledAddRMSNorm", 0), ("AllReduceBiasAddRMSNorm", 0), ("AllReduceLayerNorm", 0),
            ("AllReduceAddLayerNorm", 0), ("AllReduceBiasAddLayerNorm", 0),
            ("TwoAllReducesBiasAddLayerNorm", 0), ("TwoAllReducesAddLayerNorm", 0),
            ("TwoAllReducesAddRMSNorm", 0)]


def test_every_pattern_has_an_example_here():
    from tpfuse.compiler import PATTERNS

    assert {p.__name__ for p in PATTERNS} == {name for name, _ in EXAMPLES}


@pytest.mark.parametrize("name,scale_group", EXAMPLES)
def test_each_pattern_fuses_its_own_example(rank_pool, name, scale_group):
    # The fused op rounds once where the example rounds after each step (h and y in bf16, two sums and
    # their biases apart), so outputs agree within bf16's error and a step of fp8 (checked against
    # float64 in tests/kernels).
    for res in rank_pool(2).run(_pattern_example, name, scale_group):
        sites = 2 if name.startswith("Two") else 1
        reports = res["reports"]
        assert reports == [[reports[0][0]] * sites] and f"fused ({name})" in reports[0][0], reports
        assert res["calls"] == 1
        expected, got = list(res["expected"]), list(res["got"])
        assert [(t.shape, t.dtype) for t in got] == [(t.shape, t.dtype) for t in expected]
        if scale_group:  # (y8, scales, h): compare y8 * scale
            for out in (expected, got):
                values = out[0].float().unflatten(-1, (-1, scale_group)) * out[1].unsqueeze(-1)
                out[0] = values.flatten(-2)
            torch.testing.assert_close(got[1], expected[1], atol=0, rtol=2e-2)
            torch.testing.assert_close(got[0], expected[0], atol=0.02 * expected[0].abs().max().item(),
                                       rtol=0.13)
            expected, got = expected[2:], got[2:]
        for e, g in zip(expected, got):
            tol = dict(atol=0.05, rtol=0.13) if e.dtype == torch.float8_e4m3fn else dict(atol=3e-2, rtol=2e-2)
            torch.testing.assert_close(g.float(), e.float(), **tol)


def test_compile_modes_are_torch_compile_modes():
    from torch._inductor import list_mode_options

    from tpfuse.compiler import inductor_options_for_mode

    assert inductor_options_for_mode(None) == {}
    assert inductor_options_for_mode("reduce-overhead") == {"triton.cudagraphs": True}
    assert inductor_options_for_mode("max-autotune")["max_autotune"] is True
    for mode, options in list_mode_options().items():
        if options.get("use_post_grad_passes", True):
            assert inductor_options_for_mode(mode) == options
        else:  # e.g. "lite": no graph passes, so nothing could be fused
            with pytest.raises(ValueError, match="graph passes"):
                inductor_options_for_mode(mode)
    with pytest.raises(ValueError, match="unknown mode 'fastest'"):
        tpfuse.compile(torch.nn.Linear(2, 2), mode="fastest")


def _explained(rank, world_size, kind):
    torch._dynamo.reset()  # Site.forward was compiled by other tests of this pool: under the recompile limit
    tpfuse.get_communicator(max_tokens=16, hidden=64)
    torch.manual_seed(0)
    module = Site(kind).bfloat16()
    # [batch, seq, hidden]
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(rank)).bfloat16()
    explanation = tpfuse.explain(module, x, torch.randn(2, 3, 64).bfloat16())
    return explanation.fused, len(explanation.sites), str(explanation)


@pytest.mark.parametrize("kind,fused,says", [
    ("plain", 1, "all-reduce [s"),  # the symbolic shape of the [batch, seq, hidden] site
    ("op_between", 0, "not fused: no norm follows the all-reduce as a pattern has it"),
])
def test_explain_lists_every_site_and_why(rank_pool, kind, fused, says):
    for n_fused, n_sites, text in rank_pool(2).run(_explained, kind):
        assert (n_fused, n_sites) == (fused, 1), text
        assert says in text and f"fused {fused} of 1 all-reduce sites" in text, text
