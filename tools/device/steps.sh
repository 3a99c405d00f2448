# Sourced by the device step scripts (llm_run.sh, prefill_run.sh): $OUT, and ``step NAME LIMIT
# COMMAND...``, which runs COMMAND under a time limit, logs it to $OUT/NAME.log and prints the tail.
set -uo pipefail
export PYTHONUNBUFFERED=1
OUT=${OUT:-$PWD/out}
mkdir -p "$OUT"

step() {  # name, limit in seconds, command...
  local name=$1 limit=$2 start=$SECONDS
  shift 2
  timeout -k 5 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "== $name: rc=$? after $((SECONDS - start)) s"
  tail -3 "$OUT/$name.log" | cut -c1-600
}
