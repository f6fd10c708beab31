"""Kernel benchmark: tpfuse's fused op beside NCCL, torch symmetric memory and FlashInfer.

Every provider (:mod:`tpfuse.bench.providers`) computes the same result from the same inputs, is
checked against float64 once, then timed as CUDA-graph replays in the same run. Prints microseconds,
the effective bandwidth (one rank's bytes of x over the time) beside the measured peer copy
bandwidth, and the ratio FlashInfer one-shot / tpfuse; writes kernel.csv and kernel.png.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from tpfuse.bench.output import pyplot, write_csv
from tpfuse.bench.providers import EPS, FLOOR_PROVIDERS, Providers, peer_copy_gbps
from tpfuse.bench.timing import graph_replay_us

BASELINES = ("nccl+norm", "symm_oneshot+norm", "fi_oneshot", "fi_twoshot")


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def bench_rank(hiddens: list[int], tokens: list[int], providers: list[str]) -> tuple[list[dict], float]:
    from tpfuse.kernels.reference import fused_reference_float64

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    max_t, max_h = max(tokens), max(hiddens)
    resources = Providers(providers, max_t, max_h)
    ceiling = peer_copy_gbps(max_t * max_h * 2)
    if rank == 0:
        print(f"peer copy bandwidth ({max_t * max_h * 2 >> 20} MiB): {ceiling:.1f} GB/s", flush=True)
    rows = []
    for hidden in hiddens:
        weight_gen = torch.Generator().manual_seed(hidden)
        weight = (1 + 0.5 * torch.randn(hidden, generator=weight_gen)).bfloat16().to(dev)
        for n in tokens:
            gens = [torch.Generator().manual_seed(1000 * n + hidden + r) for r in range(world + 1)]
            xs = [torch.randn(n, hidden, generator=g).bfloat16() for g in gens[:world]]
            residual = torch.randn(n, hidden, generator=gens[world]).bfloat16().to(dev)
            x = xs[rank].to(dev)
            y_ref, _ = fused_reference_float64(xs, residual.cpu(), weight.cpu(), EPS)
            y_ref = y_ref.to(dev)
            row = {"hidden": hidden, "tokens": n, "bytes_per_rank": n * hidden * 2}
            if "tpfuse" in providers:
                row["algorithm"] = resources.comm.choose_algorithm(n, hidden, x.dtype)
            for name, call in resources.calls(x, residual, weight).items():
                if name in FLOOR_PROVIDERS:  # a bound, not the op: nothing to check
                    row[name] = graph_replay_us(call)
                    continue
                y = call()
                y.fill_(float("nan"))  # poison, then check what one call writes
                y = call()
                torch.cuda.synchronize()
                row[f"{name}_err"] = _rel_err(y, y_ref)
                row[name] = graph_replay_us(call)
                row[f"{name}_GBps"] = row["bytes_per_rank"] / row[name] / 1e3
            if "fi_oneshot" in row and "tpfuse" in row:
                row["fi_oneshot/tpfuse"] = row["fi_oneshot"] / row["tpfuse"]
            if "floor" in row and "tpfuse" in row:
                row["tpfuse/floor"] = row["tpfuse"] / row["floor"]
            best_baseline = min((row[k] for k in BASELINES if k in row), default=None)
            if best_baseline is not None and "tpfuse" in row:
                row["best_baseline/tpfuse"] = best_baseline / row["tpfuse"]
            row["peer_copy_GBps"] = ceiling
            if rank == 0:
                print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                                if not k.endswith("_GBps")), flush=True)
            rows.append(row)
    resources.release()
    return rows, ceiling


def _timed_keys(keys: list[str]) -> list[str]:
    return [k for k in keys if (k == "tpfuse" or k.startswith("tpfuse:") or k in BASELINES + FLOOR_PROVIDERS)
            and not k.endswith(("_err", "_GBps"))]


def write_outputs(rows: list[dict], ceiling: float, out_dir: str) -> None:
    keys = write_csv(rows, out_dir, "kernel.csv")
    timed = _timed_keys(keys)
    errs = {k: max(row[k] for row in rows if k in row) for k in keys if k.endswith("_err")}
    print("largest relative error against float64: "
          + ", ".join(f"{k[:-4]} {v:.1e}" for k, v in errs.items()))
    ratios = [k for k in ("fi_oneshot/tpfuse", "best_baseline/tpfuse", "tpfuse/floor") if k in keys]
    width = max(len(k) for k in timed + ratios) + 1
    print(f"peer copy bandwidth: {ceiling:.1f} GB/s")
    print(f"\n{'hidden':>6} {'tokens':>6} {'algo':>8} " + " ".join(f"{k:>{width}}" for k in timed + ratios)
          + f" {'tpfuse GB/s':>12}")
    for row in rows:
        cells = " ".join(f"{row[k]:>{width}.{3 if '/' in k else 2}f}" if k in row else f"{'-':>{width}}"
                         for k in timed + ratios)
        bw = f"{row['tpfuse_GBps']:>12.1f}" if "tpfuse_GBps" in row else f"{'-':>12}"
        print(f"{row['hidden']:>6} {row['tokens']:>6} {row.get('algorithm', '-'):>8} {cells} {bw}")
    plt = pyplot()
    if plt is None:
        return
    hiddens = sorted({row["hidden"] for row in rows})
    fig, axes = plt.subplots(2, len(hiddens), figsize=(5 * len(hiddens), 8), squeeze=False)
    for col, hidden in enumerate(hiddens):
        sel = [row for row in rows if row["hidden"] == hidden]
        for k in timed:
            pts = [(row["tokens"], row[k], row.get(f"{k}_GBps")) for row in sel if k in row]
            axes[0][col].plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=k)
            if k not in FLOOR_PROVIDERS:  # a bound moves no rows: no bandwidth
                axes[1][col].plot([p[0] for p in pts], [p[2] for p in pts], marker="o", label=k)
        axes[1][col].axhline(ceiling, color="black", linestyle="--", label="peer copy")
        labels = ((axes[0][col], "us per call (CUDA graph)"), (axes[1][col], "GB/s (one rank's x / time)"))
        for ax, ylabel in labels:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("tokens")
            ax.set_ylabel(ylabel)
            ax.set_title(f"hidden {hidden}, bf16, {dist.get_world_size()} ranks")
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "kernel.png"), dpi=110)


def init_torchrun() -> bool:
    """Join the NCCL group torchrun describes, one GPU a process; False (with a hint) outside torchrun."""
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node=NGPUS -m tpfuse ...")
        return False
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    return True


def finish_torchrun() -> None:
    import tpfuse

    dist.barrier()
    tpfuse.destroy_all()
    dist.destroy_process_group()


def run_kernel_bench(hiddens: list[int], tokens: list[int], providers: list[str], out_dir: str) -> int:
    """Entry point of ``python -m tpfuse bench kernel``; run it under torchrun, one process a GPU."""
    if not init_torchrun():
        return 2
    try:
        rows, ceiling = bench_rank(hiddens, tokens, providers)
        if dist.get_rank() == 0:
            write_outputs(rows, ceiling, out_dir)
    finally:
        finish_torchrun()
    return 0
