"""TIRx builder of a warp-specialised Hopper GEMM: TMA → mbarrier ring → wgmma, epilogue in registers.

``C[m, n] = epilogue(Σ_k A[m, k] · B[n, k])`` (``layout="nt"``, B is (N, K) K-major) or
``Σ_k A[m, k] · B[k, n]`` (``layout="nn"``, B is (K, N), read MN-major by wgmma).
A is (M, K) row-major; fp16 / bf16 inputs, fp32 accumulation.

One CTA computes a ``BM × BN`` tile with ``1 + BM/64`` warpgroups:

* warpgroup 0 (producer): one thread issues the TMA loads of stage ``s`` (A box 64×BM, B boxes
  64×BN or 64×64 chunks, 128-byte swizzle) after the consumers freed it (``empty[s]``), and
  announces the bytes on ``full[s]`` (``mbarrier.arrive.expect_tx``);
* warpgroups 1.. (consumers): each owns 64 rows; per K tile it waits ``full[s]``, issues
  ``BK/16`` ``wgmma.mma_async.m64n{BN}k16`` on shared-memory descriptors, keeps one wgmma group
  in flight and releases the previous stage (``empty``) once that group retired.

Options (:class:`GemmConfig`): ``cluster_m=2`` pairs CTAs (m, n) and (m+1, n) in a cluster; each
producer loads its own A box and half of the B tile, multicast into the same offset of both CTAs,
and a consumer frees a stage in both (``mbarrier.arrive.shared::cluster`` on the peer's ``empty``
via ``mapa``), so a stage costs each CTA 32 instead of 48 KiB of L2 reads. ``warp_release``: one
lane a warp frees a stage. ``pingpong``: the consumers take alternate tiles of ``bm`` rows (one or
two 64-row accumulator chains each), ordered by a ``turn`` barrier pair so that their main loops
alternate (measured slower than the cooperative default; kept for experiments).

``setmaxnreg`` moves registers from the producer to the consumers. The epilogue runs on the
accumulator fragment (thread t of a consumer owns rows ``16·(t/32) + (t%32)/4 (+8)`` and columns
``8·j + 2·(t%4) (+1)``); here the kernel stores ``cast(acc)`` unless the caller passes the
fused expression as a ``store_value`` builder (:mod:`.epilogue` makes it). A *pair* epilogue
(``pair_value``) combines the thread's two accumulators of columns (2c, 2c + 1) into ``C[row, c]``
of an N/2-wide output. Rows ≥ M and columns ≥ N are masked on store; TMA fills out-of-range loads with
zeros, so any M, N and any K that is a multiple of 8 (16-byte TMA strides) work.

*Row statistics* (``row_stats``, a :class:`RowStats`): the consumers also compute the LayerNorm /
RMSNorm statistics of their A rows from the A stages the main loop already has in shared memory,
so no separate statistics kernel runs. The 128-byte swizzle permutes 16-byte chunks within a
128-byte row only, so a row of the stage sums to the same value in any order: thread t of a
consumer reads four of the eight 16-byte chunks of row ``t / 2`` right after issuing its
wgmmas (the stage is released later as before, so no new synchronisation) and accumulates, in fp32,

    s1 = Σ_k (x[r, k] − c),   s2 = Σ_k (x[r, k] − c)²      (LayerNorm; c = one element of the row)
    s2 = Σ_k x[r, k]²                                       (RMSNorm)

The shift c (an element of the row's first K tile) keeps E[(x−c)²] − E[x−c]² free of the
cancellation that E[x²] − mean² suffers when |mean| ≫ std. TMA's zero fill of columns ≥ K adds
``P = 64·⌈K/64⌉ − K`` terms of −c and c², removed after the loop. Then (true K)

    mean = c + s1/K,   rstd = rsqrt(max(s2/K − (s1/K)², 0) + eps)      (RMSNorm: rsqrt(s2/K + eps))

Lanes t, t^1 combine their halves with one ``shfl.xor``; the rows of warp w's fragment (16w + t%32/4
and + 8) are exactly the rows its lanes summed, so four indexed shuffles hand each thread the
statistics of its two fragment rows (no shared memory, no barrier). The epilogue builder gets them
as its ``stats`` argument, ``(mean, rstd)`` of the row it stores.

With ``GemmConfig.stats_warps`` warps 2 and 3 of the producer warpgroup do this instead (the
consumers' wgmma issue then never waits for shared-memory reads of their own): thread s of those
64 sums rows ``s + 64·i`` (i < BM/64) of every A stage, reading physical chunk ``q ^ (s % 8)`` at
step q so that 8 consecutive rows hit 8 different bank groups, and releases the stage like a
consumer (``empty`` counts its 64 arrivals too). After a tile's last K tile it writes (mean, rstd)
of its rows to ``rowstat`` (shared) and arrives on ``stats_ready``; each consumer thread waits for
that phase, loads its two fragment rows' statistics and arrives on ``stats_free``, which the
statistics threads wait for before they overwrite ``rowstat`` with the next tile's.

*Producer statistics* (``row_partials_out``): a kernel whose output an RMSNorm reads next also
writes ``P[t, r] = Σ x[r, c]²`` over the columns c of its column tile t, squared from the rounded
values it stores. After the quad store's exchange lane r of a quad holds whole 8-column blocks
of one fragment row, so each lane sums its blocks' squares, two ``shfl.xor`` (1, 2) add the
quad's four lanes and lane 0 stores the row's entry (rows ≥ M skipped; columns ≥ N never summed).
A consumer given ``RowStats(partials=T)`` (``row_partials_in``) skips the in-loop sums and forms
``rstd = rsqrt(Σ_t P[t, r] / K + eps)`` for its two fragment rows before the epilogue. For a
LayerNorm (``partials_centered``) each lane keeps its row's (n, mean, M2) instead, joining each
8-output block's own mean and M2 (Chan: δ = mean_b − mean_a, mean += δ·n_b/n,
M2 += M2_b + δ²·n_a·n_b/n), the quad's lanes join the same way through ``shfl.xor``, and the
consumer joins the T tiles (static column counts) to (mean, rstd = rsqrt(M2/K + eps)).

The kernel is one ``@T.prim_func`` whose body is written in TVMScript with ``@T.inline`` helpers
(closures over the config); loops unrolled at generation time (accumulator chains, B boxes) emit
their statements through the IR builder. Its signature is the caller's buffers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import tvm_ffi
from tvm import tirx
from tvm.ir import Expr as PrimExpr
from tvm.script import tirx as T

WG = 128  # threads per warpgroup
STATS_THREADS = 64  # GemmConfig.stats_warps: warps 2 and 3 of the producer warpgroup
BK = 64  # K per stage: one 128-byte swizzle row of fp16 / bf16
SW128 = 3  # CUtensorMapSwizzle / descriptor code of the 128-byte swizzle


@dataclass(frozen=True)
class GemmConfig:
    """Tile shape and pipeline depth of one kernel."""

    bm: int = 128  # rows per CTA: 64 per consumer warpgroup
    bn: int = 256  # columns per CTA (wgmma N)
    stages: int = 4
    group_m: int = 8  # tile rasterisation: GROUP_M row tiles share their B tiles in L2
    producer_regs: int = 40
    consumer_regs: int = 232
    persistent: bool = True  # one CTA per SM loops over tiles: next tile's loads overlap the epilogue
    num_sms: int = 132  # H200
    vector_store: bool = True  # column pairs stored as one 2-element vector
    pair_shuffle: bool = True  # pair epilogue: lanes t, t^1 swap one value, store 2-element vectors
    ctas_per_sm: int = 1  # > 1: co-resident CTAs (launch bounds), one's epilogue overlaps another's MMAs
    cluster_m: int = 1  # 2: CTA pairs (tiles m, m+1) share the B tile: each loads half, multicast to both
    warp_release: bool = False  # one lane per consumer warp (not every thread) frees a stage
    # two consumer warpgroups on alternate tiles of bm = 64 rows: one's epilogue runs while the
    # other's wgmmas keep the tensor cores busy (the producer fills the ring in tile order)
    pingpong: bool = False
    wg_rows: int = 64  # cooperative: rows per consumer warpgroup (128: two 64-row chains each)
    # A/B switches for measurements: False keeps the bounds tests on full tiles too
    unguarded_full_tiles: bool = True
    # fp16 / bf16 outputs: erf and sigmoid in cheaper fp32 forms (opmath.fast_math16, |Δerf| ≤
    # 1.5e-7); H200, 4096³ fp16, same run: GELU 0.239 → 0.235 ms, SwiGLU 0.381 → 0.373, rel err same
    fast_math16: bool = True
    # 16-bit outputs: the four lanes of a quad swap their values (a 4 x 4 transpose by two
    # shfl.xor steps) so that each lane stores 16 contiguous bytes of one row: a warp's store
    # covers 8 rows x 64 B instead of 8 rows x 16 B (four times fewer L1 wavefronts per byte).
    # H200, kernel alone, with exit_cluster_sync off (session 19): 2048^3 30.6 -> 25.5 us (cuBLAS
    # 24.2), 2048x2048x5632 67.4 -> 62.4 (61.0), 4096^3 194.0 -> 184.3 (177.8)
    quad_store: bool = True
    # cluster_m > 1: every thread meets the peer at a cluster barrier before exiting (else the
    # producer waits for the last release of each stage, which the peer's arrivals complete)
    exit_cluster_sync: bool = False
    # plain quad store: the epilogue's 16-bit (M, N) / (N,) operands read at the output's own
    # position load as 16-byte vectors (False: 2-byte loads, same exchange and bounds test)
    vector_operands: bool = True
    # with row statistics: two warps of the producer warpgroup (idle otherwise) sum each A stage's
    # rows and hand (mean, rstd) to the epilogue through shared memory; the consumers' main loop
    # does no extra work (False: the consumers read the A rows between their wgmmas)
    stats_warps: bool = False

    @property
    def consumers(self) -> int:
        return 2 if self.pingpong else self.bm // self.wg_rows

    @property
    def chains(self) -> int:
        """Independent 64-row accumulator chains per consumer (ping-pong: the whole tile)."""
        return self.bm // 64 if self.pingpong else self.wg_rows // 64

    @property
    def release_count(self) -> int:
        """Arrivals that free one stage: every consumer thread (or warp) of every CTA reading it."""
        readers = 1 if self.pingpong else self.consumers  # warpgroups reading one stage
        per_cta = readers * (WG // 32 if self.warp_release else WG)
        return per_cta * self.cluster_m

    @property
    def threads(self) -> int:
        return WG * (1 + self.consumers)

    def smem_bytes(self, elem_bytes: int = 2) -> int:
        return self.stages * (self.bm + self.bn) * BK * elem_bytes


@dataclass(frozen=True)
class GemmProblem:
    """What the kernel computes: shapes, dtypes, layout of B."""

    m: int
    n: int
    k: int
    in_dtype: str  # float16 | bfloat16
    out_dtype: str
    layout: str = "nt"  # "nt": B (N, K); "nn": B (K, N)


@dataclass(frozen=True)
class RowStats:
    """Per-row statistics of A (over its K columns) that the kernel computes in its main loop.

    ``centered``: LayerNorm (mean and rstd); otherwise RMSNorm (rstd only). ``eps`` as in the norm.
    ``partials``: the statistics are not taken from the A stages but from what the GEMM producing
    A wrote (``row_partials_out``) for each of its ``partials`` column tiles of ``partial_cols``
    columns (the last one may be narrower): RMSNorm an (partials, M) fp32 parameter of sums of
    squares, ``Σ_k x[r, k]² = Σ_t P[t, r]``; LayerNorm a (2·partials, M) one of each tile's row
    mean (rows t) and sum of squared deviations M2 (rows partials + t), combined by Chan's rule.
    """

    centered: bool
    eps: float
    partials: int = 0
    partial_cols: int = 0


@dataclass(frozen=True)
class KernelTail:
    """A gather tail's stores (:mod:`.tail`): ``segments`` ``(j0, width, base, stride)``: columns
    ``[j0, j0 + width)`` go to ``base + row·stride + col − j0`` of the flat output of ``size``
    elements; ``value(acc, acc_partner, row, col, stats, k)`` makes the value of range k from the
    accumulators of column col and of col ^ ``half``."""

    segments: tuple[tuple[int, int, int, int], ...]
    half: int
    size: int
    value: Callable[..., PrimExpr]


def _partner_block(jb, half: int):
    """Fragment block (8 columns) holding column ``col ^ half`` for the columns of block ``jb``
    (``half`` a multiple of 8; 0: the block itself)."""
    if half == 0:
        return jb
    hb = half // 8
    return jb + hb - 2 * hb * ((jb // hb) % 2)


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def check(problem: GemmProblem, cfg: GemmConfig, row_stats: RowStats | None = None) -> str | None:
    """Why this kernel cannot compute ``problem`` with ``cfg`` (and ``row_stats``; None: it can)."""
    if problem.in_dtype not in ("float16", "bfloat16"):
        return f"input dtype {problem.in_dtype} (fp16/bf16 only)"
    if problem.k % 8:
        return f"K={problem.k} is not a multiple of 8 (TMA needs 16-byte row strides)"
    if problem.layout == "nn" and problem.n % 8:
        return f"N={problem.n} is not a multiple of 8 (TMA needs 16-byte row strides of B)"
    if problem.n % 2:
        return f"N={problem.n} is odd (the epilogue stores column pairs)"
    # B (N, K) is one TMA box of bn rows (wgmma N: a multiple of 8; 16 kept); B (K, N) comes in
    # 64-column chunks
    if cfg.bm % 64 or cfg.bm > 256 or cfg.bn % (64 if problem.layout == "nn" else 16) or cfg.bn > 256:
        return f"tile {cfg.bm}x{cfg.bn} unsupported ({problem.layout})"
    if cfg.pingpong and cfg.bm * cfg.bn > 128 * 128:
        return f"ping-pong tile {cfg.bm}x{cfg.bn}: one warpgroup holds at most 128x128 accumulators"
    if cfg.wg_rows not in (64, 128) or cfg.bm % cfg.wg_rows or (cfg.wg_rows > 64 and cfg.bn > 128):
        return f"{cfg.wg_rows} rows a warpgroup with a {cfg.bm}x{cfg.bn} tile unsupported"
    if cfg.cluster_m not in (1, 2) or (cfg.cluster_m == 2 and cfg.ctas_per_sm != 1):
        return f"cluster of {cfg.cluster_m} CTAs unsupported (1, or 2 with one CTA per SM)"
    if cfg.cluster_m == 2 and problem.layout == "nn" and (cfg.bn // 64) % 2:
        return f"a CTA pair splits B's 64-column chunks: {cfg.bn // 64} chunks do not halve"
    if cfg.smem_bytes() * cfg.ctas_per_sm > 227 * 1024:
        return (f"{cfg.smem_bytes()} bytes of shared memory per CTA x {cfg.ctas_per_sm} CTAs "
                "exceed 227 KiB")
    if problem.m >= 2**31 or problem.n >= 2**31 or problem.k >= 2**31:
        return "dimension beyond int32"
    if row_stats is not None and cfg.chains > 1:
        return "in-loop row statistics need one 64-row chain per consumer warpgroup"
    if row_stats is not None and cfg.stats_warps and cfg.pingpong:
        return "statistics warps with ping-pong consumers unsupported"
    return None


RowStatLoads = tuple  # (mean, rstd) of a fragment row: the kernel's loads of its statistics
# ``store_value(acc, row, col, stats, loads=None)``: the value stored at C[row, col] from
# accumulator ``acc``; ``loads``: an epilogue.LoadHook for its parameter loads (the quad store's)
StoreValue = Callable[..., PrimExpr]
# ``pair_value(acc_even, acc_odd, row, col, stats, loads=None)``: C[row, col] of an N/2-wide pair
# epilogue
PairValue = Callable[..., PrimExpr]
_TMA_2D = "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes"
_ALL_LANES = 4294967295


def _plus(a, b):
    """``a + b`` without a term that is the literal 0."""
    if isinstance(a, int) and a == 0:
        return b
    return a if isinstance(b, int) and b == 0 else a + b


def _all(*conds):
    """``c0 and c1 and …`` as TVMScript builds it (tirx.And, left to right); None when empty."""
    out = None
    for cond in conds:
        out = cond if out is None else tirx.And(out, cond)
    return out


def gemm_kernel(problem: GemmProblem, cfg: GemmConfig, params: Sequence[tirx.Buffer],
                a_param: int, b_param: int, c_param: int, store_value: StoreValue | None = None,
                pair_value: PairValue | None = None,
                row_stats: RowStats | None = None, rows: PrimExpr | None = None,
                row_partials_in: int | None = None,
                row_partials_out: int | None = None,
                partials_centered: bool = False, tail: KernelTail | None = None) -> tirx.PrimFunc:
    """The kernel as a TIRx PrimFunc over ``params`` (the fused function's signature, kept so the
    kernel replaces it in place); A, B, C are the parameters at the given positions.

    ``store_value(acc, row, col, stats)`` builds the value stored at ``C[row, col]`` from the
    accumulator element ``acc`` (default: the cast to C's dtype); ``stats`` is ``(mean, rstd)`` of
    the row with ``row_stats``, else None. ``pair_value(acc_even, acc_odd, row, col, stats)``
    instead makes C (M, N/2) with ``C[row, col]`` computed from the accumulators of GEMM columns
    ``2·col`` and ``2·col + 1``.

    ``rows``: a symbolic M (A's and C's row count at run time, at most ``problem.m``). The grid
    and the tiles are laid out for ``problem.m`` rows (a bucket's upper bound); at run time the
    tensor map, the raster and the store masks take ``rows``, so a CTA's tiles past the last row
    are never started (they are the trailing ones of its tile sequence: no gap in the barrier
    phases).

    ``row_partials_in``: the position of ``row_stats.partials``' (partials, M) fp32 parameter.
    ``row_partials_out``: the position of an (⌈N / BN⌉, M) fp32 output: entry ``[t, r]`` is the sum
    of squares of the values this kernel stores in row r of column tile t (the module doc's
    *producer statistics*); plain 16-bit outputs with the quad store only. ``partials_centered``:
    a (2·⌈N / BN⌉, M) output of the tile rows' mean and M2 instead (LayerNorm).

    ``tail`` (a :class:`KernelTail`): C is a flat output the quad store writes by column range
    (``kernels/gemm/tail.py``), each value made from the thread's accumulators of its own column
    and of column ``col ^ half`` (the same fragment: tiles of a multiple of 2·half columns).
    """
    p = problem
    # 0-d parameters (a scalar tensor in the epilogue) are read through one-element views that the
    # body declares: LowerTIRx flattens a 0-d load into a buffer nothing declares (TVM 0.27)
    scalars = [(b, tirx.decl_buffer((1,), str(b.dtype), name=f"{b.name}_scalar", data=b.data))
               for b in params if len(b.shape) == 0]
    store_value = _reading_scalars(store_value, scalars) if store_value and scalars else store_value
    pair_value = _reading_scalars(pair_value, scalars) if pair_value and scalars else pair_value
    ab = {"float16": "f16", "bfloat16": "bf16"}[p.in_dtype]
    in_dtype, out_dtype = p.in_dtype, p.out_dtype
    trans_b = 1 if p.layout == "nn" else 0
    kt_total = _cdiv(p.k, BK)
    last_kt = kt_total - 1
    tiles_m, tiles_n = _cdiv(p.m, cfg.bm), _cdiv(p.n, cfg.bn)
    a_stage = cfg.bm * BK * 2
    stage_bytes = a_stage + cfg.bn * BK * 2
    stage_elems, b_base = stage_bytes // 2, a_stage // 2
    stages, stages_m1 = cfg.stages, cfg.stages - 1
    acc_n = cfg.bn // 2  # fp32 accumulators per consumer thread and 64-row chain (64 x BN / 128)
    sub = cfg.chains
    if row_stats and sub > 1:
        raise ValueError("in-loop row statistics need one 64-row chain per consumer warpgroup")
    if sub > 2:
        raise ValueError(f"{sub} accumulator chains per warpgroup (at most 2)")
    cl = cfg.cluster_m
    if p.layout == "nt":  # B smem: BN rows of 128 B (K-major)
        b_dim0, b_dim1, b_box0, b_box1 = p.k, p.n, BK, cfg.bn // cl
        b_lbo, b_sbo, b_kstep = 1, 64, 32  # 16-byte units; K step of 16 elements = 32 bytes
    else:  # BN/64 chunks of [64 k][64 n]
        b_dim0, b_dim1, b_box0, b_box1 = p.n, p.k, 64, BK
        b_lbo, b_sbo, b_kstep = (64 * BK * 2) // 16, 64, 16 * 128  # 16 K rows of 128 B
    value = store_value or (lambda acc, row, col, stats: T.Cast(out_dtype, acc))
    a_buf, b_buf, c_buf = params[a_param], params[b_param], params[c_param]
    c_cols = p.n // 2 if pair_value else p.n
    n_out = p.n // 2
    # a cluster of cl CTAs owns cl row tiles of one column tile: "tiles" counts those units
    units_m = _cdiv(tiles_m, cl)
    tiles = units_m * tiles_n
    grid = min(tiles, cfg.num_sms * cfg.ctas_per_sm // cl) if cfg.persistent else tiles
    rounds = _cdiv(tiles, grid)  # tiles per CTA (the last round may be partial)
    group = max(1, min(cfg.group_m // cl, units_m))
    in_group = group * tiles_n
    vector_pair = (cfg.vector_store and not pair_value) or bool(pair_value and cfg.pair_shuffle)
    pair_align = max(4, 2 * (8 if out_dtype.endswith("64") else 4 if out_dtype.endswith("32")
                             else 2))
    guard_full = not cfg.unguarded_full_tiles
    all_tiles_full = rows is None and p.m % cfg.bm == 0 and p.n % cfg.bn == 0
    # M at run time (int32 in the device code) and what depends on it
    m_rows = p.m if rows is None else rows
    m_dev = p.m if rows is None else tirx.Cast("int32", rows)
    units_m_dev = units_m if rows is None else _cdiv(_cdiv(m_dev, cfg.bm), cl)
    tiles_dev = tiles if rows is None else units_m_dev * tiles_n
    m_ragged = rows is not None or p.m % cfg.bm != 0
    has_stats = row_stats is not None
    centered = has_stats and row_stats.centered
    from_partials = has_stats and row_stats.partials > 0
    if from_partials and (row_partials_in is None or cfg.stats_warps
                          or (centered and row_stats.partial_cols <= 0)):
        raise ValueError("statistics from partial sums: a parameter, the producer's tile width, "
                         "no statistics warps")
    n_part = row_stats.partials if from_partials else 0
    p_cols = row_stats.partial_cols if from_partials else 0
    pin = params[row_partials_in] if from_partials else None
    pout = params[row_partials_out] if row_partials_out is not None else None
    has_pout = pout is not None
    by_warps = has_stats and cfg.stats_warps  # the statistics by two producer warps (module doc)
    if by_warps and cfg.pingpong:
        raise ValueError("statistics warps with ping-pong consumers unsupported")
    stat_rows = cfg.bm // 64  # A rows per statistics thread
    release_count = cfg.release_count + (STATS_THREADS if by_warps else 0)
    eps = row_stats.eps if has_stats else 0.0
    is_pair = pair_value is not None
    n_ranges = len(tail.segments) if tail is not None else 0
    range_end = [j0 + w for j0, w, *_ in tail.segments] if tail is not None else []
    # quad_store: groups of 4 fragment column blocks (8 outputs each: plain j-groups of 8 GEMM
    # columns, pair blocks of 16) stored as 16-byte vectors; the blocks past the last full group
    # keep the narrow stores. Needs 16-bit outputs and rows of a 16-byte multiple.
    quad = (cfg.quad_store and vector_pair and out_dtype in ("float16", "bfloat16")
            and c_cols % 8 == 0)
    blocks = cfg.bn // 16 if is_pair else cfg.bn // 8
    quads = blocks // 4 if quad else 0
    if pout is not None and (is_pair or quads * 4 != blocks):
        raise ValueError("row partial sums need a plain epilogue stored by whole quads")
    if tail is not None and (is_pair or pout is not None or quads * 4 != blocks
                             or cfg.bn % (2 * max(tail.half, 8)) or p.n % cfg.bn
                             or any(j0 % cfg.bn for j0, *_ in tail.segments)
                             or len(tail.segments) > 4):
        raise ValueError("a gather tail needs a plain epilogue stored by whole quads, tiles of a "
                         "multiple of 2 * half columns inside one column range, at most 4 ranges")
    # The plain quad store exchanges the fp32 accumulators and evaluates the epilogue where the
    # 8 outputs land (one row, 8 consecutive columns, inside the store's bounds test): the
    # epilogue's 16-bit operands read there, (M, N) residuals and (N,) biases, load as one 16-byte
    # vector each (`vec_ops`, found by a dry run of ``value``) instead of eight 2-byte loads.
    vec_ops = (_vector_operands(store_value, c_cols, has_stats)
               if quad and not is_pair and store_value is not None and cfg.vector_operands
               and tail is None else [])
    vec_dtype = str(vec_ops[0].dtype) if vec_ops else in_dtype
    tma_load = T.ptx[_TMA_2D]
    tma_multicast = T.ptx[_TMA_2D + ".multicast::cluster"]
    mma = T.ptx[f"wgmma.mma_async.sync.aligned.m64n{cfg.bn}k16.f32.{ab}.{ab}"]
    k_f = float(p.k)
    pad_f = float(kt_total * BK - p.k)  # TMA's zero columns of the last K tile

    def _qi(c, e):
        """Index in ``qv`` of output ``e`` of quad slot ``c``: after the exchange ``qv`` is the
        8 outputs of one block in column order (plain: 2c + e; pair: c + 4e)."""
        return c + 4 * e if is_pair else 2 * c + e

    def first_row(wg):
        """This consumer's first 64-row block of the A stage / tile."""
        if cfg.pingpong:
            return 0
        return (wg - 1) * (cfg.wg_rows // 64) if cfg.wg_rows > 64 else (wg - 1)

    def tile_unit(bid):
        return bid if cl == 1 else bid // cl

    def mine(tile, ti, wg, alternate):
        """This CTA has tile ``tile``; ``alternate`` (ping-pong consumers): and it is warpgroup
        ``wg``'s (alternate tiles)."""
        return _all(tirx.LT(tile, tiles_dev), *([tirx.EQ(ti % 2, wg - 1)] if alternate else []))

    def tile_m0(first_m, tile, gsize, rank):
        mt = first_m + (tile % in_group) % gsize
        return (mt if cl == 1 else mt * cl + rank) * cfg.bm

    def load_b(smem, full, b_map, s, kt, n0, rank):
        """TMA loads of stage ``s``'s B tile (a cluster: this CTA's half, multicast to both)."""
        dst0 = s * stage_elems + b_base
        if p.layout == "nt":
            boxes = [(kt * 64, n0, 0)] if cl == 1 else [
                (kt * 64, n0 + rank * (cfg.bn // 2), rank * (cfg.bn // 2 * BK * 2))]
        else:
            half = cfg.bn // 64 // cl  # 64-column chunks this CTA loads
            boxes = [(_plus(n0, j * 64), kt * 64, j * 64 * BK * 2) if cl == 1 else
                     (n0 + (rank * half + j) * 64, kt * 64, (rank * half + j) * (64 * BK * 2))
                     for j in range(half)]
        for c0, c1, off in boxes:
            args = (T.cuda.cvta_generic_to_shared(smem.ptr_to([dst0 + off // 2])),
                    T.address_of(b_map), c0, c1, T.cuda.cvta_generic_to_shared(full.ptr_to([s])))
            if cl == 1:
                T.evaluate(tma_load(*args))
            else:  # the same smem offset and barrier in every CTA of the cluster (mask: all)
                T.evaluate(tma_multicast(*args, T.uint16((1 << cl) - 1)))

    def wgmma(acc, desc_a, desc_b, s, kk):
        """One k16 step of every accumulator chain u (rows 64u.., 8 KiB further into the A stage)."""
        for u in range(sub):
            a_off = s * stage_bytes + kk * 32
            if u:
                a_off = a_off + u * 64 * BK * 2
            T.evaluate(mma(*[acc[u * acc_n + i] for i in range(acc_n)],
                           desc_a[0] + T.uint64(a_off // 16),
                           desc_b[0] + T.uint64((s * stage_bytes + kk * b_kstep) // 16),
                           True, 1, 1, 0, trans_b))

    def release_guarded(cond):
        return cond is not None or cfg.warp_release

    def release_guard(cond, tx):
        return _all(*([cond] if cond is not None else []),
                    *([tirx.EQ(tx % 32, 0)] if cfg.warp_release else []))

    def stage_row(s, wg, tx):
        """Row ``t / 2`` of this warpgroup's 64 A rows in stage ``s`` (element offset)."""
        return s * stage_elems + first_row(wg) * (64 * BK) + ((tx % 128) // 2) * BK

    def row_stat_loads(rstat, h):
        return None if rstat is None else (rstat[h * 2], rstat[h * 2 + 1])

    def inside(guarded, row, col):
        """(row, col) for a pair value computed before the bounds test (its lanes shuffle):
        clamped into (M, N/2) in a bounds-tested tile, so the epilogue's own loads stay inside
        their buffers; that value is never stored."""
        if not guarded:
            return row, col
        return T.min(row, m_dev - 1), T.min(col, n_out - 1)

    def tile_inside(m0, n0):
        """The tile lies inside (M, N) (only asked when some tile does not)."""
        return _all(*([tirx.LE(m0 + cfg.bm, m_dev)] if m_ragged else []),
                    *([tirx.LE(n0 + cfg.bn, p.n)] if p.n % cfg.bn else []))

    def launch_bounds():
        """``ctas_per_sm > 1``: the device body sits in a launch-bounds attr
        (``__launch_bounds__(threads, ctas_per_sm)``: ptxas keeps the registers for co-residence)."""
        if cfg.ctas_per_sm > 1:
            return T.attr(0, "tirx.launch_bounds_min_blocks_per_sm", cfg.ctas_per_sm)
        return contextlib.nullcontext()

    @T.prim_func(check_well_formed=False)
    def kernel():
        T.func_attr({"tirx.noalias": True})
        C2 = T.decl_buffer((m_rows, c_cols), out_dtype, data=c_buf.data)
        CT = T.decl_buffer((tail.size if tail is not None else 1,), out_dtype, data=c_buf.data)
        # host: tensor maps (dims innermost first, byte strides, box, element strides, interleave,
        # swizzle, L2 promotion 256 B, OOB fill zeros)
        A_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", A_map, in_dtype, 2, a_buf.data,
                      p.k, m_rows, p.k * 2, BK, cfg.bm, 1, 1, 0, SW128, 2, 0)
        B_map: T.let[T.handle("tensormap")] = T.tvm_stack_alloca("tensormap", 1)
        T.call_packed("runtime.cuTensorMapEncodeTiled", B_map, in_dtype, 2, b_buf.data,
                      b_dim0, b_dim1, b_dim0 * 2, b_box0, b_box1, 1, 1, 0, SW128, 2, 0)
        T.device_entry()
        with launch_bounds():
            bid = T.cta_id([grid * cl])
            if cl > 1:
                rank = T.cta_id_in_cluster([cl])
            else:
                rank = T.meta_var(None)
            tx = T.thread_id([cfg.threads])
            smem = T.alloc_buffer((stages * stage_elems,), in_dtype, scope="shared.dyn", align=1024)
            full = T.alloc_shared([stages], "uint64")
            empty = T.alloc_shared([stages], "uint64")
            if cfg.pingpong:  # turn[i]: warpgroup i + 1 may start its next main loop
                turn = T.alloc_shared([2], "uint64")
            if by_warps:
                sbar = T.alloc_shared([2], "uint64")  # stats_ready, stats_free
                rowstat = T.alloc_shared([2 * cfg.bm], "float32")  # the tile rows' mean, rstd

            @T.inline
            def tile_loop(body, alternate):
                # this CTA's tiles; m0, n0 = the tile's origin (grouped raster)
                for ti in T.serial(rounds):
                    tile = tile_unit(bid) + ti * grid
                    if mine(tile, ti, wg, alternate):
                        first_m = (tile // in_group) * group
                        gsize = T.min(units_m_dev - first_m, group)
                        m0 = tile_m0(first_m, tile, gsize, rank)
                        n0 = ((tile % in_group) // gsize) * cfg.bn
                        body(ti, m0, n0)

            wg = tx // 128

            @T.inline
            def row_add(acc, o, x8):
                # the 8 halves of x8 into a row's sums at acc[o:]: LayerNorm s1 += Σ(x − c),
                # s2 += Σ(x − c)² with the shift c = acc[o + 2]; RMSNorm s2 += Σx² (module doc)
                for v in T.unroll(8):
                    if centered:
                        acc[o] = acc[o] + (T.Cast("float32", x8[v]) - acc[o + 2])
                        acc[o + 1] = acc[o + 1] + (T.Cast("float32", x8[v]) - acc[o + 2]) * (
                            T.Cast("float32", x8[v]) - acc[o + 2])
                    else:
                        acc[o + 1] = acc[o + 1] + T.Cast("float32", x8[v]) * T.Cast(
                            "float32", x8[v])

            @T.inline
            def row_finish(acc, o):
                # a row's sums at acc[o:] → acc[o] = mean, acc[o + 1] = rstd (module doc)
                if centered:
                    if pad_f != 0:  # TMA's zero columns: P terms (0 − c) and (0 − c)² came in
                        acc[o] = acc[o] + T.float32(pad_f) * acc[o + 2]
                        acc[o + 1] = acc[o + 1] - T.float32(pad_f) * acc[o + 2] * acc[o + 2]
                    acc[o] = acc[o] / T.float32(k_f)  # mean − c
                    acc[o + 1] = T.rsqrt(T.max(acc[o + 1] / T.float32(k_f) - acc[o] * acc[o],
                                               T.float32(0)) + T.float32(eps))
                    acc[o] = acc[o] + acc[o + 2]
                else:
                    acc[o + 1] = T.rsqrt(acc[o + 1] / T.float32(k_f) + T.float32(eps))
            if tx == 0:
                # the descriptors' first TMA use would fetch them from the kernel parameters
                T.ptx.prefetch.tensormap(T.address_of(A_map))
                T.ptx.prefetch.tensormap(T.address_of(B_map))
                for s in T.unroll(stages):
                    T.ptx.mbarrier.init.shared.b64(T.cuda.cvta_generic_to_shared(
                        full.ptr_to([s])), T.uint32(1))
                    T.ptx.mbarrier.init.shared.b64(T.cuda.cvta_generic_to_shared(
                        empty.ptr_to([s])), T.uint32(release_count))
                if by_warps:
                    T.ptx.mbarrier.init.shared.b64(T.cuda.cvta_generic_to_shared(
                        sbar.ptr_to([0])), T.uint32(STATS_THREADS))
                    T.ptx.mbarrier.init.shared.b64(T.cuda.cvta_generic_to_shared(
                        sbar.ptr_to([1])), T.uint32(cfg.consumers * WG))
                if cfg.pingpong:
                    for i in T.unroll(2):
                        T.ptx.mbarrier.init.shared.b64(T.cuda.cvta_generic_to_shared(
                            turn.ptr_to([i])), T.uint32(1))
            T.ptx.fence.mbarrier_init.release.cluster()
            # a cluster: the peer's TMA and stage releases reach this CTA's barriers once both
            # initialised
            if cl > 1:
                T.cuda.cluster_sync()
            else:
                T.cuda.cta_sync()
            # Launched programmatically (rules/programmatic_launch.py), the setup above overlaps
            # the predecessor's tail; nothing it wrote (A, the epilogue's inputs, C's memory) is
            # touched before this wait. The successor may launch now: its CTAs find room only as
            # this kernel's CTAs exit (a CTA holds the SM's registers). Plain launches: no-ops.
            T.ptx.griddepcontrol.wait()
            T.ptx.griddepcontrol.launch_dependents()
            if wg == 0:
                T.ptx["setmaxnreg.dec.sync.aligned.u32"](cfg.producer_regs)

                @T.inline
                def produce(ti, m0, n0):
                    for kt in T.serial(kt_total):
                        g = ti * kt_total + kt  # k-tiles issued before this one
                        s = g % stages
                        if g >= stages:
                            T.cuda.mbarrier_wait(empty.ptr_to([s]), (g // stages + 1) % 2)
                        T.ptx.mbarrier.arrive.expect_tx.shared.b64(
                            T.cuda.cvta_generic_to_shared(full.ptr_to([s])), T.uint32(stage_bytes))
                        tma_load(T.cuda.cvta_generic_to_shared(smem.ptr_to([s * stage_elems])),
                                 T.address_of(A_map), kt * 64, m0,
                                 T.cuda.cvta_generic_to_shared(full.ptr_to([s])))
                        load_b(smem, full, B_map, s, kt, n0, rank)

                if by_warps:
                    xs = T.alloc_buffer((8,), in_dtype, scope="local", align=16)
                    ssum = T.alloc_buffer((stat_rows * 3,), "float32", scope="local")  # s1, s2, c

                @T.inline
                def stats_produce(ti, m0, n0):
                    # statistics thread st sums rows st + 64·i of every A stage of the tile
                    st = tx - (WG - STATS_THREADS)
                    for i in T.unroll(stat_rows * 3):
                        ssum[i] = T.float32(0)
                    for kt in T.serial(kt_total):
                        g = ti * kt_total + kt
                        s = g % stages
                        T.cuda.mbarrier_wait(full.ptr_to([s]), (g // stages) % 2)
                        for i in T.unroll(stat_rows):
                            row_at = T.meta_var(s * stage_elems + (st + i * 64) * BK)
                            if centered:  # shift: the row's first stored element (first K tile)
                                if kt == 0:
                                    ssum[i * 3 + 2] = T.Cast("float32", smem[row_at])
                            for q in T.unroll(8):
                                # physical chunk q ^ (row % 8): 8 consecutive rows, 8 bank groups
                                xs[T.Ramp(0, 1, 8)] = smem[T.Ramp(
                                    row_at + T.bitwise_xor(q, st % 8) * 8, 1, 8)]
                                row_add(ssum, i * 3, xs)
                        T.ptx.mbarrier.arrive.shared.b64(
                            T.cuda.cvta_generic_to_shared(empty.ptr_to([s])))
                    for i in T.unroll(stat_rows):
                        row_finish(ssum, i * 3)
                    if ti > 0:  # the consumers have read the previous tile's
                        T.cuda.mbarrier_wait(sbar.ptr_to([1]), (ti - 1) % 2)
                    for i in T.unroll(stat_rows):
                        rowstat[st + i * 64] = ssum[i * 3]
                        rowstat[cfg.bm + st + i * 64] = ssum[i * 3 + 1]
                    T.ptx.mbarrier.arrive.shared.b64(T.cuda.cvta_generic_to_shared(sbar.ptr_to([0])))

                if tx == 0:
                    tile_loop(produce, False)
                    if cl > 1 and not cfg.exit_cluster_sync:
                        # No CTA may exit while its peer can still arrive on its barriers: the
                        # peer's consumers free this CTA's stages remotely. Wait for the release
                        # of every stage's last use (both CTAs' arrivals complete the phase);
                        # the peer's multicast loads into this CTA all land on full barriers its
                        # own consumers waited for. A cluster barrier at the exit would instead
                        # be a release: it waits for every epilogue store to be acknowledged.
                        issued = T.max(0, T.min(rounds, (tiles_dev - tile_unit(bid) + grid - 1)
                                                // grid)) * kt_total
                        for s in T.unroll(stages):
                            if issued > s:
                                T.cuda.mbarrier_wait(empty.ptr_to([s]), (
                                    (s + (issued - 1 - s) // stages * stages) // stages) % 2)
                if by_warps and tx >= WG - STATS_THREADS:
                    tile_loop(stats_produce, False)
            else:
                T.ptx["setmaxnreg.inc.sync.aligned.u32"](cfg.consumer_regs)
                acc = T.alloc_buffer((acc_n * sub,), "float32", scope="local")
                desc_a = T.alloc_buffer((1,), "uint64", scope="local")
                desc_b = T.alloc_buffer((1,), "uint64", scope="local")
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_a[0]),
                                                      smem.ptr_to([first_row(wg) * 4096]), 1, 64,
                                                      SW128)
                T.cuda.wgmma.encode_matrix_descriptor(T.address_of(desc_b[0]),
                                                      smem.ptr_to([b_base]), b_lbo, b_sbo, SW128)
                if vector_pair:
                    pair = T.alloc_buffer((2,), out_dtype, scope="local", align=pair_align)
                if quad:
                    qv = T.alloc_buffer((8,), out_dtype, scope="local", align=16)
                    qa = T.alloc_buffer((8,), "float32", scope="local")  # plain quads: exchanged
                    ov = T.alloc_buffer((8 * max(1, len(vec_ops)),), vec_dtype, scope="local",
                                        align=16)
                if has_stats and not by_warps:
                    xv = T.alloc_buffer((8,), in_dtype, scope="local", align=16)
                    rsum = T.alloc_buffer((3,), "float32", scope="local")  # s1, s2, shift c
                if has_pout:
                    # rows h: Σ stored² (RMSNorm), or (n, mean, M2) at 3h and a chunk's (mean, M2)
                    psum = T.alloc_buffer((6 if partials_centered else 2,), "float32", scope="local")
                if has_pout and partials_centered:
                    pch = T.alloc_buffer((2,), "float32", scope="local")
                if has_stats:
                    rstat = T.alloc_buffer((4,), "float32", scope="local")  # mean, rstd
                else:
                    rstat = T.meta_var(None)
                if cl > 1:  # the peer CTA's empty barriers in the cluster's shared window
                    peer_empty = T.alloc_buffer((1,), "uint32", scope="local")
                    T.ptx.mapa.shared__cluster.u32(peer_empty[0], T.cuda.cvta_generic_to_shared(
                        empty.ptr_to([0])), T.uint32(rank ^ 1))

                @T.inline
                def arrive(stage):
                    T.ptx.mbarrier.arrive.shared.b64(T.cuda.cvta_generic_to_shared(empty.ptr_to([stage])))
                    if cl > 1:
                        T.ptx.mbarrier.arrive.shared__cluster.b64(peer_empty[0] + T.uint32(stage * 8))

                @T.inline
                def release(stage, cond):
                    # free ``stage`` for the producers: this CTA's empty barrier and, in a cluster, the
                    # peer's (its producer multicasts into this CTA's copy); every thread or a lane a warp
                    if release_guarded(cond):
                        if release_guard(cond, tx):
                            arrive(stage)
                    else:
                        arrive(stage)

                @T.inline
                def stats_accumulate(s, kt):
                    # thread t adds half t % 2 of row t / 2 of its warpgroup's 64 A rows of stage s
                    if centered:  # shift: the row's first stored element (first K tile)
                        if kt == 0:
                            rsum[2] = T.Cast("float32", smem[stage_row(s, wg, tx)])
                    # physical 16-byte chunk ((t % 2)·4 + q) ^ (row % 8): the 8 lanes of one
                    # shared-memory phase read 8 different chunks (all 32 banks); the pair t, t^1
                    # still covers the row's 8 chunks
                    for q in T.unroll(4):
                        xv[T.Ramp(0, 1, 8)] = smem[T.Ramp(stage_row(s, wg, tx) + T.bitwise_xor(
                            (tx % 2) * 4 + q, ((tx % 128) // 2) % 8) * 8, 1, 8)]
                        row_add(rsum, 0, xv)

                @T.inline
                def stats_finish():
                    # combine the two half rows, form (mean, rstd), and give each thread the
                    # statistics of its fragment rows 16·(t/32) + (t%32)/4 (+ 8), summed by lanes
                    # 2·((t%32)/4) (+ 16)
                    if centered:
                        rsum[0] = rsum[0] + T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES), rsum[0], 1, 32)
                    rsum[1] = rsum[1] + T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES), rsum[1], 1, 32)
                    row_finish(rsum, 0)
                    for h in T.unroll(2):
                        if centered:
                            rstat[h * 2] = T.cuda.__shfl_sync(T.uint32(_ALL_LANES), rsum[0],
                                                              ((tx % 32) // 4) * 2 + h * 16, 32)
                        rstat[h * 2 + 1] = T.cuda.__shfl_sync(T.uint32(_ALL_LANES), rsum[1],
                                                              ((tx % 32) // 4) * 2 + h * 16, 32)

                @T.inline
                def stats_fetch(ti):
                    # (mean, rstd) of this thread's fragment rows, from the statistics warps
                    T.cuda.mbarrier_wait(sbar.ptr_to([0]), ti % 2)
                    for h in T.unroll(2):
                        r = first_row(wg) * 64 + ((tx % 128) // 32) * 16 + (tx % 32) // 4 + h * 8
                        if centered:
                            rstat[h * 2] = rowstat[r]
                        rstat[h * 2 + 1] = rowstat[cfg.bm + r]
                    T.ptx.mbarrier.arrive.shared.b64(T.cuda.cvta_generic_to_shared(sbar.ptr_to([1])))

                @T.inline
                def stats_from_partials(row0):
                    # (mean,) rstd of this thread's fragment rows row0 (+ 8) from the producer's
                    # partials (rows past M read row M − 1: never stored). LayerNorm: tile q's
                    # (mean, M2) over its n_q columns joins the n = q·cols before it (Chan).
                    for h in T.unroll(2):
                        if centered:
                            rsum[0] = T.float32(0)
                        rsum[1] = T.float32(0)
                        for q in T.unroll(n_part):
                            if centered:
                                n_q = T.Cast("float32", T.min(p_cols, p.k - q * p_cols))
                                n_b = T.Cast("float32", q * p_cols)
                                delta = pin[q, T.min(row0 + h * 8, m_dev - 1)] - rsum[0]
                                rsum[0] = rsum[0] + delta * n_q / (n_b + n_q)
                                rsum[1] = rsum[1] + pin[n_part + q, T.min(row0 + h * 8, m_dev - 1)] \
                                    + delta * delta * n_b * n_q / (n_b + n_q)
                            else:
                                rsum[1] = rsum[1] + pin[q, T.min(row0 + h * 8, m_dev - 1)]
                        if centered:
                            rstat[h * 2] = rsum[0]
                            rstat[h * 2 + 1] = T.rsqrt(T.max(rsum[1] / T.float32(k_f), T.float32(0))
                                                       + T.float32(eps))
                        else:
                            rstat[h * 2 + 1] = T.rsqrt(rsum[1] / T.float32(k_f) + T.float32(eps))

                @T.inline
                def quad_join(h, lanes):
                    # (n, mean, M2) of rows h joined with lane t ^ lanes' (Chan; n may be 0)
                    n_o = T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES), psum[h * 3], lanes, 32)
                    mean_o = T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES), psum[h * 3 + 1], lanes, 32)
                    m2_o = T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES), psum[h * 3 + 2], lanes, 32)
                    w = n_o / T.max(psum[h * 3] + n_o, T.float32(1))
                    delta = mean_o - psum[h * 3 + 1]
                    psum[h * 3 + 1] = psum[h * 3 + 1] + delta * w
                    psum[h * 3 + 2] = psum[h * 3 + 2] + m2_o + delta * delta * psum[h * 3] * w
                    psum[h * 3] = psum[h * 3] + n_o

                @T.inline
                def partials_store(row0, n0):
                    # the quad's four lanes hold one row's outputs: join them, lane 0 stores
                    for h in T.unroll(2):
                        if partials_centered:
                            quad_join(h, 1)
                            quad_join(h, 2)
                            if tx % 4 == 0:
                                if row0 + h * 8 < m_dev:
                                    pout[n0 // cfg.bn, row0 + h * 8] = psum[h * 3 + 1]
                                    pout[tiles_n + n0 // cfg.bn, row0 + h * 8] = psum[h * 3 + 2]
                        else:
                            psum[h] = psum[h] + T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES),
                                                                       psum[h], 1, 32)
                            psum[h] = psum[h] + T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES),
                                                                       psum[h], 2, 32)
                            if tx % 4 == 0:
                                if row0 + h * 8 < m_dev:
                                    pout[n0 // cfg.bn, row0 + h * 8] = psum[h]

                @T.inline
                def consume(ti, m0, n0):
                    if cfg.pingpong:
                        # Main loops alternate: warpgroup w starts tile ti once the other one has
                        # passed every full-barrier wait of tile ti - 1. Without this order a
                        # warpgroup waiting for a stage's phase two ahead of the barrier's would
                        # pass on the parity of the older phase.
                        if ti > 0:
                            T.cuda.mbarrier_wait(turn.ptr_to([wg - 1]), ((ti - 1) // 2) % 2)
                    for i in T.unroll(acc_n * sub):
                        acc[i] = T.float32(0)
                    if has_stats and not by_warps and not from_partials:
                        rsum[0] = T.float32(0)
                        rsum[1] = T.float32(0)
                        rsum[2] = T.float32(0)
                    for kt in T.serial(kt_total):
                        g = ti * kt_total + kt
                        s = g % stages
                        T.cuda.mbarrier_wait(full.ptr_to([s]), (g // stages) % 2)
                        T.ptx.wgmma.fence.sync.aligned()
                        for kk in T.unroll(BK // 16):
                            wgmma(acc, desc_a, desc_b, s, kk)
                        T.ptx.wgmma.commit_group.sync.aligned()
                        if has_stats and not by_warps and not from_partials:
                            stats_accumulate(s, kt)  # while the wgmmas run: this thread's half row
                        T.ptx.wgmma.wait_group.sync.aligned(1)
                        release((g + stages_m1) % stages, kt > 0)
                    if cfg.pingpong:  # one thread past the last full wait of this tile: the other's turn
                        if tx % 128 == 0:
                            T.ptx.mbarrier.arrive.shared.b64(T.cuda.cvta_generic_to_shared(
                                turn.ptr_to([2 - wg])))
                    T.ptx.wgmma.wait_group.sync.aligned(0)
                    release((ti * kt_total + last_kt) % stages, None)
                    # epilogue: fragment -> global, rows/cols masked (N even: a pair is in or out
                    # as a whole)
                    t = tx % 128

                    @T.inline
                    def store_plain(u_acc, row0, guarded):
                        # a column pair per thread
                        for j in T.unroll(quads * 4, cfg.bn // 8):
                            col = n0 + j * 8 + (t % 4) * 2
                            for h in T.unroll(2):
                                if guarded:
                                    if row0 + h * 8 < m_dev and col < p.n:
                                        store_pair(u_acc, row0, j, h, col)
                                else:
                                    store_pair(u_acc, row0, j, h, col)

                    @T.inline
                    def store_pair(u_acc, row0, j, h, col):
                        if is_pair:
                            C2[row0 + h * 8, col // 2] = pair_value(
                                acc[_plus(u_acc, j * 4) + h * 2], acc[_plus(u_acc, j * 4) + h * 2 + 1],
                                row0 + h * 8, col // 2, row_stat_loads(rstat, h))
                        elif cfg.vector_store:
                            pair[0] = value(acc[_plus(u_acc, j * 4) + h * 2 + 0], row0 + h * 8,
                                            col + 0, row_stat_loads(rstat, h))
                            pair[1] = value(acc[_plus(u_acc, j * 4) + h * 2 + 1], row0 + h * 8,
                                            col + 1, row_stat_loads(rstat, h))
                            C2[row0 + h * 8, T.Ramp(col, 1, 2)] = pair[T.Ramp(0, 1, 2)]
                        else:
                            C2[row0 + h * 8, col + 0] = value(acc[_plus(u_acc, j * 4) + h * 2 + 0],
                                                              row0 + h * 8, col + 0,
                                                              row_stat_loads(rstat, h))
                            C2[row0 + h * 8, col + 1] = value(acc[_plus(u_acc, j * 4) + h * 2 + 1],
                                                              row0 + h * 8, col + 1,
                                                              row_stat_loads(rstat, h))

                    @T.inline
                    def store_pair_shuffle(u_acc, row0, guarded):
                        # For fragment columns j = 2q and 2q + 1 lane r = t % 4 of a quad holds
                        # outputs v0 at column 8q + r and v1 at 8q + 4 + r (relative to n0 / 2).
                        # One shfl.xor 1 (odd lanes send v0, even lanes v1) gives even lanes the
                        # pair (v0, partner's v0) at 8q + r and odd lanes (partner's v1, v1) at
                        # 8q + r + 3; every lane shuffles (guarded: masked at the store only).
                        r = t % 4
                        for q in T.unroll(quads * 4, cfg.bn // 16):
                            for h in T.unroll(2):
                                row = row0 + h * 8
                                c0 = n0 // 2 + q * 8 + r
                                v0 = pair_value(acc[_plus(u_acc, q * 8) + h * 2],
                                                acc[_plus(u_acc, q * 8) + h * 2 + 1],
                                                *inside(guarded, row, c0),
                                                row_stat_loads(rstat, h))
                                v1 = pair_value(acc[_plus(u_acc, q * 8) + 4 + h * 2],
                                                acc[_plus(u_acc, q * 8) + 4 + h * 2 + 1],
                                                *inside(guarded, row, c0 + 4),
                                                row_stat_loads(rstat, h))
                                other = T.cuda.__shfl_xor_sync(T.uint32(_ALL_LANES),
                                                               T.Select(r % 2 == 1, v0, v1), 1, 32)
                                pair[0] = T.Select(r % 2 == 0, v0, other)
                                pair[1] = T.Select(r % 2 == 0, other, v1)
                                c = c0 + (r % 2) * 3
                                if guarded:
                                    if row < m_dev and c < n_out:
                                        C2[row, T.Ramp(c, 1, 2)] = pair[T.Ramp(0, 1, 2)]
                                else:
                                    C2[row, T.Ramp(c, 1, 2)] = pair[T.Ramp(0, 1, 2)]

                    @T.inline
                    def quad_exchange(xv):
                        # 4 x 4 transpose within the quad: slot c of lane q <- slot q of lane c.
                        # xor 2 swaps the off-diagonal 2 x 2 blocks, xor 1 the off-diagonal
                        # elements of each block; a lane sends the slot its partner needs.
                        hi = (t % 4) // 2 == 1
                        odd = t % 2 == 1
                        for c in T.unroll(2):
                            for e in T.unroll(2):
                                got = T.cuda.__shfl_xor_sync(
                                    T.uint32(_ALL_LANES),
                                    T.Select(hi, xv[_qi(c, e)], xv[_qi(c + 2, e)]), 2, 32)
                                xv[_qi(c, e)] = T.Select(hi, got, xv[_qi(c, e)])
                                xv[_qi(c + 2, e)] = T.Select(hi, xv[_qi(c + 2, e)], got)
                        for cc in T.unroll(2):
                            for e in T.unroll(2):
                                got = T.cuda.__shfl_xor_sync(
                                    T.uint32(_ALL_LANES),
                                    T.Select(odd, xv[_qi(2 * cc, e)], xv[_qi(2 * cc + 1, e)]), 1, 32)
                                xv[_qi(2 * cc, e)] = T.Select(odd, got, xv[_qi(2 * cc, e)])
                                xv[_qi(2 * cc + 1, e)] = T.Select(odd, xv[_qi(2 * cc + 1, e)], got)

                    @T.inline
                    def finish_quad(row, col, h):
                        # C[row, col:col + 8]: pair quads exchanged their outputs; plain ones their
                        # accumulators, which become the 8 outputs here
                        if is_pair:
                            C2[row, T.Ramp(col, 1, 8)] = qv[T.Ramp(0, 1, 8)]
                        else:
                            finish_plain(row, col, h)

                    @T.inline
                    def finish_plain(row, col, h):
                        if len(vec_ops) > 0:
                            ov[T.Ramp(0, 1, 8)] = _vector_load(vec_ops[0], row, col)
                        if len(vec_ops) > 1:
                            ov[T.Ramp(8, 1, 8)] = _vector_load(vec_ops[1], row, col)
                        if len(vec_ops) > 2:
                            ov[T.Ramp(16, 1, 8)] = _vector_load(vec_ops[2], row, col)
                        for e in T.unroll(8):
                            qv[e] = _value_at(value, qa[e], row, col, e, row_stat_loads(rstat, h),
                                              vec_ops, ov)
                            if has_pout and not partials_centered:
                                psum[h] = psum[h] + T.Cast("float32", qv[e]) * T.Cast("float32",
                                                                                      qv[e])
                        if has_pout and partials_centered:
                            # the 8 outputs' (mean, M2), joined to the row's (n, mean, M2) (Chan)
                            pch[0] = T.float32(0)
                            for e in T.unroll(8):
                                pch[0] = pch[0] + T.Cast("float32", qv[e])
                            pch[0] = pch[0] * T.float32(0.125)
                            pch[1] = T.float32(0)
                            for e in T.unroll(8):
                                pch[1] = pch[1] + (T.Cast("float32", qv[e]) - pch[0]) * (
                                    T.Cast("float32", qv[e]) - pch[0])
                            delta = pch[0] - psum[h * 3 + 1]
                            psum[h * 3 + 1] = psum[h * 3 + 1] + delta * T.float32(8) / (
                                psum[h * 3] + T.float32(8))
                            psum[h * 3 + 2] = psum[h * 3 + 2] + pch[1] + delta * delta * psum[
                                h * 3] * T.float32(8) / (psum[h * 3] + T.float32(8))
                            psum[h * 3] = psum[h * 3] + T.float32(8)
                        C2[row, T.Ramp(col, 1, 8)] = qv[T.Ramp(0, 1, 8)]

                    @T.inline
                    def store_quads(u_acc, row0, guarded):
                        # Slot c of lane r = t % 4 holds its two outputs of block 4g + c (plain:
                        # columns 2r, 2r + 1 of GEMM columns 8(4g + c)..; pair: outputs r and
                        # 4 + r of pair block 4g + c); after the exchange lane r holds all 8 of
                        # block 4g + r in order and stores them as one 16-byte vector.
                        r = t % 4
                        for g in T.unroll(quads):
                            for h in T.unroll(2):
                                row = row0 + h * 8
                                for c in T.unroll(4):
                                    if is_pair:
                                        qb = g * 4 + c
                                        c0 = n0 // 2 + qb * 8 + r
                                        qv[_qi(c, 0)] = pair_value(
                                            acc[_plus(u_acc, qb * 8) + h * 2],
                                            acc[_plus(u_acc, qb * 8) + h * 2 + 1],
                                            *inside(guarded, row, c0), row_stat_loads(rstat, h))
                                        qv[_qi(c, 1)] = pair_value(
                                            acc[_plus(u_acc, qb * 8) + 4 + h * 2],
                                            acc[_plus(u_acc, qb * 8) + 4 + h * 2 + 1],
                                            *inside(guarded, row, c0 + 4),
                                            row_stat_loads(rstat, h))
                                    else:
                                        for e in T.unroll(2):
                                            qa[_qi(c, e)] = acc[_plus(u_acc, (g * 4 + c) * 4)
                                                                + h * 2 + e]
                                col = (n0 // 2 if is_pair else n0) + (g * 4 + r) * 8
                                quad_exchange(qv if is_pair else qa)
                                if guarded:
                                    if row < m_dev and col < c_cols:
                                        finish_quad(row, col, h)
                                else:
                                    finish_quad(row, col, h)

                    @T.inline
                    def tail_quads(u_acc, row0, guarded, k):
                        # as store_quads' plain path, but the values are made before the exchange
                        # (from the own and the partner block's accumulators) and stored at
                        # column range k's place of the flat output
                        r = t % 4
                        for g in T.unroll(quads):
                            for h in T.unroll(2):
                                row = row0 + h * 8
                                for c in T.unroll(4):
                                    for e in T.unroll(2):
                                        qv[_qi(c, e)] = tail.value(
                                            acc[_plus(u_acc, (g * 4 + c) * 4) + h * 2 + e],
                                            acc[_plus(u_acc, _partner_block(g * 4 + c, tail.half)
                                                      * 4) + h * 2 + e],
                                            T.min(row, m_dev - 1) if guarded else row,
                                            n0 + (g * 4 + c) * 8 + r * 2 + e,
                                            row_stat_loads(rstat, h), k)
                                quad_exchange(qv)
                                at = (tail.segments[k][2] - tail.segments[k][0]
                                      + row * tail.segments[k][3] + n0 + (g * 4 + r) * 8)
                                if guarded:
                                    if row < m_dev:
                                        CT[T.Ramp(at, 1, 8)] = qv[T.Ramp(0, 1, 8)]
                                else:
                                    CT[T.Ramp(at, 1, 8)] = qv[T.Ramp(0, 1, 8)]

                    @T.inline
                    def tail_store(u_acc, row0, guarded):
                        # the tile's column range (tiles never straddle one): up to 4, by n0
                        if n_ranges == 1:
                            tail_quads(u_acc, row0, guarded, 0)
                        elif n_ranges == 2:
                            if n0 < range_end[0]:
                                tail_quads(u_acc, row0, guarded, 0)
                            else:
                                tail_quads(u_acc, row0, guarded, 1)
                        elif n_ranges == 3:
                            if n0 < range_end[0]:
                                tail_quads(u_acc, row0, guarded, 0)
                            elif n0 < range_end[1]:
                                tail_quads(u_acc, row0, guarded, 1)
                            else:
                                tail_quads(u_acc, row0, guarded, 2)
                        else:
                            if n0 < range_end[0]:
                                tail_quads(u_acc, row0, guarded, 0)
                            elif n0 < range_end[1]:
                                tail_quads(u_acc, row0, guarded, 1)
                            elif n0 < range_end[2]:
                                tail_quads(u_acc, row0, guarded, 2)
                            else:
                                tail_quads(u_acc, row0, guarded, 3)

                    @T.inline
                    def store(u_acc, row0, guarded):
                        if tail is not None:
                            tail_store(u_acc, row0, guarded)
                        elif quads > 0:
                            store_quads(u_acc, row0, guarded)
                        if tail is None and quads * 4 < blocks:
                            if is_pair and cfg.pair_shuffle:
                                store_pair_shuffle(u_acc, row0, guarded)
                            else:
                                store_plain(u_acc, row0, guarded)

                    @T.inline
                    def epilogue(u_acc, u_row):
                        # chain u: rows 64u further down, accumulators u·acc_n further on
                        row0 = _plus(m0, u_row) + first_row(wg) * 64 + (t // 32) * 16 + (t % 32) // 4
                        if by_warps:
                            stats_fetch(ti)
                        elif from_partials:
                            stats_from_partials(row0)
                        elif has_stats:
                            stats_finish()
                        if has_pout:
                            for i in T.unroll(6 if partials_centered else 2):
                                psum[i] = T.float32(0)
                        # A tile inside (M, N) stores without per-element guards: straight-line
                        # code whose loads (bias, residual) and arithmetic the compiler can
                        # schedule across elements.
                        if guard_full or all_tiles_full:
                            store(u_acc, row0, guard_full)
                        else:
                            if tile_inside(m0, n0):
                                store(u_acc, row0, False)
                            else:
                                store(u_acc, row0, True)
                        if has_pout:
                            partials_store(row0, n0)

                    if sub > 1:
                        for u in T.unroll(sub):
                            epilogue(u * acc_n, u * 64)
                    else:
                        epilogue(0, 0)

                tile_loop(consume, cfg.pingpong)
            if cl > 1 and cfg.exit_cluster_sync:  # the peer may still arrive on our barriers
                T.cuda.cluster_sync()

    body = tirx.SeqStmt([*(tirx.DeclBuffer(view, data=b.data) for b, view in scalars), kernel.body]) \
        if scalars else kernel.body
    return tirx.PrimFunc(list(params), body, attrs=kernel.attrs).without_attr("global_symbol")


def _reading_scalars(value: Callable, scalars: list) -> Callable:
    """``value`` (a store or pair value) with its loads of 0-d parameters ``b[()]`` made loads
    ``view[0]`` of their one-element views (``scalars``: ``[(b, view)]``), after any ``loads``
    hook of the caller."""
    def hooked(*args, loads=None):
        def hook(buf, idx):
            got = loads(buf, idx) if loads is not None else None
            view = next((v for b, v in scalars if b.same_as(buf)), None)
            return got if got is not None or view is None else view[0]

        return value(*args, loads=hook)

    return hooked


def _vector_operands(store_value: StoreValue, c_cols: int, has_stats: bool) -> list:
    """The 16-bit parameters (at most 3, one dtype) that ``store_value`` reads at its output's own
    ``[row, col]`` ((M, N) with N = ``c_cols``) or ``[col]`` ((N,)): a dry run over placeholder
    variables records them."""
    row, col = tirx.Var("row", "int32"), tirx.Var("col", "int32")
    found: list = []

    def record(buf, idx):
        if _lane_index(buf, idx, row, col, c_cols) and not any(buf.same_as(b) for b in found):
            found.append(buf)

    stats = (tirx.Var("mean", "float32"), tirx.Var("rstd", "float32")) if has_stats else None
    store_value(tirx.Var("acc", "float32"), row, col, stats, loads=record)
    found = [b for b in found if str(b.dtype) in ("float16", "bfloat16")]
    return [b for b in found if str(b.dtype) == str(found[0].dtype)][:3] if found else []


def _lane_index(buf, idx, row, col, c_cols: int | None) -> bool:
    """``buf[idx]`` is ``buf[row, col]`` of an (·, c_cols) buffer or ``buf[col]`` of a (c_cols,)
    one (``c_cols`` None: any width): 8 outputs' reads are 16 contiguous bytes, 16-byte aligned."""
    def same(a, b):
        return bool(tvm_ffi.structural_equal(a, b))

    def cols_ok(dim):
        return c_cols is None or (isinstance(dim, (int, tirx.IntImm)) and int(dim) == c_cols)

    if len(idx) == 2:
        return same(idx[0], row) and same(idx[1], col) and cols_ok(buf.shape[1])
    return len(idx) == 1 and same(idx[0], col) and cols_ok(buf.shape[0])


def _vector_load(buf, row, col):
    """The 8 elements of ``buf`` at ``[row, col:col + 8]`` or ``[col:col + 8]`` as one vector.
    ``col`` is a multiple of 8 that codegen cannot see through its let binding: written
    ``col // 8 * 8`` so that it proves the alignment and emits one 16-byte load, not a gather."""
    lanes = T.Ramp(col // 8 * 8, 1, 8)
    return buf[row, lanes] if len(buf.shape) == 2 else buf[lanes]


def _value_at(value: StoreValue, acc, row, col, e, stats, vec_ops: list, ov) -> PrimExpr:
    """``value`` at output ``C[row, col + e]``, a read of vector operand k there replaced by lane
    e of its copy ``ov[8k:8k + 8]``."""
    if not vec_ops:
        return value(acc, row, col + e, stats)

    def lane(buf, idx):
        for k, b in enumerate(vec_ops):
            if b.same_as(buf) and _lane_index(buf, idx, row, col + e, None):
                return ov[k * 8 + e]
        return None

    return value(acc, row, col + e, stats, loads=lane)


def standalone(problem: GemmProblem, cfg: GemmConfig | None = None,
               row_stats: RowStats | None = None, symbolic_m: bool = False) -> tirx.PrimFunc:
    """The kernel as a PrimFunc ``main(A, B, C)`` with ``C = cast(A·B)`` (no epilogue); with
    ``row_stats``, ``C = cast(rstd ⊙ (A·B − mean))`` (LayerNorm) or ``cast(rstd ⊙ A·B)``.
    ``symbolic_m``: A and C have ``m`` rows, a variable bound at the call (≤ ``problem.m``).

    For tests and device probes; the schedule rule builds its kernels from fused PrimFuncs.
    """
    cfg = cfg or GemmConfig()
    p = problem
    rows = tirx.Var("m", "int64") if symbolic_m else None
    m = p.m if rows is None else rows
    b_shape = (p.n, p.k) if p.layout == "nt" else (p.k, p.n)
    params = [tirx.decl_buffer(shape, dtype, name=name, data_alignment=16)
              for name, shape, dtype in (("A", (m, p.k), p.in_dtype), ("B", b_shape, p.in_dtype),
                                         ("C", (m, p.n), p.out_dtype))]
    value = None
    if row_stats is not None:
        def value(acc, row, col, stats, loads=None):  # reads no parameter: ``loads`` unused
            mean, rstd = stats
            return T.Cast(p.out_dtype, ((acc - mean) if row_stats.centered else acc) * rstd)

    func = gemm_kernel(p, cfg, params, 0, 1, 2, value, row_stats=row_stats, rows=rows)
    return func.with_attr("global_symbol", "main")
