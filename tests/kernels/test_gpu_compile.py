"""The kernels compile for a Hopper GPU (sm_90) on any machine.

The interpreter accepts code that the compiler may not, so CI compiles the launch shapes we ship
(Triton's wheel carries ptxas; no GPU needed). Compiling needs Triton out of interpreter mode, so the
test runs this file as a script in a process without TRITON_INTERPRET.
"""

import os
import re
import subprocess
import sys

import pytest

POINTERS = {"x_ptr": "*{dt}", "residual_ptr": "*{dt}", "weight_ptr": "*{dt}", "y_ptr": "*{yt}",
            "h_ptr": "*{dt}", "peer_ptrs_ptr": "*i64", "state_ptr": "*i32"}
#: The block end's pointers (the kernels' ``steps``, ``epilogue.StepTensors``): fp32 scales, the rest x's.
STEP_POINTERS = {"quant_scale": "*fp32", "scales": "*fp32", "topk_weights": "*fp32", "global_scale": "*fp32"}
SCALARS = {"n_tokens": "i32", "hidden": "i32", "region_elems": "i32", "eps": "fp32", "wait_limit": "i64",
           "pushers": "i32", "group_rows": "i32"}
ONESHOT = dict(CLEAR_FIRST=True, RELAXED_ARRIVE=True, SPLIT_PUSH=False, PUSH_CHUNKS=1, X_FIRST=False)
STATIC_FP8 = dict(QUANT=1)
# The epilogue's steps (kernels/epilogue.py): Phi's bias + LayerNorm, Gemma's post-norm, dynamic fp8.
LAYER_NORM = dict(HAS_BIAS=True, LAYER_NORM=True, HAS_NORM_BIAS=True)
GEMMA_PER_GROUP = dict(SUM_NORM=True, QUANT=2, SCALE_GROUP=128)
MOE = dict(EXPERTS=8, TOPK_WEIGHTS=True, SHARED_EXPERT=True)
NORM_BACKWARD = dict(NORM_BACKWARD=True)  # the backward's block end: the gradient's sum, RMSNorm's backward
# The quantised outputs the next GEMM takes (epilogue._store_fp8 / _store_fp4): UE8M0 exponents packed in
# int32 words with the norm's copy, column-major float32 scales, NVFP4 (e4m3 scales, swizzled) and MXFP4
# (e8m0 scales, row-major or shuffled). STEP_TYPES: the scales' pointer type where it is not float32.
PACKED_UE8M0 = dict(QUANT=2, SCALE_GROUP=128, POW2_SCALES=True, SCALE_LAYOUT=2, NORMED_COPY=True,
                    STEP_TYPES={"scales": "*i32"})
