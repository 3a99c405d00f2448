"""Injective / elementwise fused kernels: add, mul, gelu, silu, casts, bias broadcasts.

Every block must be spatial (no reduction, no opaque iterators); anything else returns ``None``.
All producers are inlined into the output block(s); each remaining block is scheduled as

    for bx in blockIdx.x:            # outer · inner / V / T blocks
      for tx in threadIdx.x:         # T = 256 threads (a divisor of the vectors, see below)
        in_local[V]  = in[...]       # one 16-byte vector load per contiguous input
        out_local[v] = f(in_local[v], other inputs...)   for v in 0..V-1 (unrolled, scalar)
        out[...]     = out_local[V]  # one 16-byte vector store

``V`` = 16 bytes / the narrowest dtype among the output and the contiguous inputs (8 × fp16,
4 × fp32; a wider dtype is copied as several 16-byte vectors), halved until it divides the
innermost extent; when it reaches 1 (odd innermost extent, symbolic innermost extent) the block
falls back to one scalar element per thread. An input is "contiguous"
when its last index is the innermost loop variable (a bias ``b[j]`` of ``y[i, j]`` is); the other
inputs (transposed reads, ``b[i, 0]``) stay scalar loads inside the compute. Loads and stores are
separate copy blocks so the vectorised code is a plain ``uint4`` copy: TVM's CUDA codegen has no
8-lane fp32 vectors, which the intermediate math of a half-precision chain would otherwise need.
The local → global copy placed by ``reverse_compute_at`` carries no predicate, so the vectorised
form is used only when T divides the vector count (T = the largest divisor ≤ 256, ≥ 32, or the
whole count when it is ≤ 256); otherwise (e.g. symbolic rows with a row not a multiple of T
vectors) the scalar form, whose block keeps its own bound check.

:class:`ElementwiseConfig` adds variants (:data:`VARIANTS`, picked by ``Options.elementwise_variant``):
k vectors a thread (k adjacent vectors, or k rows of the same columns so that per-channel inputs
are loaded once for k rows), ``__launch_bounds__(T, min blocks)``, and erf by A&S 7.1.26.
On the H200 the 5-op fp16 chain over 64 Mi elements (3 streams, ``v1``) runs at 3.74–3.77 TB/s
(kernel time); the variants' numbers are in tools/bench/NOTES.md.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import tvm
import tvm_ffi
from tvm import DataType, s_tir, tirx
from tvm.ir import Range
from tvm.s_tir.dlight.analysis import normalize_prim_func
from tvm.s_tir.dlight.base import try_inline

from ..attrs import RULE_ATTR
from ..kernels.gemm.opmath import fast_math16
from ..kernels.tir_util import BINARY_OPS, Call, Load, UnknownExpr, dtype_of, rebuild, substitute
from ..kernels.tir_util import const_int as _int
from ..kernels.tir_util import dtype_bytes as _bytes
from ..options import current_options
from ._rule import PrimFuncRule

NAME = "elementwise"
VECTOR_BYTES = 16
THREADS = 256
LAUNCH_BOUNDS_ATTR = "tirx.launch_bounds_min_blocks_per_sm"  # SplitHostDevice reads it


def _is_bool(buffer) -> bool:
    return str(buffer.dtype) == "bool"


def _in_bounds_contiguous(region, buffer, iter_vars) -> bool:
    """The read is ``buf[..., v_last]`` with every index an iterator spanning its dim exactly (or
    a constant inside it): in bounds by construction, so a vector copy of it is safe."""
    if not region or len(region) != len(buffer.shape):
        return False
    last = iter_vars[-1]
    if not region[-1].min.same_as(last.var):
        return False
    for rng, dim in zip(region, buffer.shape):
        if _int(rng.extent) != 1:
            return False
        var = next((iv for iv in iter_vars if rng.min.same_as(iv.var)), None)
        if var is not None:
            if _int(var.dom.extent) is None or _int(var.dom.extent) != _int(dim):
                return False
        elif _int(rng.min) is None or not 0 <= _int(rng.min) < (_int(dim) or 0):
            return False
    # The innermost iterator appears in the last index only.
    return all(not _uses(rng.min, last.var) for rng in region[:-1])


def _uses(expr, var) -> bool:
    found = []
    tvm_ffi.structural_walk(expr, (tirx.Var, lambda v: found.append(v.same_as(var))), order="post")
    return any(found)


def vector_copy(sch: s_tir.Schedule, loop, lanes: int) -> None:
    """Vectorise a copy loop in pieces of at most ``lanes`` (16 bytes): an 8-wide fp32 copy becomes
    two ``float4`` accesses (TVM's CUDA codegen has no 32-byte vector types)."""
    extent = _int(sch.get(loop).extent)
    if extent is not None and extent > lanes and extent % lanes == 0:
        outer, loop = sch.split(loop, [None, lanes])
        sch.unroll(outer)
    sch.vectorize(loop)


@dataclass(frozen=True)
class ElementwiseConfig:
    """How a vectorised elementwise block is spread over the GPU.

    ``vectors``: 16-byte vectors per thread per contiguous stream (k). k > 1 issues k independent
    loads per input before any math. ``row_reuse``: the k vectors of a thread are k rows of the same
    columns (stride = one row; k must divide the second-to-last dim), so per-channel inputs
    (``a[j]`` of ``y[i, j]``) are loaded once per thread, not k times; otherwise the k vectors are
    adjacent (one 16·k-byte piece a thread).
    ``min_blocks_per_sm``: ``__launch_bounds__(threads, m)``, capping registers so m blocks fit.
    ``fast_erf``: in blocks with an fp16 / bf16 output, fp32 ``erf`` by Abramowitz & Stegun 7.1.26
    (|error| ≤ 1.5e-7 in exact arithmetic, 5.8e-7 measured with ``__expf`` / ``__fdividef``;
    ``hopper.opmath.fast_math16``) instead of CUDA's ``erff`` (~28 instructions an element).
    ``vector_gathers``: the compute itself as 16-byte vectors where its remaining global loads
    (offset slices, concatenations, RoPE's rotate-half) are contiguous and aligned per vector and
    its branches the same for every lane (:func:`_vector_value`); else one load per element.
    """

    threads: int = THREADS
    vectors: int = 1
    row_reuse: bool = False
    min_blocks_per_sm: int | None = None
    fast_erf: bool = False
    vector_gathers: bool = True


# Named variants measured on the H200 (tools/bench/bench_elementwise.py --variant NAME).
VARIANTS: dict[str, ElementwiseConfig] = {
    "v1": ElementwiseConfig(),
    "v1_occ8": ElementwiseConfig(min_blocks_per_sm=8),
    "v2": ElementwiseConfig(vectors=2),
    "v2_rows": ElementwiseConfig(vectors=2, row_reuse=True),
    "v4_rows": ElementwiseConfig(vectors=4, row_reuse=True),
    "v4": ElementwiseConfig(vectors=4),
    "v1_erf": ElementwiseConfig(fast_erf=True),
    "v2_rows_erf": ElementwiseConfig(vectors=2, row_reuse=True, fast_erf=True),
    "v4_rows_erf": ElementwiseConfig(vectors=4, row_reuse=True, fast_erf=True),
}
# H200, 16384×4096 fp16 chain, kernel µs (.devq/results/ew1): v1 107.6, v1_occ8 99.9, v2 101.1,
# v2_rows 97.6, v4 119.8, v4_rows 108.7, v1_erf 94.7, v2_rows_erf 93.4, v4_rows_erf 93.3
# (floor 95.6 µs at the 4.21 TB/s copy rate). With 16-bit outputs only (see _schedule_block),
# A&S erf differs from erff by ≤ 5.8e-7 (measured, fp32), far below an fp16 rounding step.
# The default variant is ``Options.elementwise_variant`` ("v2_rows_erf").


def _launch_bounds(func: tirx.PrimFunc, min_blocks: int) -> tirx.PrimFunc:
    """Wrap the body of every ``blockIdx.x`` loop under the root block in the attribute that
    SplitHostDevice turns into ``__launch_bounds__(threads, min_blocks)`` of the kernel."""

    def visit(stmt):
        if isinstance(stmt, tirx.SeqStmt):
            return tirx.SeqStmt([visit(s) for s in stmt.seq])
        if isinstance(stmt, tirx.For) and stmt.thread_binding is not None \
                and stmt.thread_binding.thread_tag == "blockIdx.x":
            body = tirx.AttrStmt(stmt.thread_binding, LAUNCH_BOUNDS_ATTR,
                                 tirx.IntImm("int32", min_blocks), stmt.body)
            return tirx.For(stmt.loop_var, stmt.min, stmt.extent, stmt.kind, body,
                            stmt.thread_binding, stmt.annotations)
        return stmt

    realize = func.body
    root = realize.block
    block = s_tir.SBlock(root.iter_vars, root.reads, root.writes, root.name_hint,
                         visit(root.body), root.init, root.alloc_buffers, root.match_buffers,
                         root.annotations)
    return func.with_body(s_tir.SBlockRealize(realize.iter_values, realize.predicate, block))


def _reduces(block) -> bool:
    """Whether ``block`` is a reduction: an init, or a reduction iterator of any extent."""
    return block.init is not None or any(
        iv.iter_type == tirx.IterVar.CommReduce for iv in block.iter_vars)


class Elementwise(PrimFuncRule):
    """Purely spatial functions: fused loops, 256 threads, 16-byte vector loads and stores."""

    def __init__(self, threads: int | None = None, config: ElementwiseConfig | None = None) -> None:
        if config is None:
            name = current_options().elementwise_variant
            if name not in VARIANTS:
                raise ValueError(f"unknown elementwise variant {name!r}; one of {', '.join(VARIANTS)}")
            config = VARIANTS[name]
        self.config = config if threads is None else replace(config, threads=threads)
        if not current_options().elementwise_vector_gathers:
            self.config = replace(self.config, vector_gathers=False)
        self.threads = self.config.threads

    def _schedule(self, func: tirx.PrimFunc) -> s_tir.Schedule | None:
        sch = s_tir.Schedule(func)
        infos = normalize_prim_func(sch)
        if not infos or any(set(b.dom_kind()) - {"S"} for b in infos):
            return None
        if any(_reduces(sch.get(b.block_rv)) for b in infos):
            return None  # a reduction over extent-1 axes reads as "S" above; inlining its
            # consumer would put the consumer's terms in the init *and* the update (x + p + p)
        if any(not b.dom_kind() for b in infos):
            return None  # a scalar block: nothing to spread over threads
        infos = try_inline(sch, infos)
        params = set(func.params)
        for info in infos:
            stmt = sch.get(info.block_rv)
            if len(stmt.writes) != 1 or stmt.writes[0].source not in params:
                return None  # an intermediate that could not be inlined: leave it to others
        for info in infos:
            self._schedule_block(sch, info.block_rv, params)
        func = sch.mod["main"]
        if self.config.min_blocks_per_sm:
            func = _launch_bounds(func, self.config.min_blocks_per_sm)
        return s_tir.Schedule(func.with_attr(RULE_ATTR, NAME))

    def _thread_loops(self, sch: s_tir.Schedule, loops: list, vec: int) -> tuple | None:
        """Split the loops into ``(bx, tx, j, v)``: v = the elements of one vector (or of k
        adjacent vectors), j = the k rows of one thread (None unless ``row_reuse``). Falls back to
        one vector a thread when the extents do not divide. None (nothing split) when no thread
        count divides the vectors: the local → global copy after ``reverse_compute_at`` carries
        no predicate, so a partial last block would store past the end of the output."""
        cfg, threads = self.config, self.threads
        k = cfg.vectors
        inner = _int(sch.get(loops[-1]).extent)
        rows = 1
        for loop in loops[:-1]:
            extent = _int(sch.get(loop).extent)
            rows = rows * extent if rows and extent else None
        # The k rows split the last row loop only: split across a fused (b, s) row loop they
        # would index b, s as (r·k + j) // S, % S, whose cache regions are not constant in size.
        last_rows = _int(sch.get(loops[-2]).extent) if len(loops) > 1 else None
        if k > 1 and cfg.row_reuse and last_rows and last_rows % k == 0 \
                and (inner // vec) % threads == 0:
            outer, v = sch.split(loops[-1], [None, vec])
            ro, j = sch.split(loops[-2], [None, k])
            co, tx = sch.split(outer, [None, threads])
            sch.reorder(*loops[:-2], ro, co, tx, j, v)
            return sch.fuse(*loops[:-2], ro, co), tx, j, v
        if k > 1 and not cfg.row_reuse and inner % (k * vec) == 0:
            vec *= k  # k adjacent vectors: one contiguous 16·k-byte piece a thread
        if (inner // vec) % threads:
            threads = _dividing_threads(rows * (inner // vec) if rows else None, threads)
            if threads is None:
                return None
        outer, v = sch.split(loops[-1], [None, vec])
        bx, tx = sch.split(sch.fuse(*loops[:-1], outer), [None, threads])
        return bx, tx, None, v

    def _schedule_block(self, sch: s_tir.Schedule, block, params: set) -> None:
        stmt = sch.get(block)
        iters = list(stmt.iter_vars)
        inner = _int(iters[-1].dom.extent)
        out = stmt.writes[0]
        # bool has no CUDA vector type in TVM's codegen ("Cannot convert type T.boolx16"): scalar.
        loads = [r.source for r in stmt.reads if r.source in params and not _is_bool(r.source)
                 and _in_bounds_contiguous(r.region, r.source, iters)]
        store = not _is_bool(out.source) and _in_bounds_contiguous(out.region, out.source, iters)
        vec = 1
        if inner is not None and store:
            vec = VECTOR_BYTES // min(_bytes(b) for b in [out.source, *loads])
            while vec > 1 and inner % vec:
                vec //= 2
        if self.config.fast_erf and str(out.source.dtype) in ("float16", "bfloat16"):
            _rewrite_value(sch, block, fast_math16)
        loops = sch.get_loops(block)
        split = self._thread_loops(sch, loops, vec) if vec > 1 else None
        if split is None:  # scalar: the block's own predicate guards a partial last block
            bx, tx = sch.split(sch.fuse(*loops), [None, self.threads])
            sch.bind(bx, "blockIdx.x")
            sch.bind(tx, "threadIdx.x")
            return
        bx, tx, j, v = split
        sch.bind(bx, "blockIdx.x")
        sch.bind(tx, "threadIdx.x")
        if j is not None:
            sch.unroll(j)
        for buffer in dict.fromkeys(loads):  # one copy per distinct input
            index = next(i for i, r in enumerate(sch.get(block).reads) if r.source.same_as(buffer))
            cache = sch.cache_read(block, index, "local")
            sch.compute_at(cache, tx, preserve_unit_loops=False)
            _unrolled_vector_copy(sch, cache, tx, VECTOR_BYTES // _bytes(buffer))
        value = _vector_value(sch.get(block), vec, params) if self.config.vector_gathers else None
        if value is not None:  # the compute as vectors: its gathers become 16-byte loads
            _rewrite_value(sch, block, lambda _: value)
            vector_copy(sch, v, vec)
        else:
            sch.unroll(v)
        write = sch.cache_write(block, 0, "local")
        sch.reverse_compute_at(write, tx, preserve_unit_loops=False)
        _unrolled_vector_copy(sch, write, tx, VECTOR_BYTES // _bytes(out.source))


class _Scalar(Exception):
    """The value cannot be computed as vectors (:func:`_vector_value`)."""


def _vector_value(block: s_tir.SBlock, lanes: int, params: set) -> tirx.PrimExpr | None:
    """``block``'s stored value ready to be computed ``lanes`` elements at a time, or None.

    A vector holds ``lanes`` consecutive values of the innermost iterator ``i`` (the split put
    ``i = w·lanes + l``). It applies when the value still loads a parameter at an index that
    moves with ``l`` (a gather the 16-byte copies did not take: ``x[i + 64]``, a concatenation's
    pieces, RoPE's rotate-half) and:

    * every load is the same for all lanes, or contiguous (``base + l``) with ``base`` a multiple
      of ``lanes``: one aligned 16-byte load;
    * every branch condition (``if_then_else`` / ``Select``) is the same for all lanes (it
      simplifies, with ``i = w·lanes + l`` and ``0 ≤ l < lanes``, to an expression without
      ``l``); it is rewritten over the vector's first lane ``i // lanes · lanes``, which the
      lowering simplifies to an expression without the lane, so the vectoriser keeps one branch;
    * the math is ``lanes`` × 16 bits wide at most (TVM's CUDA codegen has no 8 × fp32 vectors)
      and calls no intrinsic.
    """
    store = block.body
    if not isinstance(store, tirx.BufferStore) or store.value is None:
        return None
    iters = list(block.iter_vars)
    last = iters[-1].var
    extent = _int(iters[-1].dom.extent)
    if extent is None or extent % lanes:
        return None
    analyzer = tvm.sym.Analyzer()
    for iv in iters[:-1]:
        analyzer.bind(iv.var, iv.dom)
    dt = dtype_of(last)
    w, lane = tirx.Var("w", dt), tirx.Var("lane", dt)
    analyzer.bind(w, Range(tirx.const(0, dt), tirx.const(extent // lanes, dt)))
    analyzer.bind(lane, Range(tirx.const(0, dt), tirx.const(lanes, dt)))
    split = [(last, w * lanes + lane)]
    first = [(last, tirx.floordiv(last, lanes) * lanes)]
    gathers = []

    def in_lt_form(e):
        # comparisons as "<" before simplifying (the simplifier reduces ``x·c + l < k`` but not
        # ``k <= x·c + l``), so a lane-invariant condition comes out without the lane
        if isinstance(e, tirx.LE):
            e = tirx.Not(analyzer.simplify(tirx.LT(e.b, e.a)))
        elif isinstance(e, tirx.GE):
            e = tirx.Not(analyzer.simplify(tirx.LT(e.a, e.b)))
        elif isinstance(e, tirx.GT):
            e = tirx.LT(e.b, e.a)
        return analyzer.simplify(e) if DataType(dtype_of(e)).is_bool else e

    def lane_free(cond) -> bool:
        # a condition that loads memory stays scalar: TVM's CUDA codegen of a Select over vectors
        # whose condition reads a buffer (MoE's row mask) declared the broadcast condition with the
        # value's vector type (``half4 c = make_ushort4(...)``), which nvcc refuses
        loads = []
        tvm_ffi.structural_walk(cond, (Load, loads.append), order="post")
        return not loads and not _uses(
            analyzer.simplify(rebuild(substitute(cond, split), in_lt_form)), lane)

    def load(e):
        flat = tirx.const(0, dt)
        for index, dim in zip(e.indices, e.source.shape):
            flat = flat * tirx.Cast(dt, dim) + tirx.Cast(dt, index)
        idx = analyzer.simplify(substitute(flat, split))
        base = analyzer.simplify(substitute(idx, [(lane, tirx.const(0, dt))]))
        step = analyzer.simplify(idx - base)
        if _int(step) == 0:
            return e
        if not (isinstance(step, tirx.Var) and step.same_as(lane)) \
                or _bytes(e.source) * lanes > VECTOR_BYTES \
                or not analyzer.can_prove(tirx.floormod(base, lanes) == 0):
            raise _Scalar
        if e.source in params:
            gathers.append(e)
        return e

    def visit(e):
        if isinstance(e, Load):
            return load(e)
        if DataType(dtype_of(e)).bits * lanes > 8 * VECTOR_BYTES or DataType(dtype_of(e)).is_bool:
            raise _Scalar
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return e
        if isinstance(e, (*BINARY_OPS, tirx.Mod)):
            return type(e)(visit(e.a), visit(e.b))
        if isinstance(e, tirx.Cast):
            return tirx.Cast(dtype_of(e), visit(e.value))
        if isinstance(e, tirx.Select) and lane_free(e.condition):
            return tirx.Select(substitute(e.condition, first), visit(e.true_value),
                               visit(e.false_value))
        if isinstance(e, Call) and e.op.name == "prim.if_then_else" and lane_free(e.args[0]):
            return tirx.call_intrin(dtype_of(e), e.op, substitute(e.args[0], first),
                                    visit(e.args[1]), visit(e.args[2]))
        raise _Scalar

    try:
        value = visit(store.value)
    except (_Scalar, UnknownExpr):  # (UnknownExpr: a kind rebuild does not know, in a condition)
        return None
    return value if gathers else None


def _dividing_threads(total: int | None, cap: int) -> int | None:
    """The largest thread count ≤ ``cap`` that divides ``total`` vectors (``total`` itself when it
    is ≤ cap), None when that is under a warp or ``total`` is symbolic."""
    if total is None:
        return None
    if total <= cap:
        return total
    best = next(t for t in range(cap, 0, -1) if total % t == 0)
    return best if best >= 32 else None


def _rewrite_value(sch: s_tir.Schedule, block, rewrite) -> None:
    """Replace the stored value ``v`` of a ``out[...] = v`` block by ``rewrite(v)``."""
    stmt = sch.get(block)
    store = stmt.body
    if not isinstance(store, tirx.BufferStore):
        return
    body = tirx.BufferStore(store.buffer, rewrite(store.value), store.indices)
    new = s_tir.SBlock(stmt.iter_vars, stmt.reads, stmt.writes, stmt.name_hint, body, stmt.init,
                       stmt.alloc_buffers, stmt.match_buffers, stmt.annotations)
    sch.state.replace(sch.get_sref(block), new, {stmt: new})


def _unrolled_vector_copy(sch: s_tir.Schedule, block, tx, lanes: int) -> None:
    """The copy block's last loop as 16-byte vectors, its loops between ``tx`` and that one (the
    k vectors of a thread) unrolled."""
    loops = sch.get_loops(block)
    below = [i for i, loop in enumerate(loops) if sch.get(loop).same_as(sch.get(tx))]
    for loop in loops[below[0] + 1:-1]:
        sch.unroll(loop)
    vector_copy(sch, loops[-1], lanes)
