"""Weight-streaming GEMV / small-M GEMM (M ≤ 64): ``y[m, n] = f(Σ_k x[m, k] · W[n, k])``.

W is (N, K) row-major (torch's Linear layout), x (M, K); fp16 / bf16 in, fp32 accumulation, any
epilogue ``f`` the caller builds (:mod:`.epilogue`: bias, residual, SiLU·gate pair, row statistics).
At decode each weight element is used M times, so the kernel is a stream of W: it reads W once, in
16-byte vectors straight from global memory into registers (``LDG.E.128``), with many loads in
flight, and keeps x (small, L1/L2-resident) out of the way.

One thread block owns ``rows`` consecutive rows of W (outputs ``n0 .. n0 + rows``); its ``warps``
warps split K between them (split-K inside the block: chunks of K go to the warps in turn, each
warp reading ``unroll`` chunks per iteration), so the grid is ``⌈N / rows⌉`` blocks and ``rows``
is chosen small enough that every SM streams (:func:`pick_config`). Two engines:

* CUDA cores (``mma=False``, M ≤ 8; each weight element feeds M FMAs): a chunk is 256 K values,
  lane l reads ``W[n, k + 8l : +8]`` for every row n of the block and ``x[m, k + 8l : +8]`` for
  every m, accumulates ``acc[m, n]`` in fp32; then a butterfly of ``shfl.xor`` sums the 32 lanes.
* tensor cores (``mma=True``, 8 < M ≤ 64): ``mma.sync.m16n8k16`` with W as the B operand, loaded
  straight from global memory. A chunk is 32 K values; lane t (g = t / 4, q = t % 4) reads the
  16 bytes ``W[n0 + 8j + g, k + 8q : +8]`` of each 8-row tile j and ``x[16i + g (+8), k + 8q : +8]``
  of each 16-row tile i. A dot product does not care about the order of k, so the mma's k index is
  permuted consistently in both operands: its k16 step s takes halves ``4s .. 4s + 3`` of every
  lane's vectors (fragment registers b0 = halves 4s, 4s+1, b1 = 4s+2, 4s+3; a0/a2 likewise from the
  row g vector, a1/a3 from row g + 8). No shared memory, no ldmatrix, 16-byte loads of W.
* the ring (``stages`` > 0, M ≤ 64; :func:`pick_config` takes it for M ≤ 8 on long K): W goes
  by ``cp.async`` (16 bytes a lane; each instruction copies whole runs of one or two rows, the
  CUDA-core engine's coalescing) into ``stages`` slots per warp of dynamic shared memory, a slot
  ``rows × (chunk + 32)`` halves (the 32-half skew puts rows g and g + 1 of a fragment load in
  other banks). Each step a warp refills the slot it finished, waits for the next
  (``cp.async.wait_group``, ``__syncwarp``) and reads its fragments by ``LDS.128``: W is the A
  operand (16-row tiles: rows g, g + 8), x the B operand (8-column tiles, so M ≤ 8 has no padded
  half), x's vectors of all the stage's 32-wide slabs loaded from global first; the k order is
  permuted alike in both, as above. The reduction below reuses the ring after a block barrier.

Then every warp puts its partial sums in shared memory (``red[warp, m, n]``), and the block's
threads add the warps' partials of one output each and store ``f`` of it (out-of-range rows and
columns masked; K must be a multiple of 8: one vector never crosses the end of a row).

*L2 prefetch before the programmatic-launch wait* (``l2_prefetch`` bytes, sm_90): the block's rows
of W are one contiguous range; thread 0 first asks the TMA unit to bring the range's first
``l2_prefetch`` bytes into L2 (``cp.async.bulk.prefetch.L2``), then every thread executes
``griddepcontrol.wait`` (the predecessor kernel is complete; x may be its output) and
``griddepcontrol.launch_dependents``. Launched
programmatically (``rules/programmatic_launch.py``), the weight stream of this GEMV starts during
the previous kernel's tail; launched plainly, the wait returns at once.

*W in registers before the wait* (``preload``, the register engines): the first iteration's W
vectors are loaded before ``griddepcontrol.wait`` (W is a weight: no kernel writes it), into the
registers the loop would load them into; the loop's first iteration then loads x alone. A block
made resident during its predecessor's tail so has its first DRAM round trip behind it when the
wait returns. Nothing past the loads moves: x, the statistics and the stores stay after the wait.

*Gather* (``gather``, :class:`RowGather`; ``rules/gemv_append.py``: the decode append): block
kernel-row j computes W's row ``row_of(j)``; the block puts its outputs in shared memory instead of
y, then each output's thread makes one store elsewhere (the RoPE'd q, k, v into the KV cache)
whose reads of y are outputs of the same block. The store's other data loads go out in iteration
0, after the main loop's own loads are issued, so they travel while W streams.

*Row statistics* (``row_stats``): the LayerNorm / RMSNorm statistics of x's rows, which the
epilogue reads, are summed from the same x vectors in the main loop (the block's warps cover all
of K) and reduced with the partial products. LayerNorm uses the shifted sums of
:mod:`.sm90` (c = x[m, 0]): s1 = Σ(x − c), s2 = Σ(x − c)², mean = c + s1/K,
rstd = rsqrt(max(s2/K − (s1/K)², 0) + eps); RMSNorm s2 = Σx², rstd = rsqrt(s2/K + eps).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tvm import tirx
from tvm.ir import Expr as PrimExpr
from tvm.script import tirx as T

from .sm90 import RowStats

WARP = 32
VEC = 8  # fp16 / bf16 elements per 16-byte vector
SIMT_CHUNK = WARP * VEC  # K values a warp reads per row and chunk (CUDA cores)
MMA_CHUNK = 4 * VEC  # K values per chunk of the mma engine: two k16 steps
MAX_M = 64
SIMT_MAX_M = 8
MAX_SMEM = 48 * 1024  # static shared memory of one block
MAX_RING_SMEM = 160 * 1024  # dynamic shared memory of a ring block (sm_80 allows 163 KB)
RING_SKEW = 32  # halves after each ring row: rows g and g + 1 of a fragment load hit other banks
RING_MAX_M, RING_MIN_K = 8, 8192  # where pick_config takes the ring (its docstring)
_ALL_LANES = 0xFFFFFFFF
_MMA_TYPE = {"float16": "fp16", "bfloat16": "bf16"}


@dataclass(frozen=True)
class GemvConfig:
    """``rows`` of W per block (tensor cores: a multiple of 8; the ring: of 16), ``warps`` splitting
    K, ``unroll`` K chunks a warp loads per iteration (the ring: 32-wide K slabs per stage),
    ``mma``: tensor cores; ``stages`` > 0: the ring engine (module doc) with that many stages."""

    rows: int = 4
    warps: int = 8
    unroll: int = 2
    mma: bool = False
    stages: int = 0

    @property
    def threads(self) -> int:
        return self.warps * WARP

    @property
    def chunk(self) -> int:
        """K values a warp takes per step: a register chunk, or one ring stage."""
        if self.stages:
            return MMA_CHUNK * self.unroll
        return MMA_CHUNK if self.mma else SIMT_CHUNK

    @property
    def tag(self) -> str:
        if self.stages:
            return f"ring rows={self.rows} warps={self.warps} u={self.unroll} s={self.stages}"
        return f"{'mma' if self.mma else 'simt'} rows={self.rows} warps={self.warps} u={self.unroll}"


@dataclass(frozen=True)
class GemvProblem:
    """``y (M, N) = f(x (M, K) · W (N, K)ᵀ)``; ``pair``: y is (M, N/2), from column pairs."""

    m: int
    n: int
    k: int
    in_dtype: str
    out_dtype: str
    pair: bool = False


@dataclass(frozen=True)
class RowGather:
    """The GEMV's outputs consumed inside the block instead of stored to y (module doc, *gather*).

    ``row_of(j)``: the row of W (and of the GEMM's output) kernel row ``j`` computes, a bijection
    of [0, N) under which every row a block's stores read is one of that block's rows;
    ``kernel_row(n)`` its inverse. Output ``(m, n)`` (row m of x, GEMM row n) makes one store,
    under a condition: ``guard(m, n)``. Its data loads that the store evaluates whenever it is
    made (not under a select's branch: RoPE tables, positions) are issued early, while W streams:
    ``early(m, n, "float", k)`` is the k-th float one as float32 (k < ``counts[0]``),
    ``early(m, n, "int", k)`` the k-th integer one as int64 (k < ``counts[1]``), each evaluated
    only where the guard holds. ``store(m, n, load, early)`` gives ``(buffer, indices, value)``
    of the store, reading the GEMM's output through ``load(m2, n2)`` (y[m2, n2] after the GEMM's
    own epilogue, in y's dtype, from shared memory) and the early values through ``early(k)``
    (the float ones first). ``before_wait``: every early load reads memory no kernel of the
    step writes (constants, inputs of the step), so with ``preload`` they are issued before
    ``griddepcontrol.wait``, behind the predecessor kernel, instead of after x's loads."""

    row_of: Callable[[PrimExpr], PrimExpr]
    kernel_row: Callable[[PrimExpr], PrimExpr]
    guard: Callable[[PrimExpr, PrimExpr], PrimExpr]
    early: Callable[[PrimExpr, PrimExpr, str, PrimExpr], PrimExpr]
    counts: tuple[int, int]
    store: Callable
    before_wait: bool = False


def _cdiv(a: int, b: int) -> int:
    return (a + b - 1) // b


def _m_pad(problem: GemvProblem, cfg: GemvConfig) -> int:
    """Rows of x the engine computes: M, or M rounded up to the mma tile (16 rows of the A
    operand; the ring's x is the B operand: 8 columns)."""
    if cfg.stages:
        return _cdiv(problem.m, 8) * 8
    return _cdiv(problem.m, 16) * 16 if cfg.mma else problem.m


def _red_bytes(problem: GemvProblem, cfg: GemvConfig, row_stats: RowStats | None) -> int:
    """The cross-warp reduction: partial sums (and statistics) per warp, fp32."""
    per_warp = _m_pad(problem, cfg) * (cfg.rows + (2 if row_stats is not None else 0))
    return cfg.warps * per_warp * 4


def _ring_row(cfg: GemvConfig) -> int:
    """Halves per W row of a ring stage: the chunk and 32 halves of skew (module doc)."""
    return cfg.chunk + RING_SKEW


def smem_bytes(problem: GemvProblem, cfg: GemvConfig, row_stats: RowStats | None = None) -> int:
    """Shared memory of one block: the reduction's, or the ring's (the reduction reuses it)."""
    red = _red_bytes(problem, cfg, row_stats)
    if cfg.stages:
        return max(red, cfg.warps * cfg.stages * cfg.rows * _ring_row(cfg) * 2)
    return red


def check(problem: GemvProblem, cfg: GemvConfig, row_stats: RowStats | None = None) -> str | None:
    """Why this kernel cannot compute ``problem`` with ``cfg`` (None: it can)."""
    p = problem
    if p.in_dtype not in _MMA_TYPE:
        return f"input dtype {p.in_dtype} (fp16/bf16 only)"
    if p.m > MAX_M:
        return f"M={p.m} > {MAX_M} (a GEMM, not a weight stream)"
    if not cfg.mma and p.m > SIMT_MAX_M:
        return f"M={p.m} > {SIMT_MAX_M} on CUDA cores (compute would cap the stream)"
    if p.k % VEC:
        return f"K={p.k} is not a multiple of {VEC} (16-byte vectors along K)"
    if p.pair and (p.n % 2 or cfg.rows % 2):
        return f"pair epilogue with N={p.n}, {cfg.rows} rows per block (both must be even)"
    if cfg.mma and cfg.rows % 8:
        return f"{cfg.rows} rows per block: the mma engine takes 8-row tiles"
    if cfg.stages and (cfg.rows % 16 or cfg.unroll % 2 or cfg.stages < 2):
        return f"config {cfg.tag}: the ring takes 16-row tiles, 64-wide K chunks, ≥ 2 stages"
    if cfg.rows < 1 or cfg.warps < 1 or cfg.unroll < 1 or cfg.threads > 1024:
        return f"config {cfg.tag} unsupported"
    limit = MAX_RING_SMEM if cfg.stages else MAX_SMEM
    if smem_bytes(p, cfg, row_stats) > limit:
        return f"{smem_bytes(p, cfg, row_stats)} bytes of shared memory > {limit}"
    if p.m * p.k >= 2**31 or p.n * p.k >= 2**31:
        return "tensor beyond int32 indexing"
    return None


def pick_config(problem: GemvProblem, sms: int, simt_max_m: int = 4,
                row_stats: bool = False) -> GemvConfig:
    """CUDA cores up to M = ``simt_max_m`` (at most 8), tensor cores above. CUDA cores: 8 warps,
    rows per block as many as still give every SM a block (≥ ``sms`` blocks: N small, fewer rows).

    Tensor cores above M = 8 (measured at M = 8, where the next paragraph's config has since
    replaced them; H200, session 12): without in-loop statistics, 8-row blocks of 8 warps with 4
    chunks in flight per warp (2 above M = 16: the A fragments' registers) — in the 7B model at
    batch 8 the down projection went from 39.4 to 26.3 µs and O from 16.2 to 11.7 µs a layer
    (``bench_gemv.py --configs`` at M = 8: the fastest or within 1.5 % on all four shapes). With
    ``row_stats`` every block recomputes the statistics of all of x: 32-row blocks of 4 warps
    with 2 chunks in flight where N still gives every SM a block, else the 8-row config
    (``bench_gemv.py --stats`` at M = 8, session 15: 32 rows 28.3 vs 28.9 µs on 4096×12288 and
    49.1 vs 49.7 on 4096×22016; on N = 4096 the 16-row 4-warp choice of before took 16.8 vs 11.7 µs
    and 40.6 vs 26.4 µs). Default ``simt_max_m`` 4: the engines tie at M = 4 over the 7B shapes and
    the mma engine is 1.5× faster at M = 8 (session 11).

    Up to M = 8 (one 16-row x tile), with or without statistics: 8-row blocks of 16 warps, 4
    chunks in flight. ``bench_gemv.py --ms 8`` over the 7B shapes (K = 4096), H100, session 30,
    with statistics against the 32-row 4-warp config: 4096×12288 35.3 vs 37.2 µs, 4096×22016
    60.7 vs 66.5 µs; without, against 8 warps: 34.7 vs 35.2, 60.1 vs 61.4, 4096×4096 13.0 vs 13.3
    (H200, sessions 14 and 16, without: 27.4 vs 28.2, 46.6 vs 48.5, 11.2 vs 11.3).

    The ring (16 rows × 4 warps, 256-wide chunks, 2 stages) for M ≤ 8 without statistics where
    K ≥ 8192 (long per-warp streams): ``bench_gemv.py`` at M = 8 (session 16) 11008×4096 24.3 vs
    25.7 µs; on K = 4096 it was 1–3 % slower than the register engine and with statistics 5–15 %."""
    if problem.m > min(simt_max_m, SIMT_MAX_M):
        if not row_stats and problem.m <= RING_MAX_M and problem.k >= RING_MIN_K:
            return GemvConfig(rows=16, warps=4, unroll=8, mma=True, stages=2)
        if problem.m <= SIMT_MAX_M:
            cfg = GemvConfig(rows=8, warps=16, unroll=4, mma=True)
        elif row_stats and _cdiv(problem.n, 32) >= sms:
            cfg = GemvConfig(rows=32, warps=4, unroll=2, mma=True)
        else:
            cfg = GemvConfig(rows=8, warps=8, unroll=4 if _cdiv(problem.m, 16) == 1 else 2, mma=True)
    else:
        step = 2 if problem.pair else 1
        rows = [r for r in (8, 4, 2, 1) if r % step == 0]
        best = next((r for r in rows if _cdiv(problem.n, r) >= sms), rows[-1])
        cfg = GemvConfig(rows=best)
    while smem_bytes(problem, cfg, RowStats(True, 0.0)) > MAX_SMEM and cfg.warps > 1:
        cfg = GemvConfig(cfg.rows, cfg.warps // 2, cfg.unroll, cfg.mma, cfg.stages)
    return cfg


def _early_value(ef: tirx.Buffer, ei: tirx.Buffer, o: PrimExpr, n_ef: int, n_ei: int,
                 k: int) -> PrimExpr:
    """Early value k of a gather kernel thread's output ``o`` (:class:`RowGather`)."""
    return ef[o * n_ef + k] if k < n_ef else ei[o * (n_ei + 1) + k - n_ef]


def _block_output(yb: tirx.Buffer, n0: PrimExpr, rows: int, kernel_row: Callable,
                  m: PrimExpr, n: PrimExpr) -> PrimExpr:
    """y[m, n] of a gather kernel's block (rows n0 .. n0 + rows in kernel order) from its shared
    copy; an n of another block is clamped into this one (the caller proved none is read)."""
    return yb[m * rows + T.max(T.min(kernel_row(n) - n0, rows - 1), 0)]


RowStatValues = tuple  # (mean, rstd) of the output's row
# ``store_value(acc, row, col, stats)``: the value stored at y[row, col] from the sum ``acc``
StoreValue = Callable[[PrimExpr, PrimExpr, PrimExpr, "RowStatValues | None"], PrimExpr]
# ``pair_value(acc_even, acc_odd, row, col, stats)``: y[row, col] of an N/2-wide pair epilogue
PairValue = Callable[[PrimExpr, PrimExpr, PrimExpr, PrimExpr, "RowStatValues | None"], PrimExpr]


def gemv_kernel(problem: GemvProblem, cfg: GemvConfig, params: Sequence[tirx.Buffer],
                a_param: int, b_param: int, c_param: int, store_value: StoreValue | None = None,
                pair_value: PairValue | None = None,
                row_stats: RowStats | None = None, l2_prefetch: int = 0,
                preload: bool = False, gather: RowGather | None = None) -> tirx.PrimFunc:
    """The kernel as a scheduled s_tir PrimFunc over ``params`` (the fused function's signature);
    x, W, y are the parameters at the given positions (x (M, K), W (N, K), y (M, N) or (M, N/2)
    with ``pair_value``). ``store_value`` / ``pair_value`` as in :func:`.sm90.gemm_kernel`;
    ``stats`` is ``(mean, rstd)`` of the row with ``row_stats``, else None. ``l2_prefetch`` > 0
    (sm_90 only): that many bytes of the block's W rows go to L2 before ``griddepcontrol.wait``.
    ``preload`` (sm_90 only; the register engines, not the ring): the first iteration's W vectors
    are loaded before the wait (module doc). ``gather``: the outputs go to ``gather.store``
    instead of y (W's rows in ``gather.row_of`` order; no pair epilogue, no L2 prefetch)."""
    p = problem
    reason = check(p, cfg, row_stats)
    if reason:
        raise ValueError(reason)
    if gather is not None and (p.pair or l2_prefetch):
        raise ValueError("a gather epilogue takes neither a pair epilogue nor an L2 prefetch")
    w_row = gather.row_of if gather is not None else (lambda j: j)
    gather_on = gather is not None
    n_ef, n_ei = gather.counts if gather_on else (0, 0)
    if (pair_value is not None) != p.pair:
        raise ValueError("pair_value must be given exactly for a pair problem")
    x, w = params[a_param], params[b_param]
    y = params[c_param] if gather is None else None
    in_dtype, out_dtype = p.in_dtype, p.out_dtype
    value = store_value or (lambda acc, row, col, stats: T.Cast(out_dtype, acc))
    rows, warps, unroll, chunk = cfg.rows, cfg.warps, cfg.unroll, cfg.chunk
    m_pad = _m_pad(p, cfg)
    grid = _cdiv(p.n, rows)
    stages = cfg.stages
    ring_on = stages > 0  # (TVMScript's `if` takes a bool)
    # the ring's step is one chunk (a stage); the register engines' is ``unroll`` chunks
    iters = _cdiv(_cdiv(p.k, chunk), warps * (1 if stages else unroll))
    has_stats = row_stats is not None
    centered = has_stats and row_stats.centered
    n_stats = 2 if has_stats else 0
    red_size = warps * m_pad * rows
    out_cols = rows // 2 if p.pair else rows
    n_out = p.n // 2 if p.pair else p.n
    outputs = p.m * out_cols
    out_iters = _cdiv(outputs, cfg.threads)
    k_f = float(p.k)
    eps = row_stats.eps if has_stats else 0.0
    elem_bytes = 2
    mt, nt = m_pad // 16, rows // 8  # mma tiles
    # the ring: W is the A operand (16-row tiles), x the B operand (8-column tiles)
    wt, xt = rows // 16, m_pad // 8
    tensor_cores = ring_on or cfg.mma
    # mma tiles of the tensor-core engines: 16-row A tiles × 8-column B tiles
    a_tiles, b_tiles = (wt, xt) if ring_on else (mt, nt)
    ring_row = _ring_row(cfg)
    stage_elems = rows * ring_row
    slabs = chunk // MMA_CHUNK  # 32-wide K slabs of a stage: two k16 steps each
    vec_per_row = chunk // VEC
    copies = rows * vec_per_row // WARP  # 16-byte cp.async per lane and stage
    smem_elems = smem_bytes(p, cfg, row_stats) // elem_bytes
    mma_ty = _MMA_TYPE[in_dtype]
    pf_bytes = l2_prefetch // 16 * 16  # cp.async.bulk sizes are multiples of 16 bytes
    preload = preload and not ring_on
    # the gather's loads before the wait: only behind a predecessor (preload) and where safe
    early_first = bool(gather_on and preload and gather.before_wait)

    def chunk_k(it, wid, u, lane_off):
        """First K index of this lane's vector in chunk ``u`` of iteration ``it``."""
        return ((it * warps + wid) * unroll + u) * chunk + lane_off

    def shift(m):
        return T.Cast("float32", x[m, 0])

    def stat_values(total, m):
        """(mean, rstd) of row m from the block's summed (s1, s2) in ``total[2:4]``."""
        if centered:
            d = total[2] / T.float32(k_f)
            rstd = T.rsqrt(T.max(total[3] / T.float32(k_f) - d * d, T.float32(0)) + T.float32(eps))
            return (shift(m) + d, rstd)
        return (None, T.rsqrt(total[3] / T.float32(k_f) + T.float32(eps)))

    def zeros():
        return T.Broadcast(tirx.const(0, in_dtype), VEC)

    @T.prim_func(s_tir=True, check_well_formed=False)
    def kernel():
        T.func_attr({"tirx.noalias": True})
        bx = T.launch_thread("blockIdx.x", grid)
        tx = T.launch_thread("threadIdx.x", cfg.threads)
        if ring_on:
            # per warp ``stages`` slots of rows × ring_row halves; after the loop the reduction's
            # partial sums reuse the memory
            ring = T.alloc_buffer((smem_elems,), in_dtype, scope="shared.dyn", align=128)
            red = T.decl_buffer((smem_elems // 2,), "float32", data=ring.data, scope="shared.dyn")
        else:
            red = T.alloc_buffer((red_size + warps * m_pad * n_stats,), "float32", scope="shared")
        if tensor_cores:
            acc = T.alloc_buffer((a_tiles * b_tiles * 4,), "float32", scope="local")
            afrag = T.alloc_buffer((a_tiles * 2 * VEC,), in_dtype, scope="local", align=16)
            # B fragments copied element-wise out of bv / xv: were bv only read through the mma's
            # pointer, TVM would retype it as uint4[] and the pointer offsets (in halves) would
            # land 8× too far (NaN on the H200, session 8)
            bfrag = T.alloc_buffer((b_tiles * 4,), in_dtype, scope="local", align=16)
        if ring_on:
            wv = T.alloc_buffer((wt * 2 * VEC,), in_dtype, scope="local", align=16)
            xv = T.alloc_buffer((slabs * xt * VEC,), in_dtype, scope="local", align=16)
        elif cfg.mma:
            bv = T.alloc_buffer((unroll * nt * VEC,), in_dtype, scope="local", align=16)
            av = T.alloc_buffer((unroll * mt * 2 * VEC,), in_dtype, scope="local", align=16)
        else:
            acc = T.alloc_buffer((p.m * rows,), "float32", scope="local")
            bv = T.alloc_buffer((unroll * rows * VEC,), in_dtype, scope="local", align=16)
            av = T.alloc_buffer((unroll * p.m * VEC,), in_dtype, scope="local", align=16)
        if has_stats:
            st = T.alloc_buffer((n_stats * m_pad,), "float32", scope="local")
        if gather_on:  # the block's outputs: y[m, row_of(n0 + j)] at yb[m · rows + j]
            yb = T.alloc_buffer((p.m * rows,), out_dtype, scope="shared")
            # per output of the thread: the early loads (float32, then int64 and the guard)
            ei = T.alloc_buffer((out_iters * (n_ei + 1),), "int64", scope="local")
            if n_ef > 0:
                ef = T.alloc_buffer((out_iters * n_ef,), "float32", scope="local")
            else:  # no float early loads (a store without RoPE): nothing reads it
                ef = T.meta_var(ei)
        total = T.alloc_buffer((4,), "float32", scope="local")  # products (2), s1, s2
        wid = tx // WARP
        lane = tx % WARP
        n0 = bx * rows
        @T.inline
        def shfl_sum(buf, i, lanes):
            # buf[i] summed over groups of ``lanes`` consecutive lanes (butterfly of shfl.xor)
            for s in T.unroll(lanes.bit_length() - 1):
                buf[i] = buf[i] + T.tvm_warp_shuffle_xor(T.uint32(_ALL_LANES), buf[i], 1 << s,
                                                         WARP, WARP)

        @T.inline
        def stat_add(slot, row, xv, base):
            # statistics slot ``slot`` (x row ``row``) += this lane's 8 values at xv[base:]
            for e in T.unroll(VEC):
                if centered:
                    st[slot * 2] = st[slot * 2] + (T.Cast("float32", xv[base + e]) - shift(row))
                    st[slot * 2 + 1] = st[slot * 2 + 1] + (
                        T.Cast("float32", xv[base + e]) - shift(row)) * (
                        T.Cast("float32", xv[base + e]) - shift(row))
                else:
                    st[slot * 2 + 1] = st[slot * 2 + 1] + T.Cast("float32", xv[base + e]) * T.Cast(
                        "float32", xv[base + e])

        @T.inline
        def mma_k16(s, afrag, bfrag, a, a0, n_a, b, b0, n_b):
            # k16 step s of a 32-wide slab: A fragments of n_a 16-row tiles from a (the vectors of
            # rows g, g + 8 of tile i at a0 + (2i, 2i + 1)·8): a0 = row g halves 4s, 4s+1,
            # a1 = row g + 8, a2, a3 = halves 4s+2, 4s+3; B fragments of n_b 8-column tiles from b
            # (tile j at b0 + 8j): b0 = halves 4s, 4s+1, b1 = 4s+2, 4s+3; the n_a × n_b mmas into acc
            for i in T.unroll(n_a):
                for r in T.unroll(2):
                    for h in T.unroll(2):
                        for e in T.unroll(2):
                            afrag[i * 8 + r * 4 + h * 2 + e] = a[a0 + (i * 2 + h) * VEC + s * 4
                                                                 + r * 2 + e]
            for j in T.unroll(n_b):
                for e in T.unroll(4):
                    bfrag[j * 4 + e] = b[b0 + j * VEC + s * 4 + e]
            for i in T.unroll(n_a):
                for j in T.unroll(n_b):
                    T.evaluate(T.ptx_legacy.mma(
                        "m16n8k16", "row", "col", mma_ty, mma_ty, "fp32",
                        afrag.data, i * 8, bfrag.data, j * 4,
                        acc.data, (i * n_b + j) * 4, False, dtype="float32"))

        @T.inline
        def ring_load(slot, c):
            # chunk c of this warp's rows of W → ring slot ``slot``: each instruction copies
            # whole 16-byte runs of one or two rows (coalesced, like the CUDA-core engine's loads);
            # past N or K the copy reads nothing and zero-fills
            for t in T.unroll(copies):
                r = T.meta_var((t * WARP + lane) // vec_per_row)
                kk = T.meta_var(c * chunk + (t * WARP + lane) % vec_per_row * VEC)
                T.ptx["cp.async.cg.shared.global"](
                    T.cuda.cvta_generic_to_shared(T.address_of(ring[
                        (wid * stages + slot) * stage_elems + r * ring_row
                        + (t * WARP + lane) % vec_per_row * VEC])),
                    T.address_of(w[w_row(T.min(n0 + r, p.n - 1)), T.min(kk, p.k - VEC)]),
                    16,
                    T.Cast("uint32", T.if_then_else(n0 + r < p.n and kk < p.k, 16, 0)),
                )

        @T.inline
        def w_chunk(it, u):
            # W vectors of chunk u of iteration ``it`` into bv (the register engines)
            if cfg.mma:
                kq = T.meta_var(chunk_k(it, wid, u, (lane % 4) * VEC))
                for j in T.unroll(nt):
                    if kq < p.k and n0 + j * 8 + lane // 4 < p.n:
                        bv[T.Ramp((u * nt + j) * VEC, 1, VEC)] = w[
                            w_row(n0 + j * 8 + lane // 4), T.Ramp(kq, 1, VEC)]
                    else:
                        bv[T.Ramp((u * nt + j) * VEC, 1, VEC)] = zeros()
            else:
                kv = T.meta_var(chunk_k(it, wid, u, lane * VEC))
                for r in T.unroll(rows):
                    if n0 + r < p.n:
                        bv[T.Ramp((u * rows + r) * VEC, 1, VEC)] = w[w_row(n0 + r),
                                                                      T.Ramp(kv, 1, VEC)]
                    else:
                        bv[T.Ramp((u * rows + r) * VEC, 1, VEC)] = zeros()

        @T.inline
        def gather_early(it, first):
            # iteration 0, after its loads are issued: the stores' data loads (RoPE tables,
            # positions, the guard's) go out while W streams, into ef / ei; with early_first,
            # before the wait instead (``first``: that call)
            if gather_on and first == early_first:
                if it == 0:
                    for o in T.unroll(out_iters):
                        idx = T.meta_var(o * cfg.threads + tx)
                        row = T.meta_var(idx // rows)
                        n_g = T.meta_var(w_row(bx * rows + idx % rows))
                        if idx < outputs and bx * rows + idx % rows < p.n:
                            ei[o * (n_ei + 1) + n_ei] = T.Cast("int64", gather.guard(row, n_g))
                            if ei[o * (n_ei + 1) + n_ei] != T.int64(0):
                                for k in T.unroll(n_ef):
                                    ef[o * n_ef + k] = gather.early(row, n_g, "float", k)
                                for k in T.unroll(n_ei):
                                    ei[o * (n_ei + 1) + k] = gather.early(row, n_g, "int", k)
                        else:
                            ei[o * (n_ei + 1) + n_ei] = T.int64(0)

        @T.inline
        def loop_w_chunk(it, u):
            # the main loop's W loads: with the preload, iteration 0's came before the wait
            if preload:
                if it > 0:
                    w_chunk(it, u)
            else:
                w_chunk(it, u)

        if l2_prefetch > 0:
            # this block's rows of W (one contiguous range) into L2 by the TMA unit
            if tx == 0:
                T.ptx.cp.async_.bulk.prefetch.L2.global_(T.address_of(w[n0, 0]), T.Cast(
                    "uint32", T.min(pf_bytes, (T.min(p.n, n0 + rows) - n0) * (p.k * elem_bytes))))
        if preload:
            # the first iteration's W (a weight: no kernel writes it) before the wait
            for u in T.unroll(unroll):
                if cfg.mma:
                    w_chunk(0, u)
                else:
                    if chunk_k(0, wid, u, lane * VEC) < p.k:
                        w_chunk(0, u)
        gather_early(0, True)  # early_first: the stores' data loads, none written by the step
        if l2_prefetch > 0 or preload:
            # then wait for the predecessor kernel
            T.ptx.griddepcontrol.wait()
            T.ptx.griddepcontrol.launch_dependents()
        for i in T.unroll(a_tiles * b_tiles * 4 if tensor_cores else p.m * rows):
            acc[i] = T.float32(0)
        if has_stats:
            for i in T.unroll(n_stats * m_pad):
                st[i] = T.float32(0)
        if ring_on:
            for s0 in T.unroll(stages - 1):
                if s0 < iters:
                    ring_load(s0, s0 * warps + wid)
                T.ptx["cp.async.commit_group"]()
        for it in T.serial(iters):
            if ring_on:
                # slot (it − 1) % stages is free once every lane has left step it − 1's math;
                # refill it with chunk it + stages − 1, then wait for chunk it
                T.cuda.warp_sync()
                if it + stages - 1 < iters:
                    ring_load((it + stages - 1) % stages, (it + stages - 1) * warps + wid)
                T.ptx["cp.async.commit_group"]()
                T.ptx["cp.async.wait_group"](stages - 1)
                T.cuda.warp_sync()
                base = T.meta_var((wid * stages + it % stages) * stage_elems)
                gather_early(it, False)
                for sl in T.unroll(slabs):  # x of every slab first: one L1/L2 round trip a step
                    kx = T.meta_var((it * warps + wid) * chunk + sl * MMA_CHUNK + (lane % 4) * VEC)
                    for j in T.unroll(xt):
                        if kx < p.k and j * 8 + lane // 4 < p.m:
                            xv[T.Ramp((sl * xt + j) * VEC, 1, VEC)] = x[j * 8 + lane // 4,
                                                                         T.Ramp(kx, 1, VEC)]
                        else:
                            xv[T.Ramp((sl * xt + j) * VEC, 1, VEC)] = zeros()
                for sl in T.unroll(slabs):
                    kx2 = T.meta_var((it * warps + wid) * chunk + sl * MMA_CHUNK + (lane % 4) * VEC)
                    if has_stats:
                        for j in T.unroll(xt):
                            if kx2 < p.k and j * 8 + lane // 4 < p.m:
                                stat_add(j, j * 8 + lane // 4, xv, (sl * xt + j) * VEC)
                    # lane (g, q) of W's tile i: rows 16i + g and 16i + g + 8, halves 8q .. 8q + 7
                    # of the slab; the k16 step s takes halves 4s .. 4s + 3 (the order of k is
                    # permuted alike in x: a dot product does not care)
                    for i in T.unroll(wt):
                        for h in T.unroll(2):
                            wv[T.Ramp((i * 2 + h) * VEC, 1, VEC)] = ring[T.Ramp(
                                base + (i * 16 + h * 8 + lane // 4) * ring_row + sl * MMA_CHUNK
                                + (lane % 4) * VEC, 1, VEC)]
                    for s in T.unroll(2):
                        mma_k16(s, afrag, bfrag, wv, 0, wt, xv, sl * xt * VEC, xt)
            elif cfg.mma:
                # loads of `unroll` chunks first (all in flight), then the mmas
                for u in T.unroll(unroll):
                    kq = T.meta_var(chunk_k(it, wid, u, (lane % 4) * VEC))
                    loop_w_chunk(it, u)
                    for i in T.unroll(mt):
                        for h in T.unroll(2):
                            if kq < p.k and i * 16 + h * 8 + lane // 4 < p.m:
                                av[T.Ramp(((u * mt + i) * 2 + h) * VEC, 1, VEC)] = x[
                                    i * 16 + h * 8 + lane // 4, T.Ramp(kq, 1, VEC)]
                            else:
                                av[T.Ramp(((u * mt + i) * 2 + h) * VEC, 1, VEC)] = zeros()
                gather_early(it, False)
                for u in T.unroll(unroll):
                    if has_stats:
                        # after every load of the iteration is issued: summed right after its own
                        # load, x of chunk 0 stalled the loads of chunks 1.. (session 15)
                        kq2 = T.meta_var(chunk_k(it, wid, u, (lane % 4) * VEC))
                        for i in T.unroll(mt):
                            for h in T.unroll(2):
                                if kq2 < p.k and i * 16 + h * 8 + lane // 4 < p.m:
                                    stat_add(i * 2 + h, i * 16 + h * 8 + lane // 4, av,
                                             ((u * mt + i) * 2 + h) * VEC)
                    for s in T.unroll(2):
                        mma_k16(s, afrag, bfrag, av, u * mt * 2 * VEC, mt, bv, u * nt * VEC, nt)
            else:
                for u in T.unroll(unroll):
                    kv = T.meta_var(chunk_k(it, wid, u, lane * VEC))
                    if kv < p.k:
                        loop_w_chunk(it, u)
                        for m in T.unroll(p.m):
                            av[T.Ramp((u * p.m + m) * VEC, 1, VEC)] = x[m, T.Ramp(kv, 1, VEC)]
                gather_early(it, False)
                for u in T.unroll(unroll):
                    kv = T.meta_var(chunk_k(it, wid, u, lane * VEC))
                    if kv < p.k:
                        for m in T.unroll(p.m):
                            if has_stats:
                                stat_add(m, m, av, (u * p.m + m) * VEC)
                            for r in T.unroll(rows):
                                for e in T.unroll(VEC):
                                    acc[m * rows + r] = acc[m * rows + r] + T.Cast(
                                        "float32", av[(u * p.m + m) * VEC + e]) * T.Cast(
                                        "float32", bv[(u * rows + r) * VEC + e])
        # this warp's partial sums → red[wid, m, n] (statistics after them: [wid, m, 2])
        if ring_on:
            T.tvm_storage_sync("shared")  # every warp is out of its ring: red reuses it
            # C fragment: c0, c1 = (W row g, x rows 2q, 2q + 1), c2, c3 = W row g + 8
            for i in T.unroll(wt):
                for j in T.unroll(xt):
                    for h in T.unroll(2):
                        for e in T.unroll(2):
                            red[(wid * m_pad + j * 8 + (lane % 4) * 2 + e) * rows + i * 16 + h * 8
                                + lane // 4] = acc[(i * xt + j) * 4 + h * 2 + e]
            if has_stats:  # the 4 lanes of a group read one x row's slab together
                for i in T.unroll(xt * 2):
                    shfl_sum(st, i, 4)
                if lane % 4 == 0:
                    for j in T.unroll(xt):
                        for c in T.unroll(2):
                            red[red_size + (wid * m_pad + j * 8 + lane // 4) * 2 + c] = st[j * 2 + c]
        elif cfg.mma:
            for i in T.unroll(mt):
                for j in T.unroll(nt):
                    for h in T.unroll(2):
                        for e in T.unroll(2):
                            red[(wid * m_pad + i * 16 + h * 8 + lane // 4) * rows + j * 8
                                + (lane % 4) * 2 + e] = acc[(i * nt + j) * 4 + h * 2 + e]
            if has_stats:  # the 4 lanes of a group read one row's K chunk together
                for i in T.unroll(mt * 4):
                    shfl_sum(st, i, 4)
                if lane % 4 == 0:
                    for i in T.unroll(mt):
                        for h in T.unroll(2):
                            for c in T.unroll(2):
                                red[red_size + (wid * m_pad + i * 16 + h * 8 + lane // 4) * 2
                                    + c] = st[(i * 2 + h) * 2 + c]
        else:
            for i in T.unroll(p.m * rows):
                shfl_sum(acc, i, WARP)
            if has_stats:
                for i in T.unroll(n_stats * m_pad):
                    shfl_sum(st, i, WARP)
            if lane == 0:
                for i in T.unroll(p.m * rows):
                    red[wid * m_pad * rows + i] = acc[i]
                if has_stats:
                    for i in T.unroll(n_stats * m_pad):
                        red[red_size + wid * m_pad * 2 + i] = st[i]
        T.tvm_storage_sync("shared")
        # one output per thread: the warps' partials summed, the epilogue, the store
        for o in T.serial(out_iters):
            idx = T.meta_var(o * cfg.threads + tx)
            row = T.meta_var(idx // out_cols)
            col = T.meta_var(idx % out_cols)
            if idx < outputs and bx * out_cols + col < n_out:
                for c in T.unroll(4):
                    total[c] = T.float32(0)
                for v in T.unroll(warps):
                    if p.pair:
                        total[0] = total[0] + red[(v * m_pad + row) * rows + col * 2]
                        total[1] = total[1] + red[(v * m_pad + row) * rows + col * 2 + 1]
                    else:
                        total[0] = total[0] + red[(v * m_pad + row) * rows + col]
                    if has_stats:
                        total[2] = total[2] + red[red_size + (v * m_pad + row) * 2]
                        total[3] = total[3] + red[red_size + (v * m_pad + row) * 2 + 1]
                stats = T.meta_var(stat_values(total, row) if has_stats else None)
                if gather_on:
                    yb[row * rows + col] = value(total[0], row, w_row(bx * rows + col), stats)
                elif p.pair:
                    y[row, bx * out_cols + col] = pair_value(total[0], total[1], row,
                                                             bx * out_cols + col, stats)
                else:
                    y[row, bx * out_cols + col] = value(total[0], row, bx * out_cols + col, stats)
        if gather_on:
            # every output of the block is in yb: each thread makes the stores of its outputs
            T.tvm_storage_sync("shared")
            for o in T.unroll(out_iters):
                idx = T.meta_var(o * cfg.threads + tx)
                row = T.meta_var(idx // rows)
                col = T.meta_var(idx % rows)
                if idx < outputs and bx * rows + col < p.n:
                    if ei[o * (n_ei + 1) + n_ei] != T.int64(0):
                        made = T.meta_var(gather.store(
                            row, w_row(bx * rows + col),
                            functools.partial(_block_output, yb, n0, rows, gather.kernel_row),
                            functools.partial(_early_value, ef, ei, o, n_ef, n_ei)))
                        T.buffer_store(made[0], made[2], made[1])

    return tirx.PrimFunc(list(params), kernel.body, attrs=kernel.attrs).without_attr(
        "global_symbol")


def standalone(problem: GemvProblem, cfg: GemvConfig | None = None,
               l2_prefetch: int = 0, rms_eps: float | None = None,
               preload: bool = False) -> tirx.PrimFunc:
    """``main(x, W, y)`` with ``y = cast(x · Wᵀ)`` (pair: ``y[m, c] = cast(silu(y₂c) · y₂c₊₁)``),
    for tests, benchmarks and device probes; the rule builds its kernels from fused PrimFuncs.
    ``rms_eps``: x is RMS-normalised first, its statistics computed in the loop (the decode's QKV
    and gate/up): ``y = cast(rstd_m · x·Wᵀ)``, ``rstd_m = 1/√(mean_k x[m, k]² + eps)``."""
    p = problem
    cfg = cfg or pick_config(p, 132, row_stats=rms_eps is not None)
    stats = RowStats(False, rms_eps) if rms_eps is not None else None
    out_n = p.n // 2 if p.pair else p.n
    params = [tirx.decl_buffer(shape, dtype, name=name, data_alignment=16)
              for name, shape, dtype in (("x", (p.m, p.k), p.in_dtype), ("w", (p.n, p.k), p.in_dtype),
                                         ("y", (p.m, out_n), p.out_dtype))]

    def scaled(acc, st):
        return acc * st[1] if st is not None else acc

    def silu_mul(a, b, row, col, st):
        a, b = scaled(a, st), scaled(b, st)
        return T.Cast(p.out_dtype, a * T.sigmoid(a) * b)

    def store(acc, row, col, st):
        return T.Cast(p.out_dtype, scaled(acc, st))

    func = gemv_kernel(p, cfg, params, 0, 1, 2, store_value=None if p.pair else store,
                       pair_value=silu_mul if p.pair else None, row_stats=stats,
                       l2_prefetch=l2_prefetch, preload=preload)
    return func.with_attr("global_symbol", "main")
