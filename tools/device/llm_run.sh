#!/usr/bin/env bash
# The LLM issue's GPU measurements, in steps that each fit a device call (600 s). From the root:
#
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/llm_run.sh STEP...
#
# Steps (results under $OUT/<step>.json, logs $OUT/<step>.log, each under its own time limit):
#   tests     pytest -m gpu: compile_lm generate, the cache kernels, PDL, GEMV, buckets  (~350 s)
#   lm4       bench_lm_decode lm4, ctx 2048: decode ms/token, tokens, torch.compile anchor  (~250 s)
#   attn      bench_decode_cache: the split-KV kernel over unroll x splits, lm4 and 7b     (~120 s)
#   7b        every 7B line in one call: bench_lm_decode 7b, ctx 1024: decode vs the 3.2 ms floor,
#             prefill 2048 vs torch.compile, compile time, and batch 8 compiled in a second process
#             beside it, its decode interleaved with batch 1's (the ratio)                 (~450 s)
#   7b_b8     bench_lm_decode 7b, batch 8, ctx 1024                                         (~300 s)
#   7b4       the 7B shapes with 4 layers, ctx 2048: prefill kernel split vs torch.compile   (~150 s)
#   split     PDL-off kernel splits of the 7B shapes with 4 layers at batch 1 and 8          (~125 s)
#   gemv      bench_gemv: M = 1, 4, 16, 64 x the 7B shapes against cuBLAS                   (~200 s)
#   lm4ab     lm4 decode with and without Options.gemv_prefetch_after_attention, same call   (~150 s)
#   preload   lm4 decode with Options.gemv_preload_weights (default) and without, interleaved in one process (~200 s)
#   gemv_lm4  bench_gemv at M = 1 over the 4-layer LM's shapes, CUDA-core configs swept      (~60 s)
#   cluster   the cluster-combine decode attention: its GPU numerics, the kernel alone (lm4 at 2048
#             and 2064 slots, 128/256 threads) and lm4 decode with it, interleaved    (~170 s)
#   gappend   the QKV GEMV making the cache append (Options.decode_gemv_append): its GPU generate
#             tests, then lm4 decode with and without it, interleaved                  (~300 s)
#   ga7b4     the 7B shapes with 4 layers, ctx 1024: decode_gemv_append A/B at batch 1, and at
#             batch 8 beside decode_cluster_combine=on                                  (~300 s)
#   gemv8     bench_gemv at M = 8 over the 7B shapes, with and without the in-loop RMSNorm
#             statistics, 16- and 32-warp blocks beside pick_config's choice            (~200 s)
#   b8cluster the 7B shapes with 4 layers at batch 8 (no PDL): decode_cluster_combine "on" vs the
#             default ("pdl": off there), interleaved                                   (~120 s)
#   b8pdl     the 7B shapes with 4 layers at batch 8: PDL (and with it the GEMV weight preload)
#             on vs the default (off above batch 1, session 16, before the preload existed), with
#             and without the cluster combine that PDL brings along                      (~250 s)
. "$(dirname "$0")/steps.sh"  # $OUT and step()

