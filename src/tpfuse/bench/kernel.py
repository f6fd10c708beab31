"""Kernel benchmark: tpfuse's fused op beside NCCL, torch symmetric memory and FlashInfer.

Every provider (:mod:`tpfuse.bench.providers`) computes the same result from the same inputs (the plain
op, or with ``--epilogue`` another block end: :data:`tpfuse.bench.providers.EPILOGUES`), is
checked against float64 once, then timed as CUDA-graph replays in the same run. Prints microseconds,
the effective bandwidth (one rank's bytes of x over the time) beside the measured peer copy
bandwidth, and the ratio FlashInfer one-shot / tpfuse; writes kernel.csv and kernel.png.
"""

from __future__ import annotations

import dataclasses
import os

import torch
import torch.distributed as dist

from tpfuse.bench.output import pyplot, write_csv
from tpfuse.bench.providers import EPS, FLOOR_PROVIDERS, Providers, epilogue_case, peer_copy_gbps
from tpfuse.bench.timing import graph_replay_us

BASELINES = ("nccl+norm", "symm_oneshot+norm", "fi_oneshot", "fi_twoshot", "nccl_rs+norm+ag")


def bench_inputs(epilogue: str, n: int, hidden: int, world: int, rank: int, device: torch.device):
    """(case, this rank's inputs on ``device``, the float64 y on ``device``) of one size of ``--epilogue``."""
    from tpfuse.blockend.reference import fused_reference_float64

    case = epilogue_case(epilogue, n, hidden, seed=1000 * n + hidden)
    inputs = case.inputs(world)  # every rank's x, for the float64 reference
    xs = inputs["xs"]
    if epilogue == "two_branches":
        others = dataclasses.replace(case, seed=case.seed + 1).inputs(world)["xs"]
        inputs["x_other"] = others[rank]
        xs = [x + other for x, other in zip(xs, others)]  # what the model's two all-reduces sum
    y_ref, _ = fused_reference_float64(xs, inputs["residual"], inputs["weight"], EPS, case.epilogue(inputs))
    on_device = {k: [t.to(device) for t in v] if k == "xs" else v.to(device) if torch.is_tensor(v) else v
                 for k, v in inputs.items()}
    return case, on_device, y_ref.to(device)


def relative_error(case, result: tuple[torch.Tensor, torch.Tensor | None], y_ref: torch.Tensor) -> float:
    """|y - y_ref| / |y_ref| of a provider's ``(y, scales)``; a dynamic fp8 y counts as ``y8 * scale``."""
    y, scales = result
    if scales is not None:
        y = (y.float().unflatten(-1, (-1, case.scale_group)) * scales.unsqueeze(-1)).flatten(-2)
    return ((y.double() - y_ref).norm() / y_ref.norm()).item()


def bench_rank(hiddens: list[int], tokens: list[int], providers: list[str],
               epilogues: tuple[str, ...] = ("plain",)) -> tuple[list[dict], float]:
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    max_t, max_h = max(tokens), max(hiddens)
    resources = Providers(providers, max_t, max_h)
    ceiling = peer_copy_gbps(max_t * max_h * 2)
    if rank == 0:
        print(f"peer copy bandwidth ({max_t * max_h * 2 >> 20} MiB): {ceiling:.1f} GB/s", flush=True)
    rows = []
    sizes = [(epilogue, hidden, n) for epilogue in epilogues for hidden in hiddens for n in tokens]
    for epilogue, hidden, n in sizes:
        case, on_device, y_ref = bench_inputs(epilogue, n, hidden, world, rank, dev)
        row = {"epilogue": epilogue, "hidden": hidden, "tokens": n, "bytes_per_rank": n * hidden * 2}
        if "tpfuse" in providers:
            row["algorithm"] = resources.comm.choose_algorithm(n, hidden, torch.bfloat16,
                                                               epilogue=case.epilogue(on_device))
        for name, call in resources.calls(case, on_device, epilogue == "two_branches").items():
            if name in FLOOR_PROVIDERS:  # a bound, not the op: nothing to check
                row[name] = graph_replay_us(call)
                continue
            y, _ = call()
            y.fill_(float("nan"))  # poison, then check what one call writes
            row[f"{name}_err"] = relative_error(case, call(), y_ref)
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
    epilogues = list(dict.fromkeys(row["epilogue"] for row in rows))
    shown = epilogues != ["plain"]  # the epilogue column, when the run had others
    print("\n" + f"{'epilogue':>12} " * shown + f"{'hidden':>6} {'tokens':>6} {'algo':>8} "
          + " ".join(f"{k:>{width}}" for k in timed + ratios) + f" {'tpfuse GB/s':>12}")
    for row in rows:
        cells = " ".join(f"{row[k]:>{width}.{3 if '/' in k else 2}f}" if k in row else f"{'-':>{width}}"
                         for k in timed + ratios)
        bw = f"{row['tpfuse_GBps']:>12.1f}" if "tpfuse_GBps" in row else f"{'-':>12}"
        print(f"{row['epilogue']:>12} " * shown
              + f"{row['hidden']:>6} {row['tokens']:>6} {row.get('algorithm', '-'):>8} {cells} {bw}")
    plt = pyplot()
    if plt is None:
        return
    rows = [row for row in rows if row["epilogue"] == epilogues[0]]  # the plot: the first epilogue
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


def run_kernel_bench(hiddens: list[int], tokens: list[int], providers: list[str], out_dir: str,
                     epilogues: tuple[str, ...] = ("plain",)) -> int:
    """Entry point of ``python -m tpfuse bench kernel``; run it under torchrun, one process a GPU."""
    from tpfuse.bench.providers import EPILOGUES

    unknown = [name for name in epilogues if name not in EPILOGUES]
    if unknown:
        print(f"unknown epilogue {', '.join(unknown)}; there are {', '.join(EPILOGUES)}")
        return 2
    if not init_torchrun():
        return 2
    try:
        rows, ceiling = bench_rank(hiddens, tokens, providers, epilogues)
        if dist.get_rank() == 0:
            write_outputs(rows, ceiling, out_dir)
    finally:
        finish_torchrun()
    return 0
