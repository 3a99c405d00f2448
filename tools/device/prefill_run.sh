#!/usr/bin/env bash
# The patterns issue's prefill measurements (the 4-layer LM vs torch.compile, SDPA forms), in steps
# that each fit a device call (600 s). From the root:
#
#   bash .tvmdev/setup.sh && export PYTHONPATH=/tmp/tvmdev/site:$PWD && bash tools/device/prefill_run.sh STEP...
#
# Steps (results under $OUT/<step>.json, logs $OUT/<step>.log, each under its own time limit):
#   tests   pytest -m gpu: the sm90 GEMM epilogues (vector operands, every M bucket), the row
#           statistics by consumers and by the producer's warps, elementwise gathers, Bloom's ALiBi (~400 s)
#   ptests  the same GPU tests, the compile_lm / greedy ones and the ViT / transformers-family ones
#           in 8 concurrent pytest processes
#           (16 CPU cores compile while the GPU checks; for correctness only, nothing timed) (~250 s)
#   lm      bench_llama_lm: the default build, eager and torch.compile in 7 interleaved rounds
#           (add --variant NAME=FIELD:VALUE for an A/B in the same rounds)             (~120 s)
#   graph   the lm step with a second build, Options.cuda_graph=True, in the same rounds  (~170 s)
#   split   kernel_times llama_lm --anchor compile: per-kernel split vs torch.compile    (~150 s)
#   warps   kernel_times llama_lm, the default build and Options.sm90_stats_warps: which GEMMs the
#           statistics warps slow (the LM prefill is ~11 % slower with them, sessions 22 and 30) (~150 s)
#   pstats  the producer statistics (Options.sm90_producer_stats): their GPU numerics, then the
#           LM prefill with them (default), without them and with PDL on every kernel, in the same
#           7 interleaved rounds                                                          (~400 s)
#   hf      bench_hf_prefill: transformers' GPT-2 and BERT (LayerNorm) against torch.compile, with
#           the LayerNorm producer statistics (Options.sm90_producer_stats_layernorm) as a variant,
#           7 interleaved rounds                                                         (~180 s)
#   bias    the sm_90a attention with an additive bias (Options.sm90_attention_bias, on): its GPU
#           tests, then BERT with a padded attention_mask with it on and off, 5 rounds    (~250 s)
#   tail    Options.sm90_gemm_tail (off): the QKV GEMM making the RoPE / Q, K, V pack's stores, its
#           GPU tests, then the LM prefill with it on and off, 7 interleaved rounds        (~250 s)
#   sdpa    bench_attention_forms --no-compile, 7 interleaved rounds: hand-written causal and
#           SDPA from (B, H, S, D) against eager SDPA                                   (~150 s)
#   onnx    bench_onnx_decoder: the 7B-sized decoder layer from its ONNX export vs from torch, one
#           process (the patterns issue's "within 10 %" line)                           (~200 s)
#   atests  ptests' attention group alone: the GPU numerics of the attention forms      (~130 s)
. "$(dirname "$0")/steps.sh"  # $OUT and step()
attention_tests=(tests/test_pass_attention_forms.py -k "not sliding_window")  # ptests' group, atests

for s in "$@"; do
  case $s in
    tests) step tests 480 python3 -m pytest -q -m gpu -p no:cacheprovider \
             tests/test_schedule_gemm_sm90.py tests/test_schedule_gemm_sm90_buckets.py \
             tests/test_schedule_gemm_sm90_stats.py tests/test_gpu_memory_bound.py \
             tests/test_pass_attention_forms.py -k "not sliding_window" ;;
    ptests) gpu_test() { local name=$1; shift; step "$name" 330 python3 -m pytest -q -m gpu -p no:cacheprovider "$@" & }
            gpu_test t_stats_warps tests/test_schedule_gemm_sm90_stats.py -k stats_warps
            gpu_test t_stats tests/test_schedule_gemm_sm90_stats.py -k "not stats_warps"
            gpu_test t_gemm tests/test_schedule_gemm_sm90.py tests/test_schedule_gemm_sm90_buckets.py
            gpu_test t_attention "${attention_tests[@]}"
            gpu_test t_memory tests/test_gpu_memory_bound.py -k "rope_pack or matches_torch"
            gpu_test t_llm tests/test_llm_compile_lm.py tests/test_llm_greedy.py
            gpu_test t_models tests/test_vit_onnx.py tests/test_hf_families.py tests/test_pass_permute_rows.py
            gpu_test t_gemv tests/test_schedule_gemv.py -k "preload or ring"
            wait ;;
    lm) step lm 300 python3 tools/bench/bench_llama_lm.py --out "$OUT/lm.json" --rounds 7 ;;
    graph) step graph 300 python3 tools/bench/bench_llama_lm.py --out "$OUT/graph.json" --rounds 7 \
             --variant graph=cuda_graph:true ;;
    split) step split 300 python3 tools/device/kernel_times.py llama_lm --anchor compile --iters 20 ;;
    warps) step warps 300 python3 tools/device/kernel_times.py llama_lm --iters 20 \
             --variant warps=sm90_stats_warps:true ;;
    pstats) step t_pstats 260 python3 -m pytest -q -m gpu -p no:cacheprovider \
              tests/test_rule_gemm_sm90_producer_stats.py tests/test_schedule_gemm_sm90_stats.py \
              -k "residual or llama_lm or gpt2 or decoder_layer or mlp_block"
            step lm_pstats 330 python3 tools/bench/bench_llama_lm.py --out "$OUT/lm_pstats.json" \
              --rounds 7 --variant no_pstats=sm90_producer_stats:false \
              --variant pdl=programmatic_launch:all ;;
    hf) step hf 380 python3 tools/bench/bench_hf_prefill.py --rounds 7 --out "$OUT/hf.json" \
          --variant ln_partials=sm90_producer_stats_layernorm:true ;;
    bias) step t_bias 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_attention_sm90.py \
            tests/test_pass_attention_forms.py tests/test_hf_families.py -k "bias"
          step hf_bert 200 python3 tools/bench/bench_hf_prefill.py --family bert --rounds 5 \
            --variant bias_off=sm90_attention_bias:false --out "$OUT/hf_bert.json" ;;
    tail) step t_tail 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/test_rule_fold_gemm_tail.py
          step lm_tail 300 python3 tools/bench/bench_llama_lm.py --out "$OUT/lm_tail.json" --rounds 7 \
            --variant tail=sm90_gemm_tail:true ;;
    onnx) step onnx 300 python3 tools/bench/bench_onnx_decoder.py --no-compile --out "$OUT/onnx.json" ;;
    atests) step t_attention 330 python3 -m pytest -q -m gpu -p no:cacheprovider "${attention_tests[@]}" ;;
    sdpa) step sdpa 300 python3 tools/bench/bench_attention_forms.py --no-compile --rounds 7 --out "$OUT/sdpa.json" ;;
    *) echo "unknown step $s (tests ptests lm graph split warps pstats hf bias tail sdpa onnx atests)"; exit 2 ;;
  esac
done
