"""A GEMM whose output an injective *gather tail* rearranges, read as per-column-range stores.

``rules/fold_gemm_tail.py`` merges a GEMM's fused function with the injective kernel that is
its output's only reader (the LM's RoPE / Q, K, V pack: slices, reshapes, transposes, rotate-half,
the cos / sin products, a concatenation). The merged function runs the GEMM's blocks (matmul and
epilogue, writing ``C``, the (M, N) values the tail read before), then the tail's. With the
tail's blocks inlined into its last one, it stores ``out[p] = E(p)``, where E reads C and
parameters (cos / sin).

:func:`gather_tail` reads that as what the wgmma kernel's epilogue can make from its registers:

* the *primary* read ``C[i, j]``, evaluated at every point and a bijection onto the (M, N)
  result, ties each point p to the accumulator (i, j) the kernel holds;
* the points of a column range (a *segment*: Q, K, V) are stored row-affinely,
  ``p = base + i·stride + (j − j0)`` (found from the points, checked on every one);
* every other read of C is ``C[i, j]`` or ``C[i, j ^ half]``: the *partner* column, which a
  thread's wgmma fragment holds too when tiles are multiples of 2·half columns (RoPE's
  rotate-half: d and d ± D/2 of one head, half = D/2).

Each segment's E is rebuilt over the output's row and column (``dims``), the own value ``own``
(C[i, j]) and the partner's ``partner`` and simplified for that column range. All reads are
checked on every point with the indices evaluated in numpy (:mod:`..index_eval`); a read whose
index depends on data, a point reading another row, or a partner other than ``j ^ half`` raise
:class:`NotHandled`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import tvm
import tvm.sym
import tvm_ffi
from tvm import s_tir, tirx

from ...errors import TVM_ERRORS
from ..index_eval import Unknown, is_select, reads, select_parts
from ..tir_util import Load, dtype_of, rebuild

MAX_POINTS = 1 << 26  # points evaluated in numpy (int64 arrays of this size, a few at a time)


class NotHandled(Exception):
    """Not a gather tail this kernel can store; the message says why."""


@dataclass(frozen=True)
class Segment:
    """Columns ``[j0, j0 + width)`` of the GEMM result, stored at ``base + row·stride + col − j0``
    of the flat output with the value ``expr`` (of ``own``, ``partner`` and ``dims``)."""

    j0: int
    width: int
    base: int
    stride: int
    expr: tirx.PrimExpr


@dataclass(frozen=True)
class GatherTail:
    """The tail's stores by column range; ``half``: the partner column is ``col ^ half`` (0: the
    tail reads none); ``size``: elements of the flat output; ``own`` / ``partner``: the segment
    expressions' variables for C[row, col] and C[row, col ^ half]."""

    segments: tuple[Segment, ...]
    half: int
    own: tirx.Var
    partner: tirx.Var
    size: int


def gather_tail(func: tirx.PrimFunc, n_gemm: int, c: tirx.Buffer, m: int, n: int,
                dims: list[tirx.Var]) -> tuple[GatherTail, tirx.Buffer]:
    """The :class:`GatherTail` of ``func``'s blocks from ``n_gemm`` on, which read ``c`` (m, n),
    and its output parameter; raises :class:`NotHandled` (module doc)."""
    last, store = _inlined_store(func, n_gemm)
    out = store.buffer
    if not any(p.same_as(out) for p in func.params):
        raise NotHandled("the last block does not write a parameter")
    if str(out.dtype) not in ("float16", "bfloat16"):
        raise NotHandled(f"output dtype {out.dtype} (16-bit outputs are stored as 16-byte vectors)")
    ivs = [iv.var for iv in last.iter_vars]
    extents = [int(iv.dom.extent) for iv in last.iter_vars]
    shape = [int(s) for s in out.shape]
    if extents != shape or len(store.indices) != len(ivs) or not all(
            i.same_as(v) for i, v in zip(store.indices, ivs)):
        raise NotHandled("the last block does not write its whole output as out[v0, v1, ...]")
    size = int(np.prod(shape))
    if size != m * n or size > MAX_POINTS:
        raise NotHandled(f"{size} output elements for an ({m}, {n}) GEMM result")
    env = [(v, np.arange(e).reshape([e if k == d else 1 for k in range(len(shape))]))
           for d, (v, e) in enumerate(zip(ivs, extents))]
    found: list = []
    try:
        reads(store.value, c, env, np.ones(shape, bool), found)
    except Unknown as why:
        raise NotHandled(f"a read of the GEMM result at an index that depends on data ({why})") from why
    rows, cols = _primary(found, shape, m, n)
    grid = np.empty((m, n), np.int64)
    grid[rows.ravel(), cols.ravel()] = np.arange(size)
    segments = _segments(grid, m, n)
    half, partner_loads = _partners(found, rows, cols, n)
    own = tirx.Var("own", str(c.dtype))
    partner = tirx.Var("partner", str(c.dtype))

    def pre(e):
        if isinstance(e, Load) and e.source.same_as(c):
            return partner if any(tvm_ffi.structural_equal(e, p) for p in partner_loads) else own
        return None

    value = rebuild(store.value, lambda x: x, pre)
    strides = [int(np.prod(shape[k + 1:])) for k in range(len(shape))]
    built = tuple(Segment(j0, w, base, stride, _segment_expr(value, ivs, extents, strides, dims,
                                                             (j0, w, base, stride), m))
                  for j0, w, base, stride in segments)
    return GatherTail(built, half, own, partner, size), out


