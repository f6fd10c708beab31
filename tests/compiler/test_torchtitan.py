"""torchtitan 0.3.0's own Llama 3 (its model code and its TP plan, sequence parallel off) under tpfuse.compile
in training, on 2 CPU ranks: it trains to the eager run's losses and gradients and its forward's block ends
fuse. A tiny config made here (dim 64, 4 heads, 2 layers); SDPA attention (FlexAttention has no CPU
backward, and torchtitan 0.3.0's config names no SDPA backend, so its SDPA class is chosen directly)."""

import functools

import pytest
import torch
import torch.nn.functional as F

import tpfuse

pytestmark = pytest.mark.slow

HIDDEN, LIMIT = 64, 16


def _titan_llama(world_size, sequence_parallel=False, spmd_backend="partial_dtensor"):
    import torchtitan.distributed.parallel_dims as parallel_dims
    import torchtitan.tools.utils as titan_utils
    from torchtitan.distributed import ParallelDims
    from torchtitan.distributed.utils import set_spmd_backend
    from torchtitan.models import llama3
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3.sharding import set_llama3_sharding_config

    parallel_dims.device_type = titan_utils.device_type = "cpu"  # torchtitan assumes a GPU
    set_spmd_backend(spmd_backend)
    llama3.get_attention_config = lambda backend: ScaledDotProductAttention.Config()
    heads = 4
    config = llama3.Llama3Model.Config(
        dim=HIDDEN, vocab_size=256,
        tok_embeddings=Embedding.Config(num_embeddings=256, embedding_dim=HIDDEN,
                                        param_init=llama3._EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=HIDDEN, param_init=llama3._NORM_INIT),
        lm_head=Linear.Config(in_features=HIDDEN, out_features=256,
                              param_init=llama3._output_linear_init(HIDDEN)),
        layers=llama3._build_llama3_layers(
            fuse_qkv=spmd_backend != "spmd_types", n_layers=2, dim=HIDDEN, n_heads=heads, hidden_dim=128,
            rope=ComplexRoPE.Config(dim=HIDDEN // heads, max_seq_len=256, theta=500000, scaling="llama"),
            attn_backend="sdpa"))
    set_llama3_sharding_config(config, enable_sp=sequence_parallel)
    torch.manual_seed(0)
    model = config.build()
    dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=world_size, pp=1, ep=1, world_size=world_size,
                        spmd_backend=spmd_backend)
    dims.build_mesh()
    model.parallelize(dims)
    model.init_states(buffer_device=torch.device("cpu"))
    return model.to(torch.bfloat16), functools.partial(_logits, dims)


def _logits(dims, run, ids):
    """Every rank's full logits of ``run(ids)`` (a model of :func:`_titan_llama`, or it compiled), as
    torchtitan's trainer runs it: under the plain-tensor backend inside its SPMD context with the inputs'
    types declared (the logits then stay sharded over the vocabulary: gathered here, with a gradient)."""
    if dims.spmd_backend != "spmd_types":
        logits = run(ids)
        return logits.full_tensor() if hasattr(logits, "placements") else logits  # a DTensor
    import torch.distributed._functional_collectives as funcol
    from torchtitan.distributed.spmd_types import annotate_input_spmd_types
    from torchtitan.distributed.utils import get_spmd_context

    with get_spmd_context(parallel_dims=dims)():
        inputs, _, _ = annotate_input_spmd_types(dims, ids, ids.clone(), {})
        logits = run(inputs)
    return funcol.all_gather_tensor_autograd(logits.movedim(-1, 0).contiguous(), 0,
                                             dims.get_mesh("tp").get_group()).movedim(0, -1)


