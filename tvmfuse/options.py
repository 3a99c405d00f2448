"""Compile options as one value: the kernels' A/B switches, the device, strict mode.

    opts = Options(sm80_epilogue_from_registers=True)
    lib = tvmfuse.compile(model, target="sm80", options=opts)
    with use_options(opts):            # the same for code that calls pipeline stages itself
        mod = pipeline.lower(mod, spec)

Passes and schedule rules read the options in effect with :func:`current_options`; no module global
is written to change a build (measurement scripts in ``tools/`` pass an :class:`Options`).

Where the options live. TVM's ``PassContext`` would be the natural carrier, but 0.27 registers
config keys only from C++ (``PassContext::RegisterConfigOption``: no FFI function exposes it, and
``transform.ListConfigs`` only reads the registry), so
``PassContext(config={"tvmfuse.options": ...})`` raises "Invalid config option". The options travel
in a :class:`contextvars.ContextVar` instead, entered by ``pipeline.lower`` / ``pipeline.build``
alongside their target and PassContext (:func:`use_options`): scoped like a PassContext (restored
on exit, nested scopes stack), private to each thread and asyncio task (two compiles in two threads
each see their own options), and visible to every pass and rule TVM calls back into Python, as
those run in the calling thread.

``strict`` defaults to ``TVMFUSE_STRICT=1`` (set by the test suite and CI): an exception inside a
schedule rule or kernel generator then propagates instead of becoming a recorded fallback
(``schedules/fallback.py``).
"""

from __future__ import annotations

import contextvars
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field, fields
from typing import Any

from .errors import InputSpecError


def _strict_from_env() -> bool:
    return os.environ.get("TVMFUSE_STRICT", "") not in ("", "0")