COLUMNS = dict(QUANT=2, SCALE_GROUP=128, SCALE_LAYOUT=1)
NVFP4 = dict(QUANT=3, SCALE_GROUP=16, NORMED_COPY=True, STEP_TYPES={"scales": "*u8"})
MXFP4 = dict(QUANT=4, SCALE_GROUP=32, STEP_TYPES={"scales": "*u8"})
MXFP4_SHUFFLED = dict(MXFP4, SCALE_LAYOUT=3)  # AITER's e8m0_shuffle order
QUANTISED_OUTPUTS = [
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, **PACKED_UE8M0)),
    ("oneshot", 4, "bf16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, **COLUMNS)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, **NVFP4)),
    ("oneshot", 2, "fp16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, **MXFP4)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, **PACKED_UE8M0)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=True, **NVFP4)),
    ("twoshot", 4, "bf16", dict(BLOCK_H=4096, GROUPED=True, WIRE=False, **MXFP4)),
    ("oneshot", 8, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, **MXFP4_SHUFFLED)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=2048, GROUPED=True, WIRE=False, **MXFP4_SHUFFLED)),
]
# (kernel, world, dtype, constexprs)
SHAPES = [
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192)),
    # Triton's launcher passes an integer argument of 1 as a constant: one-token calls compile apart.
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, n_tokens=1)),
    ("oneshot", 8, "fp16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, **STATIC_FP8)),
    ("oneshot", 4, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, CLEAR_FIRST=False,
                                RELAXED_ARRIVE=False)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, SPLIT_PUSH=True, PUSH_CHUNKS=4, BLOCK_C=2048)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, SPLIT_PUSH=True, PUSH_CHUNKS=4, BLOCK_C=2048,
                                X_FIRST=True)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, n_tokens=1, X_FIRST=True)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, **LAYER_NORM)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, **GEMMA_PER_GROUP)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, QUANT=2)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=False, WIRE=False)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False)),
    ("twoshot", 8, "fp16", dict(BLOCK_H=4096, GROUPED=False, WIRE=False, **STATIC_FP8)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, **LAYER_NORM)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, **GEMMA_PER_GROUP)),
    # 32 warps (twoshot max_warps=32): rows of 8192 one 16-byte access a thread.
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, num_warps=32)),
    # The fp8 wire (kernels/wire.py): its code and exponent words are not 16-byte rows.
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=True)),
    ("twoshot", 4, "bf16", dict(BLOCK_H=4096, GROUPED=False, WIRE=True, **LAYER_NORM)),
    # A plain all-reduce (tpfuse.all_reduce): no norm, no y.
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, NORMED=False)),
    ("twoshot", 4, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, NORMED=False)),
    # A MoE finalize before the sum: 8 experts' outputs weighted, a shared expert (split push too).
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=4096, BLOCK_C=4096, **MOE)),
    ("oneshot", 4, "bf16", dict(ONESHOT, BLOCK_H=8192, SPLIT_PUSH=True, PUSH_CHUNKS=4, BLOCK_C=2048, **MOE)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, **MOE)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=4096, GROUPED=True, WIRE=True, **MOE)),
    ("oneshot", 2, "bf16", dict(ONESHOT, BLOCK_H=8192, BLOCK_C=8192, **NORM_BACKWARD)),
    ("twoshot", 4, "bf16", dict(BLOCK_H=4096, GROUPED=True, WIRE=False, **NORM_BACKWARD)),
    # Sequence parallel (rows sharded): the forward, static fp8, and the backward whose owner sends y.
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, SHARDED=True)),
    ("twoshot", 4, "fp16", dict(BLOCK_H=4096, GROUPED=True, WIRE=False, SHARDED=True, **STATIC_FP8)),
    ("twoshot", 2, "bf16", dict(BLOCK_H=8192, GROUPED=True, WIRE=False, SHARDED=True, **NORM_BACKWARD)),
] + QUANTISED_OUTPUTS
PLAIN = dict(HAS_BIAS=False, SUM_NORM=False, LAYER_NORM=False, HAS_NORM_BIAS=False, QUANT=0, SCALE_GROUP=0,
             NORMED=True, EXPERTS=0, TOPK_WEIGHTS=False, SHARED_EXPERT=False, NORMED_COPY=False,
             NORM_BACKWARD=False, POW2_SCALES=False, SCALE_LAYOUT=0)


