#!/usr/bin/env bash
# Tuning on a 2-GPU machine through TVM's RPC tracker (tvmfuse tune --gpus 2: one RPC server per
# GPU), then compile with and without each database and time both (tools/bench/bench_tune.py).
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/tune_two_gpus.sh
# Needs tornado for the tracker: the wheel in .whl/ (carry it) is installed to /tmp/site.
# WORKLOADS / TRIALS / GPUS override the defaults; databases land in $OUT/db/<workload>/.
set -uo pipefail
export PYTHONUNBUFFERED=1 TVM_CUDA_COMPILE_MODE=nvcc
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"
if ! python3 -c "import tornado" 2>/dev/null; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/tornado-*.whl
  export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$OUT/gpus.txt"
WORKLOADS=${WORKLOADS:-bias_relu:4096x4096x4096:float16,attn_causal:4x2048x2048x16x16x128:float16}
python3 tools/bench/bench_tune.py --target sm90 --gpus "${GPUS:-2}" --trials "${TRIALS:-16}" \
  --workloads "$WORKLOADS" --db "$OUT/db" --iters 30 --out "$OUT/tune.json" 2>&1 \
  | grep -v "Warning\|return cls" | tee "$OUT/tune.log" | grep -v "it/s\|trial/s"