@dataclass(frozen=True)
class Options:
    """Every switch a build can be varied by; the defaults are what ``tvmfuse compile`` ships."""

    # gemm_sm90_stats: a norm's row statistics move into the sm_90a wgmma GEMMs that read them
    sm90_in_loop_stats: bool = True
    # ... wherever the kernel takes them, not only where the cost estimate says it pays
    sm90_in_loop_stats_always: bool = False
    # ... summed by two warps of the producer warpgroup (GemmConfig.stats_warps), not by the
    # consumers between their wgmmas; then the consumers' main loop costs nothing extra, so every
    # GEMM that can takes them (no cost estimate). Off: slower on the H200 (session 22, the
    # 4-layer LM's prefill, 5 interleaved rounds: 1.703 ms with it vs 1.538; numerics pass)
    sm90_stats_warps: bool = False
    # gemm_sm90_producer_stats: an RMSNorm's sums of squares come from the wgmma GEMM writing its
    # input (partial sums per column tile), read by the GEMMs after the norm: no statistics kernel
    sm90_producer_stats: bool = True
    # ... for LayerNorm too (tile means and M2 joined by Chan's rule). Its GPU numerics pass (H100,
    # session 32: ragged / full / bf16 blocks, GPT-2), but where it applies the in-loop statistics
    # already took the kernel (GPT-2), and it was no faster there: 1.165 → 1.179 ms, within the
    # ±1 % two builds of the same kernels differ by. Off.
    sm90_producer_stats_layernorm: bool = False
    # gemm_row_stats_simt: the statistics move into the fp32 SIMT GEMMs that read them
    simt_in_loop_stats: bool = True
    # gemm_sm80: the epilogue on the mma fragments, stored from registers (no shared staging)
    sm80_epilogue_from_registers: bool = False
    # gemm_sm80: fp32 accumulator rows in shared memory padded by this many floats (0: none)
    sm80_c_row_pad: int = 8
    # gemm_sm80: output elements per lane and store of the epilogue (None: 16 bytes of the dtype)
    sm80_epilogue_lane_elems: int | None = 4
    # gemv: decode-size GEMMs (M ≤ 64, sm_80+) on the weight-streaming kernel (kernels/gemm/gemv.py);
    # numerics checked on the H200 (session 8: M 1, 4, 16, 64 × five epilogues, fp16; M = 1 reads
    # W at 3.16 TB/s, 1.57× cuBLAS). Off: those GEMMs keep the GEMM rules they had.
    small_m_gemv: bool = True
    # rows up to which a GEMM takes the gemv kernel: 8 (the CUDA-core engine, measured faster than
    # cuBLAS at M = 1); up to 64 adds the mma engine (numerics checked, speed not yet measured
    # against the wgmma GEMM, so not by default)
    gemv_max_m: int = 8
    # gemv: rows up to which the CUDA-core engine runs (above: the mma engine, M padded to 16);
    # 4: the engines tie there on the H200, mma is 1.5x faster at M = 8 (7B shapes, session 11)
    gemv_simt_max_m: int = 4
    # sm_90+: kernels launch with programmatic dependent launch (rules/programmatic_launch.py): each
    # may start while its predecessor ends and waits for it in-kernel (griddepcontrol.wait).
    # "decode": the kernels of compile_lm's decode step (measured faster there, slower on the
    # prefill); "all": every kernel; "off": plain stream-ordered launches
    programmatic_launch: str = "decode"
    # "decode" applies to compile_lm libraries of at most this max_batch (larger: "off"). The 7B
    # shapes with 4 layers at batch 8, ctx 1024, one call: 0.789 ms/token with PDL, 0.738 without
    # (H200, session 16); at batch 1 PDL is faster (the 4-layer LM: 0.1866 vs 0.1935, session 12)
    programmatic_launch_max_batch: int = 1
    # gemv with programmatic_launch: bytes of each block's weight rows prefetched into L2 before
    # the wait (0: none). 0: 64 KiB made every 7B-shaped GEMV 3-12 % slower standalone and the
    # 4-layer LM's decode no faster with PDL (H200, session 12)
    gemv_l2_prefetch_bytes: int = 0
    # gemv with programmatic_launch: a GEMV reading a compile_lm decode attention's output (the O
    # projection) prefetches all its weight rows into L2 before its wait, during the attention
    # (which moves few bytes for its time). Off: no faster on the H200 (the 4-layer LM at ctx 2048,
    # same call: 0.16271 ms/token with it, 0.16307 without, session 18). Prefetching the next
    # GEMVs' weights from the attention's partial kernel instead (8–36 MiB) was slower at every
    # size (0.1680–0.1747 vs 0.1625): it slows the attention more than it speeds the GEMVs
    gemv_prefetch_after_attention: bool = False
    # gemv with programmatic_launch: the register engines load their first iteration's weight
    # vectors before the wait (kernels/gemm/gemv.py ``preload``), so a block resident during its
    # predecessor's tail has its first DRAM round trip done when the wait returns. H100 (session
    # 25, same process, 7 alternating rounds): the 4-layer LM's decode 0.1977 → 0.1879 ms/token
    # (-4.9 %), the 7B shapes with 4 layers 0.6938 → 0.6893 (-0.7 %); tokens equal
    gemv_preload_weights: bool = True
    # compile_lm decode attention (CUDA): the split-KV combine in the partial kernel (the last block
    # of a head row combines; one launch) instead of a second kernel. Off: the 4-layer LM decoded
    # at 0.1767 ms/token with it, 0.1672 without (H200, session 14, one call)
    decode_fused_combine: bool = False
    # compile_lm decode (CUDA): the append kernel (RoPE of q and k, the K/V row into the cache)
    # folded into the split-KV attention kernel, one launch a layer fewer
    # (rules/fold_decode_append.py). Off: no faster on the H200 (the 4-layer LM at ctx 2048,
    # same call: 0.1631 ms/token folded vs 0.1629 not, session 17); numerics pass both ways
    decode_fold_append: bool = False
    # compile_lm decode (CUDA): the append (RoPE of q and k, the K/V row into the cache) made by
    # the QKV GEMV's epilogue (rules/gemv_append.py): one launch a layer fewer and no qkv round
    # trip between kernels. On since session 34, where its data loads (positions, offsets, the
    # RoPE tables) moved before the programmatic-launch wait: H100, 7 interleaved rounds, every
    # round faster: the 4-layer LM's decode 0.1816 → 0.1811 ms/token (−0.3 %), the 7B shapes with
    # 4 layers at batch 1 0.6757 → 0.6720 (−0.6 %); at batch 8 (no PDL) −0.3 % (session 30).
    # Session 30's version (loads after the wait) was +0.6 % at the 4-layer LM
    decode_gemv_append: bool = True
    # compile_lm decode attention with programmatic launch (sm_90+): a layer's cache of at most
    # this many bytes is prefetched into L2 by the attention kernel before it waits for the append
    # kernel (the old rows load while the append runs); 0: never. Larger caches (the 7B at batch 8:
    # 134 MB a layer) would only evict the weights from the 50 MB L2
    decode_kv_prefetch_bytes: int = 24 << 20
    # compile_lm decode attention with programmatic launch (sm_90+): the partial kernel loads its
    # first iteration's keys and values into registers before it waits for the append kernel (the
    # newest slot again after the wait), as gemv_preload_weights does with weights
    # (flash_decode's ``preload``); the rest of its rows are prefetched into L2 as above. Off:
    # slower on an H100 (the 4-layer LM at ctx 2048, 7 alternating rounds in one process, session
    # 27): 0.1885 ms/token with it vs 0.1860 without (+1.3 %, every round), tokens equal
    decode_preload_kv: bool = False
    # compile_lm decode attention (sm_90): the split-KV chunks of a head row run as one
    # thread-block cluster (≤ 16 chunks) and combine through distributed shared memory
    # (flash_decode's ``cluster``): one launch a layer fewer, no partials through L2. "pdl"
    # (default): where the decode step launches programmatically (batch ≤
    # programmatic_launch_max_batch); "on": every sm_90 decode step; "off". H100 (session 28, 7
    # interleaved rounds in one process, the 4-layer LM at ctx 2048): 0.1793 vs 0.1869 ms/token
    # with 256 threads (one iteration a block), every round; with 128 threads (two iterations)
    # 3.7 % slower than without. Not measured above batch 1 (hence "pdl")
    decode_cluster_combine: str = "pdl"
    # compile_lm decode attention (CUDA): threads per block of the split-KV kernel (16 lanes a key
    # row at head_dim 128: 128 threads take 8 rows at a time, 256 take 16); 0: 256 with the
    # cluster combine where a block merges ≤ 4 query heads, else 128 (flash_decode.pick_config)
    decode_attention_threads: int = 0
    # compile_lm decode attention (CUDA): query heads of one KV head a block of the split-KV
    # kernel takes. 0: with the cluster combine, all of them (at most 8) halved while twice the
    # blocks still fit on the SMs (flash_decode._spread_heads: the 4-layer LM 2 of 4, 120 blocks
    # instead of 60; H100, session 36, 7 interleaved rounds in two calls: −1.2 % decode time);
    # without it all of them. Each K/V row is read by G / heads blocks (from L2)
    decode_attention_heads: int = 0
    # CUDA targets: TVM's RewriteCUDAGraph captures the kernels between static allocations into a
    # CUDA graph on the first call and replays it (host launch cost once per call, not per kernel).
    # Off: no faster on the H200 (session 19, same process each): the 4-layer LM's prefill 1.660
    # ms with it vs 1.622, a 2-layer hidden-256 LM at 128 tokens 0.495 vs 0.502
    cuda_graph: bool = False
    # sm_90a flash attention: persistent CTAs, one per SM, looping over the query tiles
    # (Sm90FlashConfig.persistent_ctas): the next tile's Q and K/V load during a tile's epilogue.
    # None: where a query tile visits at most 16 KV tiles (2048 keys; rules/attention.py
    # sm90_config). H100, same process, 5-7 interleaved rounds (session 26): faster at B4·S2048
    # causal (0.5-1.2 %), B4·S2048 full (2.6 %), the LM's B1·S2048 16q/4kv (1.9 % causal, 5.9 %
    # full), a 1024-key window at S8192 (7.6 %); slower at causal S4096 32q/8kv (3.4 %) and
    # causal S8192 (5.5 %)
    sm90_attention_persistent: bool | None = None
    # sm_90a flash attention with an additive bias (padding masks, T5's position bias) in the
    # wgmma kernel (False: those attentions keep the sm80-style mma.sync kernel). H100 (session
    # 33, 5 interleaved rounds): transformers' BERT 4x768 at 8x512 with a padded attention_mask
    # 0.759 ms on, 0.792 off (-4.2 %); its GPU tests pass
    sm90_attention_bias: bool = True
    # passes/fold_gemm_tail.py: a GEMM and the injective kernel that is its output's only reader
    # (the LM's RoPE / Q, K, V pack) become one sm_90a kernel that makes the pack's stores in its
    # epilogue (kernels/gemm/tail.py). Off until its GPU tests have run
    sm90_gemm_tail: bool = False
    # gemm_sm90: GemmConfig.vector_operands for every kernel (residual / bias as 16-byte loads);
    # the 4-layer LM's prefill 1.538 ms with them vs 1.592 (session 22, interleaved rounds)
    sm90_vector_operands: bool = True
    # elementwise: the named ElementwiseConfig (schedules/elementwise.py VARIANTS)
    elementwise_variant: str = "v2_rows_erf"
    # elementwise: loads the vector copies cannot take (offset slices, concatenations, RoPE's
    # rotate-half) as 16-byte vectors where the branches are the same for a vector's lanes and
    # the math is 16-bit (ElementwiseConfig.vector_gathers); off: one 2-byte load per element.
    # The 4-layer LM's prefill 1.538 ms with them vs 1.585 (session 22, interleaved rounds)
    elementwise_vector_gathers: bool = True
    # sliding-window attention on CUDA targets: the window kernels (flash sm90a / sm80, split-KV
    # decode), numerics checked on the H200 (session 8). Off: on CUDA targets a proved band stays
    # unfused with its reason (and an R.nn.attention with window_size is decomposed); the cpu
    # target always fuses it into the windowed cpu kernel
    gpu_window_attention: bool = True
    # multi-head latent attention (values narrower than q and k: DeepSeek-V2/V3's 192 / 128) on
    # CUDA targets: the sm80 flash kernel with its own value width (nvcc builds it for sm80 and
    # sm90a without spills; its GPU numerics, tests/test_attention_kernels.py mla_* and
    # test_pass_attention_forms.py latent_rope, have not run yet: no GPU in session 46). Off: on
    # CUDA targets such an attention stays unfused with its reason, as before session 46; the cpu
    # target always fuses it into the cpu kernel
    gpu_mla_attention: bool = False
    # device properties for tile and cost decisions: a name of device_props.DEVICES or a
    # DeviceProperties; None: TVMFUSE_DEVICE, else the GPU present, else the target's table entry
    device: Any = None
    # exceptions in rules / generators propagate (True) or become recorded fallbacks (False)
    strict: bool = field(default_factory=_strict_from_env)

    def __post_init__(self) -> None:
        """Each switch must have its declared type: ``Options(cuda_graph="False")`` would
        otherwise be a truthy string, silently on (a bench variant did this in session 22)."""
        for f in fields(self):
            allowed = [_TYPES.get(name.strip()) for name in f.type.split("|")]
            if None in allowed:  # Any: not checked
                continue
            value = getattr(self, f.name)
            ok = any(type(value) is t for t in allowed) or (
                float in allowed and type(value) is int)
            if not ok:
                raise InputSpecError(f"Options.{f.name} must be {f.type}, not {value!r} "
                                     f"({type(value).__name__})")
        if self.decode_attention_heads < 0:
            raise InputSpecError("Options.decode_attention_heads must be 0 (the kernel's rule) or a "
                                 f"number of query heads, not {self.decode_attention_heads}")
        if self.decode_cluster_combine not in ("pdl", "on", "off"):
            raise InputSpecError("Options.decode_cluster_combine must be 'pdl', 'on' or 'off', "
                                 f"not {self.decode_cluster_combine!r}")


_TYPES = {"bool": bool, "int": int, "str": str, "float": float, "None": type(None)}


_CURRENT: contextvars.ContextVar[Options | None] = contextvars.ContextVar(
    "tvmfuse_options", default=None)


def current_options() -> Options:
    """The options of the innermost :func:`use_options` scope, else the defaults."""
    return _CURRENT.get() or Options()


@contextmanager
def use_options(options: Options | None) -> Iterator[Options]:
    """Make ``options`` current inside the ``with`` block (None: keep the ones in effect)."""
    if options is None:
        yield current_options()
        return
    token = _CURRENT.set(options)
    try:
        yield options
    finally:
        _CURRENT.reset(token)
