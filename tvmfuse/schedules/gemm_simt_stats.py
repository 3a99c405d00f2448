"""SIMT fp32 GEMM + epilogue whose thread blocks compute their rows' norm statistics first.

Takes the PrimFuncs :mod:`.gemm_row_stats_simt` makes (marked ``tvmfuse.simt_row_stats``):

    s1[i] = Σ_k x[i, k]; mean[i] = s1[i] / K; s2[i] = Σ_k (x[i, k] − mean[i])²   (LayerNorm)
    s2[i] = Σ_k x[i, k]²                                                         (RMSNorm)
    rstd[i] = rsqrt(s2[i] / K + eps)
    C[i, j] = Σ_k x[i, k] · W[k, j]   (or W[j, k]);   out[i, j] = f(C[i, j], mean[i], rstd[i], …)

Schedule, per thread block of ``BM × BN`` outputs and ``(BM / TM) × (BN / TN)`` threads::

    blockIdx.y = M tile, blockIdx.x = N tile    (the blocks of one row tile run side by side,
                                                 so their re-reads of x hit L2)
    statistics of the block's BM rows → shared  (rows over threadIdx.y; K over threadIdx.x with
                                                 a cross-thread sum; two passes over x as in the
                                                 statistics kernel: no E[x²] − mean² cancellation)
    acc[TM, TN] = 0                             registers
    for k0 in K / BK:
        x_s[BK, BM], W_s[BK, BN] ← global       (16-byte loads by all threads; x stored K-major)
        for k1 in BK: a ← x_s[k1, ty·TM : +TM], b ← W_s[k1, tx·TN : +TN]   (16-byte reads)
                      acc[tm, tn] += a[tm] · b[tn]
    out[i, j] = f(acc, mean_s[i], rstd_s[i], …)  the epilogue on the registers, 16-byte stores

The epilogue drives the loop nest (the matmul is computed at its thread loop, the statistics at
its block loop): TVM's reverse_compute_inline cannot put an epilogue that also reads the
statistics into the matmul's store. Tiles (:func:`pick_config`): 128 × 128 with 8 × 8 per thread
when that grid fills the GPU, else 64 × 64 with 4 × 4, and 16 × 64 for decode rows (M ≤ 16).

M, N, K are padded to the tile (``pad_einsum``: zero rows/columns, predicated stores). Each
block reads its ``BM`` rows of ``x`` twice more than a GEMM alone (the two statistics passes):
``N / BN`` recomputations of the statistics in all, traded for the statistics kernel's launch
and its HBM read of ``x`` and write of mean / rstd.

Returns ``None`` for any function without the mark, or when a primitive refuses;
:mod:`.gemm_row_stats_simt` schedules each merged function once and keeps the statistics kernel
where this rule refuses, so a merged function always gets this schedule.
"""

from __future__ import annotations

from dataclasses import dataclass

from tvm import s_tir, tirx
from tvm.s_tir.dlight.gpu.base import GPUScheduleRule
from tvm.s_tir.dlight.gpu.matmul import (
    IterKind,
    auto_inline_producers,
    detect_iter_traits,
    make_iter_fusion_index_map,
)
from tvm.target import Target

from ..attrs import RULE_ATTR, SIMT_ATTR, TILE_ATTR
from .elementwise import VECTOR_BYTES
from .tir_util import const_int

NAME = "gemm_simt_stats"


@dataclass(frozen=True)
class SimtConfig:
    """A ``block_m × block_n`` output tile in K steps of ``block_k``; each of the
    ``(block_m / thread_m) × (block_n / thread_n)`` threads owns ``thread_m × thread_n`` outputs,
    as ``thread_m / vec`` (``thread_n / vec``) runs of ``vec`` rows (columns) that lie
    ``block_m / (thread_m / vec)`` apart, so a warp's shared-memory reads are 16-byte vectors
    at consecutive addresses."""

    block_m: int = 128
    block_n: int = 128
    block_k: int = 16
    thread_m: int = 8
    thread_n: int = 8
    vec: int = 4

    @property
    def threads_y(self) -> int:
        return self.block_m // self.thread_m

    @property
    def threads_x(self) -> int:
        return self.block_n // self.thread_n


LARGE_CONFIG = SimtConfig()  # 256 threads of 8 × 8 outputs
MEDIUM_CONFIG = SimtConfig(block_m=64, block_n=64, thread_m=4, thread_n=4)  # 256 threads of 4 × 4
SMALL_M_CONFIG = SimtConfig(block_m=16, block_n=64, thread_m=1, thread_n=4)  # decode rows
LARGE_MIN_BLOCKS = 132  # LARGE_CONFIG when its grid fills the H200's SMs once


