#!/usr/bin/env bash
# One device call on a 2-GPU machine: the gpu tests on GPU 1 while the benchmarks run on GPU 0.
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/run_two_gpus.sh
# Env: BENCH_S (default 300): no benchmark starts later than this; EXTRA: a command run on both
# GPUs after the two halves finish (e.g. the multi-GPU tuning check), if time is left.
# Output: $OUT/tests (run_gpu.sh with SKIP_BENCH), $OUT/bench (run_all), packed into one archive.
set -uo pipefail
export PYTHONUNBUFFERED=1 TVM_CUDA_COMPILE_MODE=nvcc
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT/tests" "$OUT/bench"
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$OUT/gpus.txt"
(CUDA_VISIBLE_DEVICES=1 OUT="$OUT/tests" SKIP_BENCH=1 bash tools/device/run_gpu.sh \
  > "$OUT/tests/run.log" 2>&1) &
tests=$!
CUDA_VISIBLE_DEVICES=0 OUT="$OUT/bench" SKIP_TESTS=1 TIME_LIMIT_S="${BENCH_S:-300}" \
  BENCH_ONLY="${BENCH_ONLY:-}" BENCH_ARGS="${BENCH_ARGS:-}" bash tools/device/run_gpu.sh \
  > "$OUT/bench/run.log" 2>&1
bench_rc=$?
wait $tests
tests_rc=$?
echo "== tests rc=$tests_rc, bench rc=$bench_rc ($SECONDS s)"
cat "$OUT/tests/pytest.log" 2>/dev/null
grep -A40 "^workload" "$OUT/bench/run.log" | cut -c1-220
if [[ -n ${EXTRA:-} ]]; then
  echo "== extra ($SECONDS s): $EXTRA"
  bash -c "$EXTRA" > "$OUT/extra.log" 2>&1
  echo "extra rc=$?"; tail -20 "$OUT/extra.log"
fi
tar -C "$OUT" -czf /tmp/final-results.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/final-results.tgz "$OUT/"
echo "== done ($SECONDS s)"