def _inlined_store(func: tirx.PrimFunc, n_gemm: int):
    """(last block, its store) of ``func`` with the tail's blocks (from ``n_gemm`` on) but the
    last inlined."""
    try:
        sch = s_tir.Schedule(func)
        blocks = list(sch.get_child_blocks(sch.get_sblock("root")))
        for block in blocks[n_gemm:-1]:
            sch.compute_inline(block)
        blocks = sch.get_child_blocks(sch.get_sblock("root"))
        last = sch.get(blocks[-1])
    except (s_tir.ScheduleError, *TVM_ERRORS) as err:
        raise NotHandled(f"the tail's blocks do not inline into one store ({err})") from err
    if len(blocks) != n_gemm + 1:
        raise NotHandled("blocks other than the GEMM's and one store remain after inlining")
    if any(iv.iter_type != tirx.IterVar.DataPar for iv in last.iter_vars) or last.init is not None:
        raise NotHandled("the last block is not elementwise")
    if not isinstance(last.body, tirx.BufferStore):
        raise NotHandled("the last block is not a single store")
    return last, last.body


def _primary(found: list, shape: list, m: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """(row, column) of the GEMM result each point reads as its own value: reads with disjoint
    point sets covering every point (the concatenation's branches, widest first), mapped
    one-to-one onto the (M, N) result."""
    rows, cols = np.full(shape, -1, np.int64), np.full(shape, -1, np.int64)
    covered = np.zeros(shape, bool)
    for idx, mask, _ in sorted(found, key=lambda f: -int(f[1].sum())):
        if len(idx) != 2 or not mask.any() or (mask & covered).any():
            continue
        r, c = (np.broadcast_to(np.asarray(i, np.int64), shape) for i in idx)
        rows[mask], cols[mask] = r[mask], c[mask]
        covered |= mask
    if not covered.all() or rows.min() < 0 or cols.min() < 0 or rows.max() >= m or \
            cols.max() >= n or np.unique(rows.ravel() * n + cols.ravel()).size != m * n:
        raise NotHandled("no reads of the GEMM result map the output's points one-to-one onto it")
    return rows, cols


def _segments(grid: np.ndarray, m: int, n: int) -> list[tuple[int, int, int, int]]:
    """Column ranges ``(j0, width, base, stride)`` with ``grid[i, j] = base + i·stride + j − j0``."""
    stride = grid[1] - grid[0] if m > 1 else np.zeros(n, np.int64)
    if not (grid == grid[0][None, :] + np.arange(m)[:, None] * stride[None, :]).all():
        raise NotHandled("the output position of a column is not affine in the row")
    starts = [0] + [j for j in range(1, n)
                    if stride[j] != stride[j - 1] or grid[0, j] != grid[0, j - 1] + 1]
    out = []
    for j0, j1 in zip(starts, [*starts[1:], n]):
        base, s = int(grid[0, j0]), int(stride[j0])
        if (j1 - j0) % 8 or base % 8 or s % 8:
            raise NotHandled(f"columns {j0}..{j1} are stored at {base} + row * {s}: not in "
                             "16-byte pieces")
        out.append((j0, j1 - j0, base, s))
    return out


def _partners(found: list, rows: np.ndarray, cols: np.ndarray, n: int) -> tuple[int, list]:
    """(half, the loads reading the partner column ``j ^ half``); other reads are ``C[i, j]``."""
    halves, partner = set(), []
    for idx, mask, node in found:
        if not mask.any():
            continue
        r, c = (np.broadcast_to(np.asarray(i, np.int64), mask.shape)[mask] for i in idx)
        if not (r == rows[mask]).all():
            raise NotHandled("a point reads the GEMM result of another row")
        diff = c ^ cols[mask]
        if (diff == 0).all():
            continue
        h = int(diff[0])
        if not (diff == h).all() or h & (h - 1) or h < 8:
            raise NotHandled("a point reads a GEMM column other than its own or j ^ half "
                             "(half a power of two, at least 8)")
        halves.add(h)
        partner.append(node)
    if len(halves) > 1:
        raise NotHandled(f"partner columns at several distances {sorted(halves)}")
    for node in partner:  # a load evaluated both as partner and as its own column
        for idx, mask, other in found:
            if tvm_ffi.structural_equal(node, other) and mask.any():
                c = np.broadcast_to(np.asarray(idx[1], np.int64), mask.shape)[mask]
                if (c == cols[mask]).any():
                    raise NotHandled("one load reads both the own and the partner column")
    return (halves.pop() if halves else 0), partner


def _segment_expr(value, ivs: list, extents: list, strides: list, dims: list, seg: tuple,
                  m: int) -> tirx.PrimExpr:
    """``value`` with the output point of (row, col) of segment ``seg`` substituted, simplified for
    rows < m and the segment's columns."""
    j0, width, base, stride = seg
    row, col = (tirx.Var(v.name, "int64") for v in dims)  # int64: the ivs' type, bounds bind
    flat = row * stride + (col + (base - j0))
    point = []
    for e, s in zip(extents, strides):
        v = tirx.FloorDiv(flat, tirx.IntImm("int64", s))
        point.append(tirx.FloorMod(v, tirx.IntImm("int64", e)) if e * s < int(np.prod(extents))
                     else v)
    subst = [(iv, p if dtype_of(iv) == "int64" else tirx.Cast(dtype_of(iv), p))
             for iv, p in zip(ivs, point)]

    def post(e):
        if isinstance(e, tirx.Var):
            return next((p for v, p in subst if v.same_as(e)), e)
        return e

    ana = tvm.sym.Analyzer()
    ana.bind(row, tvm.ir.Range.from_min_extent(tirx.IntImm("int64", 0), tirx.IntImm("int64", m)))
    ana.bind(col, tvm.ir.Range.from_min_extent(tirx.IntImm("int64", j0),
                                              tirx.IntImm("int64", width)))
    simple = _simplify(rebuild(value, post), ana)
    back = [(row, tirx.Cast("int64", dims[0])), (col, tirx.Cast("int64", dims[1]))]
    return rebuild(simple, lambda e: next((p for v, p in back if v.same_as(e)), e)
                   if isinstance(e, tirx.Var) else e)


def _simplify(e, ana) -> tirx.PrimExpr:
    """``e`` with integer and boolean parts simplified, selects of a known condition folded and
    each branch simplified under its condition."""
    if is_select(e):
        c, a, b = select_parts(e)
        c = ana.simplify(c)
        if isinstance(c, tirx.IntImm):
            return _simplify(a if int(c.value) else b, ana)
        with ana.constraint_scope(c):
            a = _simplify(a, ana)
        with ana.constraint_scope(tirx.Not(c)):
            b = _simplify(b, ana)
        return tirx.Select(c, a, b) if isinstance(e, tirx.Select) else tirx.if_then_else(c, a, b)
    if dtype_of(e).startswith(("int", "uint", "bool")):
        return ana.simplify(rebuild(ana.simplify(e), lambda x: _fold(x, ana)))
    return rebuild(e, lambda x: x, lambda x: _simplify(x, ana) if x is not e and (
        is_select(x) or dtype_of(x).startswith(("int", "uint", "bool"))) else None)


def _fold(e, ana) -> tirx.PrimExpr:
    """An integer sub-expression whose bounds meet (``col // 128`` over one head's columns) as
    that constant (TVM's simplifier leaves such quotients)."""
    if isinstance(e, (tirx.FloorDiv, tirx.FloorMod)) and dtype_of(e).startswith("int"):
        bound = ana.const_int_bound(e)
        if bound.min_value == bound.max_value:
            return tirx.IntImm(dtype_of(e), int(bound.min_value))
    return e
