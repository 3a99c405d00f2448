"""Row reductions followed by elementwise work over the same row: LayerNorm, RMSNorm, softmax.

The shape this rule takes, after elementwise blocks are inlined::

    R1(x) → [s1 = f(R1)] → [m = g(x, s1)] → R2(x or m) → ... → E(x, m, s…, w, b) → y

Every reduction ``R`` runs over the trailing "column" dims of a row (iterators ``S…S R…R``, the
same rows and columns for all), the optional row scalars ``s`` (``mean = sum / N``, ``rsqrt(…)``)
have the row dims only, and the last block ``E`` writes the output over ``rows × columns``.
Unit dims (``keepdim=True`` reductions) are ignored. Rows need not be one dim: (B, S, N) and
(B, H, S, S) inputs have 2 and 3 row dims, flattened into one.

Schedule — one thread block per row, or ``r_blk`` rows (threadIdx.y) of a short-row problem:

* the columns are split ``[J, T, V]``: ``V`` elements = one 16-byte vector of the narrowest dtype
  (8 × fp16, 4 × fp32), ``T`` threads (threadIdx.x), ``J`` vectors per thread; column
  ``k = (j·T + t)·V + v``, so every warp access is coalesced;
* every input read along the row (``x``, a mask, ``weight``, ``bias``) is read from global memory
  ONCE, with 16-byte vector loads, into a per-thread register tile ``[J, V]`` (``cache_read`` into
  "local", relaid out to ``[row, J, T, V]`` so that buffer compaction leaves ``J·V`` registers a
  thread); the loads are issued first so their latency overlaps the reductions;
* a row-shaped intermediate read by more than one later block (softmax's ``exp(x − max)``) is
  computed once into registers instead of in each consumer;
* reductions read the register tile: an unrolled in-thread part over ``J·V`` values, then TVM's
  cross-thread reduction lowering (warp shuffles, one shared-memory step across warps); the
  result is published in shared memory (see the note in ``_schedule`` on why not "local");
* row scalars are computed once per thread into registers, so that ``E`` sees plain registers
  and nvcc hoists ``rsqrt(var + eps)`` out of the per-element code;
* ``E`` is unrolled scalar code on registers into an output tile, stored with 16-byte vectors
  (``cache_write``). Loads and stores are plain vector copies: TVM's CUDA codegen has no 8-lane
  fp32 vectors, which vectorising the half-precision math itself would need.

``V`` halves until it divides the row length (a 4100-wide fp16 row gets 8-byte vectors, so that
every row starts aligned); ``T`` is a divisor of ``N / V`` (so there is no column predicate), a
multiple of 32 where possible, with about ``VECTORS_PER_THREAD`` vectors per thread. On the H200,
8192 × 4096 fp16 LayerNorm runs in 34.7 µs (3.87 TB/s, kernel time), fp32 LayerNorm / RMSNorm /
softmax at 4.0-4.1 TB/s; fp16 softmax (49 µs) is bound by the instruction count of TVM's fp16
max / exp / divide code, not by memory. Returns ``None`` — dlight's rules
then take the function — for other shapes, symbolic shapes, rows of a prime number of vectors,
and tiles that would not fit in registers.
"""

from __future__ import annotations

import math

import tvm
from tvm import s_tir, tirx
from tvm.s_tir.dlight.analysis import normalize_prim_func

from ..attrs import RULE_ATTR
from ..kernels.tir_util import UnknownExpr, const_int, dtype_bytes, dtype_of, substitute
from ..passes._util import is_copy
from ._rule import PrimFuncRule
from .elementwise import VECTOR_BYTES, vector_copy

NAME = "row_norm"
MAX_THREADS = 1024
MAX_TILE_BYTES = 512  # register tiles of one thread: all inputs, kept intermediates and the output
MIN_BLOCK_THREADS = 128  # short rows: rows are packed into a thread block up to this many threads
VECTORS_PER_THREAD = 2  # long rows: the number of 16-byte vectors of a row each thread aims for

Role = tuple  # ("row", i) | ("col", i) | ("unit",) | ("const", value)




