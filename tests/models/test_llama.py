"""The demo model's KV cache decodes what a full causal pass computes, batched, eager and compiled."""

import pytest
import torch
import torch.nn.functional as F

import tpfuse
from tpfuse.models import Transformer
from tpfuse.models.llama import grouped_query_attention
from tpfuse.testing import rank_device


def _prefill_then_decode(fn, tokens, device):
    logits = [fn(tokens[:, :4], torch.arange(4, device=device))]  # prefill 4 positions
    for pos in range(4, tokens.shape[1]):  # then one token a step
        logits.append(fn(tokens[:, pos : pos + 1], torch.tensor([pos], device=device)))
    return torch.cat(logits, dim=1).float()


def _decode(rank, world_size):
    device = rank_device("gloo", rank)
    tpfuse.get_communicator(max_tokens=16, hidden=64)
    tokens = torch.randint(0, 256, (3, 7), generator=torch.Generator().manual_seed(5)).to(device)
    out = {}
    with torch.no_grad():
        exact = Transformer.build("tiny", device=device, dtype=torch.float32)
        exact.setup_caches(max_batch=3, max_seq=16)
        full = torch.stack([exact(seq) for seq in tokens])  # no cache: one causal pass a sequence
        out["cache vs full pass (fp32)"] = (
            (_prefill_then_decode(exact, tokens, device) - full).abs().max().item()
        )

        model = Transformer.build("tiny", device=device)
        model.setup_caches(max_batch=3, max_seq=16)
        eager = _prefill_then_decode(model, tokens, device)
        tpfuse.reset_stats()
        compiled = _prefill_then_decode(tpfuse.compile(model), tokens, device)
        out["fused calls"] = sum(n for k, n in tpfuse.stats().items() if k.startswith("triton."))
        out["compiled vs eager (bf16)"] = (compiled - eager).abs().max().item() / eager.abs().max().item()
    return out


def test_kv_cache_decode_matches_full_pass_and_compiles_fused(rank_pool):
    for out in rank_pool(2).run(_decode):
        assert out["cache vs full pass (fp32)"] < 1e-4, out
        assert out["fused calls"] == 4 * 8, out  # a prefill and 3 steps, 8 sites each
        # bf16 sums in eager, fp32 in the fused kernel: a few bf16 ulps of the largest logit
        assert out["compiled vs eager (bf16)"] < 0.05, out


@pytest.mark.parametrize("heads, kv_heads, seq", [(8, 2, 1), (8, 2, 5), (6, 3, 4), (4, 4, 3)])
def test_grouped_query_attention_matches_sdpa(heads, kv_heads, seq):
    gen = torch.Generator().manual_seed(heads * 100 + seq)
    q = torch.randn(2, heads, seq, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, kv_heads, 9, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    mask = torch.rand(seq, 9, generator=gen) < 0.7
    mask[:, 0] = True  # every query sees at least one position
    expected = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(grouped_query_attention(q, k, v, mask), expected, rtol=1e-6, atol=1e-8)
