"""``python -m tpfuse info``: what to paste into a bug report, and what each call size would run."""

from __future__ import annotations

import importlib.util
import os
import platform

import torch

from tpfuse import select
from tpfuse.comm.communicator import DEFAULT_HIDDEN


def _version(module: str) -> str:
    if importlib.util.find_spec(module) is None:
        return "not installed"
    try:
        return __import__(module).__version__
    except Exception as exc:  # a broken install still gets reported, not raised
        return f"installed, import fails: {type(exc).__name__}"


# Compiles the plain one-shot kernel (2 ranks, rows of 4096, bf16) for the architecture in argv[1], in a
# process of its own: LLVM aborts the whole process on code it cannot lower.
_COMPILE_ONE_SHOT = """
import sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from tpfuse.blockend.epilogue import PLAIN, StepTensors
from tpfuse.kernels.oneshot import _oneshot_allreduce_add_rmsnorm_kernel as kernel
arch = sys.argv[1]
amd = arch.startswith("gfx")
flags = dict(RANK=1, WORLD=2, BLOCK_H=4096, HAS_RESIDUAL=True, STEPS=PLAIN.switches(4096), USE_PDL=not amd,
             DEADLINE_GIVEN=False, DESC_FLAGS=5, CLEAR_FIRST=True, RELAXED_ARRIVE=True, SPLIT_PUSH=False,
             PUSH_CHUNKS=1, BLOCK_C=4096, X_FIRST=False)
types = dict(peer_ptrs_ptr="*i64", state_ptr="*i32", eps="fp32", wait_limit="i64",
             steps=StepTensors._make(("*bf16",) * len(StepTensors._fields)))
signature = {a: "constexpr" if a in flags else types.get(a, "*bf16" if a.endswith("_ptr") else "i32")
             for a in kernel.arg_names}
target = GPUTarget("hip", arch, 64) if amd else GPUTarget("cuda", int(arch[2:]), 32)
triton.compile(ASTSource(kernel, signature, flags), target=target, options={"num_warps": 8 if amd else 16})
"""


def kernels_compile_for(arch: str) -> str:
    """Whether the one-shot kernel compiles for ``arch`` (``sm90``, ``gfx942``) with this Triton: "yes", or
    "no" and the compiler's last words."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    try:
        done = subprocess.run([sys.executable, "-c", _COMPILE_ONE_SHOT, arch], env=env, capture_output=True,
                              text=True, timeout=300)
    except subprocess.TimeoutExpired:
        return "no: the compiler took over 300 s"
    if done.returncode == 0:
        return "yes"
    last = (done.stderr.strip().splitlines() or [f"exit status {done.returncode}"])[-1]
    return f"no (exit status {done.returncode}): {last}"


def algorithm_ranges(
    hidden: int, dtype: torch.dtype, world_size: int, workspace_bytes: int, device: torch.device | str | None
) -> list[tuple[int, int | None, str]]:
    """[(first_tokens, last_tokens or None for "and above", algorithm)] for calls of ``hidden``."""
    limit = select.max_token_num(hidden, dtype, world_size, workspace_bytes, device)
    ranges, start, current = [], 1, None
    for n in range(1, limit + 2):
        algorithm = select.choose_algorithm(n, hidden, dtype, world_size, workspace_bytes, device)
        if algorithm != current:
            if current is not None:
                ranges.append((start, n - 1, current))
            start, current = n, algorithm
    ranges.append((start, None, current))
    return ranges


def run_info(hidden: int, world_size: int | None, max_tokens: int) -> int:
    """Print versions, GPUs and peer access, the backend, the table in force and the algorithm per size."""
    import tpfuse

    print(
        f"tpfuse {tpfuse.__version__}  python {platform.python_version()}  torch {torch.__version__}  "
        f"triton {_version('triton')}  flashinfer {_version('flashinfer')}"
    )
    n_gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n_gpus:
        for i in range(n_gpus):
            props = torch.cuda.get_device_properties(i)
            print(f"GPU {i}: {props.name}, {props.multi_processor_count} SMs, {props.total_memory >> 30} GiB")
        pairs = [(a, b) for a in range(n_gpus) for b in range(n_gpus) if a != b]
        missing = [f"{a}->{b}" for a, b in pairs if not torch.cuda.can_device_access_peer(a, b)]
        print(
            "peer access: " + ("every pair" if not missing else "missing for " + ", ".join(missing))
            if pairs
            else "peer access: one GPU only"
        )
    else:
        print("GPUs: none (the kernels run on the CPU only under TRITON_INTERPRET=1, for tests)")
    device = torch.device("cuda", 0) if n_gpus else torch.device("cpu")
    if n_gpus:
        from tpfuse import targets

        target = targets.target(device)
        runtime = f"ROCm (HIP {torch.version.hip})" if targets.on_rocm() else f"CUDA {torch.version.cuda}"
        print(f"vendor: {target.vendor}, {runtime}, arch {target.arch}; fp8 outputs {target.fp8.name}; "
              f"kernels compile here: {kernels_compile_for(target.arch)}")
        if target.amd:
            print("  ROCm: compiled and checked in CI (gfx942, gfx950), not yet run on AMD hardware by us: "
                  "run scripts/gpu_check.sh, then python -m tpfuse tune (README, ROCm)")
    world = world_size or max(n_gpus, 2)
    print(f"backend: {os.environ.get('TPFUSE_BACKEND') or 'triton'} (TPFUSE_BACKEND)")
    table = select.algorithm_table(world, device)
    print(f"algorithm table for {select.device_slug(device)} with {world} ranks: {table.source}")
    workspace_bytes = max_tokens * DEFAULT_HIDDEN * select.ELEMENT_BYTES
    print(
        f"calls of hidden {hidden}, bf16, workspace of {max_tokens} x {DEFAULT_HIDDEN} "
        f"({workspace_bytes >> 20} MiB a rank):"
    )
    for first, last, algorithm in algorithm_ranges(hidden, torch.bfloat16, world, workspace_bytes, device):
        span = f"{first}-{last}" if last is not None else f"{first}+"
        print(f"  {span:>12} tokens: {algorithm}")
    return 0
