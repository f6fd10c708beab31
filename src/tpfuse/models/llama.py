"""A tensor-parallel Llama in the style of gpt-fast: random weights, nothing downloaded.

Column-parallel projections in, row-parallel out, one all-reduce at the end of attention and of the
MLP, each followed by a residual add and an RMSNorm: the sites tpfuse fuses. The RMSNorm can be
written three ways (``norm_style``) and the all-reduce two ways (``all_reduce_style``), as the models
users compile are.
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
    intermediate: int = 14336
    vocab_size: int = 32000
    norm_eps: float = 1e-5
    norm_style: str = "hf"  # "hf" (transformers Llama/Qwen/Mistral), "gptfast", "torch" (nn.RMSNorm)
    all_reduce_style: str = "functional"  # "functional" (funcol.all_reduce) or "inplace" (dist.all_reduce)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


PRESETS = {
    "tiny": ModelArgs(dim=64, n_layers=4, n_heads=4, intermediate=128, vocab_size=256, norm_eps=1e-6),
    "llama-3-8b": ModelArgs(dim=4096, n_layers=4, n_heads=32, intermediate=14336, vocab_size=128256),
    "llama-3-70b": ModelArgs(dim=8192, n_layers=2, n_heads=64, intermediate=28672, vocab_size=128256),
    "dense-7168": ModelArgs(dim=7168, n_layers=2, n_heads=56, intermediate=18432, vocab_size=129280),
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
        self.args, self.n_local_heads = args, args.n_heads // world_size
        local = self.n_local_heads * args.head_dim
        self.wqkv = nn.Linear(args.dim, 3 * local, bias=False)  # column parallel
        self.wo = nn.Linear(local, args.dim, bias=False)  # row parallel: partial sums

    def forward(self, x):
        tokens = x.shape[0]
        q, k, v = self.wqkv(x).view(tokens, 3, self.n_local_heads, self.args.head_dim).unbind(1)
        y = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True)
        return all_reduce(self.wo(y.transpose(0, 1).reshape(tokens, -1)), self.args)


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

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    """Token ids [T] (one sequence, causal) -> logits [T, vocab]; tensor parallel over the default group."""

    def __init__(self, args: ModelArgs):
        super().__init__()
        world = dist.get_world_size() if dist.is_initialized() else 1
        if args.n_heads % world or args.intermediate % world:
            raise ValueError(f"{args} does not split over {world} ranks")
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(TransformerBlock(args, world) for _ in range(args.n_layers))
        self.norm = make_norm(args)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.tok_embeddings(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.output(self.norm(x))

    @classmethod
    def build(cls, preset: str | ModelArgs, *, seed: int = 0, dtype=torch.bfloat16, device="cpu", **overrides):
        """Random weights, identical on every rank for replicated parameters; shards differ by rank."""
        args = PRESETS[preset] if isinstance(preset, str) else preset
        args = replace(args, **overrides)
        torch.manual_seed(seed + (dist.get_rank() if dist.is_initialized() else 0))
        model = cls(args)
        torch.manual_seed(seed)  # replicated: embeddings, norms, output
        for module in [model.tok_embeddings, model.output, model.norm,
                       *[n for layer in model.layers for n in (layer.attention_norm, layer.ffn_norm)]]:
            for p in module.parameters():
                nn.init.normal_(p, mean=1.0 if p.dim() == 1 else 0.0, std=0.1 if p.dim() == 1 else 0.02)
        torch.manual_seed(seed + 1000 + (dist.get_rank() if dist.is_initialized() else 0))  # shards
        for layer in model.layers:
            for lin in (layer.attention.wqkv, layer.attention.wo, layer.feed_forward.w13, layer.feed_forward.w2):
                nn.init.normal_(lin.weight, std=lin.in_features ** -0.5)
        return model.to(device=device, dtype=dtype).eval()
