#!/usr/bin/env bash
# Everything the GPU machine should run: GPU tests, graph-replay soak, tune, kernel benchmark, end to
# end; a short table last. On 2 x H200 (2026-11-30) the tests took 4.3 min at 100,000 replays a phase
# (6.1 min beside an eager soak), tune 1.5 min, the kernel benchmark 2.5 min (`bench`: 20 token
# counts, 5 providers), `variants` 2 min, the end-to-end benchmark 3-5 min: a 10-minute device call
# holds one part.
# Usage (device tool, carry [".anchors"] for FlashInfer):
#   bash scripts/gpu_check.sh [one-gpu|timings|sequence-parallel|host|quick|tests|bench|variants|epilogues|baseline|e2e|hf|hf-pairs|soak-start|soak-wait]
# Needs: 2+ GPUs, python3 with torch (>= 2.11) and triton; nothing is installed from a registry.
# Runs on NVIDIA (CUDA torch) and AMD (ROCm torch: MI300X, MI355X) alike: on ROCm the topology comes
# from rocm-smi and FlashInfer (NVIDIA only) leaves the providers.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on the machines we test on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src:/tmp/anchor-site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/results/gpu}
MODE=${1:-full}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
ROCM=$(python3 -c "import torch; print(torch.version.hip or '')")
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), 'hip', torch.version.hip)"
if [ -n "$ROCM" ]; then
  rocm-smi --showtopo 2>/dev/null | head -20
  FLASHINFER=""  # NVIDIA only
else
  nvidia-smi topo -m 2>/dev/null | head -5
  FLASHINFER=",flashinfer"
fi
if [ -f .anchors/setup.sh ]; then bash .anchors/setup.sh .anchors 2>&1 | tail -1; fi
python3 -m tpfuse info --hidden 8192 | tee "$OUT/info.log"

status=0
# `host`: host us a call of the launches and the eager op (two ranks on one GPU) beside torch's chain.
host_cost() {
  echo "== host us a call =="
  timeout 200 python3 -m tpfuse bench host --tokens 1,64 --hidden 4096,8192 --out "$OUT" 2>&1 | tee "$OUT/host.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
}
# `one-gpu`: what one GPU can show. The fast lane on the GPU (kernels compiled for it: the compile
# test, the one-GPU kernel tests, world size 1, two ranks sharing the GPU reducing rows in batches),
# two ranks sharing the GPU (GPU us a call), batch-invariant mode's gathered path beside the reference
# path, a block end's backward fused against unfused, sequence parallel's block end against the
# all-reduce's and unfused, and the host us a call of the launchers and the eager op (two ranks on the
# GPU) beside torch's chain. `timings`: the latency scripts alone.
if [ "$MODE" = one-gpu ]; then
  echo "== one GPU: the fast lane, kernels compiled for this GPU =="
  # A fresh machine compiles every kernel first: 2026-12-07 on one H100 that ran past 300 s (302 tests
  # in 104 s warm).
  timeout 480 python3 -m pytest tests -q -rfE -m "not slow" -p no:cacheprovider 2>&1 | tee "$OUT/one-gpu-tests.log" | tail -8
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== loopback: two ranks on one GPU, GPU us a call (CUDA-graph replays) =="
  timeout 150 python3 scripts/loopback_latency.py 2>&1 | tee "$OUT/loopback.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== batch-invariant mode: the gathered path's block end beside the reference path's (GPU us) =="
  timeout 120 python3 scripts/batch_invariant_cost.py 2>&1 | tee "$OUT/batch-invariant.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== a block end's backward fused against unfused: two ranks on one GPU (GPU us) =="
  timeout 240 python3 scripts/backward_latency.py 2>&1 | tee "$OUT/backward.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  echo "== sequence parallel: the sharded block end against the all-reduce's and unfused: two ranks on one GPU (GPU us) =="
  timeout 240 python3 scripts/sequence_parallel_latency.py 2>&1 | tee "$OUT/sequence-parallel.log"
  [ "${PIPESTATUS[0]}" = 0 ] || status=1
  host_cost
  exit $status
fi
if [ "$MODE" = timings ]; then
  for script in backward_latency sequence_parallel_latency loopback_latency; do
    echo "== $script (two ranks on one GPU, GPU us) =="
    timeout 240 python3 "scripts/$script.py" 2>&1 | tee "$OUT/$script.log" | grep -v -i warn
    [ "${PIPESTATUS[0]}" = 0 ] || status=1
  done
  exit $status
fi
if [ "$MODE" = host ]; then host_cost; exit $status; fi
# `sequence-parallel` (2+ GPUs): the sharded block end against the group's reduce-scatter + compiled add +
# RMSNorm + all-gather, and tpfuse's all-reduce block end (two-shot) of the same rows, 1k-16k tokens.
if [ "$MODE" = sequence-parallel ]; then
  timeout 420 torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --hidden 4096,8192 \
    --tokens 1024,2048,4096,8192,16384 --providers tpfuse:sp,nccl_sp,tpfuse:twoshot,nccl \
    --out "$OUT/sequence-parallel" > "$OUT/sequence-parallel.log" 2>&1 || status=1
  grep -v -i warn "$OUT/sequence-parallel.log" | tail -14
  exit $status