def choose_threads(n_vec: int, rows: int) -> tuple[int, int] | None:
    """``(threads per row, rows per thread block)`` for rows of ``n_vec`` vectors, or None.

    Threads per row divide ``n_vec``. Long rows get 32 … 1024 threads (multiples of 32 first) with
    about ``VECTORS_PER_THREAD`` vectors each; rows of ≤ 32 vectors get the largest power-of-two
    (sub-)warp that divides them (None when that is one thread), and rows are packed so that a
    thread block has at least ``MIN_BLOCK_THREADS`` threads.
    """
    if n_vec <= 32:
        # A power of two, so that TVM lowers the reduction to warp shuffles whose result every
        # lane holds in a register (other sub-warp sizes go through shared memory).
        t_row = n_vec & -n_vec
        if t_row == 1:
            return None
    else:
        best = None
        for t in range(32, min(MAX_THREADS, n_vec) + 1):
            if n_vec % t:
                continue
            score = (t % 32 != 0, abs(math.log2(n_vec / t / VECTORS_PER_THREAD)), -t)
            if best is None or score < best[0]:
                best = (score, t)
        if best is None:
            return None
        t_row = best[1]
    # Several rows share a block only when each row is one (sub-)warp: TVM 0.27 lowers a
    # reduction of several warps per row with several rows per block wrongly on the GPU
    # (LayerNorm 256×512 fp32 gave NaN on the H200: 64 threads a row, 2 rows a block).
    r_blk = max(1, min(MIN_BLOCK_THREADS // t_row, rows)) if t_row <= 32 else 1
    return t_row, r_blk


class _Shape:
    """The rows × columns of the function; block kinds are decided on non-unit iterators."""

    def __init__(self, rows: list[int], cols: list[int]) -> None:
        self.rows, self.cols = rows, cols

    @property
    def ncols(self) -> int:
        return math.prod(self.cols)

    def kind(self, dom: list[int] | None, dom_kind: str) -> str | None:
        """'reduce', 'row' (rows × cols), 'scalar' (rows), 'col' (cols) or None."""
        if dom is None:
            return None
        kept = [(k, d) for k, d in zip(dom_kind, dom) if d != 1]
        dom_kind, dom = "".join(k for k, _ in kept), [d for _, d in kept]
        r, c = len(self.rows), len(self.cols)
        if dom_kind == "S" * r + "R" * c and dom == self.rows + self.cols:
            return "reduce"
        if set(dom_kind) - {"S"}:
            return None
        if dom == self.rows + self.cols:
            return "row"
        if dom == self.rows:
            return "scalar"
        if dom == self.cols:
            return "col"
        return None

    def iter_roles(self, stmt) -> list[Role]:
        """Role of each block iterator: unit, or the i-th row / column dim (in order)."""
        roles, n = [], 0
        for iv in stmt.iter_vars:
            if const_int(iv.dom.extent) == 1:
                roles.append(("unit",))
                continue
            roles.append(("row", n) if n < len(self.rows) else ("col", n - len(self.rows)))
            n += 1
        return roles


def _analyse(sch: s_tir.Schedule, last_kind: str = "row") -> _Shape | None:
    """Rows × columns of the reductions, when every block fits them and the last is ``last_kind``."""
    infos = normalize_prim_func(sch)
    if not infos:
        return None
    reductions = [b for b in infos if "R" in b.dom_kind()]
    if not reductions:
        return None
    pairs = [(k, d) for k, d in zip(reductions[0].dom_kind(), _ints(reductions[0].dom()) or [])
             if d != 1]
    kind = "".join(k for k, _ in pairs)
    n_rows = len(kind) - len(kind.lstrip("S"))
    if not pairs or n_rows == 0 or kind != "S" * n_rows + "R" * (len(kind) - n_rows):
        return None
    dom = [d for _, d in pairs]
    shape = _Shape(dom[:n_rows], dom[n_rows:])
    if any(shape.kind(_ints(b.dom()), b.dom_kind()) is None for b in infos):
        return None
    if shape.kind(_ints(infos[-1].dom()), infos[-1].dom_kind()) != last_kind:
        return None
    return shape


def _ints(exprs) -> list[int] | None:
    out = [const_int(e) for e in exprs]
    return None if any(v is None for v in out) else out


def _block_kind(sch: s_tir.Schedule, block, shape: _Shape) -> str | None:
    stmt = sch.get(block)
    kinds = "".join("S" if iv.iter_type == tirx.IterVar.DataPar else
                    "R" if iv.iter_type == tirx.IterVar.CommReduce else "O"
                    for iv in stmt.iter_vars)
    return shape.kind(_ints([iv.dom.extent for iv in stmt.iter_vars]), kinds)


def _inline(sch: s_tir.Schedule, shape: _Shape, params: set,
            keep: frozenset[str] | set[str] = frozenset()) -> bool:
    """Inline every rows × cols and cols-only spatial block except the last, the ones worth
    keeping in registers and the ``keep`` ones (register tiles of :func:`_reindex_tiles`); False
    when one cannot be inlined (then this is not our shape)."""
    root = sch.get_sblock("root")
    changed = True
    while changed:
        changed = False
        for block in sch.get_child_blocks(root)[:-1]:
            kind = _block_kind(sch, block, shape)
            if kind not in ("row", "col") or sch.get(block).name_hint in keep:
                continue
            if any(w.source in params for w in sch.get(block).writes):
                return False  # a second output
            if kind == "row" and _keep_in_registers(sch, block, shape):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                return False
            changed = True
            break
    return True


def inline_copies(sch: s_tir.Schedule) -> bool:
    """Inline the data-movement blocks of ``sch`` into their readers: a norm fused with the slice
    and reshape that made its input (Qwen3's per-head q / k norms of the QKV GEMM's output,
    ``passes/norm_input_copies.py``) then reads that output directly, ``x[t, a + h·D + d]``.
    True when a block was inlined."""
    params = set(sch.mod["main"].params)
    inlined = False
    while True:  # again after each inline: the block list has changed
        for block in sch.get_child_blocks(sch.get_sblock("root"))[:-1]:
            stmt = sch.get(block)
            if not is_copy(stmt) or any(w.source in params for w in stmt.writes):
                continue
            try:
                sch.compute_inline(block)
            except s_tir.ScheduleError:
                continue
            inlined = True
            break
        else:
            return inlined


def _flat_index(region, buffer) -> tirx.PrimExpr | None:
    """Row-major element offset of a point access (None for a region wider than one point)."""
    if any(const_int(r.extent) != 1 for r in region):
        return None
    offset = tirx.const(0, "int64")
    for rng, dim in zip(region, buffer.shape):
        offset = offset * tirx.Cast("int64", dim) + tirx.Cast("int64", rng.min)
    return offset


def _reindex_tiles(sch: s_tir.Schedule, shape: _Shape, params: set) -> set[str]:
    """Register tiles for inputs read at a merged index (``x[t, a + h·D + d]`` after
    :func:`inline_copies`), which ``cache_read`` cannot lay out per row: their one reader's read
    becomes a copy block into a (rows × cols) buffer (``reindex``) that is scheduled like the
    ``cache_read`` tiles, 16-byte vectors in. Taken when the offset is ``base + d`` with ``d``
    the one column iterator and ``base`` a multiple of 16 bytes for every row (so each vector is
    one aligned load); returns the copy blocks' names."""
    if len(shape.cols) != 1:
        return set()
    names = set()
    for block in sch.get_child_blocks(sch.get_sblock("root")):
        stmt = sch.get(block)
        if _block_kind(sch, block, shape) != "row":
            continue
        for index, region in enumerate(stmt.reads):
            buffer = region.source
            if buffer not in params or _region_roles(stmt, region.region, buffer, shape) is not None:
                continue
            if _reindex_offset_aligned(stmt, region, shape) and _read_once(sch, buffer):
                copy = sch.reindex(block, ("read", index))
                sch.set_scope(copy, 0, "local")
                names.add(sch.get(copy).name_hint)
                break
    return names


def _read_once(sch: s_tir.Schedule, buffer) -> bool:
    """True when one block of the function reads ``buffer`` (``reindex`` copies one reader's)."""
    readers = [b for b in sch.get_child_blocks(sch.get_sblock("root"))
               if any(r.source.same_as(buffer) for r in sch.get(b).reads)]
    return len(readers) == 1


def _reindex_offset_aligned(stmt, region, shape: _Shape) -> bool:
    """The access's flat offset is ``base + d`` (``d`` the column iterator, ``base`` free of it)
    with ``base`` a multiple of one 16-byte vector."""
    offset = _flat_index(region.region, region.source)
    roles = shape.iter_roles(stmt)
    cols = [iv for iv, r in zip(stmt.iter_vars, roles) if r[0] == "col"]
    if offset is None or len(cols) != 1:
        return False
    analyzer = tvm.sym.Analyzer()
    for iv in stmt.iter_vars:
        analyzer.bind(iv.var, iv.dom)
    col = cols[0].var
    zero = tirx.const(0, dtype_of(col))
    try:
        base = substitute(offset, [(col, zero)])
    except UnknownExpr:
        return False
    if not analyzer.can_prove_equal(offset - base, tirx.Cast("int64", col)):
        return False
    lanes = VECTOR_BYTES // dtype_bytes(region.source)
    return analyzer.can_prove_equal(tirx.floormod(base, lanes), tirx.const(0, "int64"))


def _keep_in_registers(sch: s_tir.Schedule, block, shape: _Shape) -> bool:
    """A rows × cols block that depends on a reduction and feeds more than one block (softmax's
    exp): computing it once into registers beats recomputing it in each consumer."""
    if len(sch.get_consumers(block)) < 2:
        return False
    return any(_block_kind(sch, p, shape) in ("reduce", "scalar") for p in sch.get_producers(block))


def _region_roles(stmt, region, buffer, shape: _Shape) -> list[Role] | None:
    """Role of each buffer dim in one access: the iterator it is indexed by, a unit dim, or a
    constant inside the dim; None for anything else (or an index that could leave the dim)."""
    roles = []
    iter_roles = dict(zip((iv.var for iv in stmt.iter_vars), shape.iter_roles(stmt)))
    for rng, dim in zip(region, buffer.shape):
        if const_int(rng.extent) != 1:
            return None
        role = next((r for v, r in iter_roles.items() if rng.min.same_as(v)), None)
        if role is not None and role[0] in ("row", "col"):
            extent = (shape.rows if role[0] == "row" else shape.cols)[role[1]]
            if const_int(dim) != extent:
                return None
            roles.append(role)
        elif const_int(dim) == 1:
            roles.append(("unit",))
        elif const_int(rng.min) is not None and 0 <= const_int(rng.min) < (const_int(dim) or 0):
            roles.append(("const", const_int(rng.min)))
        else:
            return None
    return roles


def _tile_inputs(sch: s_tir.Schedule, blocks: list, shape: _Shape, params: set) -> list:
    """``[(buffer, [reader blocks], dim roles)]`` of the inputs read into register tiles with
    vector loads: every reader reads the row's columns in order as the last non-unit dims
    (``x[row, k]``, ``mask[s, k]``, ``weight[k]``). Other inputs stay scalar loads."""
    readers: dict = {}
    for block in blocks:
        stmt = sch.get(block)
        for region in stmt.reads:
            if region.source in params:
                readers.setdefault(region.source, []).append((block, stmt, region.region))
    n_cols = len(shape.cols)
    result = []
    for buffer, reads in readers.items():
        patterns = set()
        for _, stmt, region in reads:
            roles = _region_roles(stmt, region, buffer, shape)
            patterns.add(None if roles is None else tuple(roles))
        if len(patterns) != 1 or None in patterns:
            continue
        roles = list(patterns.pop())
        kept = [r for r in roles if r[0] != "unit"]
        if kept[len(kept) - n_cols:] != [("col", i) for i in range(n_cols)]:
            continue
        if any(r[0] == "col" for r in kept[: len(kept) - n_cols]):
            continue
        result.append((buffer, [b for b, _, _ in reads], roles))
    return result


def _index_map(roles: list[Role], shape: _Shape, t_row: int, vec: int,
               dtype: str = "int64") -> tirx.IndexMap:
    """``dims → (row, [j,] t, v)``: unit dims dropped, the row dims (when all present, in order)
    flattened into one, other leading dims kept, column k = (j·T + t)·V + v. No ``j`` axis with one
    vector per thread (a unit loop would be simplified away); no ``j, t, v`` without columns."""
    row_roles = [r for r in roles if r[0] == "row"]
    flatten = row_roles == [("row", i) for i in range(len(shape.rows))]
    has_cols = any(r[0] == "col" for r in roles)
    with_j = shape.ncols > t_row * vec

    def fmap(*idx):
        lead, rows, cols = [], [], []
        for i, role in zip(idx, roles):
            if role[0] == "col":
                cols.append(i)
            elif role[0] == "row" and flatten:
                rows.append(i)
            elif role[0] != "unit":
                lead.append(i)
        if rows:
            row = rows[0]
            for extent, i in zip(shape.rows[1:], rows[1:]):
                row = row * extent + i
            lead = [row, *lead]
        if not has_cols:
            return tuple(lead)
        k = cols[0]
        for extent, i in zip(shape.cols[1:], cols[1:]):
            k = k * extent + i
        j = (k // (t_row * vec),) if with_j else ()
        return (*lead, *j, k // vec % t_row, k % vec)

    return tirx.IndexMap.from_func(fmap, ndim=len(roles), index_dtype=dtype)


def _dtype(exprs) -> str:
    """The index dtype of a buffer shape (int64 from Relax, int32 from TE)."""
    return next((str(e.ty) for e in exprs if hasattr(e, "ty")), "int64")


def _iter_dtype(sch: s_tir.Schedule, block) -> str:
    return _dtype([iv.var for iv in sch.get(block).iter_vars])


def _write_roles(sch: s_tir.Schedule, block, shape: _Shape) -> list[Role] | None:
    stmt = sch.get(block)
    write = stmt.writes[0]
    return _region_roles(stmt, write.region, write.source, shape)


def cache_tiles(sch: s_tir.Schedule, tiles: list, shape: _Shape, t_row: int, vec: int) -> list[str]:
    """Read each tiled input (:func:`_tile_inputs`) once into a register tile laid out
    ``(row, [j,] t, v)``, shared by all its readers; returns the copy blocks' names."""
    names = []
    for buffer, readers, roles in tiles:
        stmt = sch.get(readers[0])
        index = next(i for i, r in enumerate(stmt.reads) if r.source.same_as(buffer))
        cache = sch.cache_read(readers[0], index, "local", consumer_blocks=readers)
        sch.transform_layout(cache, ("write", 0),
                             _index_map(roles, shape, t_row, vec, _dtype(buffer.shape)))
        sch.transform_block_layout(cache, _index_map(roles, shape, t_row, vec,
                                                     _iter_dtype(sch, cache)))
        names.append(sch.get(cache).name_hint)
    return names


def _thread_loops(sch: s_tir.Schedule, loops: list) -> tuple:
    """``[j,] t, v`` → ``t`` bound to threadIdx.x outside an unrolled ``j``; returns ``(t, v)``."""
    if len(loops) == 3:
        j, t, v = loops
        sch.reorder(t, j, v)
        sch.unroll(j)
    else:
        t, v = loops
    sch.bind(t, "threadIdx.x")
    return t, v


class RowNorm(PrimFuncRule):
    """LayerNorm / RMSNorm / softmax-like rows: one read of x into registers, 16-byte vectors."""

    def _schedule(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        if inline_copies(sch):
            func = sch.mod["main"]
        shape = _analyse(sch)
        return None if shape is None else self._schedule_rows(func, shape)

    def _schedule_rows(self, func: tirx.PrimFunc, shape: _Shape) -> s_tir.Schedule | None:
        params = set(func.params)
        sch = s_tir.Schedule(func)
        copies = _reindex_tiles(sch, shape, params)
        if not _inline(sch, shape, params, copies):
            return None
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        kinds = [_block_kind(sch, b, shape) for b in blocks]
        if kinds[-1] != "row" or "col" in kinds or "reduce" not in kinds or None in kinds:
            return None
        if any(w.source in params for b in blocks[:-1] for w in sch.get(b).writes):
            return None  # only the last block may write a function parameter
        if any(len(sch.get(b).writes) != 1 for b in blocks):
            return None
        kept = [b for b, k in zip(blocks[:-1], kinds[:-1]) if k == "row"]
        out_buf = sch.get(blocks[-1]).writes[0].source

        # Vector width: the narrowest dtype of the tiles gets 16-byte vectors, wider ones several.
        tiles = _tile_inputs(sch, blocks, shape, params)
        tile_bufs = [b for b, _, _ in tiles] + [sch.get(b).writes[0].source for b in kept]
        tile_bufs.append(out_buf)
        vec = VECTOR_BYTES // min(dtype_bytes(b) for b in tile_bufs)
        while shape.ncols % vec:
            vec //= 2
        choice = choose_threads(shape.ncols // vec, math.prod(shape.rows))
        if choice is None:
            return None
        t_row, r_blk = choice
        j_vec = shape.ncols // vec // t_row
        if sum(j_vec * vec * dtype_bytes(b) for b in tile_bufs) > MAX_TILE_BYTES:
            return None
        write_roles = {i: _write_roles(sch, b, shape) for i, b in enumerate(blocks)}
        if None in write_roles.values():
            return None
        # A kept tile lives in the registers of the thread that computed it: every reader must
        # read it at its own (row, column), as it was written.
        natural = [("row", i) for i in range(len(shape.rows))] + [
            ("col", i) for i in range(len(shape.cols))]
        for i, block in enumerate(blocks[:-1]):
            if kinds[i] != "row":
                continue
            if [r for r in write_roles[i] if r[0] != "unit"] != natural:
                return None
            buffer = sch.get(block).writes[0].source
            for consumer in sch.get_consumers(block):
                stmt = sch.get(consumer)
                for region in stmt.reads:
                    if region.source.same_as(buffer) and _region_roles(
                            stmt, region.region, buffer, shape) != write_roles[i]:
                        return None

        # Phase 1 — tiles and layouts. Inputs via cache_read, the output via cache_write, kept
        # intermediates in place; every block iterates (row, [j,] t, v) or (row,), every tile
        # and row-scalar buffer is laid out the same way.
        role = {name: "copy" for name in cache_tiles(sch, tiles, shape, t_row, vec)}
        out_roles = write_roles[len(blocks) - 1]
        store = sch.cache_write(blocks[-1], 0, "local")
        sch.transform_layout(blocks[-1], ("write", 0),
                             _index_map(out_roles, shape, t_row, vec, _dtype(out_buf.shape)))
        sch.transform_block_layout(store, _index_map(out_roles, shape, t_row, vec,
                                                     _iter_dtype(sch, store)))
        role[sch.get(store).name_hint] = "copy"
        for i, (block, kind) in enumerate(zip(blocks, kinds)):
            stmt = sch.get(block)
            sch.transform_block_layout(block, _index_map(shape.iter_roles(stmt), shape, t_row, vec,
                                                         _iter_dtype(sch, block)))
            if i < len(blocks) - 1:
                written = stmt.writes[0].source
                sch.transform_layout(block, ("write", 0), _index_map(
                    write_roles[i], shape, t_row, vec, _dtype(written.shape)))
            role[stmt.name_hint] = ("copy" if stmt.name_hint in copies else
                                    "compute" if kind == "row" else kind)
        # Simplify the (j·TV + t·V + v) // TV … indices so buffer compaction sees the tiles.
        sch = s_tir.Schedule(s_tir.transform.StmtSimplify()(sch.mod))
        blocks = sch.get_child_blocks(sch.get_sblock("root"))

        # Phase 2 — loops. The output store fixes them: row → blockIdx.x (and threadIdx.y).
        loops = sch.get_loops(blocks[-1])
        row = loops[0]
        if r_blk > 1:
            bx, row = sch.split(row, [None, r_blk])
            sch.bind(bx, "blockIdx.x")
            sch.bind(row, "threadIdx.y")
        else:
            sch.bind(row, "blockIdx.x")
        _, v = _thread_loops(sch, loops[1:])
        vector_copy(sch, v, VECTOR_BYTES // dtype_bytes(sch.get(blocks[-1]).writes[0].source))

        # Everything else moves under the row loop, producers in front of their consumers:
        # vector copies in, unrolled scalar compute and reductions on registers.
        n_inner = 3 if j_vec > 1 else 2
        # Where the reduction results live. A row inside one warp (a power of two ≤ 32 threads)
        # is reduced with shuffles that leave the result in every lane's registers: "local".
        # A row of several warps is reduced through shared memory; its result must be declared
        # "shared" (written once after the allreduce, read after a barrier): declared "local",
        # TVM's allreduce lowering turns it into a volatile shared word, StorageRewrite may then
        # reuse that word in place for a row scalar, and the threads of the row race on it.
        # ("shared" for a sub-warp row is no good either: nothing orders the write of lane 0 and
        # the reads of the other lanes, and StorageRewrite shares the word between reductions.)
        warp = t_row <= 32 and t_row & (t_row - 1) == 0
        for block in reversed(blocks[:-1]):
            kind = role[sch.get(block).name_hint]
            # Loads go first (index -2: the earliest legal spot) to overlap the reductions.
            sch.compute_at(block, row, preserve_unit_loops=False, index=-2 if kind == "copy" else -1)
            if kind == "scalar":
                sch.set_scope(block, 0, "local")
                continue
            _, v = _thread_loops(sch, sch.get_loops(block)[-n_inner:])
            if kind == "copy":
                vector_copy(sch, v, VECTOR_BYTES // dtype_bytes(sch.get(block).writes[0].source))
                continue
            sch.unroll(v)
            sch.set_scope(block, 0, "shared" if kind == "reduce" and not warp else "local")
        return s_tir.Schedule(sch.mod["main"].with_attr(RULE_ATTR, NAME))
