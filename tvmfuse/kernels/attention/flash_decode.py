"""Split-KV decode attention (flash-decoding) for CUDA: one query token per sequence.

``Sq == 1``. The KV axis is cut into ``n_split`` chunks; one PrimFunc launches two kernels::

    partial  grid (n_split, Hkv·HC, B), 128 threads: one block = one KV chunk × one KV head ×
             GC = G/HC query heads of that KV head, which share every K/V row it loads.
             16 lanes cover one key row (8 elements = one 16-byte load each); 8 lane groups take
             keys j ≡ group (mod 8), ``unroll`` keys ahead. Per head, fp32, log2 domain:
               s_j = q·k_j·scale·log2e (+ bias·log2e);  m, l, acc: running max / sum / Σ 2^(s−m)·v
               (soft-capped: tanh(q·k_j·scale/cap)·cap·log2e, q pre-scaled by scale/cap)
             the 8 groups merge through shared memory into (m, l, acc[D]) per head and chunk,
             written to a float32 workspace allocated inside the PrimFunc.
    combine  grid (B·Hq), D threads:  M = max_c m_c;  out = Σ_c 2^(m_c−M)·acc_c / Σ_c 2^(m_c−M)·l_c
             (the loops over the ≤ 128 chunks are unrolled: every load is issued at once)

Over a cache (:func:`flash_decode_cache_primfunc`) q, K and V are rows of one per-layer state
(:func:`state_rows`), and the combine can run in the partial kernel
(``DecodeConfig.fused_combine``, one launch): each block fences its partial and counts itself in
``sync[b, y]`` (atomic add); the block that counts last combines the GC heads of its (b, y) and
sets the counter back to 0, so the int32 ``sync`` buffer (zero before the first call) is zero
after every call and a CUDA graph can replay the kernel.

With ``cluster`` (over a cache, sm_90) the combine needs neither a second launch nor the float32
partials in global memory: the n_split ≤ 16 chunks of a block row are one thread-block cluster
(launch tag ``clusterCtaIdx.x``; above 8 CTAs the runtime allows the non-portable size). Each
block leaves its merged (o[GC·D], m, l per head) in shared memory; after a cluster barrier
(release/acquire) block r merges outputs r·E … r·E + E − 1 (E = ⌈GC·D / n_split⌉) from every
peer's shared memory (``mapa`` + ``ld.shared::cluster``, all peers' loads in flight together) and
stores them; a second, relaxed barrier keeps each block resident until its peers have read it.
The chunk count is not reduced by rounding chunks to whole iterations (the cache's chunk length
follows the visible slots at run time), and :func:`pick_config` raises the unroll so that one
iteration a block covers the cache where that takes ≤ 10 rows a lane group.

With ``l2_prefetch`` the partial kernel, launched programmatically (PDL) while the append kernel
before it still runs, first has one thread hand its chunk's K rows and V rows (two contiguous
ranges) to the TMA unit as bulk L2 prefetches, then executes ``griddepcontrol.wait`` itself (the
PDL device pass then adds no wait of its own): the cache's old rows come from HBM while the
append runs, and the reads after the wait hit L2. Safe for the row the append writes: L2 is the
point of coherence, so a prefetched line is updated by the later write; offsets/starts were
written kernels earlier (a kernel launches only once its predecessor passed its own wait).

With ``preload`` (over a cache, launched with PDL, no ``new_token``) the block loads its first
iteration's keys and values into registers before that wait, as the weight-streaming GEMV does
with its weights (with ``l2_prefetch`` as well, only the rows after them go to L2). The one row the append
before it writes, the newest slot ``p``, is loaded again after the wait by the lanes that hold it
(every other row was written by calls before this one, which completed before the append started).

With ``new_token`` (over a cache; :class:`NewToken`) the kernel also does the decode append: each
block computes its GC query heads from this step's unrotated projections (the model's RoPE,
folded in as an expression) into shared memory, 128 threads sharing the work, while its first
keys load; the block whose chunk holds the newest slot ``p = offsets[b]`` (when ``p < M``) first
writes that slot's key and value row, then (after the block barrier) loads its keys. One launch
a layer fewer, no query rows written to the state.

Over a cache the chunk length follows the sequence: ``ceil(visible / n_split)`` keys (rounded to
the keys one iteration takes), so every block works whatever the cache's capacity ``M``.

Causal with Sq == 1: TopLeft sees key 0 only, BottomRight every key; a sliding window of ``w``
keys (BottomRight) the last ``w``: the chunks cover only the visible keys ``kbase .. Skv − 1``.
CUDA-core FMAs: at D=128 the kernel moves 2·D·2 bytes per key and head group and is meant to run
at HBM bandwidth.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tvm
from tvm.script import tirx as T

from ...device_props import device_properties
from .cpu import bias_strides
from .spec import AttentionSpec, at

_LOG2E = math.log2(math.e)
_NEG_INF = float("-inf")
_THREADS = 128
_VEC = 8  # elements per 16-byte load
_MAX_GC = 8  # query heads per block (registers: 2·GC·8 floats of q and acc per thread)
_MAX_SPLITS = 128  # the combine unrolls its loops over the chunks
_MAX_CLUSTER = 16  # CTAs of a cluster on sm_90 (above 8 the runtime allows the non-portable size)
# DecodeConfig.trace: what thread 0 of a block records, in order (globaltimer ns, SM id, clock64
# cycles at the end of each stage; a stage the config does not have stays as it was)
TRACE_SLOTS = ("start_ns", "smid", "start", "wait", "loop", "merge_sync", "merged", "cluster_sync",
               "cluster_out", "exit_barrier", "end_ns")
_GLOBALTIMER = """
__forceinline__ __device__ unsigned long long tvmfuse_globaltimer() {
  unsigned long long t; asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t)); return t;
}"""
_SMID = """
__forceinline__ __device__ unsigned long long tvmfuse_smid() {
  unsigned int s; asm volatile("mov.u32 %0, %%smid;" : "=r"(s)); return s;
}"""


@dataclass(frozen=True)
class DecodeConfig:
    """``unroll`` keys in flight per lane group; ``splits`` KV chunks (0: ~2 blocks per SM);
    ``fused_combine`` (over a cache only): the combine in the partial kernel (module doc);
    ``l2_prefetch`` (over a cache, sm_90, launched with PDL): each block prefetches its K and V
    rows into L2, then waits for its predecessor (``griddepcontrol.wait``) — module doc;
    ``pipeline``: a second register set of keys and values, so each iteration's loads are in
    flight while the previous one's scores and accumulation run (:func:`pick_config`);
    ``preload`` (over a cache, launched with PDL, not with ``new_token``): the first iteration's
    keys and values load into registers before the wait, which the kernel places itself as with
    ``l2_prefetch`` (module doc);
    ``cluster`` (over a cache, sm_90, not with ``fused_combine``): the chunks of one block row are
    one thread-block cluster (≤ 16 chunks) and combine through distributed shared memory, one
    launch, no partials in global memory (module doc); ``threads`` per block (a multiple of the
    lanes one key row takes; more threads: more keys per iteration, fewer chunks for the cluster);
    ``heads``: query heads of one KV head a block takes (0: all of them, at most 8; fewer: the
    same chunks over G/heads times the blocks, each K/V row read by that many blocks from L2);
    ``trace`` (over a cache, CUDA; a diagnostic for ``bench_decode_cache.py --trace``): the kernel
    takes a sixth buffer ``trace`` (:func:`trace_shape`, uint64) where thread 0 of each block
    records when it ran each stage (:data:`TRACE_SLOTS`).

    unroll 8 (was 4): the kernel alone on the H200 (``bench_decode_cache.py``, session 12, correct
    against SDPA in fp32 for every config), default splits: the 4-layer LM's cache (ctx 2048, 16 q /
    4 KV heads) 7.11 → 6.31 µs, the 7B cache at batch 8 (ctx 1024) 37.1 → 36.0 µs."""

    unroll: int = 8
    splits: int = 0
    fused_combine: bool = False
    l2_prefetch: bool = False
    pipeline: bool = False
    preload: bool = False
    cluster: bool = False
    threads: int = _THREADS
    heads: int = 0
    trace: bool = False


@dataclass(frozen=True)
class NewToken:
    """This step's q, k and v as expressions, for the kernel that does the decode append itself:
    ``value(b, h, d)`` is element ``d`` of head ``h`` of ``concat(q, k, v)`` over heads (h < Hq:
    query heads after RoPE, then Hkv key heads after RoPE, then Hkv value heads) of sequence
    ``b`` (int32 PrimExprs in, a PrimExpr of the cache dtype out). The buffers it reads become
    parameters of the kernel's caller (:mod:`tvmfuse.rules.fold_decode_append`)."""

    value: Callable