def pick_config(m: int, n: int) -> SimtConfig:
    """The tile for an ``m × n`` output: decode rows (m ≤ 16) get 16-row tiles, large outputs
    128 × 128, the rest 64 × 64 (more blocks where 128 × 128 would leave SMs idle)."""
    if m <= SMALL_M_CONFIG.block_m:
        return SMALL_M_CONFIG
    if -(-m // 128) * -(-n // 128) >= LARGE_MIN_BLOCKS:
        return LARGE_CONFIG
    return MEDIUM_CONFIG


class GemmSimtRowStats(GPUScheduleRule):
    """fp32 SIMT GEMM + epilogue + per-block row statistics (see the module docstring)."""

    def __init__(self, config: SimtConfig | None = None) -> None:
        self.config = config  # None: pick_config by the output's size

    def apply(self, func: tirx.PrimFunc, target: Target, _: bool) -> s_tir.Schedule | None:
        if not isinstance(func, tirx.PrimFunc) or not self.is_target_available(target):
            return None
        if target.kind.name != "cuda" or not (func.attrs and func.attrs.get(SIMT_ATTR)):
            return None
        sch = s_tir.Schedule(func)
        try:
            tag = _schedule(sch, self.config)
        except Exception:  # noqa: BLE001 - a primitive refusing: dlight's rules take it
            return None
        return s_tir.Schedule(sch.mod["main"].with_attrs({RULE_ATTR: NAME, TILE_ATTR: tag}))


def _split_blocks(sch: s_tir.Schedule):
    """(statistics blocks in order, the matmul block): the blocks before the matmul write
    (M, 1) row scalars."""
    stats, matmul = [], None
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in stmt.iter_vars) \
                and detect_iter_traits(stmt) is not None and len(stmt.reads) == 2:
            matmul = block
            break
        out = stmt.writes[0].source
        if len(out.shape) != 2 or const_int(out.shape[1]) != 1:
            raise ValueError(f"block {stmt.name_hint} before the matmul is no row statistic")
        stats.append(block)
    if matmul is None or not stats:
        raise ValueError("no statistics blocks before a matmul block")
    return stats, matmul


def _canonical(sch: s_tir.Schedule, block) -> tuple[int, int]:
    """Reindex the matmul to ``C[1, I, J] += A[1, I, K] · B[1, K, J]`` (B as (K, N) in shared
    memory whatever its layout); returns (M, N)."""
    s_, i_, j_, k_ = IterKind.kIter_S, IterKind.kIter_I, IterKind.kIter_J, IterKind.kIter_K
    reindex_a = sch.reindex(block, ("read", 0))
    reindex_b = sch.reindex(block, ("read", 1))
    reindex_c = sch.reindex(block, ("write", 0))
    traits = detect_iter_traits(sch.get(block))
    if traits is None:
        raise ValueError("not a matmul")
    traits_a, traits_b, traits_c, traits_blk = traits
    fusion = make_iter_fusion_index_map
    sch.transform_layout(reindex_a, ("write", 0), fusion(traits_a, [s_, i_, k_]))
    sch.transform_layout(reindex_b, ("write", 0), fusion(traits_b, [s_, k_, j_]))
    sch.transform_layout(reindex_c, ("read", 0), fusion(traits_c, [s_, i_, j_]))
    sch.transform_block_layout(block, fusion(traits_blk, [s_, i_, j_, k_]))
    extents = [const_int(iv.dom.extent) for iv in sch.get(block).iter_vars]
    if None in extents or extents[0] != 1:
        raise ValueError("batched or symbolic matmul")
    return extents[1], extents[2]


