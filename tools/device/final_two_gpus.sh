#!/usr/bin/env bash
# The closing device call of a session, on a 2-GPU machine (one call, both GPUs busy):
#   GPU 0: benchmarks of GEMMs (fp16 with torch.compile, bf16), norm+Linear, MLP, decoder layer and
#          the memory-bound set
#   GPU 1: every gpu-marked test file (parallel pytest processes), then the attention benchmark,
#          then any queued probe scripts (.devq/requests) while time is left
# Outputs land in one archive $OUT/final.tgz (what comes back from a call is limited in file count).
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/final_two_gpus.sh
set -uo pipefail
export PYTHONUNBUFFERED=1 TVM_CUDA_COMPILE_MODE=nvcc
OUT=${OUT:-$PWD/out}
LIMIT=${LIMIT_S:-300}  # no benchmark starts after this many seconds; each is cut at LIMIT + 20
mkdir -p "$OUT/gpu0" "$OUT/gpu1"
nvidia-smi --query-gpu=index,name,driver_version --format=csv | tee "$OUT/gpus.txt"
gpu1() {
  CUDA_VISIBLE_DEVICES=1 OUT="$OUT/gpu1" SKIP_BENCH=1 timeout $((LIMIT - 60)) bash tools/device/run_gpu.sh \
    > "$OUT/gpu1/tests.log" 2>&1
  echo "tests rc=$? at $SECONDS s" >> "$OUT/gpu1/tests.log"
  CUDA_VISIBLE_DEVICES=1 timeout $((LIMIT + 20 - SECONDS)) python3 tools/bench/run_all.py --only attention --out "$OUT/gpu1/bench_attention.json" \
    --budget-s $((LIMIT - SECONDS)) > "$OUT/gpu1/bench_attention.log" 2>&1
  for req in .devq/requests/*.sh; do
    [[ -e $req && $SECONDS -lt $LIMIT ]] || continue
    name=$(basename "$req" .sh); mkdir -p "$OUT/gpu1/$name"
    CUDA_VISIBLE_DEVICES=1 OUT="$OUT/gpu1/$name" timeout $((LIMIT + 20 - SECONDS)) bash "$req" > "$OUT/gpu1/$name/log.txt" 2>&1
  done
}
gpu1 &
g1=$!
left() { echo $((LIMIT - SECONDS)); }
CUDA_VISIBLE_DEVICES=0 timeout $((LIMIT + 20)) python3 tools/bench/run_all.py --only gemm,norm_linear,mlp,decoder,layernorm,rmsnorm,softmax,elementwise \
  --out "$OUT/gpu0/bench_fp16.json" --budget-s "$(left)" > "$OUT/gpu0/bench_fp16.log" 2>&1
if (( $(left) > 30 )); then
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 tools/bench/bench_gemm.py --dtype bfloat16 --no-compile \
    --shapes 4096x4096x4096,8192x8192x4096 --out "$OUT/gpu0/bench_gemm_bf16.json" > "$OUT/gpu0/bench_gemm_bf16.log" 2>&1
fi
if (( $(left) > 20 )); then
  CUDA_VISIBLE_DEVICES=0 timeout "$(left)" python3 tools/bench/bench_gemm.py --target sm80 --no-compile \
    --cases bias_relu,bias_gelu --shapes 4096x4096x4096 --out "$OUT/gpu0/bench_gemm_sm80.json" > "$OUT/gpu0/bench_gemm_sm80.log" 2>&1
fi
wait $g1
echo "== done at $SECONDS s"
cat "$OUT/gpu1/pytest.log" 2>/dev/null
for f in "$OUT"/gpu0/*.log "$OUT"/gpu1/bench_attention.log; do echo "== $f"; grep -A30 "^workload" "$f" | cut -c1-200; done
tar -C "$OUT" -czf /tmp/final.tgz . && rm -rf "${OUT:?}"/* && mv /tmp/final.tgz "$OUT/"
