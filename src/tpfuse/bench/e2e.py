"""``python -m tpfuse bench e2e``: decode-step and prefill latency of the tensor-parallel Llama.

Three ways to run the same model (:class:`tpfuse.models.Transformer`, random weights, bf16), each
compiled with the same ``torch.compile`` mode (``mode="reduce-overhead"``, CUDA graphs, unless
``--mode`` says otherwise):

- ``unfused``: ``torch.compile`` as is: NCCL all-reduce, Inductor's add + RMSNorm;
- ``tpfuse``: :func:`tpfuse.compile` with the Triton backend;
- ``flashinfer``: :func:`tpfuse.compile` with the communicator's ``flashinfer`` backend (when importable).

A decode step is one token for each of ``batch`` sequences whose KV cache holds ``prefill``
positions; the prefill is ``prefill`` tokens of one sequence. Times are CUDA-event milliseconds per
call over back-to-back calls (median of repeats, slowest rank). Every provider's logits are compared
with the unfused model's.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from tpfuse.bench.output import pyplot, write_csv
from tpfuse.bench.timing import progress

PROVIDERS = ("unfused", "tpfuse", "flashinfer")


def _ms_per_call(fn, device: torch.device, iters: int = 20, repeats: int = 5) -> float:
    """Median over ``repeats`` of back-to-back calls (CUDA events; wall clock on the CPU), slowest rank."""
    for _ in range(3):
        fn()
    cuda = device.type == "cuda"
    samples = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        dist.barrier()
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        else:
            began = time.perf_counter()
        for _ in range(iters):
            fn()
        if cuda:
            end.record()
            torch.cuda.synchronize()
            samples.append(start.elapsed_time(end) / iters)
        else:
            samples.append((time.perf_counter() - began) * 1000 / iters)
    t = torch.tensor([sorted(samples)[len(samples) // 2]], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _compiled(provider: str, model, prefill: int, mode: str):
    import tpfuse

    torch._dynamo.reset()
    tpfuse.destroy_all()
    if provider == "unfused":
        return torch.compile(model, mode=mode, dynamic=True)
    backend = "triton" if provider == "tpfuse" else "flashinfer"
    tpfuse.get_communicator(max_tokens=prefill, hidden=model.args.dim, backend=backend)
    return tpfuse.compile(model, mode=mode)


def _fill_caches(model, device: torch.device) -> None:
    """The same cache contents before every workload of every provider, so their logits compare."""
    gen = torch.Generator(device).manual_seed(1)
    for layer in model.layers:
        for cache in (layer.attention.k_cache, layer.attention.v_cache):
            cache.copy_(torch.randn(cache.shape, generator=gen, device=device, dtype=cache.dtype))


def e2e_rank(
    rank: int,
    world_size: int,
    preset: str,
    layers: int | None,
    batches: list[int],
    prefill: int,
    providers: list[str],
    device: torch.device | None = None,
    iters: int = 20,
    mode: str = "reduce-overhead",
) -> list[dict]:
    """Time every provider on this rank (the process group is set up); the rows, the same on every rank.

    ``device`` defaults to the current GPU; on the CPU (tests) the kernels run in Triton's interpreter.
    """
    import tpfuse
    from tpfuse.models import Transformer

    device = device or torch.device("cuda", torch.cuda.current_device())
    overrides = {"n_layers": layers} if layers else {}
    model = Transformer.build(preset, device=device, **overrides)
    model.setup_caches(max_batch=max(batches), max_seq=prefill + 1)
    gen = torch.Generator().manual_seed(0)
    workloads = [
        (
            f"decode b{b}",
            b,
            torch.randint(0, model.args.vocab_size, (b, 1), generator=gen).to(device),
            torch.tensor([prefill], device=device),
        )
        for b in batches
    ]
    workloads.append(
        (
            f"prefill {prefill}",
            1,
            torch.randint(0, model.args.vocab_size, (1, prefill), generator=gen).to(device),
            torch.arange(prefill, device=device),
        )
    )
    rows = {name: {"workload": name, "tokens": tokens.numel()} for name, _, tokens, _ in workloads}
    reference = {}
    total, done = len(providers) * len(workloads), 0
    for provider in providers:
        try:
            fn = _compiled(provider, model, prefill, mode)
        except (ImportError, ValueError) as exc:  # FlashInfer missing, or no CUDA for it
            if rank == 0:
                print(f"\n{provider}: {exc}; skipping it")
            done += len(workloads)
            continue
        for name, _, tokens, pos in workloads:
            if rank == 0:
                progress(done, total, f"e2e: {provider}, {name}")
            with torch.no_grad():
                _fill_caches(model, device)
                tpfuse.reset_stats()
                logits = fn(tokens, pos).float().clone()
                fused = sum(n for k, n in tpfuse.stats().items() if k.startswith(("triton.", "flashinfer.")))
                rows[name][f"{provider}_ms"] = _ms_per_call(lambda: fn(tokens, pos), device, iters)
            rows[name][f"{provider}_fused_calls"] = fused
            if rank == 0:
                print(
                    f"\n{provider:>10} {name:>14}: {rows[name][f'{provider}_ms']:.3f} ms, "
                    f"{fused} fused calls",
                    flush=True,
                )
            if provider == "unfused":
                reference[name] = logits
            elif name in reference:
                ref = reference[name]
                rows[name][f"{provider}_logit_diff"] = ((logits - ref).abs().max() / ref.abs().max()).item()
                rows[name][f"{provider}_argmax_agree"] = (
                    (logits.argmax(-1) == ref.argmax(-1)).float().mean().item()
                )
            done += 1
    if rank == 0:
        progress(total, total, "e2e: done")
    torch._dynamo.reset()
    tpfuse.destroy_all()
    out = list(rows.values())
    for row in out:
        for provider in ("tpfuse", "flashinfer"):
            if f"{provider}_ms" in row and "unfused_ms" in row:
                row[f"{provider}_speedup_%"] = 100 * (row["unfused_ms"] / row[f"{provider}_ms"] - 1)
    return out


def write_outputs(rows: list[dict], title: str, out_dir: str) -> None:
    keys = write_csv(rows, out_dir, "e2e.csv")
    cols = [k for k in keys if k.endswith(("_ms", "_speedup_%", "_fused_calls", "_logit_diff"))]
    print(f"\n{title}")
    print(f"{'workload':>14} " + " ".join(f"{k:>20}" for k in cols))
    for row in rows:
        print(
            f"{row['workload']:>14} "
            + " ".join(
                f"{row[k]:>20.4g}" if isinstance(row.get(k), float) else f"{row.get(k, '-'):>20}"
                for k in cols
            )
        )
    plt = pyplot()
    if plt is None:
        return
    providers = [p for p in PROVIDERS if f"{p}_ms" in keys]
    fig, ax = plt.subplots(figsize=(2 + 1.6 * len(rows), 4))
    width = 0.8 / len(providers)
    for i, provider in enumerate(providers):
        ax.bar(
            [j + i * width for j in range(len(rows))],
            [row.get(f"{provider}_ms", 0) for row in rows],
            width,
            label=provider,
        )
    ax.set_xticks(
        [j + width * (len(providers) - 1) / 2 for j in range(len(rows))], [r["workload"] for r in rows]
    )
    ax.set_yscale("log")
    ax.set_ylabel("ms per call (CUDA graphs)")
    ax.set_title(title, fontsize=9)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "e2e.png"), dpi=110)


def describe(preset: str, layers: int | None, world_size: int, mode: str = "reduce-overhead") -> str:
    from tpfuse.models.llama import PRESETS

    args = PRESETS[preset]
    return (
        f"{preset} ({layers or args.n_layers} layers, hidden {args.dim}, bf16), {world_size} x "
        f"{torch.cuda.get_device_name()}, torch.compile mode {mode}, decode steps and prefill, ms per call"
    )


def run_e2e_bench(
    preset: str, layers: int | None, batches: list[int], prefill: int, providers: list[str], out_dir: str,
    mode: str = "reduce-overhead",
) -> int:
    """Entry point of ``python -m tpfuse bench e2e``; run it under torchrun, one process a GPU."""
    from tpfuse.bench.kernel import finish_torchrun, init_torchrun

    if not init_torchrun():
        return 2
    try:
        rows = e2e_rank(dist.get_rank(), dist.get_world_size(), preset, layers, batches, prefill, providers,
                        mode=mode)
        if dist.get_rank() == 0:
            write_outputs(rows, describe(preset, layers, dist.get_world_size(), mode), out_dir)
    finally:
        finish_torchrun()
    return 0
