#!/usr/bin/env bash
# The closing device call of a session, on one or two GPUs (one call):
#   tests:  every gpu-marked test file (parallel pytest processes, numerics only), then the
#           queued probe scripts ($REQS/*.sh, each with OUT=$OUT/NAME, 150 s limit)
#   bench:  run_all.py fp16 (GEMMs with torch.compile, norm+Linear, MLP, decoder, attention, the
#           memory-bound set), then bf16 GEMMs and the sm80 GEMM path while time is left
# Two GPUs: tests on GPU 1 beside the benchmarks on GPU 0. One GPU: tests first (builds are CPU-bound,
# the GPU is idle most of the time), then the benchmarks alone on the GPU.
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/closing_run.sh
# Env: LIMIT_S (default 480: nothing starts after it), REQS (default reqs), TESTS_S (default 300: the
# GPU tests' limit), BENCH_ONLY (run_all workloads; default the fp16 set below), BENCH_EXTRA=0 (skip
# the bf16 and sm80 GEMM runs), BENCH_ARGS (more run_all options). Outputs: $OUT/closing.tgz.
set -uo pipefail
export PYTHONUNBUFFERED=1 TVM_CUDA_COMPILE_MODE=nvcc PYTHONPATH=${PYTHONPATH:-/tmp/tvmdev/site:$PWD}
OUT=${OUT:-$PWD/out}
R=$OUT/r
LIMIT=${LIMIT_S:-480}
REQS=${REQS:-reqs}
mkdir -p "$R/tests" "$R/bench"
ngpu=$(nvidia-smi --query-gpu=index --format=csv,noheader | wc -l)
nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv | tee "$R/gpus.txt"
tgpu=$(( ngpu > 1 ? 1 : 0 ))
left() { echo $(( LIMIT - SECONDS )); }

tests() {
  CUDA_VISIBLE_DEVICES=$tgpu OUT="$R/tests" SKIP_BENCH=1 timeout "${TESTS_S:-300}" bash tools/device/run_gpu.sh \
    > "$R/tests/tests.log" 2>&1
  echo "tests rc=$? at $SECONDS s" >> "$R/tests/tests.log"
  for req in "$REQS"/*.sh; do
    [[ -e $req ]] || continue
    name=$(basename "$req" .sh); mkdir -p "$R/req/$name"
    (( $(left) > 30 )) || { echo "$name: not run (time)" > "$R/req/$name/log.txt"; continue; }
    CUDA_VISIBLE_DEVICES=$tgpu OUT="$R/req/$name" timeout -k 5 150 bash "$req" > "$R/req/$name/log.txt" 2>&1
    echo "rc=$? at $SECONDS s" >> "$R/req/$name/log.txt"
  done
}
bench() {
  CUDA_VISIBLE_DEVICES=0 timeout $(( $(left) + 20 )) python3 tools/bench/run_all.py \
    --only "${BENCH_ONLY:-gemm,norm_linear,mlp,decoder,attention,layernorm,rmsnorm,softmax,elementwise}" \
    --out "$R/bench/bench_fp16.json" --budget-s "$(left)" ${BENCH_ARGS:-} > "$R/bench/bench_fp16.log" 2>&1
  [[ ${BENCH_EXTRA:-1} == 0 ]] && return
  if (( $(left) > 40 )); then
    CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 tools/bench/bench_gemm.py --dtype bfloat16 --no-compile \
      --shapes 4096x4096x4096,8192x8192x4096 --out "$R/bench/bench_gemm_bf16.json" > "$R/bench/bench_gemm_bf16.log" 2>&1
  fi
  if (( $(left) > 25 )); then
    CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 tools/bench/bench_gemm.py --target sm80 --no-compile \
      --cases bias_relu,bias_gelu --shapes 4096x4096x4096 --out "$R/bench/bench_gemm_sm80.json" > "$R/bench/bench_gemm_sm80.log" 2>&1
  fi
}
if (( ngpu > 1 )); then
  tests & t=$!
  bench
  wait $t
else
  tests
  bench
fi
echo "== done at $SECONDS s on $ngpu GPU(s)"
cat "$R/tests/pytest.log" 2>/dev/null; tail -1 "$R/tests/tests.log"
for d in "$R"/req/*; do [[ -d $d ]] && { echo "== $d"; tail -30 "$d/log.txt" | cut -c1-250; }; done
for f in "$R"/bench/*.log; do echo "== $f"; grep -A40 "^workload" "$f" | cut -c1-220; done
find "$R" \( -name "*.so" -o -name "*.safetensors" \) -delete  # libraries and their weights stay there
tar -C "$R" -czf /tmp/closing.tgz . && rm -rf "$R" && mv /tmp/closing.tgz "$OUT/"
