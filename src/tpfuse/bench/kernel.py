"""Kernel benchmark: tpfuse's fused op beside NCCL, torch symmetric memory and FlashInfer.

Every provider computes h = allreduce(x) + residual and y = RMSNorm(h) * weight in bf16 from the
same inputs, timed as CUDA-graph replays in the same run; FlashInfer is used when importable
(see ../shared/anchors). Prints microseconds and the ratio FlashInfer one-shot / tpfuse, writes
kernel.csv and kernel.png.
"""

from __future__ import annotations

import csv
import os
import sys

import torch
import torch.distributed as dist

from tpfuse.bench.timing import graph_replay_us

EPS = 1e-6

# One-shot launch variants that can be timed beside the default as providers "tpfuse:<name>".
VARIANTS = {
    "nopdl": dict(pdl=False),
    "clear_last": dict(clear_first=False),
    "acq_rel": dict(relaxed_arrive=False),
}


def _load_flashinfer():
    sys.path.insert(0, os.environ.get("ANCHOR_SITE", "/tmp/anchor-site"))
    try:
        import flashinfer.comm.trtllm_ar as fi

        fi.get_trtllm_comm_module()
        return fi
    except Exception as exc:  # optional provider: any import or build problem just drops it
        if dist.get_rank() == 0:
            print(f"flashinfer not available ({type(exc).__name__}: {exc}); skipping it")
        return None


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return ((got.double() - ref).norm() / ref.norm()).item()


def bench_rank(hiddens: list[int], tokens: list[int], providers: list[str]) -> list[dict]:
    import torch.distributed._symmetric_memory as symm_mem

    import tpfuse
    from tpfuse.comm.workspace import enable_symm_mem
    from tpfuse.kernels.oneshot import OneShotVariant, oneshot_allreduce_add_rmsnorm
    from tpfuse.kernels.reference import add_rmsnorm_reference, fused_reference_float64

    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", torch.cuda.current_device())
    group_name = dist.group.WORLD.group_name
    max_t, max_h = max(tokens), max(hiddens)
    comm = tpfuse.get_communicator(max_tokens=max_t, hidden=max_h)
    variants = {p: OneShotVariant(**VARIANTS[p.split(":", 1)[1]]) for p in providers if p.startswith("tpfuse:")}
    fi = _load_flashinfer() if "flashinfer" in providers else None
    if fi is not None:
        _, fi_workspace, _ = fi.trtllm_create_ipc_workspace_for_all_reduce_fusion(
            rank, world, max_t, max_h, group=dist.group.WORLD, create_metadata=True)
    if "symm_mem" in providers:
        enable_symm_mem(group_name)
        symm_buf = symm_mem.empty(max_t * max_h, device=dev, dtype=torch.bfloat16)
        symm_mem.rendezvous(symm_buf, group_name)
    # The baselines' add + RMSNorm: the reference path's own torch code, compiled.
    compiled_norm = torch.compile(add_rmsnorm_reference, dynamic=True)

    def add_rmsnorm(reduced, residual, weight):
        return compiled_norm(reduced, residual, weight, EPS)

    rows = []
    for hidden in hiddens:
        weight = (1 + 0.5 * torch.randn(hidden, generator=torch.Generator().manual_seed(hidden))).bfloat16().to(dev)
        for n in tokens:
            gens = [torch.Generator().manual_seed(1000 * n + hidden + r) for r in range(world + 1)]
            xs = [torch.randn(n, hidden, generator=g).bfloat16() for g in gens[:world]]
            residual = torch.randn(n, hidden, generator=gens[world]).bfloat16().to(dev)
            x = xs[rank].to(dev)
            y_ref, _ = fused_reference_float64(xs, residual.cpu(), weight.cpu(), EPS)
            y_ref = y_ref.to(dev)
            row = {"hidden": hidden, "tokens": n, "bytes_per_rank": n * hidden * 2}
            y, h = torch.empty_like(x), torch.empty_like(x)

            def ours():
                tpfuse.allreduce_add_rmsnorm(x, residual, weight, EPS, out=y, residual_out=h)

            def nccl():
                reduced = x.clone()
                dist.all_reduce(reduced)
                return add_rmsnorm(reduced, residual, weight)

            def symm_oneshot():
                buf = symm_buf[: n * hidden].view(n, hidden)
                buf.copy_(x)
                return add_rmsnorm(torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", group_name), residual, weight)

            def fi_call(one_shot, norm_out, residual_out):
                fi.trtllm_allreduce_fusion(
                    allreduce_in=x, world_size=world, world_rank=rank, token_num=n, hidden_dim=hidden,
                    workspace_ptrs=fi_workspace, launch_with_pdl=True, trigger_completion_at_end=True,
                    fp32_acc=True, pattern_code=fi.AllReduceFusionPattern.kARResidualRMSNorm,
                    use_oneshot=one_shot, allreduce_out=None, residual_in=residual, residual_out=residual_out,
                    norm_out=norm_out, quant_out=None, scale_out=None, rms_gamma=weight, rms_eps=EPS,
                    scale_factor=None, layout_code=None)

            y.fill_(float("nan"))
            ours()
            torch.cuda.synchronize()
            row["tpfuse_err"] = _rel_err(y, y_ref)
            row["tpfuse"] = graph_replay_us(ours)
            for name, variant in variants.items():
                y.fill_(float("nan"))
                row[name] = graph_replay_us(lambda: oneshot_allreduce_add_rmsnorm(
                    x, residual, weight, EPS, y, h, comm.workspace, comm.rank, comm.world_size,
                    comm.max_programs, variant=variant))
                row[f"{name}_err"] = _rel_err(y, y_ref)  # what the replays left in y
            if "nccl" in providers:
                row["nccl+norm"] = graph_replay_us(nccl)
            if "symm_mem" in providers:
                row["symm_oneshot+norm"] = graph_replay_us(symm_oneshot)
            if fi is not None:
                for name, one_shot in (("fi_oneshot", True), ("fi_twoshot", False)):
                    if not one_shot and n <= world:
                        continue
                    norm_out, res_out = torch.empty_like(x), torch.empty_like(x)
                    fi_call(one_shot, norm_out, res_out)
                    torch.cuda.synchronize()
                    row[f"{name}_err"] = _rel_err(norm_out, y_ref)
                    row[name] = graph_replay_us(lambda: fi_call(one_shot, norm_out, res_out))
            if "fi_oneshot" in row:
                row["fi_oneshot/tpfuse"] = row["fi_oneshot"] / row["tpfuse"]
            if rank == 0:
                print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()),
                      flush=True)
            rows.append(row)
    return rows


