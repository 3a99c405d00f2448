#!/usr/bin/env bash
# The GPU-machine job, run in ONE device call from the checkout root:
#
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/run_gpu.sh
#
# 1. machine summary (nvidia-smi, python / torch / tvm versions)     -> $OUT/env.log
# 2. python3 -m pytest -q -m gpu, one process per test file, in parallel -> $OUT/pytest*.log, junit-*.xml
# 3. python3 tools/bench/run_all.py --out $OUT/bench.json            -> $OUT/bench.log, bench.json
#
# Env: SKIP_TESTS=1, SKIP_BENCH=1, BENCH_ONLY=gemm,layernorm (run_all --only),
#      BENCH_ARGS="--target sm80 --iters 100" (more run_all options),
#      TIME_LIMIT_S=480: no benchmark starts later than this many seconds into the script (the
#      device call is killed at 600 s; bench.json is rewritten after each workload).
# Exit status: pytest's when tests fail, 1 when no GPU test passed (all skipped: no device seen),
# otherwise run_all's; the benchmarks run either way.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"

{
  echo "== $(date -u +%FT%TZ) on $(hostname)"
  nvidia-smi --query-gpu=index,name,driver_version,memory.total,clocks.max.sm,power.limit \
    --format=csv || echo "nvidia-smi failed"
  python3 - <<'PY'
import platform

import torch

gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
print(f"python {platform.python_version()}  torch {torch.__version__}  cuda {torch.version.cuda}"
      f"  gpu {gpu}")
try:
    import tvm

    print(f"tvm {tvm.__version__} from {tvm.__file__}")
except Exception as err:  # report, the steps below show the consequences
    print(f"tvm import failed: {err}")
PY
} 2>&1 | tee "$OUT/env.log"

tests_rc=0
if [[ ${SKIP_TESTS:-0} != 1 ]]; then
  # The gpu-marked files run as parallel pytest processes (numerics only, no timings; the builds
  # are CPU-bound and the device has 16 cores); each writes its own log and junit file.
  echo "== pytest -m gpu ($SECONDS s)"
  files=$(grep -l "mark.gpu" tests/test_*.py)
  rm -f "$OUT"/junit-*.xml  # only this run's results are counted below
  pids=()
  for f in $files; do
    name=$(basename "$f" .py)
    python3 -m pytest -q -m gpu "$f" -p no:cacheprovider --junitxml="$OUT/junit-$name.xml" \
      > "$OUT/pytest-$name.log" 2>&1 &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do
    wait "$pid"
    rc=$?
    if [[ $rc != 0 && $rc != 5 ]]; then  # 5: no tests collected
      tests_rc=$rc
    fi
  done
  for f in $files; do
    name=$(basename "$f" .py)
    echo "-- $name: $(tail -1 "$OUT/pytest-$name.log")"
    grep -E "^(FAILED|ERROR)" "$OUT/pytest-$name.log" | cut -c1-300
  done | tee "$OUT/pytest.log"
  # Every GPU test skipped (no CUDA device seen, a missing tool, ...) is a failed run, not a pass.
  python3 - "$OUT" <<'PY' | tee -a "$OUT/pytest.log"
import glob
import sys
import xml.etree.ElementTree as ET

counts = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
for path in glob.glob(f"{sys.argv[1]}/junit-*.xml"):
    for suite in ET.parse(path).getroot().iter("testsuite"):
        for key in counts:
            counts[key] += int(suite.get(key, 0))
passed = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
print(f"-- gpu tests: {passed} passed, {counts['skipped']} skipped, "
      f"{counts['failures']} failed, {counts['errors']} errors")
if passed == 0:
    print("-- FAILED: no GPU test passed (every one skipped or none ran)")
    sys.exit(1)
PY
  if [[ ${PIPESTATUS[0]} != 0 && $tests_rc == 0 ]]; then
    tests_rc=1
  fi
  echo "== tests done ($SECONDS s), rc=$tests_rc"
fi

bench_rc=0
if [[ ${SKIP_BENCH:-0} != 1 ]]; then
  echo "== benchmarks ($SECONDS s)"
  args=(--out "$OUT/bench.json" --budget-s "$(( ${TIME_LIMIT_S:-480} - SECONDS ))")
  if [[ -n ${BENCH_ONLY:-} ]]; then
    args+=(--only "$BENCH_ONLY")
  fi
  read -ra extra <<< "${BENCH_ARGS:-}"
  python3 tools/bench/run_all.py "${args[@]}" "${extra[@]}" 2>&1 | tee "$OUT/bench.log"
  bench_rc=$?
fi

echo "== done in $SECONDS s: tests rc=$tests_rc, bench rc=$bench_rc; files in $OUT:"
ls -l "$OUT"
if [[ $tests_rc != 0 ]]; then
  exit "$tests_rc"
fi
exit "$bench_rc"
