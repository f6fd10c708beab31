"""A compiled model in batch-invariant mode: a prompt's logits are the same bits alone, batched with other
prompts, and batched above the fusion limit (docs/determinism.md).

tpfuse's Llama (random weights, one layer) compiled with ``tpfuse.compile`` on 2 and 3 CPU ranks, its
all-reduce sites fused: a prompt of 3 tokens alone runs the one-shot, in a batch of 2 prompts the
two-shot, in a batch of 4 (12 tokens, over the 8 rows of the workspace) fused calls of the workspace's
rows. The
model's other ops on the CPU (its matmuls, attention and the vocabulary gather) are row-independent
here, so any difference would come from the all-reduce sites; outside the mode the batch of 4 runs
the plain graph (the group's all-reduce and Inductor's norm).
"""

import pytest
import torch

pytestmark = pytest.mark.slow

PROMPT = 3
BATCHES = (1, 2, 4)  # prompts a call: the one-shot, the two-shot, over the workspace
WORKSPACE_ROWS = 8


def _logits_of_the_first_prompt(rank, world_size, invariant):
    import tpfuse
    from tpfuse.models import Transformer
    from tpfuse.testing import forced_table, fused_calls

    tpfuse.set_batch_invariant(invariant)
    # 6 heads and 258 words split over 2 or 3 ranks
    model = Transformer.build("tiny", n_layers=1, dim=96, n_heads=6, n_kv_heads=6, intermediate=192,
                              vocab_size=258)
    # Ranks compile at their own pace (3 on 2 cores): a first fused call may wait a while for its peers.
    comm = tpfuse.get_communicator(max_tokens=WORKSPACE_ROWS, hidden=96, wait_timeout_s=300)
    prompts = torch.randint(0, 258, (max(BATCHES), PROMPT), generator=torch.Generator().manual_seed(3))
    out = {"logits": [], "fused": [], "gathered": []}
    with torch.no_grad(), forced_table(world_size, "cpu", oneshot_max=4, hiddens=(96,)):
        compiled = tpfuse.compile(model)
        for batch in BATCHES:
            tpfuse.reset_stats()
            logits = compiled(prompts[:batch])
            out["logits"].append(logits[0].float().clone())
            out["fused"].append(fused_calls(backends=("triton",)))
    comm.destroy()
    tpfuse.set_batch_invariant(None)
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_prompts_logits_do_not_depend_on_its_batch(rank_pool, world_size):
    # Inductor compiles on every rank, in the interpreter's company: minutes on 2 cores
    results = rank_pool(world_size).run(_logits_of_the_first_prompt, True, timeout=1200)
    for rank, out in enumerate(results):
        # 2 sites a call: one fused call each, two parts each over the workspace
        assert out["fused"] == [2, 2, 4], (rank, out["fused"])
        alone = out["logits"][0]
        for batch, logits in zip(BATCHES, out["logits"]):
            assert torch.equal(logits, alone), (
                f"rank {rank}: the first prompt's logits batched with {batch - 1} others differ from its "
                f"logits alone by up to {(logits - alone).abs().max().item()}")
        assert torch.equal(alone, results[0]["logits"][0]), f"rank {rank} differs from rank 0"