def write_outputs(rows: list[dict], out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    keys = list(dict.fromkeys(k for row in rows for k in row))
    with open(os.path.join(out_dir, "kernel.csv"), "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    timed = [k for k in keys if k in ("tpfuse", "nccl+norm", "symm_oneshot+norm", "fi_oneshot", "fi_twoshot")
             or (k.startswith("tpfuse:") and not k.endswith("_err"))]
    errs = {k: max(row[k] for row in rows if k in row) for k in keys if k.endswith("_err")}
    print("largest relative error against float64: "
          + ", ".join(f"{k[:-4]} {v:.1e}" for k, v in errs.items()))
    width = max(len(k) for k in timed + ["fi_oneshot/tpfuse"]) + 1
    print(f"\n{'hidden':>6} {'tokens':>6} " + " ".join(f"{k:>{width}}" for k in timed)
          + f" {'fi_oneshot/tpfuse':>{width}}")
    for row in rows:
        cells = " ".join(f"{row[k]:>{width}.2f}" if k in row else f"{'-':>{width}}" for k in timed)
        ratio = f"{row['fi_oneshot/tpfuse']:>{width}.3f}" if "fi_oneshot/tpfuse" in row else f"{'-':>{width}}"
        print(f"{row['hidden']:>6} {row['tokens']:>6} {cells} {ratio}")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not installed: no plot")
        return
    hiddens = sorted({row["hidden"] for row in rows})
    fig, axes = plt.subplots(1, len(hiddens), figsize=(5 * len(hiddens), 4), squeeze=False)
    for ax, hidden in zip(axes[0], hiddens):
        sel = [row for row in rows if row["hidden"] == hidden]
        for k in timed:
            pts = [(row["tokens"], row[k]) for row in sel if k in row]
            ax.plot(*zip(*pts), marker="o", label=k)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("tokens")
        ax.set_ylabel("us per call (CUDA graph)")
        ax.set_title(f"hidden {hidden}, bf16, {dist.get_world_size()} ranks")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "kernel.png"), dpi=110)


def run_kernel_bench(hiddens: list[int], tokens: list[int], providers: list[str], out_dir: str) -> int:
    """Entry point of ``python -m tpfuse bench kernel``; run it under torchrun, one process a GPU."""
    if "RANK" not in os.environ:
        print("run under torchrun: torchrun --nproc_per_node=NGPUS -m tpfuse bench kernel")
        return 2
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    dist.init_process_group("nccl", device_id=torch.device("cuda", int(os.environ["LOCAL_RANK"])))
    try:
        rows = bench_rank(hiddens, tokens, providers)
        if dist.get_rank() == 0:
            write_outputs(rows, out_dir)
    finally:
        import tpfuse

        dist.barrier()
        tpfuse.destroy_all()
        dist.destroy_process_group()
    return 0