for s in "$@"; do
  case $s in
    tests) step tests 420 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_llm_compile_lm.py \
             tests/test_llm_kv_cache.py tests/test_llm_greedy.py tests/test_pass_programmatic_launch.py tests/test_schedule_gemv.py \
             tests/test_schedule_gemm_sm90_buckets.py -k "not tensor_parallel" ;;
    lm4) step lm4 400 python3 tools/bench/bench_lm_decode.py --size lm4 --ctx 2048 --new 32 \
           --out "$OUT/lm4.json" ;;
    attn) step attn 300 python3 tools/bench/bench_decode_cache.py --case lm4 --case 7b --case 7b_b8 --combine kernel,fused \
            --unroll 2,4 --splits 0,16,33,66,128 --out "$OUT/attn.json" ;;
    7b) step 7b 560 env TVMFUSE_TIME_STAGES=1 python3 tools/bench/bench_lm_decode.py --size 7b --ctx 1024 \
          --new 32 --no-compile --prefill-len 2048 --compile-prefill --ratio-batch 8 --out "$OUT/7b.json" ;;
    7b_b8) step 7b_b8 560 python3 tools/bench/bench_lm_decode.py --size 7b --ctx 1024 --new 16 --batch 8 \
             --no-compile --out "$OUT/7b_b8.json" ;;
    7b4) step 7b4 300 python3 tools/bench/bench_lm_decode.py --size 7b4 --ctx 2048 --new 16 --no-compile \
           --compile-prefill --out "$OUT/7b4.json" ;;
    gemv) step gemv 400 python3 tools/bench/bench_gemv.py --out "$OUT/gemv.json" ;;
    split) for b in 8 1; do
             step "7b4_b${b}_off" 90 python3 tools/bench/bench_lm_decode.py --size 7b4 --ctx 1024 --new 16 \
               --batch "$b" --no-compile --programmatic-launch off --out "$OUT/7b4_b${b}_off.json"
           done ;;
    lm4ab) for pf in off on; do
             flag=(); [ "$pf" = on ] && flag=(--gemv-prefetch-after-attention)
             step "lm4_prefetch_$pf" 120 python3 tools/bench/bench_lm_decode.py --size lm4 --ctx 2048 \
               --new 32 --no-compile "${flag[@]}" --out "$OUT/lm4_prefetch_$pf.json"
           done ;;
    preload) step lm4_preload 400 python3 tools/bench/bench_lm_decode.py --size lm4 --ctx 2048 --new 32 \
               --no-compile --ab gemv_preload_weights=False --out "$OUT/lm4_preload.json" ;;
    cluster) step t_cluster 150 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_llm_kv_cache.py \
               -k "cluster or decode_numerics"
             step cl_attn 120 python3 tools/bench/bench_decode_cache.py --case lm4 --case lm4_step \
               --unroll 8 --combine kernel,cluster --threads 128,256 --out "$OUT/cl_attn.json"
             step cl_lm4 300 python3 tools/bench/bench_lm_decode.py --size lm4 --ctx 2048 --new 32 \
               --no-compile --ab decode_cluster_combine=off --ab decode_cluster_combine=pdl,decode_attention_threads=128 \
               --out "$OUT/cl_lm4.json" ;;
    b8cluster) step b8cluster 200 python3 tools/bench/bench_lm_decode.py --size 7b4 --ctx 1024 --new 16 \
                 --batch 8 --no-compile --ab decode_cluster_combine=on --out "$OUT/b8cluster.json" ;;
    b8pdl) step b8pdl 260 python3 tools/bench/bench_lm_decode.py --size 7b4 --ctx 1024 --new 16 \
             --batch 8 --no-compile --ab programmatic_launch_max_batch=8 \
             --ab programmatic_launch_max_batch=8,decode_cluster_combine=off --out "$OUT/b8pdl.json" ;;
    gappend) step t_gappend 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_llm_compile_lm.py \
               tests/test_llm_greedy.py -k "gemv_append or cluster_without_pdl or advance"
             step ga_lm4 300 python3 tools/bench/bench_lm_decode.py --size lm4 --ctx 2048 --new 32 \
               --no-compile --ab decode_gemv_append=True --out "$OUT/ga_lm4.json" ;;
    ga7b4) step ga7b4_b1 200 python3 tools/bench/bench_lm_decode.py --size 7b4 --ctx 1024 --new 16 \
             --no-compile --ab decode_gemv_append=True --out "$OUT/ga7b4_b1.json"
           step ga7b4_b8 200 python3 tools/bench/bench_lm_decode.py --size 7b4 --ctx 1024 --new 16 \
             --batch 8 --no-compile --ab decode_gemv_append=True --ab decode_cluster_combine=on \
             --out "$OUT/ga7b4_b8.json" ;;
    gemv8) step gemv8_stats 150 python3 tools/bench/bench_gemv.py --ms 8 --stats --jobs 16 \
             --configs auto,mma:8:16:4,mma:8:16:2,mma:16:16:2,mma:8:32:2 --out "$OUT/gemv8_stats.json"
           step gemv8 150 python3 tools/bench/bench_gemv.py --ms 8 --jobs 16 \
             --configs auto,mma:8:16:4,mma:8:32:2,mma:8:32:4,mma:16:16:4 --out "$OUT/gemv8.json" ;;
    gemv_lm4) step gemv_lm4 200 python3 tools/bench/bench_gemv.py --shapes lm4 --ms 1 \
                --configs auto,simt:4:8:4,simt:8:4:4,simt:2:8:8,simt:8:8:8 --out "$OUT/gemv_lm4.json" ;;
    *) echo "unknown step $s (tests lm4 attn 7b 7b_b8 7b4 gemv split lm4ab preload gemv_lm4 cluster b8cluster b8pdl gappend ga7b4 gemv8)"; exit 2 ;;
  esac
done
