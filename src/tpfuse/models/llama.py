"""A tensor-parallel Llama in the style of gpt-fast: random weights, nothing downloaded.

Column-parallel projections in, row-parallel out, one all-reduce at the end of attention and of the
MLP, each followed by a residual add and an RMSNorm: the sites tpfuse fuses. The RMSNorm can be
written three ways (``norm_style``) and the all-reduce two ways (``all_reduce_style``), as the models
users compile are. Grouped-query attention with a static KV cache (``setup_caches``) for decoding;
the output head is split over the vocabulary and its logits gathered, as inference engines do.
The residual stream is [tokens, dim] with batch and sequence flattened, as in vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelArgs:
    dim: int = 4096
    n_layers: int = 32
    n_heads: int = 32
    n_kv_heads: int | None = None  # grouped-query attention; None means n_heads
    intermediate: int = 14336
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    norm_style: str = "hf"  # "hf" (transformers Llama/Qwen/Mistral), "gptfast", "torch" (nn.RMSNorm)
    all_reduce_style: str = "functional"  # "functional" (funcol.all_reduce) or "inplace" (dist.all_reduce)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads


PRESETS = {
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, n_kv_heads=2, intermediate=128, vocab_size=256,
                      norm_eps=1e-6),
    "llama-3-8b": ModelArgs(dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, intermediate=14336,
                            vocab_size=128256),
    # 80 layers do not fit in two GPUs: the 70B's layer shapes, fewer of them.
    "llama-3-70b": ModelArgs(dim=8192, n_layers=8, n_heads=64, n_kv_heads=8, intermediate=28672,
                             vocab_size=128256),
    # A dense stand-in with DeepSeek-V3's hidden size (its attention is MLA, its MLP mostly experts).
    "dense-7168": ModelArgs(dim=7168, n_layers=8, n_heads=56, n_kv_heads=8, intermediate=18432,
                            vocab_size=129280),
}


class HFRMSNorm(nn.Module):
    """RMSNorm as Hugging Face transformers writes it: fp32 variance, cast back, then the weight."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.variance_epsilon = eps

    def forward(self, hidden_states):
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)


