"""Decode attention over a 2049-position cache, three ways, compiled, timed over CUDA-graph replays.

Run on one H200 on 2026-11-29 (docs/benchmarks.md): `python docs/results/attention-variants-2026-11-29.py`.
"""
import torch, torch.nn.functional as F
torch.manual_seed(0)

def sdpa_gqa(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

def matmuls(q, k, v, mask):
    b, h, s, d = q.shape; g = h // k.shape[1]
    rows = q.reshape(b, k.shape[1], g * s, d)
    sc = ((rows * d**-0.5) @ k.transpose(-1, -2)).float().masked_fill(~mask.repeat(g, 1), float("-inf"))
    return (torch.softmax(sc, -1).to(v.dtype) @ v).view(b, h, s, d)

def packed(q, k, v, mask):  # grouped heads as the rows of one SDPA head
    b, h, s, d = q.shape; g = h // k.shape[1]
    rows = q.reshape(b, k.shape[1], g * s, d)
    return F.scaled_dot_product_attention(rows, k, v, attn_mask=mask.repeat(g, 1)).view(b, h, s, d)

def time_us(fn, args, n=20):
    for _ in range(3): fn(*args)
    torch.cuda.synchronize(); g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(n): fn(*args)
    ts = []
    for _ in range(7):
        a, b = torch.cuda.Event(True), torch.cuda.Event(True)
        a.record(); g.replay(); b.record(); b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / n)
    return sorted(ts)[3]

S, KV, H, D = 2049, 4, 16, 128
mask_full = torch.tril(torch.ones(S, S, dtype=torch.bool, device="cuda"))
print("attn batch seq | sdpa_gqa(old) | matmuls | packed_sdpa  (us, compiled, graph replays)")
for b, s in ((1, 1), (8, 1), (32, 1), (64, 1), (1, 2048)):
    q = torch.randn(b, H, s, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(b, KV, S, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    mask = mask_full[torch.arange(S - s, S, device="cuda")]
    ref = sdpa_gqa(q.double(), k.double(), v.double(), mask)
    row = []
    for fn in (sdpa_gqa, matmuls, packed):
        c = torch.compile(fn, dynamic=False)
        err = (c(q, k, v, mask).double() - ref).abs().max().item()
        row.append(f"{time_us(c, (q, k, v, mask)):9.1f} (err {err:.1e})")
    print(f"ATTN b{b:<3d} s{s:<5d}", " | ".join(row), flush=True)