def _schedule(sch: s_tir.Schedule, config: SimtConfig | None) -> str:
    stats, block = _split_blocks(sch)
    # 1. Canonical layout, padded to the tile (zero rows / columns, predicated stores).
    m, n = _canonical(sch, block)
    cfg = config or pick_config(m, n)
    sch.pad_einsum(block, [1, cfg.block_m, cfg.block_n, cfg.block_k])
    # The epilogue becomes one block reading the padded C. It cannot be inlined into the
    # matmul's store (reverse_compute_inline refuses a consumer that also reads the statistics,
    # which this function writes), so it drives the loops instead (below).
    blocks = sch.get_child_blocks(sch.get_sblock("root"))
    at = [sch.get(b).same_as(sch.get(block)) for b in blocks].index(True)
    after = blocks[at + 1:]
    for b in after[:-1]:
        sch.compute_inline(b)
    epilogue = after[-1]

    # 2. The epilogue's (rows, columns) tiled over blocks × threads × registers (rows fused
    # when the output is (B, S, N)); the matmul is computed at each thread's tile, the
    # statistics at each block's: both are producers of the epilogue.
    *rows, col = sch.get_loops(epilogue)
    row = sch.fuse(*rows) if len(rows) > 1 else rows[0]
    by, ty, tm = sch.split(row, [None, cfg.threads_y, cfg.thread_m])
    bx, tx, tn = sch.split(col, [None, cfg.threads_x, cfg.thread_n])
    sch.reorder(by, bx, ty, tx, tm, tn)
    sch.bind(by, "blockIdx.y")
    sch.bind(bx, "blockIdx.x")
    sch.bind(ty, "threadIdx.y")
    sch.bind(tx, "threadIdx.x")
    sch.unroll(tm)
    tn_o, tn_i = sch.split(tn, [None, min(cfg.vec, cfg.thread_n)])
    sch.unroll(tn_o)
    try:
        sch.vectorize(tn_i)
    except Exception:  # noqa: BLE001 - predicated columns (N not a multiple of the tile)
        sch.unroll(tn_i)
    sch.compute_at(block, tx, preserve_unit_loops=True)
    sch.set_scope(block, 0, "local")
    *_, m_loop, n_loop, k_loop = sch.get_loops(block)
    ko, ki = sch.split(k_loop, [None, cfg.block_k])
    sch.reorder(ko, ki, m_loop, n_loop)
    sch.unroll(ki)

    # 3. Global → shared, all threads, 16-byte loads; A stored K-major so that a thread's
    # rows are one vector read (x_s[k, i], W_s[k, j]); then shared → registers per k step.
    def to_shared(index: int, transpose: bool):
        copy = sch.cache_read(block, index, "shared")
        sch.compute_at(copy, ko, preserve_unit_loops=True)
        loops = sch.get_loops(copy)[-2:]
        _, c_ty, c_tx, vec = sch.split(sch.fuse(*loops),
                                       [None, cfg.threads_y, cfg.threads_x, VECTOR_BYTES // 4])
        sch.bind(c_ty, "threadIdx.y")
        sch.bind(c_tx, "threadIdx.x")
        sch.vectorize(vec)
        if transpose:
            sch.transform_layout(copy, ("write", 0), lambda s, r, c: (s, c, r))
        auto_inline_producers(sch, copy)

    def to_registers(index: int, width: int):
        frag = sch.cache_read(block, index, "local")
        sch.compute_at(frag, ki, preserve_unit_loops=True)
        last = sch.get_loops(frag)[-1]
        if width > 1:
            _, v = sch.split(last, [None, width])
            sch.vectorize(v)

    to_shared(0, transpose=True)
    to_shared(1, transpose=False)
    to_registers(0, min(cfg.vec, cfg.thread_m))
    to_registers(1, min(cfg.vec, cfg.thread_n))
    sch.unroll(m_loop)
    sch.unroll(n_loop)
    sch.decompose_reduction(block, ko)

    # 4. The block's row statistics, before its main loop, into shared memory: rows over
    # threadIdx.y, K over threadIdx.x (a cross-thread sum), row scalars one per thread.
    for stat in reversed(stats):
        sch.compute_at(stat, bx, preserve_unit_loops=True)
    for stat in stats:
        stmt = sch.get(stat)
        loops = sch.get_loops(stat)[2:]
        sch.set_scope(stat, 0, "shared")
        if any(iv.iter_type == tirx.IterVar.CommReduce for iv in stmt.iter_vars):
            r, _unit, c = loops
            r_o, r_ty = sch.split(r, [None, cfg.threads_y])
            c_o, c_tx = sch.split(c, [None, cfg.threads_x])
            sch.reorder(r_ty, r_o, c_tx, c_o)
            sch.bind(r_ty, "threadIdx.y")
            sch.bind(c_tx, "threadIdx.x")
        else:
            _, f_ty, f_tx = sch.split(sch.fuse(*loops), [None, cfg.threads_y, cfg.threads_x])
            sch.bind(f_ty, "threadIdx.y")
            sch.bind(f_tx, "threadIdx.x")
    return f"{cfg.block_m}x{cfg.block_n}x{cfg.block_k}t{cfg.thread_m}x{cfg.thread_n}"