def _trained(rank, world_size, sequence_parallel=False, spmd_backend="partial_dtensor", steps=3):
    tpfuse.get_communicator(max_tokens=LIMIT, hidden=HIDDEN)
    (eager, logits_of), (model, _) = (_titan_llama(world_size, sequence_parallel, spmd_backend)
                                      for _ in range(2))
    compiled = tpfuse.compile(model)
    losses, first_grads = {"eager": [], "compiled": []}, {}
    for name, run, trained in (("eager", eager, eager), ("compiled", compiled, model)):
        optimizer = torch.optim.SGD(trained.parameters(), lr=0.5)
        for step in range(steps):
            seeded = torch.Generator().manual_seed(step)
            # sequence parallel shards the sequence over the ranks: even lengths there
            ids = torch.randint(0, 256, (2, 3 + 4 * (step % 2) + sequence_parallel), generator=seeded)
            logits = logits_of(run, ids)
            loss = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten())
            optimizer.zero_grad()
            loss.backward()
            if step == 0:
                first_grads[name] = [getattr(p.grad, "_local_tensor", p.grad).float()
                                     for p in trained.parameters()]
            optimizer.step()
            losses[name].append(loss.item())
    grad_difference = max(((g - e).abs().max() / e.abs().max()).item()
                          for g, e in zip(first_grads["compiled"], first_grads["eager"], strict=True))
    return losses, grad_difference, [[str(s) for s in graph] for graph in compiled.tpfuse_backend.reports]


def test_torchtitans_llama_trains_compiled_with_its_forward_fused(rank_pool):
    """Its forward: the embedding's all-reduce into the first norm and the four block ends; all but the
    one whose pre-add sum the backward keeps fuse (as torch's parallelize_module model). Its backward
    holds one all-reduce (the embedding's input gradient, which no norm's backward follows); the
    column-parallel layers' input gradients are reduce-scatters and all-gathers there, which the
    backward's block end does not take yet."""
    for losses, grad_difference, reports in rank_pool(2).run(_trained, timeout=900):
        for eager, compiled in zip(losses["eager"], losses["compiled"], strict=True):
            assert abs(eager - compiled) < 2e-2 * abs(eager), losses
        assert grad_difference < 5e-2, grad_difference
        forward = reports[0]
        assert sum(": fused (" in line for line in forward) == 4 and len(forward) == 5, reports


def _inference(rank, world_size, spmd_backend):
    tpfuse.get_communicator(max_tokens=LIMIT, hidden=HIDDEN)
    model, logits_of = _titan_llama(world_size, True, spmd_backend)
    compiled = tpfuse.compile(model)
    ids = torch.randint(0, 256, (2, 8), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected, got = logits_of(model, ids), logits_of(compiled, ids)
    difference = ((got.float() - expected.float()).abs().max() / expected.float().abs().max()).item()
    return difference, [[str(s) for s in graph] for graph in compiled.tpfuse_backend.reports]


# CI runs the plain-tensor backend (torchtitan's default); the DTensor form is CI's in the ParallelStyles
# training test
@pytest.mark.parametrize("spmd_backend", [pytest.param("partial_dtensor", marks=pytest.mark.extended),
                                          "spmd_types"])
def test_torchtitans_llama_with_sequence_parallel_fuses_every_block_end(rank_pool, spmd_backend):
    """torchtitan's own plan with sequence parallel on (its default): the embedding's reduce-scatter into the
    first norm and the four block ends are reduce-scatter -> add -> RMSNorm -> all-gather (DTensor's
    chunk/cat around a dim-0 reduce-scatter; the plain-tensor backend permutes the rows sequence-first
    around it instead). Every one fuses in inference; in training, all but the one
    whose pre-add sum the backward keeps, and the losses and gradients are the eager run's. Its backward's
    block ends (the layers' input gradients reduce-scattered, RMSNorm's backward + the residual's gradient,
    all-gathered) fuse too, all but the final norm's, which has no residual stream after it."""
    for difference, reports in rank_pool(2).run(_inference, spmd_backend, timeout=900):
        assert difference < 2e-2, difference
        [graph] = reports
        assert len(graph) == 5 and all("fused (ReduceScatter" in line for line in graph), graph
    for losses, grad_difference, reports in rank_pool(2).run(_trained, True, spmd_backend, timeout=900):
        for eager, compiled in zip(losses["eager"], losses["compiled"], strict=True):
            assert abs(eager - compiled) < 2e-2 * abs(eager), losses
        assert grad_difference < 5e-2, grad_difference
        # (forward, backward) graphs: one pair, or one a sequence length (the plain-tensor backend recompiles)
        assert len(reports) in (2, 4), reports
        for forward, backward in zip(reports[::2], reports[1::2]):
            assert len(forward) == 5, reports
            assert sum(": fused (ReduceScatter" in line for line in forward) == 4, reports
            assert len(backward) == 5, reports
            fused = [line for line in backward if ": fused (ReduceScatterRMSNormBackwardAllGather)" in line]
            assert len(fused) == 4, reports
