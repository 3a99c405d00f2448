"""Row statistics: reductions over a row's trailing columns whose outputs are row scalars only.

    layer_norm_stats:  mean = Σ_k x[r, k] / N,   rstd = rsqrt(Σ_k (x[r, k] − mean)² / N + eps)
    rms_norm_stats:    rstd = rsqrt(Σ_k x[r, k]² / N + eps)
    x (..., N) → mean, rstd (..., 1) in fp32

NormGemmPrologue (``passes/norm_gemm.py``) emits these kernels; its GEMM applies the statistics in
its epilogue. On sm_90a with fp16 / bf16 GEMMs they do not run at all: the wgmma GEMM computes
them itself (``gemm_sm90_stats.py``); this rule schedules the ones that remain.
The shape this rule takes, after row-wide elementwise producers (casts) are inlined:
blocks that are reductions over the row's columns (iterators ``S…S R…R``) or row scalars (rows
only), the last a row scalar, and 1–2 outputs, all row scalars. :class:`~.row_norm.RowNorm` takes
the functions whose last block writes whole rows; this rule shares its analysis and layout:

* one thread block per row (``threadIdx.y`` packs several short rows into one block); columns
  split ``[J, T, V]``, column ``k = (j·T + t)·V + v``, with ``V`` one 16-byte vector of ``x``;
* ``x`` is read from global memory ONCE, with 16-byte vector loads, into a per-thread register
  tile of ``J·V`` values;
* every reduction reads that tile: an unrolled in-thread part, then warp shuffles and one
  shared-memory step across warps. LayerNorm's second reduction is the exact two-pass form
  Σ(x − mean)² on the registers (no E[x²] − E[x]² cancellation) and costs no memory traffic;
* a row scalar a later block reads (``mean``) is computed by every thread into a register; each
  output scalar is written once per row, by the row's thread ``t = 0``.

On the H200 (kernel time, 8192 × 4096 fp16): LayerNorm stats 17.8 µs (3.78 TB/s of x), RMSNorm
stats 16.5 µs (4.06 TB/s); before this rule dlight's Fallback took 4.32 ms (one thread a row) for
the former and its Reduction rule 42.0 µs for the latter (tools/bench/results/
archive-2026-11-30-to-12-02.tar.xz: 2026-11-30-row-stats.json).

Returns ``None`` for anything else (row-wide outputs, more than two outputs, symbolic shapes, rows
of a prime number of vectors, tiles over the register budget): dlight's rules take those.
"""

from __future__ import annotations

import math

from tvm import s_tir, tirx

from ..attrs import RULE_ATTR
from ..kernels.tir_util import dtype_bytes
from ._rule import PrimFuncRule
from .elementwise import VECTOR_BYTES, vector_copy
from .row_norm import (
    MAX_TILE_BYTES,
    _analyse,
    _block_kind,
    _dtype,
    _index_map,
    _inline,
    _iter_dtype,
    _thread_loops,
    _tile_inputs,
    _write_roles,
    cache_tiles,
    choose_threads,
)

NAME = "row_stats"
MAX_OUTPUTS = 2


def _first_thread_only(sch: s_tir.Schedule, block, t_row: int) -> None:
    """Run ``block`` on thread ``t = 0`` of its row only: a unit loop split imperfectly into
    ``[t_row, 1]`` gets the predicate ``t < 1`` and binds to threadIdx.x like the other loops."""
    t, _ = sch.split(sch.add_unit_loop(block), [t_row, 1])
    sch.bind(t, "threadIdx.x")