fi
E2E_LAYERS=${E2E_LAYERS:-8}
e2e() {
  echo "== end to end: TP llama-3-8b shapes ($E2E_LAYERS layers), decode steps and prefill, CUDA graphs =="
  timeout 420 torchrun --nproc_per_node="$NGPU" -m tpfuse bench e2e --layers "$E2E_LAYERS" --out "$OUT" \
    > "$OUT/e2e.log" 2>&1 || status=1
  grep -v -i warn "$OUT/e2e.log" | tail -9
}
if [ "$MODE" = e2e ]; then e2e; exit $status; fi
# The Hugging Face client: LlamaForCausalLM with llama-3-8b shapes under tp_plan="auto" (random weights
# saved once to /tmp/tpfuse-hf), plain torch.compile against tpfuse.compile, CUDA graphs. PROFILE=N
# adds where each step's time goes (N profiled steps, by kernel family).
HF_LAYERS=${HF_LAYERS:-32}
HF_PROVIDERS=${HF_PROVIDERS:-unfused,tpfuse$FLASHINFER}
hf_bench() {  # providers, output folder, rendezvous port
  mkdir -p "$2"
  timeout "${HF_TIMEOUT:-540}" torchrun --nproc_per_node=2 --master_port="$3" -m tpfuse bench e2e --client hf \
    --layers "$HF_LAYERS" --batches 1,32 --providers "$1" --profile "${PROFILE:-0}" --out "$2" \
    > "$2/e2e-hf.log" 2>&1
}
hf_summary() {  # output folder
  grep -E "tpfuse: (fused|graph split)|fused calls|ms,|Error|error" "$1/e2e-hf.log" | sort | uniq -c | tail -30
  grep -v -i warn "$1/e2e-hf.log" | grep -A40 "^Hugging Face"
}
if [ "$MODE" = hf ]; then
  echo "== end to end: Hugging Face Llama ($HF_LAYERS layers, llama-3-8b shapes), providers $HF_PROVIDERS =="
  hf_bench "$HF_PROVIDERS" "$OUT" 29500 || status=1
  hf_summary "$OUT"
  exit $status
fi
# `hf-pairs`: one provider per pair of GPUs at once (4 GPUs: two providers in one call), each pinned
# to its own share of the cores; at 32 layers one provider's compile and run fill most of a call.
if [ "$MODE" = hf-pairs ]; then
  IFS=, read -r -a providers <<< "$HF_PROVIDERS"
  pairs=$((NGPU / 2)); cores=$(nproc)
  [ "${#providers[@]}" -le "$pairs" ] || { echo "hf-pairs: ${#providers[@]} providers need $((2 * ${#providers[@]})) GPUs"; exit 2; }
  python3 -c "import torch; from tpfuse.bench.e2e import hf_checkpoint, save_hf_llama
save_hf_llama(hf_checkpoint('llama-3-8b', $HF_LAYERS), $HF_LAYERS, torch.device('cuda'))"
  for i in "${!providers[@]}"; do
    first=$((i * cores / pairs)); last=$(((i + 1) * cores / pairs - 1))
    (export CUDA_VISIBLE_DEVICES=$((2 * i)),$((2 * i + 1)); taskset -cp "$first-$last" $BASHPID > /dev/null
     hf_bench "${providers[$i]}" "$OUT/${providers[$i]}" $((29500 + i))) &
  done
  wait
  for p in "${providers[@]}"; do echo "== $p (its own GPU pair)"; hf_summary "$OUT/$p"; done
  exit 0
fi

# A soak longer than one device call: `soak-start` leaves it running in a process of its own (it
# prints a progress line a minute into $SOAK_LOG) and returns; `soak-wait`, in a later call, waits for
# it and prints the result. If the soak did not outlive the first call, the log's last line says how
# far it got.
SOAK_LOG=${SOAK_LOG:-/tmp/tpfuse-soak.log}
if [ "$MODE" = soak-start ]; then
  TPFUSE_SOAK_SECONDS=${TPFUSE_SOAK_SECONDS:-600} setsid nohup python3 -m pytest tests/ops/test_soak.py -q -s \
    -p no:cacheprovider > "$SOAK_LOG" 2>&1 < /dev/null &
  echo "soak started (pid $!), log $SOAK_LOG"
  exit 0
fi
if [ "$MODE" = soak-wait ]; then
  while pgrep -f "pytest tests/ops/test_soak.py" > /dev/null; do sleep 15; done
  grep -E "soak|passed|failed|skipped|Error" "$SOAK_LOG" | tail -6
  grep -q " passed" "$SOAK_LOG"
  exit $?
fi

