#!/usr/bin/env bash
# Everything the GPU machine should run, in one call: GPU tests, graph-replay soak, kernel benchmark.
# Usage (device tool, carry [".anchors"] for FlashInfer): bash scripts/gpu_check.sh [quick]
# Needs: 2+ GPUs, python3 with torch (>= 2.11) and triton; nothing is installed from a registry.
set -uo pipefail
cd "$(dirname "$0")/.."
# NVLink multicast stays off on the machines we test on.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONPATH=$PWD/src${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/results/gpu}
mkdir -p "$OUT"
NGPU=$(python3 -c "import torch; print(torch.cuda.device_count())")
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count())"
nvidia-smi topo -m 2>/dev/null | head -5
if [ -f .anchors/setup.sh ]; then bash .anchors/setup.sh .anchors 2>&1 | tail -1; fi

status=0
echo "== GPU tests (NCCL ranks; kernels compiled for the GPU; the compiler pass on a TP Llama) =="
TPFUSE_GRAPH_REPLAYS=${TPFUSE_GRAPH_REPLAYS:-100000} \
  python3 -m pytest tests -q -x -k "nccl or fp8 or graph or reduce_overhead" -p no:cacheprovider 2>&1 | tee "$OUT/tests.log" | tail -15
[ "${PIPESTATUS[0]}" = 0 ] || status=1

if [ "${1:-}" = variants ]; then
  # One-shot launch variants (docs/kernel-notes.md) beside the default and FlashInfer, one process.
  torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --tokens 1,4,16,64,96,128,192,256,512 \
    --providers tpfuse,tpfuse:nopdl,tpfuse:clear_last,tpfuse:acq_rel,flashinfer \
    --out "$OUT" > "$OUT/variants.log" 2>&1 || status=1
  grep -A30 "^hidden tokens" "$OUT/variants.log"
  exit $status
fi

echo "== kernel benchmark =="
TOKENS=1,2,4,8,16,32,64,128,256,512
[ "${1:-}" = quick ] && TOKENS=1,8,64,512
torchrun --nproc_per_node="$NGPU" -m tpfuse bench kernel --tokens "$TOKENS" --out "$OUT" > "$OUT/bench.log" 2>&1 || status=1
grep -v "^hidden=" "$OUT/bench.log" | grep -v -i warn | tail -45
exit $status
