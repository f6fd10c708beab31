"""``python -m tpfuse tune``: measure where each algorithm wins on this machine and write the table.

Under torchrun, one process a GPU. For every hidden size and token count it times the one-shot,
the two-shot and NCCL + compiled norm (what the unfused graph runs) as CUDA-graph replays, then
derives the limits of an :class:`tpfuse.select.AlgorithmTable`:

- fused up to the largest measured count below which a fused kernel always beat NCCL;
- one-shot up to the largest measured count below which it always beat the two-shot.

The table goes to :func:`tpfuse.select.user_table_dir` (or ``--out``), where later runs find it.
"""

from __future__ import annotations

import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from tpfuse import select
from tpfuse.bench.kernel import finish_torchrun, init_torchrun
from tpfuse.bench.providers import Providers, epilogue_case
from tpfuse.bench.timing import graph_replay_us, progress

PROVIDERS = ["tpfuse:oneshot", "tpfuse:twoshot", "nccl"]


def derive_limits(times: dict[int, dict[str, float]], world_size: int) -> tuple[int, int, list[str]]:
    """(oneshot_max_tokens, fused_max_tokens, reasons) from ``times[tokens][provider] = us``."""
    reasons = []
    fused_max = 0
    for n in sorted(times):
        fused = min(t for k, t in times[n].items() if k.startswith("tpfuse:"))
        if fused > times[n]["nccl+norm"]:
            reasons.append(
                f"NCCL + norm wins from {n} tokens ({times[n]['nccl+norm']:.1f} us vs {fused:.1f})"
            )
            break
        fused_max = n
    oneshot_max = 0
    for n in sorted(times):
        if n > fused_max:
            break
        two = times[n].get("tpfuse:twoshot")
        if n >= world_size and two is not None and two < times[n]["tpfuse:oneshot"]:
            reasons.append(
                f"two-shot wins from {n} tokens ({two:.1f} us vs one-shot {times[n]['tpfuse:oneshot']:.1f})"
            )
            break
        oneshot_max = n
    return oneshot_max, fused_max, reasons


def tune_rank(hiddens: list[int], tokens: list[int]) -> dict[int, dict[int, dict[str, float]]]:
    rank, world = dist.get_rank(), dist.get_world_size()
    resources = Providers(PROVIDERS, max(tokens), max(hiddens))
    times: dict[int, dict[int, dict[str, float]]] = {}
    total, done = len(hiddens) * len(tokens), 0
    for hidden in hiddens:
        weight = torch.ones(hidden, device="cuda", dtype=torch.bfloat16)
        times[hidden] = {}
        for n in tokens:
            if rank == 0:
                progress(done, total, f"tune: hidden {hidden}, {n} tokens")
            x = torch.randn(n, hidden, device="cuda", dtype=torch.bfloat16)
            # The plain op; only this rank's x is made (the others' are never read here).
            inputs = dict(xs=[x] * world, residual=torch.randn_like(x), weight=weight, quant_scale=None,
                          bias=None, sum_weight=None, norm_bias=None)
            times[hidden][n] = {
                name: graph_replay_us(call)
                for name, call in resources.calls(epilogue_case("plain", n, hidden), inputs).items()
                if not (name == "tpfuse:twoshot" and n < world)
            }
            done += 1
    if rank == 0:
        progress(done, total, "tune: done")
    resources.release()
    return times


def run_tune(hiddens: list[int], tokens: list[int], out: str | None) -> int:
    """Entry point of ``python -m tpfuse tune``."""
    if not init_torchrun():
        return 2
    try:
        world = dist.get_world_size()
        device = torch.device("cuda", torch.cuda.current_device())
        times = tune_rank(hiddens, tokens)
        if dist.get_rank() == 0:
            limits, lines = {}, []
            for hidden, per_count in times.items():
                oneshot_max, fused_max, reasons = derive_limits(per_count, world)
                limits[hidden] = (oneshot_max, fused_max)
                lines.append(
                    f"hidden {hidden}: one-shot up to {oneshot_max} tokens, two-shot up to {fused_max}, "
                    f"NCCL above" + ("; " + "; ".join(reasons) if reasons else "")
                )
            table = select.AlgorithmTable(torch.cuda.get_device_name(device), world, limits)
            for hidden, per_count in times.items():
                print(
                    f"\nhidden {hidden}: {'tokens':>6} {'one-shot':>9} {'two-shot':>9} "
                    f"{'nccl+norm':>9}  chosen"
                )
                for n, t in per_count.items():
                    print(
                        f"{'':>14}{n:>6} {t['tpfuse:oneshot']:>9.2f} "
                        f"{t.get('tpfuse:twoshot', float('nan')):>9.2f} "
                        f"{t['nccl+norm']:>9.2f}  {table.choose(n, hidden)}"
                    )
            path = (
                Path(out)
                if out
                else select.user_table_dir() / select.table_filename(select.device_slug(device), world)
            )
            path.parent.mkdir(parents=True, exist_ok=True)
            data = table.to_json(
                measured=datetime.date.today().isoformat(),
                torch=torch.__version__,
                command=" ".join(["python -m tpfuse tune"] + sys.argv[2:]),
                times_us={str(h): {str(n): t for n, t in per.items()} for h, per in times.items()},
            )
            path.write_text(json.dumps(data, indent=1) + "\n")
            print("\n" + "\n".join(lines))
            print(
                f"wrote {path}; later runs on {select.device_slug(device)} with {world} ranks use it "
                "(TPFUSE_TABLE_DIR or TPFUSE_TUNE_TABLE override where tables are found)"
            )
    finally:
        finish_torchrun()
    return 0