# `baseline`: small calls of this tree and of an earlier one (its src/ copied into .baseline/, carried
# along) in one call, alternating, so a change's cost is measured on the same machine and run.
if [ "$MODE" = baseline ]; then
  for round in 1 2; do
    for tree in src .baseline/src; do
      PYTHONPATH=$PWD/$tree:/tmp/anchor-site timeout 150 torchrun --nproc_per_node=2 -m tpfuse bench kernel \
        --hidden 4096,8192 --tokens 1,8,64 --providers tpfuse$FLASHINFER --out "$OUT/baseline-$round-${tree%%/*}" \
        > "$OUT/baseline.log" 2>&1 || status=1
      echo "== round $round: $tree"; grep -A8 "^hidden tokens" "$OUT/baseline.log"
    done
  done
  exit $status
fi

# `epilogues`: the block ends of other model families (issue 18), tpfuse against NCCL + the compiled
# unfused chain, every provider checked against float64 first; then their GPU tests.
if [ "$MODE" = epilogues ]; then
  timeout 420 torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --hidden 4096,8192 \
    --tokens 1,2,4,8,16,32,64,512,1024,2048,4096 --providers tpfuse,nccl \
    --epilogue bias,gemma,layernorm,two_branches,fp8_token,fp8_group128 --out "$OUT/epilogues" \
    > "$OUT/epilogues.log" 2>&1 || status=1
  grep -E "^largest" "$OUT/epilogues.log"; grep -A90 "epilogue hidden tokens" "$OUT/epilogues.log"
  timeout 150 python3 -m pytest tests/kernels/test_epilogue.py -q -rfE -k nccl \
    -p no:cacheprovider 2>&1 | tail -3
  exit $status
fi

if [ "$MODE" = variants ]; then
  # One-shot launch variants (docs/kernel-notes.md) beside the default and FlashInfer, one process.
  timeout 300 torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --tokens 1,8,16,32,64,96,128,256 \
    --providers tpfuse:oneshot,tpfuse:no_split_push,tpfuse:split_push_4k,tpfuse:x_first$FLASHINFER \
    --out "$OUT" > "$OUT/variants.log" 2>&1 || status=1
  grep -A30 "^hidden tokens" "$OUT/variants.log"
  # Two-shot: rows scattered a group ahead (docs/kernel-notes.md, "Two-shot").
  timeout 200 torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --hidden 4096,8192 \
    --tokens 512,1024,2048,4096,8192 --out "$OUT/twoshot" \
    --providers tpfuse:twoshot,tpfuse:twoshot_w32,tpfuse:twoshot_fp8,tpfuse:twoshot_all_rows,tpfuse:twoshot_g2,tpfuse:twoshot_g8$FLASHINFER \
    > "$OUT/variants-twoshot.log" 2>&1 || status=1
  grep -A12 "^hidden tokens" "$OUT/variants-twoshot.log"
  exit $status
fi

if [ "$MODE" != bench ]; then
echo "== GPU tests (NCCL ranks; kernels compiled for the GPU; FlashInfer backend; the compiler pass) =="
TPFUSE_GRAPH_REPLAYS=${TPFUSE_GRAPH_REPLAYS:-100000} timeout 480 \
  python3 -m pytest tests -q -rfE -k "nccl or fp8 or graph or reduce_overhead or flashinfer or soak or gpu_memory" \
  -p no:cacheprovider \
  2>&1 | tee "$OUT/tests.log" | tail -8
[ "${PIPESTATUS[0]}" = 0 ] || status=1
echo "== the extended lane (CPU ranks, tests whose coverage others share; CI leaves them here) =="
timeout 300 python3 -m pytest tests -q -rfE -m "extended and not vllm" -k "not nccl" -p no:cacheprovider 2>&1 \
  | tee "$OUT/extended.log" | tail -3
[ "${PIPESTATUS[0]}" = 0 ] || status=1
if [ "$MODE" = tests ]; then exit $status; fi
fi  # `bench`: the kernel benchmark only

TOKENS=1,2,3,4,8,16,32,64,96,128,192,256,384,512,1024,1536,2048,3000,4096,8192
[ "$MODE" = quick ] && TOKENS=1,8,64,512,4096
if [ "$MODE" != bench ]; then  # `bench` times the shipped table, as users get it
  echo "== tune: where each algorithm wins here =="
  timeout 240 torchrun --nproc_per_node="$NGPU" -m tpfuse tune --tokens "$TOKENS" --out "$OUT/table.json" \
    > "$OUT/tune.log" 2>&1 || status=1
  grep -E "^hidden [0-9]+: one-shot|^wrote" "$OUT/tune.log"
  [ -f "$OUT/table.json" ] && export TPFUSE_TUNE_TABLE=$OUT/table.json
fi

echo "== kernel benchmark (tpfuse as the op picks, each algorithm forced, NCCL, FlashInfer) =="
timeout 300 torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --tokens "$TOKENS" \
  --providers tpfuse,tpfuse:oneshot,tpfuse:twoshot,nccl$FLASHINFER,floor,launch --out "$OUT" > "$OUT/bench.log" 2>&1 || status=1
grep -v "^hidden=" "$OUT/bench.log" | grep -v -i warn | tail -62
if [ "$MODE" = bench ]; then exit $status; fi
e2e
exit $status
