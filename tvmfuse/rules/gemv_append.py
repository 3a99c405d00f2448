"""Decode: the cache append made by the QKV GEMV's epilogue (one kernel a layer fewer).

``compile_lm``'s decode step per layer (:mod:`tvmfuse.llm.kv_cache`), after FuseTIR::

    qkv = call_tir(fused_matmul, (x, W, ...))                      # y = f(x · Wᵀ), M ≤ 64: a GEMV
    s = call_tir_inplace(fused_append, (qkv, cos, pos, sin, state, offsets))
  → s = call_tir_inplace(gemv_append, (x, W, ..., cos, pos, sin, state, offsets))

The append PrimFunc (RoPE of q and k, the V slice and the in-place store of
:func:`tvmfuse.llm.kernels.decode_append`) inlines to one guarded store per point ``(b, h, d)`` of
``concat(q, k, v)`` (:func:`.fold_decode_append.append_store`), an expression of qkv's elements.
The GEMV kernel makes those stores itself (:class:`~..kernels.gemm.gemv.RowGather`): a block puts
its outputs in shared memory, then each thread evaluates the points of its outputs (point
``(b, h, d)`` ↔ output ``(b, h·D + d)``) with the qkv reads taken from there. So every qkv
element a point reads must be an output of the point's own block. RoPE reads two elements of a
head: d and d ± D/2 (rotate-half, Llama's), or 2i and 2i + 1 (the interleaved form); the kernel
computes W's rows in an order that puts each such pair in one block: W's own order, or each
head's rows d and d + D/2 alternating (or, for a partial rotary embedding over the first D/2^k
dims, the same within groups of D/2^k rows; its blocks read W's rows in that order: no weight is
copied). Which order holds is checked on every point with the reads' indices evaluated in numpy;
where neither does, or a read's index depends on data, the two kernels stay.

Bytes moved are the same; what goes is a launch and the qkv round trip between two kernels on
the decode step's critical path. Where the append's data loads (positions, offsets, the RoPE tables)
read only constants and the step's inputs (the parameters compile_lm names in ``STEP_INPUTS_ATTR``,
which no kernel of the step writes), a kernel launched programmatically issues them before its
``griddepcontrol.wait``, behind the previous kernel (``RowGather.before_wait``).
``Options.decode_gemv_append`` switches it (on). The built kernel is :func:`.gemv.build_kernel`'s
with ``append``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import tvm
import tvm_ffi
from tvm import relax, s_tir, tirx

from ..attrs import STEP_INPUTS_ATTR
from ..errors import TVM_ERRORS
from ..kernels.gemm.gemv import RowGather
from ..kernels.index_eval import Unknown as _Unknown
from ..kernels.index_eval import children as _children
from ..kernels.index_eval import is_select as _is_select
from ..kernels.index_eval import reads as _reads
from ..kernels.index_eval import select_parts as _select_parts
from ..kernels.tir_util import Load, UnknownExpr, dtype_of, rebuild
from ..passes._util import is_op
from .fold_decode_append import append_store

NAME = "gemv_append"
_APPEND_BLOCK = "append"


@dataclass(frozen=True)
class AppendSite:
    """A decode append reading a GEMV's output: its call, the argument positions of the GEMV's
    output (``qkv``) and of the state it writes in place (``state``)."""

    call: relax.Call
    qkv: int
    state: int
    # every other argument is a constant or an input of the step that no call in it writes (or
    # a reshape of one): the append's data loads may go before the programmatic-launch wait
    inputs_only: bool = False


@dataclass(frozen=True)
class _Order:
    """Kernel row j computes W row ``row_of(j)``; ``kernel_row`` inverts it (numpy or TIR)."""

    name: str
    row_of: Callable
    kernel_row: Callable


def _orders(head_dim: int) -> list[_Order]:
    """W's own order, then the rotate-half pairings: in each group of p rows (p = D, D/2, …, 4:
    partial rotary embeddings rotate the first D/2^k dims of a head) rows i and i + p/2
    alternating."""
    orders = [_Order("rows", lambda j: j, lambda n: n)]
    p = head_dim
    while p >= 4 and p % 2 == 0:
        orders.append(_rotate_half(p))
        p //= 2
    return orders


def _rotate_half(p: int) -> _Order:
    half = p // 2
    return _Order(f"rotate_half/{p}",
                  lambda j: j // p * p + j % p // 2 + j % 2 * half,
                  lambda n: n // p * p + n % p % half * 2 + n % p // half)


def gather_for(afunc: tirx.PrimFunc, site: AppendSite, m: int, n: int, rows: int, dtype: str
               ) -> RowGather | str:
    """The :class:`RowGather` making ``afunc``'s stores from a GEMV's (m, n) output of ``dtype``
    whose blocks hold ``rows`` kernel rows; a str: why it cannot (module doc)."""
    qkv = afunc.params[site.qkv]
    if str(qkv.dtype) != dtype:
        return f"the append reads the GEMV's output as {qkv.dtype}, the GEMV writes {dtype}"
    shape = [int(s) for s in qkv.shape]
    if int(np.prod(shape)) != m * n:
        return f"the append reads {shape} of the GEMV's ({m}, {n}) output"
    found = append_store(afunc, None)
    extents = None if found is None else [int(iv.dom.extent) for iv in found[0]]
    # the append's points (B, 1, H, D), one per GEMV output
    if extents is None or len(extents) != 4 or extents[:2] != [m, 1] or extents[2] * extents[3] != n:
        return "no decode append block over the GEMV's outputs"
    ivs, guard, store = found
    heads, d = extents[2:]
    state = afunc.params[site.state]
    before_wait = site.inputs_only and not _reads_buffer(
        [store.value, *store.indices, *([guard] if guard is not None else [])], state)
    strides = [int(np.prod(shape[i + 1:])) for i in range(len(shape))]
    env = [(ivs[0].var, np.arange(m).reshape(m, 1, 1)), (ivs[1].var, np.int64(0)),
           (ivs[2].var, np.arange(heads).reshape(1, heads, 1)),
           (ivs[3].var, np.arange(d).reshape(1, 1, d))]
    reads: list = []
    try:
        for e in [store.value, *store.indices, *([guard] if guard is not None else [])]:
            _reads(e, qkv, env, np.ones((m, heads, d), bool), reads)
    except _Unknown as why:
        return f"a read of the GEMV's output at an index that depends on data ({why})"
    point = np.arange(heads).reshape(1, heads, 1) * d + np.arange(d).reshape(1, 1, d)
    for order in _orders(d):
        home = order.kernel_row(point) // rows
        if all(_closed(idx, mask, strides, m, n, home, order, rows) for idx, mask, _ in reads):
            return _gather(order, ivs, guard, store, qkv, strides, n, d, before_wait)
    return (f"a point of the append reads GEMV outputs of another block ({rows} rows a block, "
            f"head_dim {d}, orders tried: {', '.join(o.name for o in _orders(d))})")


def _closed(idx: list, mask: np.ndarray, strides: list, m: int, n: int, home: np.ndarray,
            order: _Order, rows: int) -> bool:
    """Whether every masked point's read (flat index from ``idx``) is a row of its own block."""
    flat = np.broadcast_to(sum(np.asarray(i) * s for i, s in zip(idx, strides)), mask.shape)
    flat = flat[mask]
    if flat.size == 0:
        return True
    if flat.min() < 0 or flat.max() >= m * n:
        return False
    return bool(np.all(order.kernel_row(flat % n) // rows == np.broadcast_to(home, mask.shape)[mask]))


def _early_loads(e, qkv: tirx.Buffer, found: list, path=None) -> None:
    """The outermost loads in ``e`` of buffers other than ``qkv``, each once (structurally) with
    the condition under which ``e`` evaluates it (``path``: the select conditions above it, None:
    always; a load under several paths gets their disjunction), in order."""
    if isinstance(e, Load):
        if not e.source.same_as(qkv):
            seen = next((f for f in found if tvm_ffi.structural_equal(e, f[0])), None)
            if seen is None:
                found.append([e, path])
            elif seen[1] is not None:
                seen[1] = None if path is None else tirx.Or(seen[1], path)
        return
    if _is_select(e):
        c, a, b = _select_parts(e)
        _early_loads(c, qkv, found, path)
        _early_loads(a, qkv, found, c if path is None else tirx.And(path, c))
        not_c = tirx.Not(c)
        _early_loads(b, qkv, found, not_c if path is None else tirx.And(path, not_c))
        return
    for child in _children(e):
        _early_loads(child, qkv, found, path)


def _reads_buffer(exprs: list, buf: tirx.Buffer) -> bool:
    """Whether any of ``exprs`` loads from ``buf`` (at any depth; True where an expression holds a
    node :func:`rebuild` does not know)."""
    hits: list = []

    def post(node):
        if isinstance(node, Load) and node.source.same_as(buf):
            hits.append(node)
        return node

    try:
        for e in exprs:
            rebuild(e, post)
    except UnknownExpr:
        return True
    return bool(hits)


def _gather(order: _Order, ivs: list, guard, store: tirx.BufferStore, qkv: tirx.Buffer,
            strides: list, n: int, d: int, before_wait: bool) -> RowGather:
    """The :class:`RowGather` of ``store`` under ``guard`` with the point (b, h, d) ↔ GEMV output
    (b, h·D + d); the early loads are the value's and the indices' (a load under a select only
    where the select takes it); ``before_wait``: none reads memory the step writes."""

    def at(row, col):
        """(guard, value, indices, early loads) at the point of output (row, col)."""
        point = [row, 0, col // d, col % d]
        vmap = [(iv.var, tirx.Cast(dtype_of(iv.var), x)) for iv, x in zip(ivs, point)]

        def post(e):
            return next((new for old, new in vmap if old.same_as(e)), e) if isinstance(
                e, tirx.Var) else e

        value = rebuild(store.value, post)
        indices = [rebuild(i, post) for i in store.indices]
        early: list = []
        for e in (value, *indices):
            _early_loads(e, qkv, early)
        floats = [f for f in early if dtype_of(f[0]).startswith(("float", "bfloat"))]
        ints = [f for f in early if dtype_of(f[0]).startswith(("int", "uint"))]
        cond = rebuild(guard, post) if guard is not None else tirx.const(True, "bool")
        return cond, value, indices, floats, ints

    def early_value(row, col, kind, k):
        _, _, _, floats, ints = at(row, col)
        loads, dtype = (floats, "float32") if kind == "float" else (ints, "int64")
        if not loads:  # an unrolled loop of no iterations still parses its body
            return tirx.const(0, dtype)

        def guarded(load, path):  # a load under a select: only where the select takes it
            value = tirx.Cast(dtype, load)
            return value if path is None else tirx.if_then_else(path, value, tirx.const(0, dtype))

        out = guarded(*loads[-1])
        for i in range(len(loads) - 2, -1, -1):  # k is an unrolled loop's var: folds to one
            out = tirx.Select(k == i, guarded(*loads[i]), out)
        return out

    def make(row, col, load, early):
        _, value, indices, floats, ints = at(row, col)
        hoisted = [f[0] for f in (*floats, *ints)]

        def pre(e):
            for k, h in enumerate(hoisted):
                if isinstance(e, Load) and tvm_ffi.structural_equal(e, h):
                    return tirx.Cast(dtype_of(h), early(k))
            if isinstance(e, Load) and e.source.same_as(qkv):
                flat = sum(tirx.Cast("int32", i) * s for i, s in zip(e.indices, strides))
                return load(flat // n, flat % n)
            return None

        return store.buffer, [rebuild(i, lambda x: x, pre) for i in indices], rebuild(
            value, lambda x: x, pre)

    probe = at(tirx.Var("m", "int32"), tirx.Var("n", "int32"))
    return RowGather(order.row_of, order.kernel_row, lambda row, col: at(row, col)[0],
                     early_value, (len(probe[3]), len(probe[4])), make, before_wait)


def append_sites(mod: tvm.IRModule, func: relax.Function) -> dict:
    """GEMV output var → the decode append that is its only reader (:class:`AppendSite`)."""
    uses: dict = {}
    for b in (b for block in func.body.blocks for b in block.bindings):
        for var in relax.analysis.free_vars(b.value):
            uses.setdefault(var, []).append(b.value)
    for var in relax.analysis.free_vars(func.body.body):
        uses.setdefault(var, []).append(None)
    steady = _step_inputs(func)
    sites = {}
    for b in (b for block in func.body.blocks for b in block.bindings):
        call = b.value
        if not (is_op(call, "relax.call_tir_inplace") and isinstance(call.args[1], relax.Tuple)):
            continue
        afunc = mod[call.args[0]]
        inplace = [int(i) for i in call.attrs.inplace_indices]
        if not isinstance(afunc, tirx.PrimFunc) or len(inplace) != 1 or not _has_append(afunc):
            continue
        args = list(call.args[1].fields)
        for i, arg in enumerate(args):
            if (i != inplace[0] and isinstance(arg, relax.Var) and len(uses.get(arg, [])) == 1
                    and sum(a.same_as(arg) for a in args) == 1):
                others = [a for j, a in enumerate(args) if j not in (i, inplace[0])]
                sites[arg] = AppendSite(call, i, inplace[0], all(
                    isinstance(a, tvm.ir.expr.Constant) or any(a.same_as(v) for v in steady)
                    for a in others))
    return sites


def _step_inputs(func: relax.Function) -> list:
    """The parameters of ``func`` its builder names as the call's inputs (``STEP_INPUTS_ATTR``:
    compile_lm's ids, positions, offsets, starts; not the caches or the attention's counters) and
    that no call in it writes in place, and the vars bound to a reshape of one (views): memory
    whose contents the step's kernels do not change."""
    names = [str(n) for n in (func.attrs or {}).get(STEP_INPUTS_ATTR, [])]
    bindings = [b for block in func.body.blocks for b in block.bindings]
    written = [b.value.args[1].fields[int(i)] for b in bindings
               if is_op(b.value, "relax.call_tir_inplace") and isinstance(b.value.args[1], relax.Tuple)
               for i in b.value.attrs.inplace_indices]
    steady = [p for p in func.params
              if str(p.name) in names and not any(p.same_as(w) for w in written)]
    for b in bindings:
        if is_op(b.value, "relax.reshape") and any(b.value.args[0].same_as(v) for v in steady):
            steady.append(b.var)
    return steady


def _has_append(func: tirx.PrimFunc) -> bool:
    """Whether ``func`` has the decode append's block (:func:`tvmfuse.llm.kernels.decode_append`)."""
    try:
        s_tir.Schedule(func).get_sblock(_APPEND_BLOCK)
    except (s_tir.ScheduleError, *TVM_ERRORS):
        return False
    return True
