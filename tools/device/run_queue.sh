#!/usr/bin/env bash
# Run every queued device request (.devq/requests/NAME.sh) in one device call:
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/run_queue.sh
# Each request runs from the repo root with OUT=$OUT/NAME, a 150 s limit, its log in $OUT/NAME/log.txt.
set -uo pipefail
OUT=${OUT:-$PWD/out}
# PARALLEL="a b": requests that only check numerics run side by side first (no timings in them).
run_one() {
  local name=$1 start=$SECONDS
  mkdir -p "$OUT/$name"
  OUT="$OUT/$name" timeout -k 5 "${REQUEST_LIMIT_S:-150}" bash ".devq/requests/$name.sh" \
    > "$OUT/$name/log.txt" 2>&1
  echo "rc=$? after $((SECONDS - start)) s" >> "$OUT/$name/log.txt"
}
for name in ${PARALLEL:-}; do
  run_one "$name" &
done
wait
for name in ${PARALLEL:-}; do
  echo "== $name (parallel)"; tail -5 "$OUT/$name/log.txt"
done
for req in .devq/requests/*.sh; do
  [[ -e $req ]] || continue
  name=$(basename "$req" .sh)
  [[ " ${PARALLEL:-} " == *" $name "* ]] && continue
  mkdir -p "$OUT/$name"
  echo "== $name ($SECONDS s)"
  start=$SECONDS
  OUT="$OUT/$name" timeout -k 5 "${REQUEST_LIMIT_S:-150}" bash "$req" > "$OUT/$name/log.txt" 2>&1
  echo "rc=$? after $((SECONDS - start)) s" | tee -a "$OUT/$name/log.txt"
  tail -5 "$OUT/$name/log.txt"
done
echo "== all done in $SECONDS s"
# One archive: what comes back from a device call is limited in file count.
tar -C "$OUT" -czf /tmp/queue-results.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/queue-results.tgz "$OUT/"