def _vec(spec: AttentionSpec) -> int:
    """Elements a lane loads at once (16 bytes; 4 floats in float32)."""
    return _VEC if spec.dtype != "float32" else 4


def _lane_groups(spec: AttentionSpec, threads: int) -> int:
    """Key rows a block of ``threads`` loads at once (head_dim / vec lanes a row)."""
    return threads // (spec.head_dim // _vec(spec))


def _split_count(spec: AttentionSpec, cfg: DecodeConfig, blocks_per_split: int, kv_eff: int,
                 keys_per_iter: int, sms: int) -> int:
    most = min(_MAX_CLUSTER if cfg.cluster else _MAX_SPLITS,
               (kv_eff + keys_per_iter - 1) // keys_per_iter)
    if cfg.splits:
        return max(1, min(cfg.splits, most))
    want = (sms * 2 + blocks_per_split - 1) // blocks_per_split  # ~2 blocks per SM
    return max(1, min(want, most))


def _visible(spec: AttentionSpec) -> tuple[int, int]:
    """(kbase, kv_eff): the first visible key and how many are visible. Sq == 1: TopLeft sees key
    0 only; BottomRight (j ≤ Skv − 1) and none see all keys; a window of w keys (BottomRight)
    the last w."""
    kv_eff = 1 if spec.causal == "TopLeft" else spec.kv_len
    kbase = 0
    if spec.window is not None:
        kbase = max(kv_eff - spec.window, 0)
        kv_eff -= kbase
    return kbase, kv_eff


def _chunks(spec: AttentionSpec, cfg: DecodeConfig, sms: int) -> tuple[int, int, int]:
    """(n_split, L, per_iter): KV chunks, keys per chunk (a multiple of the keys one iteration
    takes, ``per_iter`` = 8 lane groups × ``unroll`` at 16 lanes a row)."""
    per_iter = _lane_groups(spec, cfg.threads) * cfg.unroll
    _, kv_eff = _visible(spec)
    n_split = _split_count(spec, cfg, spec.batch * spec.kv_heads * _head_chunks(spec, cfg)[1], kv_eff,
                           per_iter, sms)
    L = (kv_eff + n_split - 1) // n_split
    L = (L + per_iter - 1) // per_iter * per_iter
    if cfg.cluster:  # over a cache the chunk length follows the sequence: keep every cluster block
        return n_split, L, per_iter
    return (kv_eff + L - 1) // L, L, per_iter


_PIPELINE_MIN_ITERS = 8
_MAX_UNROLL = 10  # rows a lane group holds at once (registers: 2·unroll·8 halves of K and V)
_MAX_SCORES = 40  # unroll · GC scores a lane holds (registers)
_MAX_STATIC_SMEM = 48 << 10  # bytes of static shared memory a CUDA block may declare
# the cluster's chunks (≤ 16) against the two-kernel config's, in rows a lane group works through:
# lm4 (H100, session 28) won 4 % at 9 vs 8 rows, broke even at 16 vs 8, lost 3.7 % at 24 vs 8
_CLUSTER_MAX_SERIAL = 1.25


def pick_config(spec: AttentionSpec, sms: int, fused_combine: bool = False,
                l2_prefetch: bool = False, preload: bool = False, cluster: bool = False,
                threads: int = 0, heads: int = 0) -> DecodeConfig:
    """Unroll 8, or unroll 4 with the pipeline where each block loops ≥ 8 iterations (few
    splits: many sequences × KV heads fill the SMs). H200, ``bench_decode_cache.py`` (session 16,
    kernel alone): the 7B cache at batch 8, ctx 1024 (16 iterations a block at unroll 4)
    pipelined 34.98 µs vs 36.75 (unroll 8) and 38.1 (unroll 4); at batch 1 (≤ 4 iterations)
    the pipeline was slower: 7B 5.94 vs 5.54 µs, the 4-layer LM's cache 6.93 vs 6.22.

    ``threads`` 0: 256 with ``cluster`` where a block takes ≤ 4 query heads (the lane groups'
    shared merge buffer, threads·8·GC floats, stays at 32 KiB), else 128. With ``cluster``: the
    unroll that lets one iteration of the (≤ 16) chunks cover every slot, where it is ≤ 10 and
    unroll·GC ≤ 40 (the scores' registers; lm4, GC = 4: 9, 177 registers, no spills). The
    cluster is kept only where each lane group then works through ≤ 1.25× the key rows it would
    without (few KV heads at long contexts, e.g. one KV head: 16 chunks would serialise what the
    two-kernel config spreads over up to 128); else the two-kernel config is returned. H100
    (session 28, kernel alone, 256 threads, 2064 of 2081 slots visible as in the 4-layer LM's
    decode): unroll 9 (one iteration) 6.00 µs vs unroll 8 (two) 7.18.

    ``heads`` 0 with ``cluster``: half the query heads a block while twice the blocks still fit
    on the SMs (:func:`_spread_heads`; lm4: 2 of 4, 120 blocks instead of 60)."""
    if cluster and not heads:
        heads = _spread_heads(spec, sms, fused_combine=fused_combine, l2_prefetch=l2_prefetch,
                              preload=preload, cluster=True, threads=threads)
    GC = _head_chunks(spec, DecodeConfig(heads=heads))[0]
    explicit = threads
    threads = threads or (256 if cluster and GC <= 4 else _THREADS)
    flags = {"fused_combine": fused_combine, "l2_prefetch": l2_prefetch,
             "preload": preload, "cluster": cluster, "threads": threads, "heads": heads}
    base = DecodeConfig(**flags)
    if cluster:  # one iteration a block where ≤ _MAX_UNROLL rows a lane group cover every slot
        rows = _MAX_CLUSTER * _lane_groups(spec, threads)
        unroll = -(-_visible(spec)[1] // rows)
        if base.unroll < unroll <= _MAX_UNROLL and unroll * GC <= _MAX_SCORES:
            base = DecodeConfig(unroll=unroll, **flags)
    piped = DecodeConfig(unroll=4, pipeline=True, **flags)
    _, L, per_iter = _chunks(spec, piped, sms)
    picked = piped if L // per_iter >= _PIPELINE_MIN_ITERS else base
    if cluster:  # ≤ 16 chunks must not lengthen each lane group's serial work much (doc)
        plain = pick_config(spec, sms, fused_combine, l2_prefetch, preload, threads=explicit,
                            heads=heads)
        if _serial_rows(spec, picked, sms) > _CLUSTER_MAX_SERIAL * _serial_rows(spec, plain, sms):
            return plain
    return picked


def _spread_heads(spec: AttentionSpec, sms: int, **flags: Any) -> int:
    """Query heads a cluster block takes by default (0: all, at most 8), halved while the grid of the
    half, B · Hkv · (G / heads) · n_split blocks, still fits on ``sms``. The block's loop is bound
    by its instructions (scores reduced across 16 lanes, the softmax kept by each of them), not
    by its loads, so spreading a layer over more SMs shortens it. H100 (session 36, 2064 of 2081
    slots, K/V in L2; ``bench_decode_cache.py --trace``): 4 heads a block, 60 blocks, loop 5439
    cycles, kernel 5.97 µs; 2 heads, 120 blocks: 4349 cycles, 5.69 µs; the 4-layer LM's decode
    −1.2 % (7 interleaved rounds, two calls: 0.1795 → 0.1774 and 0.1800 → 0.1779 ms/token). 1 head
    (240 blocks, more than the SMs) took as long as 2 alone."""
    gc = _head_chunks(spec)[0]
    while gc % 2 == 0:
        half = pick_config(spec, sms, **flags, heads=gc // 2)
        blocks = spec.batch * spec.kv_heads * _head_chunks(spec, half)[1] * _chunks(spec, half, sms)[0]
        if not half.cluster or blocks > sms:
            break
        gc //= 2
    return 0 if gc == _head_chunks(spec)[0] else gc


def _serial_rows(spec: AttentionSpec, cfg: DecodeConfig, sms: int) -> float:
    """Key rows one lane group of a block works through: chunk length / lane groups a block."""
    return _chunks(spec, cfg, sms)[1] / _lane_groups(spec, cfg.threads)


def check(spec: AttentionSpec) -> str | None:
    """Why the split-KV decode kernel does not take ``spec``, or None when it does."""
    if spec.q_len != 1:
        return f"needs q_len == 1, not {spec.q_len}"
    if spec.dtype not in ("float16", "bfloat16", "float32"):
        return f"dtype {spec.dtype} unsupported"
    if spec.value_dim_differs:
        return spec.value_dim_differs
    vec = _vec(spec)
    lanes = spec.head_dim // vec
    if spec.head_dim % vec or lanes & (lanes - 1) or _THREADS % lanes:
        return f"head_dim {spec.head_dim} unsupported"
    return None


def flash_decode_primfunc(spec: AttentionSpec, target: tvm.target.Target | None = None,
                          config: DecodeConfig | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(q, k, v, [bias,] out)`` for a spec :func:`check` takes (layout in ``attention.py``)."""
    return _primfunc(spec, target, config, cache=False)


def state_rows(kv_heads: int, max_seq: int, q_heads: int) -> tuple[int, int, int, int]:
    """Rows of a decode state ``(B, R, D)``: (K row 0, V row 0, q row 0, R). Row ``g·M + j`` is
    key slot j of KV head g, ``Hkv·M + g·M + j`` its value, ``2·Hkv·M + h`` this step's query
    of head h (M = max_seq): one buffer, so one in-place kernel writes q and appends K and V."""
    v0 = kv_heads * max_seq
    return 0, v0, 2 * v0, 2 * v0 + q_heads


def flash_decode_cache_primfunc(spec: AttentionSpec, target: tvm.target.Target | None = None,
                                config: DecodeConfig | None = None,
                                new_token: NewToken | None = None) -> tvm.tirx.PrimFunc:
    """PrimFunc ``(state, offsets, starts, sync, out)``: the same kernel over a KV cache (``sync``
    is read only with ``config.fused_combine``: then one launch). ``new_token``: the kernel
    appends this step's key and value and computes its query itself (module doc); the buffers
    ``new_token.value`` reads are left free for the caller to bind.

    state ``(B, R, D)`` (:func:`state_rows`, M = ``spec.kv_len`` slots), out ``(B, 1, Hq, D)``;
    offsets, starts ``(B,)`` int32; ``sync`` :func:`sync_shape` int32, zero before the first call
    and left zero. Sequence b sees the slots ``lo .. p``, p = min(offsets[b], M − 1),
    lo = min(starts[b], p), read where they lie (no copy); the chunks are cut from M, and the
    blocks of chunks past p only write an empty partial (m = −inf, l = 0).
    """
    if spec.causal != "none" or spec.window is not None or spec.bias_shape is not None:
        raise ValueError("flash decode over a cache: the visible slots come from offsets/starts")
    return _primfunc(spec, target, config, cache=True, new_token=new_token)


def _head_chunks(spec: AttentionSpec, cfg: DecodeConfig | None = None) -> tuple[int, int]:
    """(GC, HC): GC query heads of one KV head per block (the largest divisor of G up to
    ``cfg.heads`` or 8), HC blocks per KV head."""
    G = spec.group
    cap = min(G, _MAX_GC, cfg.heads if cfg is not None and cfg.heads > 0 else _MAX_GC)
    GC = max(d for d in range(1, cap + 1) if G % d == 0)
    return GC, G // GC


def sync_shape(spec: AttentionSpec) -> tuple[int]:
    """The fused combine's counters: one per (sequence, block row) = B · Hkv · HC, allocated for
    the most block rows any config has (HC = G: B · Hq)."""
    return (spec.batch * spec.q_heads,)


def trace_shape(spec: AttentionSpec, config: DecodeConfig, sms: int) -> tuple[int, int]:
    """``DecodeConfig.trace``'s buffer: one row of :data:`TRACE_SLOTS` per block, block
    ``(b·Hkv·HC + y)·n_split + chunk``."""
    blocks = spec.batch * spec.kv_heads * _head_chunks(spec, config)[1]
    return (blocks * _chunks(spec, config, sms)[0], len(TRACE_SLOTS))


def _primfunc(spec: AttentionSpec, target: tvm.target.Target | None, config: DecodeConfig | None,
              cache: bool, new_token: NewToken | None = None) -> tvm.tirx.PrimFunc:
    reason = check(spec)
    if reason is not None:  # callers ask check() first; reaching this is a caller's bug
        raise ValueError(f"flash decode: {reason}")
    vec = _vec(spec)
    cfg = config or DecodeConfig()
    B, Skv, Hq, Hkv, D = spec.batch, spec.kv_len, spec.q_heads, spec.kv_heads, spec.head_dim
    G = spec.group
    GC, HC = _head_chunks(spec, cfg)
    dt, odt = spec.dtype, spec.result_dtype
    QKV_L, OUT_L = spec.qkv_layout, spec.out_layout  # memory layouts (spec.at)
    q_shape, kv_shape, out_shape = spec.q_shape, at(QKV_L, B, Skv, Hkv, D), spec.out_shape
    fused_combine = cache and cfg.fused_combine  # the counters live beside the cache
    cluster = cache and cfg.cluster  # the chunks of a block row combine through DSMEM
    if cluster and (fused_combine or new_token is not None):
        raise ValueError("flash decode: the cluster combine takes neither fused_combine nor new_token")
    prefetch = cache and cfg.l2_prefetch
    pipeline = cfg.pipeline
    folded = new_token is not None
    preload = cache and cfg.preload and not folded  # iteration 0 in registers before the wait
    self_wait = prefetch or (cache and cfg.preload)  # the kernel places griddepcontrol.wait
    traced = cache and cfg.trace
    new = new_token.value if folded else None
    row_bytes = D * tvm.DataType(dt).bits // 8
    k0, v0, q0, rows = state_rows(Hkv, Skv, Hq)

    def q_at(b, h, d):
        return (b, q0 + h, d) if cache else at(QKV_L, b, 0, h, d)

    def k_at(b, j, g, d):
        return (b, k0 + g * Skv + j, d) if cache else at(QKV_L, b, j, g, d)

    def v_at(b, j, g, d):
        return (b, v0 + g * Skv + j, d) if cache else at(QKV_L, b, j, g, d)
    LPR = D // vec  # lanes per key row
    NT = cfg.threads
    if NT % LPR or NT % 32 or not 0 < NT <= 1024:
        raise ValueError(f"flash decode: {NT} threads a block: need whole warps (a multiple of 32, at "
                         f"most 1024) holding whole key rows of {LPR} lanes")
    NG = NT // LPR  # key rows in flight per unroll step
    smem = 4 * (NG * GC * (D + 2) + (GC * (D + 2) if cluster else 0) + (GC * D if folded else 0))
    if smem > _MAX_STATIC_SMEM:
        raise ValueError(f"flash decode: {NT} threads a block merging {GC} query heads need {smem} "
                         f"bytes of shared memory (at most {_MAX_STATIC_SMEM}): fewer threads")
    U = cfg.unroll
    kbase, kv_eff = _visible(spec)  # kv_eff keys from kbase are visible
    n_split, L, per_iter = _chunks(spec, cfg, device_properties(target).sms)
    has_bias = spec.bias_shape is not None
    fb, fh, _ = bias_strides(spec) if has_bias else (0, 0, 0)
    bias_shape = spec.bias_shape if has_bias else (1, 1, 1, 1)
    bdt = spec.bias_dtype or dt
    # q is pre-scaled: s = q·k·scale·log2e, or soft-capped s = tanh(q·k·scale/cap)·cap·log2e
    sc = float(spec.scale * _LOG2E if spec.softcap is None else spec.tanh_scale)
    cap_out = float(spec.score_unit * _LOG2E) if spec.softcap is not None else None
    l2e = float(_LOG2E)
    full = T.uint32(0xFFFFFFFF)

    @T.macro
    def merge(c, m_at, l_at, o_at):
        """``c[2] / c[3]`` = Σ_c 2^(m_c − M)·o_c / Σ_c 2^(m_c − M)·l_c over the n_split chunks,
        M = max_c m_c (``c[0]``; ``c[1]``: 0 where every chunk is empty); ``m_at(c)``, ``l_at(c)``,
        ``o_at(c)`` give chunk c's running max, sum and partial output."""
        c[0] = T.float32(_NEG_INF)
        for sp2 in T.unroll(n_split):
            c[0] = T.max(c[0], m_at(sp2))
        c[1] = T.if_then_else(c[0] == T.float32(_NEG_INF), T.float32(0), c[0])
        c[2] = T.float32(0)
        c[3] = T.float32(0)
        for sp2 in T.unroll(n_split):
            c[2] = c[2] + T.exp2(m_at(sp2) - c[1]) * o_at(sp2)
            c[3] = c[3] + T.exp2(m_at(sp2) - c[1]) * l_at(sp2)

    @T.macro
    def store(out, c, b, h, d):
        out[at(OUT_L, b, 0, h, d)] = T.Cast(
            odt, T.if_then_else(c[3] > T.float32(0), c[2] / c[3], T.float32(0)))

    @T.macro
    def combine(part_o, part_ml, out, c, mc, bh, t2):
        """Element t2 of head row bh = b·Hq + h from the n_split partials (module doc)."""
        for sp2 in T.unroll(n_split):
            mc[sp2] = part_ml[(bh * n_split + sp2) * 2]
        merge(c, lambda s: mc[s], lambda s: part_ml[(bh * n_split + s) * 2 + 1],
              lambda s: part_o[(bh * n_split + s) * D + t2])
        store(out, c, bh // Hq, bh % Hq, t2)

    tail_iters = (GC * D + NT - 1) // NT
    unroll_tail = tail_iters * n_split <= 512  # the loads of every output in flight together

    @T.macro
    def tail_output(part_o, sm_ml2, out, c, b, h0, idx):
        """Fused combine: output element ``idx`` (head h0 + idx // D) from the chunks' (m, l) in
        ``sm_ml2`` (shared, [head, chunk, 2]) and their partial sums in ``part_o``."""
        if idx < GC * D:
            hh: T.let[T.int32] = idx // D
            merge(c, lambda s: sm_ml2[(hh * n_split + s) * 2],
                  lambda s: sm_ml2[(hh * n_split + s) * 2 + 1],
                  lambda s: part_o[((b * Hq + h0 + hh) * n_split + s) * D + idx % D])
            store(out, c, b, h0 + hh, idx % D)

    @T.macro
    def load_row(k, v, kbuf, vbuf, u, b, kvh, j, d0):
        """This lane's ``vec`` elements of key and value row ``j`` into register slot ``u``."""
        kbuf[T.ramp(u * vec, 1, vec)] = k[k_at(b, j, kvh, T.ramp(d0, 1, vec))]
        vbuf[T.ramp(u * vec, 1, vec)] = v[v_at(b, j, kvh, T.ramp(d0, 1, vec))]

    @T.macro
    def load_keys(k, v, kbuf, vbuf, it, b, kvh, kb, ke, j0, grp, d0):
        """Keys and values of iteration ``it`` (``U`` rows a lane group) into registers."""
        for u in T.unroll(U):
            jl: T.let[T.int32] = kb + T.min(j0 + it * per_iter + u * NG + grp, ke - 1)
            load_row(k, v, kbuf, vbuf, u, b, kvh, jl, d0)

    @T.macro
    def prefetch_rows(k, v, b, kvh, j, n_rows, tx):
        """Thread 0 hands K rows ``j .. j + n_rows − 1`` of KV head ``kvh`` and the same V rows
        to the TMA unit as two bulk L2 prefetches."""
        if tx == 0 and n_rows > 0:
            T.ptx.cp.async_.bulk.prefetch.L2.global_(
                T.address_of(k[k_at(b, j, kvh, 0)]), T.Cast("uint32", n_rows * row_bytes))
            T.ptx.cp.async_.bulk.prefetch.L2.global_(
                T.address_of(v[v_at(b, j, kvh, 0)]), T.Cast("uint32", n_rows * row_bytes))

    @T.macro
    def reload_newest(k, v, kbuf, vbuf, b, kvh, kb, ke, j0, grp, d0):
        """After the wait: the iteration-0 rows that are the newest visible slot ``kb + ke − 1``
        (the append's row; clamped lanes past the chunk's end hold it too) loaded again."""
        for u in T.unroll(U):
            jn: T.let[T.int32] = T.min(j0 + u * NG + grp, ke - 1)
            if jn == ke - 1:
                load_row(k, v, kbuf, vbuf, u, b, kvh, kb + jn, d0)

    @T.macro
    def attend(kbuf, vbuf, it, s, qr, m, lsum, st, acc, bias, b, h0, ke, j0, Lc, grp):
        """Scores, online softmax and the V accumulation of iteration ``it``'s keys."""
        for u in T.unroll(U):
            for hh in T.unroll(GC):
                s[u * GC + hh] = T.float32(0)
                for e in T.unroll(vec):
                    s[u * GC + hh] = s[u * GC + hh] + qr[hh * vec + e] * T.Cast(
                        "float32", kbuf[u * vec + e])
        for u in T.unroll(U):
            for hh in T.unroll(GC):
                for x in T.unroll(LPR.bit_length() - 1):
                    s[u * GC + hh] = s[u * GC + hh] + T.tvm_warp_shuffle_xor(
                        full, s[u * GC + hh], 1 << x, 32, 32)
        if cap_out is not None:  # soft cap: one MUFU.TANH per score
            for u in T.unroll(U):
                for hh in T.unroll(GC):
                    T.ptx["tanh.approx.f32"](s[u * GC + hh], s[u * GC + hh])
                    s[u * GC + hh] = s[u * GC + hh] * T.float32(cap_out)
        for u in T.unroll(U):
            j: T.let[T.int32] = j0 + it * per_iter + u * NG + grp
            for hh in T.unroll(GC):
                if has_bias:
                    s[u * GC + hh] = s[u * GC + hh] + T.Cast("float32", bias[
                        b * fb, (h0 + hh) * fh, 0, kbase + T.min(j, kv_eff - 1)]) * l2e
                if j >= T.min(j0 + Lc, ke):
                    s[u * GC + hh] = T.float32(_NEG_INF)
        for hh in T.unroll(GC):
            st[0] = m[hh]
            for u in T.unroll(U):
                st[0] = T.max(st[0], s[u * GC + hh])
            st[1] = T.if_then_else(st[0] == T.float32(_NEG_INF), T.float32(0), st[0])
            lsum[hh] = lsum[hh] * T.exp2(m[hh] - st[1])
            for e in T.unroll(vec):
                acc[hh * vec + e] = acc[hh * vec + e] * T.exp2(m[hh] - st[1])
            m[hh] = st[0]
            for u in T.unroll(U):
                s[u * GC + hh] = T.exp2(s[u * GC + hh] - st[1])
                lsum[hh] = lsum[hh] + s[u * GC + hh]
                for e in T.unroll(vec):
                    acc[hh * vec + e] = acc[hh * vec + e] + s[u * GC + hh] * T.Cast(
                        "float32", vbuf[u * vec + e])

    # cluster combine: block ``sp`` of the cluster merges outputs sp·E … sp·E + E − 1 of the GC·D
    CE = (GC * D + n_split - 1) // n_split

    @T.macro
    def cluster_output(pb, c, mc, lc, oc, out, b, h0, idx):
        """Cluster combine: output element ``idx`` (head h0 + idx // D) from the (m, l, o) each
        block p of the cluster left in its shared ``cl`` ([GC·D partial sums, GC × (m, l)]; its
        address in the cluster window ``pb[p]``), read through distributed shared memory
        (``ld.shared::cluster``), all loads in flight together."""
        if idx < GC * D:
            hh: T.let[T.int32] = idx // D
            for p in T.unroll(n_split):
                T.ptx.ld.shared__cluster.f32(mc[p], pb[p] + T.Cast("uint32", (GC * D + hh * 2) * 4))
                T.ptx.ld.shared__cluster.f32(lc[p], pb[p] + T.Cast("uint32", (GC * D + hh * 2 + 1) * 4))
                T.ptx.ld.shared__cluster.f32(oc[p], pb[p] + T.Cast("uint32", idx * 4))
            merge(c, lambda s: mc[s], lambda s: lc[s], lambda s: oc[s])
            store(out, c, b, h0 + hh, idx % D)

    @T.macro
    def stamp(trace, blk, slot, tx):
        """Thread 0 records ``TRACE_SLOTS[slot]`` of block ``blk`` (``DecodeConfig.trace``)."""
        if traced and tx == 0:
            if TRACE_SLOTS[slot].endswith("_ns"):
                trace[blk, slot] = T.cuda.func_call("tvmfuse_globaltimer", source_code=_GLOBALTIMER,
                                                    return_type="uint64")
            elif TRACE_SLOTS[slot] == "smid":
                trace[blk, slot] = T.cuda.func_call("tvmfuse_smid", source_code=_SMID,
                                                    return_type="uint64")
            else:
                trace[blk, slot] = T.cuda.clock64()

    @T.macro
    def body(q, k, v, bias, out, offsets, starts, sync, trace):
        if not cluster:
            part_o = T.alloc_buffer((B * Hq * n_split * D,), "float32", scope="global")
            part_ml = T.alloc_buffer((B * Hq * n_split * 2,), "float32", scope="global")
        with T.launch_thread("blockIdx.x", n_split) as sp:
            if cluster:  # the n_split chunks of this block row are one cluster
                T.launch_thread("clusterCtaIdx.x", n_split)
            yb = T.launch_thread("blockIdx.y", Hkv * HC)
            b = T.launch_thread("blockIdx.z", B)
            tx = T.launch_thread("threadIdx.x", NT)
            qr = T.alloc_buffer((GC * vec,), "float32", scope="local")
            acc = T.alloc_buffer((GC * vec,), "float32", scope="local")
            kr = T.alloc_buffer((U * vec,), dt, scope="local")
            vr = T.alloc_buffer((U * vec,), dt, scope="local")
            if pipeline:
                kr2 = T.alloc_buffer((U * vec,), dt, scope="local")
                vr2 = T.alloc_buffer((U * vec,), dt, scope="local")
            s = T.alloc_buffer((U * GC,), "float32", scope="local")
            m = T.alloc_buffer((GC,), "float32", scope="local")
            lsum = T.alloc_buffer((GC,), "float32", scope="local")
            st = T.alloc_buffer((2,), "float32", scope="local")
            sm_o = T.alloc_buffer((NG * GC * D,), "float32", scope="shared")
            sm_ml = T.alloc_buffer((NG * GC * 2,), "float32", scope="shared")
            if cluster:
                cl = T.alloc_buffer((GC * D + GC * 2,), "float32", scope="shared")
            if folded:
                sm_q = T.alloc_buffer((GC * D,), "float32", scope="shared")
            blk: T.let[T.int32] = (b * (Hkv * HC) + yb) * n_split + sp
            stamp(trace, blk, 0, tx)
            stamp(trace, blk, 1, tx)
            stamp(trace, blk, 2, tx)
            kvh: T.let[T.int32] = yb // HC
            h0: T.let[T.int32] = kvh * G + (yb % HC) * GC
            grp: T.let[T.int32] = tx // LPR
            d0: T.let[T.int32] = (tx % LPR) * vec
            # visible keys kb .. kb + ke − 1: static, or this sequence's cache slots, cut into
            # n_split chunks of Lc keys (a multiple of per_iter)
            if cache:
                last: T.let[T.int32] = T.min(offsets[b], Skv - 1)
                kb: T.let[T.int32] = T.min(starts[b], last)
                ke: T.let[T.int32] = last - kb + 1
                Lc: T.let[T.int32] = ((ke + n_split - 1) // n_split + per_iter - 1) // per_iter * per_iter
            else:
                kb = T.meta_var(kbase)
                ke = T.meta_var(kv_eff)
                Lc = T.meta_var(L)
            j0: T.let[T.int32] = sp * Lc
            if self_wait:  # this chunk's K and V rows into L2, then wait for the append (module doc)
                # with preload, iteration 0's rows go to registers and only the rest to L2
                if preload:
                    load_keys(k, v, kr, vr, 0, b, kvh, kb, ke, j0, grp, d0)
                if preload and prefetch:
                    n_rest: T.let[T.int32] = T.max(T.min(Lc - per_iter, ke - j0 - per_iter), 0)
                    prefetch_rows(k, v, b, kvh, kb + j0 + per_iter, n_rest, tx)
                elif prefetch:
                    n_rows: T.let[T.int32] = T.max(T.min(Lc, ke - j0), 0)
                    prefetch_rows(k, v, b, kvh, kb + j0, n_rows, tx)
                T.ptx.griddepcontrol.wait()
                T.ptx.griddepcontrol.launch_dependents()
                if preload:  # the newest slot, written by the append, loaded again
                    reload_newest(k, v, kr, vr, b, kvh, kb, ke, j0, grp, d0)
            stamp(trace, blk, 3, tx)
            if folded:  # the decode append inside (module doc)
                # keys of the first iteration in flight during the RoPE work, except in the block
                # whose chunk holds the newest slot p: it writes that slot first
                has_p: T.let[T.bool] = j0 < ke and ke <= j0 + Lc and offsets[b] < Skv
                if not has_p:
                    load_keys(k, v, kr, vr, 0, b, kvh, kb, ke, j0, grp, d0)
                # the GC query heads once per block (every lane group reads them), via shared memory
                for i6 in T.unroll((GC * D + NT - 1) // NT):
                    idx6: T.let[T.int32] = i6 * NT + tx
                    if idx6 < GC * D:
                        sm_q[idx6] = T.Cast("float32", new(b, h0 + idx6 // D, idx6 % D)) * sc
                if has_p:
                    for i5 in T.unroll((2 * D + NT - 1) // NT):
                        idx5: T.let[T.int32] = i5 * NT + tx
                        if idx5 < 2 * D:
                            k[b, T.if_then_else(idx5 < D, k0, v0) + kvh * Skv + offsets[b], idx5 % D] = new(
                                b, Hq + idx5 // D * Hkv + kvh, idx5 % D)
                T.tvm_storage_sync("shared")  # q, and the new slot's row, before any lane reads them
                if has_p:
                    load_keys(k, v, kr, vr, 0, b, kvh, kb, ke, j0, grp, d0)
            for hh in T.unroll(GC):
                m[hh] = T.float32(_NEG_INF)
                lsum[hh] = T.float32(0)
                for e in T.unroll(vec):
                    if folded:
                        qr[hh * vec + e] = sm_q[hh * D + d0 + e]
                    else:
                        qr[hh * vec + e] = T.Cast("float32", q[q_at(b, h0 + hh, d0 + e)]) * sc
                    acc[hh * vec + e] = T.float32(0)
            if pipeline:  # the next iteration's loads in flight during this one's math
                n_it: T.let[T.int32] = Lc // per_iter
                if not folded and not preload:
                    load_keys(k, v, kr, vr, 0, b, kvh, kb, ke, j0, grp, d0)
                for it2 in T.serial((n_it + 1) // 2):
                    # past the chunk's last iteration: clamped to a real key, never attended
                    load_keys(k, v, kr2, vr2, it2 * 2 + 1, b, kvh, kb, ke, j0, grp, d0)
                    attend(kr, vr, it2 * 2, s, qr, m, lsum, st, acc, bias, b, h0, ke, j0, Lc, grp)
                    load_keys(k, v, kr, vr, it2 * 2 + 2, b, kvh, kb, ke, j0, grp, d0)
                    if it2 * 2 + 1 < n_it:
                        attend(kr2, vr2, it2 * 2 + 1, s, qr, m, lsum, st, acc, bias, b, h0, ke, j0,
                               Lc, grp)
            elif folded or preload:  # iteration 0's keys are loaded above
                attend(kr, vr, 0, s, qr, m, lsum, st, acc, bias, b, h0, ke, j0, Lc, grp)
                for it in T.serial(Lc // per_iter - 1):
                    load_keys(k, v, kr, vr, it + 1, b, kvh, kb, ke, j0, grp, d0)
                    attend(kr, vr, it + 1, s, qr, m, lsum, st, acc, bias, b, h0, ke, j0, Lc, grp)
            else:
                for it in T.serial(Lc // per_iter):
                    load_keys(k, v, kr, vr, it, b, kvh, kb, ke, j0, grp, d0)
                    attend(kr, vr, it, s, qr, m, lsum, st, acc, bias, b, h0, ke, j0, Lc, grp)
            stamp(trace, blk, 4, tx)
            # merge the NG lane groups of this block
            for hh in T.unroll(GC):
                for e in T.unroll(vec):
                    sm_o[(grp * GC + hh) * D + d0 + e] = acc[hh * vec + e]
                if tx % LPR == 0:
                    sm_ml[(grp * GC + hh) * 2] = m[hh]
                    sm_ml[(grp * GC + hh) * 2 + 1] = lsum[hh]
            T.tvm_storage_sync("shared")
            stamp(trace, blk, 5, tx)
            for it2 in T.serial((GC * D + NT - 1) // NT):
                idx: T.let[T.int32] = it2 * NT + tx
                if idx < GC * D:
                    hh2: T.let[T.int32] = idx // D
                    dd: T.let[T.int32] = idx % D
                    st[0] = T.float32(_NEG_INF)
                    for gi in T.unroll(NG):
                        st[0] = T.max(st[0], sm_ml[(gi * GC + hh2) * 2])
                    st[1] = T.if_then_else(st[0] == T.float32(_NEG_INF), T.float32(0), st[0])
                    acc[0] = T.float32(0)
                    acc[1] = T.float32(0)
                    for gi in T.unroll(NG):
                        acc[2] = T.exp2(sm_ml[(gi * GC + hh2) * 2] - st[1])
                        acc[0] = acc[0] + acc[2] * sm_o[(gi * GC + hh2) * D + dd]
                        acc[1] = acc[1] + acc[2] * sm_ml[(gi * GC + hh2) * 2 + 1]
                    if cluster:  # this chunk's (o, m, l) stay in shared memory for the cluster
                        cl[idx] = acc[0]
                        if dd == 0:
                            cl[GC * D + hh2 * 2] = st[0]
                            cl[GC * D + hh2 * 2 + 1] = acc[1]
                    else:
                        pbase: T.let[T.int32] = (b * Hq + h0 + hh2) * n_split + sp
                        part_o[pbase * D + dd] = acc[0]
                        if dd == 0:
                            part_ml[pbase * 2] = st[0]
                            part_ml[pbase * 2 + 1] = acc[1]
            stamp(trace, blk, 6, tx)
            if cluster:  # every chunk's partial is in its block's shared memory: merge (module doc)
                cc2 = T.alloc_buffer((4,), "float32", scope="local")
                mc2 = T.alloc_buffer((n_split,), "float32", scope="local")
                lc2 = T.alloc_buffer((n_split,), "float32", scope="local")
                oc2 = T.alloc_buffer((n_split,), "float32", scope="local")
                pb = T.alloc_buffer((n_split,), "uint32", scope="local")  # the peers' cl addresses
                for p2 in T.unroll(n_split):
                    T.ptx.mapa.shared__cluster.u32(pb[p2], T.cuda.cvta_generic_to_shared(
                        T.address_of(cl[0])), T.uint32(p2))
                T.cuda.cluster_sync()  # release/acquire: the peers' shared writes are visible
                stamp(trace, blk, 7, tx)
                for it5 in T.serial((CE + NT - 1) // NT):
                    if it5 * NT + tx < CE:
                        cluster_output(pb, cc2, mc2, lc2, oc2, out, b, h0, sp * CE + it5 * NT + tx)
                stamp(trace, blk, 8, tx)
                # no block leaves while a peer still reads its shared memory (execution only: this
                # block's reads have returned, its output is its own)
                T.ptx.barrier.cluster.arrive.relaxed.aligned()
                T.ptx.barrier.cluster.wait.aligned()
                stamp(trace, blk, 9, tx)
            if fused_combine:  # the block that counts last combines its GC heads (module doc)
                last_in = T.alloc_buffer((1,), "int32", scope="shared")
                arrived = T.alloc_buffer((1,), "int32", scope="local")  # (no shared load in an if)
                cc = T.alloc_buffer((4,), "float32", scope="local")
                T.cuda.thread_fence()
                T.tvm_storage_sync("shared")
                if tx == 0:
                    last_in[0] = T.cuda.atomic_add(T.address_of(sync[b * (Hkv * HC) + yb]), 1)
                T.tvm_storage_sync("shared")
                arrived[0] = last_in[0]
                if arrived[0] == n_split - 1:
                    T.cuda.thread_fence()
                    # every chunk's (m, l) of the GC heads into shared memory at once (sm_o is free:
                    # the merge above read it before the barrier), then each output element loads
                    # its n_split partials together: two L2 round trips for the whole tail
                    for it4 in T.serial((GC * n_split + NT - 1) // NT):
                        idx4: T.let[T.int32] = it4 * NT + tx
                        if idx4 < GC * n_split:
                            src: T.let[T.int32] = (b * Hq + h0 + idx4 // n_split) * n_split + idx4 % n_split
                            sm_o[idx4 * 2] = part_ml[src * 2]
                            sm_o[idx4 * 2 + 1] = part_ml[src * 2 + 1]
                    T.tvm_storage_sync("shared")
                    if unroll_tail:
                        for it3 in T.unroll(tail_iters):
                            tail_output(part_o, sm_o, out, cc, b, h0, it3 * NT + tx)
                    else:
                        for it3 in T.serial(tail_iters):
                            tail_output(part_o, sm_o, out, cc, b, h0, it3 * NT + tx)
                    if tx == 0:
                        sync[b * (Hkv * HC) + yb] = 0
            stamp(trace, blk, len(TRACE_SLOTS) - 1, tx)
        if not fused_combine and not cluster:
            with T.launch_thread("blockIdx.x", B * Hq) as bh:
                t2 = T.launch_thread("threadIdx.x", D)
                c = T.alloc_buffer((4,), "float32", scope="local")
                mc = T.alloc_buffer((n_split,), "float32", scope="local")
                combine(part_o, part_ml, out, c, mc, bh, t2)

    if cache and traced:

        @T.prim_func(check_well_formed=False)
        def flash_decode(state: T.Buffer((B, rows, D), dt), offsets: T.Buffer((B,), "int32"),
                         starts: T.Buffer((B,), "int32"), sync: T.Buffer(sync_shape(spec), "int32"),
                         out: T.Buffer(out_shape, odt),
                         trace: T.Buffer(trace_shape(spec, cfg, device_properties(target).sms),
                                         "uint64")):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            body(state, state, state, state, out, offsets, starts, sync, trace)

    elif cache:

        # with new_token the buffers its expression reads are free until the caller binds them
        # (checked below otherwise)
        @T.prim_func(check_well_formed=False)
        def flash_decode(state: T.Buffer((B, rows, D), dt), offsets: T.Buffer((B,), "int32"),
                         starts: T.Buffer((B,), "int32"), sync: T.Buffer(sync_shape(spec), "int32"),
                         out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            body(state, state, state, state, out, offsets, starts, sync, state)

    elif has_bias:

        @T.prim_func
        def flash_decode(q: T.Buffer(q_shape, dt), k: T.Buffer(kv_shape, dt),
                         v: T.Buffer(kv_shape, dt), bias: T.Buffer(bias_shape, bdt),
                         out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            body(q, k, v, bias, out, q, q, q, q)

    else:

        @T.prim_func
        def flash_decode(q: T.Buffer(q_shape, dt), k: T.Buffer(kv_shape, dt),
                         v: T.Buffer(kv_shape, dt), out: T.Buffer(out_shape, odt)):
            T.func_attr({"tir.is_scheduled": True, "tir.noalias": True})
            body(q, k, v, q, out, q, q, q, q)

    if cache and not folded:
        tvm.tirx.analysis.verify_well_formed(flash_decode)
    return flash_decode