class RowStats(PrimFuncRule):
    """Per-row statistics (mean, rstd): one read of x into registers, reductions from registers."""

    def _schedule(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        params = set(func.params)
        sch = s_tir.Schedule(func)
        shape = _analyse(sch, last_kind="scalar")
        if shape is None or not _inline(sch, shape, params):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        kinds = [_block_kind(sch, b, shape) for b in blocks]
        if set(kinds) != {"reduce", "scalar"} or kinds[-1] != "scalar":
            return None
        if any(len(sch.get(b).writes) != 1 for b in blocks):
            return None
        outputs = [b for b in blocks if sch.get(b).writes[0].source in params]
        if not 1 <= len(outputs) <= MAX_OUTPUTS or any(
                _block_kind(sch, b, shape) != "scalar" for b in outputs):
            return None
        if any(_write_roles(sch, b, shape) is None for b in blocks):
            return None

        tiles = _tile_inputs(sch, blocks, shape, params)
        if not tiles:
            return None
        vec = VECTOR_BYTES // min(dtype_bytes(b) for b, _, _ in tiles)
        while shape.ncols % vec:
            vec //= 2
        choice = choose_threads(shape.ncols // vec, math.prod(shape.rows))
        if choice is None:
            return None
        t_row, r_blk = choice
        j_vec = shape.ncols // vec // t_row
        if sum(j_vec * vec * dtype_bytes(b) for b, _, _ in tiles) > MAX_TILE_BYTES:
            return None

        # Phase 1 — tiles and layouts: x via cache_read into (row, [j,] t, v); an output that a
        # later block reads (mean) is computed into a register and stored from there.
        copies = set(cache_tiles(sch, tiles, shape, t_row, vec))
        for block in outputs:
            consumers = sch.get_consumers(block)
            if consumers:
                sch.cache_write(block, 0, "local", consumer_blocks=consumers)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        # Roles and kinds first: they are read off the iterators that the layouts replace.
        plan = [(b, sch.get(b), _block_kind(sch, b, shape), _write_roles(sch, b, shape))
                for b in blocks]
        role = {}
        for block, stmt, kind, write_roles in plan:
            if stmt.name_hint in copies:
                role[stmt.name_hint] = "copy"
                continue
            sch.transform_block_layout(block, _index_map(shape.iter_roles(stmt), shape, t_row, vec,
                                                         _iter_dtype(sch, block)))
            written = stmt.writes[0].source
            if written in params:
                role[stmt.name_hint] = "store"
                continue
            sch.transform_layout(block, ("write", 0), _index_map(
                write_roles, shape, t_row, vec, _dtype(written.shape)))
            role[stmt.name_hint] = kind
        # Simplify the (j·TV + t·V + v) // TV … indices so buffer compaction sees the tile.
        sch = s_tir.Schedule(s_tir.transform.StmtSimplify()(sch.mod))
        blocks = sch.get_child_blocks(sch.get_sblock("root"))

        # Phase 2 — loops. The first block (a load of x) fixes them: row → blockIdx.x (and
        # threadIdx.y). Every later block follows under the row loop in program order
        # (reverse_compute_at: its producers are there already; compute_at would need all its
        # consumers there, and the output stores cannot move that way).
        row = sch.get_loops(blocks[0])[0]
        if r_blk > 1:
            bx, row = sch.split(row, [None, r_blk])
            sch.bind(bx, "blockIdx.x")
            sch.bind(row, "threadIdx.y")
        else:
            sch.bind(row, "blockIdx.x")
        # Reduction results: registers for a row within one warp (shuffles leave the result in
        # every lane), shared memory for a row of several warps (see row_norm._schedule).
        warp = t_row <= 32 and t_row & (t_row - 1) == 0
        n_inner = 3 if j_vec > 1 else 2
        for i, block in enumerate(blocks):
            kind = role[sch.get(block).name_hint]
            if i > 0:
                sch.reverse_compute_at(block, row, preserve_unit_loops=False)
            if kind == "store":
                _first_thread_only(sch, block, t_row)
            elif kind == "scalar":
                sch.set_scope(block, 0, "local")
            else:
                _, v = _thread_loops(sch, sch.get_loops(block)[-n_inner:])
                if kind == "copy":
                    vector_copy(sch, v, VECTOR_BYTES // dtype_bytes(sch.get(block).writes[0].source))
                else:
                    sch.unroll(v)
                    sch.set_scope(block, 0, "local" if warp else "shared")
        return s_tir.Schedule(sch.mod["main"].with_attr(RULE_ATTR, NAME))