class GptFastRMSNorm(nn.Module):
    """RMSNorm as gpt-fast writes it."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        output = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return output.type_as(x) * self.weight


def make_norm(args: ModelArgs) -> nn.Module:
    if args.norm_style == "hf":
        return HFRMSNorm(args.dim, args.norm_eps)
    if args.norm_style == "gptfast":
        return GptFastRMSNorm(args.dim, args.norm_eps)
    if args.norm_style == "torch":
        return nn.RMSNorm(args.dim, eps=args.norm_eps)
    raise ValueError(f"unknown norm_style {args.norm_style!r}")


# torch 2.13 renamed the functional all-gather; 2.11 has only the old name.
_all_gather = getattr(funcol, "all_gather_single", None) or funcol.all_gather_tensor


def all_reduce(x: torch.Tensor, args: ModelArgs) -> torch.Tensor:
    if dist.get_world_size() == 1:
        return x
    if args.all_reduce_style == "functional":
        return funcol.all_reduce(x, "sum", dist.group.WORLD)
    dist.all_reduce(x)
    return x


class Attention(nn.Module):
    def __init__(self, args: ModelArgs, world_size: int):
        super().__init__()
        self.args = args
        self.n_local_heads, self.n_local_kv_heads = args.n_heads // world_size, args.kv_heads // world_size
        q, kv = self.n_local_heads * args.head_dim, self.n_local_kv_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, q + 2 * kv, bias=False)  # column parallel
        self.wo = nn.Linear(q, args.dim, bias=False)  # row parallel: partial sums
        self.register_buffer("k_cache", None, persistent=False)  # filled by Transformer.setup_caches
        self.register_buffer("v_cache", None, persistent=False)

    def forward(self, x, batch: int, input_pos: torch.Tensor | None, mask: torch.Tensor | None):
        head_dim = self.args.head_dim
        seq = x.shape[0] // batch
        kv = self.n_local_kv_heads * head_dim
        q, k, v = self.wqkv(x).view(batch, seq, -1).split([self.n_local_heads * head_dim, kv, kv], -1)
        q, k, v = (t.reshape(batch, seq, -1, head_dim).transpose(1, 2) for t in (q, k, v))
        if input_pos is not None:  # decode or prefill into the static cache, attend over all of it
            # One index_put_ on each whole cache buffer: Inductor updates a buffer in place when the
            # buffer itself is written. Writing a slice of it (cache[:batch]) copied the batch's
            # whole cache twice a step: 2.0 of 3.9 ms a decode step at batch 64 on 2 x H200.
            rows = torch.arange(batch, device=x.device).view(batch, 1, 1)
            heads = torch.arange(self.n_local_kv_heads, device=x.device).view(1, -1, 1)
            where = (rows, heads, input_pos.view(1, 1, -1))
            self.k_cache.index_put_(where, k)
            self.v_cache.index_put_(where, v)
            k, v = self.k_cache[:batch], self.v_cache[:batch]
        # enable_gqa: query heads share key/value heads without copying the cache for each of them
        if mask is None:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return all_reduce(self.wo(y.transpose(1, 2).reshape(batch * seq, -1)), self.args)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs, world_size: int):
        super().__init__()
        self.args, local = args, args.intermediate // world_size
        self.w13 = nn.Linear(args.dim, 2 * local, bias=False)
        self.w2 = nn.Linear(local, args.dim, bias=False)

    def forward(self, x):
        gate, up = self.w13(x).chunk(2, dim=-1)
        return all_reduce(self.w2(F.silu(gate) * up), self.args)


class TransformerBlock(nn.Module):
    def __init__(self, args: ModelArgs, world_size: int):
        super().__init__()
        self.attention, self.feed_forward = Attention(args, world_size), FeedForward(args, world_size)
        self.attention_norm, self.ffn_norm = make_norm(args), make_norm(args)

    def forward(self, x, batch, input_pos, mask):
        h = x + self.attention(self.attention_norm(x), batch, input_pos, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids [T] or [batch, T] -> logits [T, vocab] or [batch, T, vocab], tensor parallel (default group).

    Without ``input_pos`` each call is a fresh causal sequence. After :meth:`setup_caches`, pass the
    positions ``input_pos`` [T] the tokens take: their keys and values go into the cache and they
    attend to every earlier position (prefill, then one token a step for decoding).
    """

    def __init__(self, args: ModelArgs):
        super().__init__()
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if args.n_heads % self.world or args.kv_heads % self.world or args.intermediate % self.world \
                or args.vocab_size % self.world:
            raise ValueError(f"{args} does not split over {self.world} ranks")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, self.world) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size // self.world, bias=False)  # vocabulary parallel
        self.register_buffer("causal_mask", None, persistent=False)  # filled by setup_caches

    def setup_caches(self, max_batch: int, max_seq: int) -> None:
        """Allocate the static KV cache for up to ``max_batch`` sequences of ``max_seq`` positions."""
        # Buffers, not plain attributes: CUDA graphs (reduce-overhead) treat buffers as static inputs,
        # so updating the cache in place does not make them skip the graph.
        param = self.output.weight
        for layer in self.layers:
            attn = layer.attention
            shape = (max_batch, attn.n_local_kv_heads, max_seq, self.args.head_dim)
            for name in ("k_cache", "v_cache"):
                setattr(attn, name, torch.zeros(shape, dtype=param.dtype, device=param.device))
        self.causal_mask = torch.tril(torch.ones(max_seq, max_seq, dtype=torch.bool, device=param.device))

    def forward(self, tokens: torch.Tensor, input_pos: torch.Tensor | None = None) -> torch.Tensor:
        batched = tokens.dim() == 2
        batch = tokens.shape[0] if batched else 1
        mask = None if input_pos is None else self.causal_mask[input_pos]
        x = self.tok_embeddings(tokens.reshape(-1))
        for layer in self.layers:
            x = layer(x, batch, input_pos, mask)
        logits = self.output(self.norm(x))
        if self.world > 1:  # every rank holds a slice of the vocabulary: gather them
            parts = _all_gather(logits, 0, dist.group.WORLD).view(self.world, *logits.shape)
            logits = parts.permute(1, 0, 2).reshape(logits.shape[0], -1)
        return logits.view(batch, -1, logits.shape[-1]) if batched else logits

    @classmethod
    def build(cls, preset: str | ModelArgs, *, seed: int = 0, dtype=torch.bfloat16, device="cpu",
              **overrides):
        """Random weights, identical on every rank for replicated parameters; shards differ by rank."""
        args = PRESETS[preset] if isinstance(preset, str) else preset
        args = replace(args, **overrides)
        torch.manual_seed(seed + (dist.get_rank() if dist.is_initialized() else 0))
        model = cls(args)
        torch.manual_seed(seed)  # replicated: embeddings, norms, output
        for module in [model.tok_embeddings, model.norm,
                       *[n for layer in model.layers for n in (layer.attention_norm, layer.ffn_norm)]]:
            for p in module.parameters():
                nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1 if p.dim() == 1 else 0.02)
        torch.manual_seed(seed + 1000 + (dist.get_rank() if dist.is_initialized() else 0))  # shards
        nn.init.normal_(model.output.weight, std=0.02)
        for layer in model.layers:
            ffn = layer.feed_forward
            for lin in (layer.attention.wqkv, layer.attention.wo, ffn.w13, ffn.w2):
                nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
        return model.to(device=device, dtype=dtype).eval()