def compile_shape(name: str, world: int, dtype: str, constexprs: dict, target, use_pdl: bool, max_warps: int):
    """Compile one entry of :data:`SHAPES` for ``target`` (a ``GPUTarget``): the compiled kernel and its
    constexprs. Warps as ``protocol.launch_config`` gives them on the target (at most ``max_warps``; a
    shape's ``num_warps`` is the launcher's ``max_warps`` argument)."""
    import triton
    from triton.compiler import ASTSource

    from tpfuse.kernels.oneshot import _oneshot_allreduce_add_rmsnorm_kernel
    from tpfuse.kernels.twoshot import _twoshot_allreduce_add_rmsnorm_kernel

    kernel = {"oneshot": _oneshot_allreduce_add_rmsnorm_kernel,
              "twoshot": _twoshot_allreduce_add_rmsnorm_kernel}[name]
    constexprs = dict(constexprs)
    if name == "twoshot":
        constexprs.setdefault("SHARDED", False)
    asked = constexprs.pop("num_warps", 16)
    step_types = {**STEP_POINTERS, **constexprs.pop("STEP_TYPES", {})}
    from tpfuse.blockend.epilogue import StepTensors, Switches

    switches = dict(PLAIN)
    for name in Switches._fields:
        switches[name] = constexprs.pop(name, switches[name])
    flags = dict(RANK=world - 1, WORLD=world, HAS_RESIDUAL=True, STEPS=Switches(**switches), USE_PDL=use_pdl,
                 DEADLINE_GIVEN=False, DESC_FLAGS=5, **constexprs)
    warps = max(1, min(asked, max_warps, flags["BLOCK_H"] // (8 * target.warp_size)))
    quant = flags["STEPS"].QUANT > 0
    steps = StepTensors(*[step_types.get(name, "*{dt}").format(dt=dtype) for name in StepTensors._fields])
    signature = {
        arg: "constexpr" if arg in flags
        else POINTERS[arg].format(dt=dtype, yt="u8" if quant else dtype) if arg in POINTERS
        else steps if arg == "steps"
        else SCALARS[arg]
        for arg in kernel.arg_names
    }
    # Triton's launcher tells the compiler which pointers are 16-byte aligned (torch's tensors are);
    # the sizes get no hint here, as for a hidden size such as 4104 that is not a multiple of 16.
    aligned = {(i,): [["tt.divisibility", 16]]
               for i, arg in enumerate(kernel.arg_names) if arg in POINTERS}
    at = kernel.arg_names.index("steps")
    aligned.update({(at, j): [["tt.divisibility", 16]] for j in range(len(steps))})
    compiled = triton.compile(ASTSource(kernel, signature, flags, aligned), target=target,
                              options={"num_warps": warps})
    return compiled, flags


def _compile_all() -> None:
    from triton.backends.compiler import GPUTarget

    for name, world, dtype, constexprs in SHAPES:
        compiled, flags = compile_shape(name, world, dtype, constexprs, GPUTarget("cuda", 90, 32), True, 32)
        quant = flags["STEPS"].QUANT > 0
        ptx = compiled.asm["ptx"]
        narrow = len(re.findall(r"(?:ld|st)(?:\.volatile)?\.global\.b16", ptx))
        # The fp8 wire's exponent words (one per block of 128: a short vector, a word a thread) add a
        # few narrow sends and polls per peer; its code words move 16 bytes at a time like rows.
        allowed = 4 * (world - 1) + (4 * world if flags.get("WIRE") else 0)
        print(f"{name} W={world} {dtype} fp8={quant} {constexprs}: {len(compiled.asm['cubin'])} bytes, "
              f"{narrow} narrow of {allowed} allowed, {ptx.count('st.global')} stores")


def _compile_quantised_outputs_for_sm100() -> None:
    """The quantised outputs' shapes for Blackwell (sm_100), whose GEMMs take NVFP4 and packed UE8M0."""
    from triton.backends.compiler import GPUTarget

    for name, world, dtype, constexprs in QUANTISED_OUTPUTS:
        compiled, _ = compile_shape(name, world, dtype, constexprs, GPUTarget("cuda", 100, 32), True, 32)
        print(f"sm_100 {name} W={world} {dtype} {constexprs}: {len(compiled.asm['cubin'])} bytes")


def _compile_floor() -> None:
    """The benchmark's bound kernels (tpfuse.bench.floor), which CI never runs compiled either."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from tpfuse.bench.floor import _launch_only_kernel, _ping_pong_kernel

    ping_pong = {"peer_ptrs_ptr": "*i64", "state_ptr": "*i32", "wait_limit": "i64", "RANK": "constexpr",
                 "WORLD": "constexpr", "USE_PDL": "constexpr"}
    for kernel, signature, constants in ((_ping_pong_kernel, ping_pong, dict(RANK=1, WORLD=2, USE_PDL=True)),
                                         (_launch_only_kernel, {"USE_PDL": "constexpr"}, dict(USE_PDL=True))):
        compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                                  options={"num_warps": 16})
        print(f"floor kernel {kernel.fn.__name__}: {len(compiled.asm['cubin'])} cubin")


def test_kernels_compile_for_sm90():
    import triton

    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    if not os.path.exists(ptxas):
        pytest.skip("this Triton has no ptxas")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, __file__], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]
    assert done.stdout.count("bytes") == len(SHAPES) + len(QUANTISED_OUTPUTS), done.stdout
    assert done.stdout.count("sm_100 ") == len(QUANTISED_OUTPUTS), done.stdout
    assert done.stdout.count("floor kernel") == 2, done.stdout
    lines = [line for line in done.stdout.splitlines() if line.endswith("stores")]
    # Rows of 16-bit words move 16 bytes an access: pushes to peers, polls, clears, loads and stores.
    # Accesses of one word each took 8x the transactions (over NVLink too) until the kernels said
    # that peer buffers and sizes are aligned. The only narrow accesses left are the call
    # descriptor's 8 words (a thread a word): its send, its two polls and its clear, for each peer.
    counts = [(line, *map(int, re.search(r", (\d+) narrow of (\d+) allowed", line).groups()))
              for line in lines]
    narrow = [line for line, found, allowed in counts
              if found > allowed or (found != allowed and "'WIRE': True" not in line)]
    assert not narrow, "16-bit global accesses left:\n" + "\n".join(narrow)


if __name__ == "__main__":
    _compile_all()
    _compile_quantised_outputs_for_sm100()
    _compile_floor()
