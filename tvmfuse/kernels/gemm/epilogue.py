"""Read a fused GEMM PrimFunc as ``out[i, j] = f(Σ_k A[i, k]·B[k, j], params at (i, j))``.

FuseTIR gives a GEMM with its epilogue as one PrimFunc: a ``matmul`` block
``C[i, j] += cast(A[i, k]) * cast(B[k, j])`` (or ``B[j, k]``) followed by spatial blocks over the
same ``(i, j)`` domain (casts, bias ``b[j]``, activations, residual ``r[i, j]``, row scales
``s[i, 0]``). :func:`analyze` inlines those blocks into one expression of the accumulator and the
parameters, and :func:`expr_value` rebuilds it over the kernel's values for its store. A *pair*
epilogue (``PairGemm``'s gated Linear) reads the GEMM result only at ``C[i, 2j]`` and
``C[i, 2j + 1]`` and writes ``out[i, j]`` (N/2 wide): its expression has two accumulators, ``acc``
(even column) and ``acc_odd``. Anything else
(a prologue on A or B, a batched B, a reduction after the GEMM, two outputs) is reported as the
reason the function is not handled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import tvm
import tvm.sym
from tvm import tirx
from tvm.script import tirx as T

from ...attrs import GATHER_TAIL_ATTR
from ...errors import TVM_ERRORS
from ...relax_shapes import same_dim
from ..tir_util import BINARY_OPS as _BINARY
from ..tir_util import MATH_CALLS as _CALLS
from ..tir_util import Call as _Call
from ..tir_util import Load as _Load
from ..tir_util import Op as _Op
from ..tir_util import dtype_of as _dt
from ..tir_util import strip_cast as _strip_cast
from .tail import GatherTail, gather_tail
from .tail import NotHandled as TailNotHandled


class NotHandled(Exception):
    """The function is not a GEMM + epilogue this path can take; the message says why."""


@dataclass
class FusedGemm:
    """A fused GEMM: ``out = expr(acc, params)`` over an (M, N) output (leading dims fold into M)."""

    a: int  # parameter positions
    b: int
    out: int
    m: int | tirx.PrimExpr  # a PrimExpr only from analyze(func, symbolic_m=True)
    n: int
    k: int
    in_dtype: str
    out_dtype: str
    layout: str  # "nt": B (N, K); "nn": B (K, N)
    out_shape: tuple[int | tirx.PrimExpr, ...]
    expr: tirx.PrimExpr  # in terms of `acc` and `dims`
    acc: tirx.Var
    dims: list[tirx.Var]  # one per output dimension
    param_names: list[str] = field(default_factory=list)
    acc_odd: tirx.Var | None = None  # pair epilogue: C[i, 2j + 1] (acc is C[i, 2j]); out is N/2 wide
    # a gather tail (:mod:`.tail`): ``expr`` makes the (M, N) values the tail reads (out_dtype and
    # out_shape are theirs); the tail's stores go to parameter ``out``
    tail: GatherTail | None = None


def _int(e) -> int:
    if isinstance(e, tirx.IntImm):
        return int(e.value)
    if isinstance(e, int):
        return e
    raise NotHandled(f"symbolic extent {e}")


def _rows_shape(buf, symbolic_m: bool) -> tuple:
    """``buf``'s shape: ints, the first dimension a PrimExpr where ``symbolic_m`` lets it be one."""
    first, *rest = buf.shape
    lead = first if symbolic_m and not isinstance(first, tirx.IntImm) else _int(first)
    return (lead, *(_int(d) for d in rest))


def top_blocks(func: tirx.PrimFunc):
    """Top-level blocks in order, each with its BlockRealize (FuseTIR's loop-nest-per-block form)."""
    from tvm import s_tir

    sch = s_tir.Schedule(func)
    root = sch.get_sblock("root")
    out = []
    for rv in sch.get_child_blocks(root):
        out.append((sch.get(rv), sch.get_sref(rv)))
    return sch, out


def _matmul(block, params, symbolic_m: bool = False):
    """(A param, B param, layout, C buffer, M, N, K, in dtype) of the matmul block (M a PrimExpr
    where ``symbolic_m`` allows it)."""
    kinds = [iv.iter_type for iv in block.iter_vars]
    if kinds.count(tirx.IterVar.CommReduce) != 1 or len(kinds) != 3:
        raise NotHandled("the GEMM block is not a 2-D matmul (batched or multi-reduction)")
    vi, vj, vk = (iv.var for iv in block.iter_vars)
    body = block.body
    if not isinstance(body, tirx.BufferStore) or block.init is None:
        raise NotHandled("matmul block without init or store")
    c = body.buffer
    val = body.value
    if not (isinstance(val, tirx.Add) and isinstance(val.a, _Load)
            and val.a.source.same_as(c) and isinstance(val.b, tirx.Mul)):
        raise NotHandled("matmul update is not C + x*y")
    x, y = _strip_cast(val.b.a), _strip_cast(val.b.b)
    if not (isinstance(x, _Load) and isinstance(y, _Load)):
        raise NotHandled("matmul operands are not buffer loads")
    if str(c.dtype) != "float32":
        raise NotHandled(f"accumulator dtype {c.dtype} (fp32 only)")

    def same(idx, vars_):
        return len(idx) == len(vars_) and all(a.same_as(b) for a, b in zip(idx, vars_))

    if not same(body.indices, [vi, vj]):
        raise NotHandled("matmul output is not C[i, j]")
    if not same(x.indices, [vi, vk]):
        raise NotHandled("A is not read as A[i, k]")
    if same(y.indices, [vk, vj]):
        layout = "nn"
    elif same(y.indices, [vj, vk]):
        layout = "nt"
    else:
        raise NotHandled("B is read neither as B[k, j] nor B[j, k]")
    a_pos = next((i for i, p in enumerate(params) if p.same_as(x.source)), None)
    b_pos = next((i for i, p in enumerate(params) if p.same_as(y.source)), None)
    if a_pos is None or b_pos is None:
        raise NotHandled("A or B is computed inside the function (prologue)")
    if str(x.source.dtype) != str(y.source.dtype):
        raise NotHandled(f"A {x.source.dtype} and B {y.source.dtype} differ")
    if len(x.source.shape) != 2 or len(y.source.shape) != 2 or len(c.shape) != 2:
        raise NotHandled("A, B or C is not 2-D")
    m, kk = _rows_shape(x.source, symbolic_m)
    n = _rows_shape(c, symbolic_m)[1]
    if not same_dim(m, c.shape[0]):
        raise NotHandled("A and C have different row counts")
    return a_pos, b_pos, layout, c, m, n, kk, str(x.source.dtype)


def _lookup(pairs, var):
    """The value paired with ``var`` (Python wrappers of one Var differ: compare with same_as)."""
    return next((val for key, val in pairs if key.same_as(var)), None)


class _Inliner:
    """Inlines spatial blocks into one expression over canonical output indices.

    ``defs[buf] = (block vars, stored value)``; a load ``buf[idx]`` becomes the value with the
    block vars bound to ``idx`` (so a 1-D bias cast or a 2-D chain inline alike). The GEMM
    result ``c`` may only be read at the canonical indices: it becomes the accumulator.
    """

    def __init__(self, params, acc, c, dims):
        self.params = params
        self.acc, self.c, self.dims = acc, c, dims
        self.acc_odd = tirx.Var("acc_odd", "float32")
        self.reads: set[str] = set()  # "plain" (C[i, j]) and / or "pair" (C[i, 2j], C[i, 2j + 1])
        self.defs: list = []  # [(buffer, block vars, value)]

    def _gemm_read(self, idx) -> tirx.PrimExpr:
        """The accumulator a read ``C[idx]`` stands for."""
        if len(idx) == len(self.dims) == 2 and idx[0].same_as(self.dims[0]):
            if idx[1].same_as(self.dims[1]):
                self.reads.add("plain")
                return self.acc
            offset = tvm.sym.Analyzer().simplify(idx[1] - self.dims[1] * 2)
            if isinstance(offset, tirx.IntImm) and int(offset.value) in (0, 1):
                self.reads.add("pair")
                return self.acc_odd if int(offset.value) else self.acc
        raise NotHandled(f"GEMM result {self.c.name} read at other indices")

    def inline(self, e, vmap):
        """``e`` with block vars mapped (vmap) and intermediate loads replaced by definitions."""
        if isinstance(e, _Load):
            idx = [self.inline(i, vmap) for i in e.indices]
            if self.c.same_as(e.source):
                return self._gemm_read(idx)
            for buf, ivs, value in self.defs:
                if buf.same_as(e.source):
                    return self.inline(value, list(zip(ivs, idx)))
            if not any(p.same_as(e.source) for p in self.params):
                raise NotHandled(f"load of {e.source.name}, neither parameter nor earlier block")
            return tirx.BufferLoad(e.source, idx)
        if isinstance(e, tirx.Var):
            found = _lookup(vmap, e)
            if found is None:
                raise NotHandled(f"free variable {e.name}")
            return found
        if isinstance(e, (tirx.IntImm, tirx.FloatImm)):
            return e
        if isinstance(e, tirx.Cast):
            return tirx.Cast(_dt(e), self.inline(e.value, vmap))
        if isinstance(e, _BINARY):
            return type(e)(*_same_int_width(self.inline(e.a, vmap), self.inline(e.b, vmap)))
        if isinstance(e, tirx.Select):
            return tirx.Select(self.inline(e.condition, vmap), self.inline(e.true_value, vmap),
                               self.inline(e.false_value, vmap))
        if isinstance(e, tirx.Not):
            return tirx.Not(self.inline(e.a, vmap))
        if isinstance(e, _Call) and isinstance(e.op, _Op) and e.op.name in _CALLS:
            return _Call(e.op, [self.inline(a, vmap) for a in e.args], ret_ty=_dt(e))
        raise NotHandled(f"epilogue expression {type(e).__name__} unsupported: {e}")


def _same_int_width(a, b):
    """Index arithmetic of an int64 block var bound to an int32 output dim: ``d * T.int64(2)``
    becomes ``d * 2`` (constants take the other side's type; otherwise the narrower is cast)."""
    da, db = _dt(a), _dt(b)
    if da == db or not (da.startswith("int") and db.startswith("int")):
        return a, b
    if isinstance(b, tirx.IntImm):
        return a, tirx.IntImm(da, int(b.value))
    if isinstance(a, tirx.IntImm):
        return tirx.IntImm(db, int(a.value)), b
    wide = max(da, db, key=lambda t: int(t[3:]))
    return (a if da == wide else tirx.Cast(wide, a)), (b if db == wide else tirx.Cast(wide, b))




def analyze(func: tirx.PrimFunc, symbolic_m: bool = False) -> FusedGemm:
    """The fused GEMM in ``func``; raises :class:`NotHandled` with the reason otherwise.
    ``symbolic_m``: M may be symbolic (``FusedGemm.m`` a PrimExpr; N and K stay static)."""
    params = list(func.params)  # 0.27: parameters are the buffers themselves
    try:
        _, blocks = top_blocks(func)
    except TVM_ERRORS as err:  # TVM refuses a function that is not block-structured
        raise NotHandled(f"not a block-structured function ({err})") from err
    if not blocks:
        raise NotHandled("no blocks")
    first = blocks[0][0]
    a_pos, b_pos, layout, c, m, n, k, in_dtype = _matmul(first, params, symbolic_m)
    acc = tirx.Var("acc", "float32")
    dims = [tirx.Var(f"d{i}", "int32") for i in range(2)]
    n_gemm = len(blocks)  # the GEMM's blocks; after them a gather tail's (GATHER_TAIL_ATTR)
    if func.attrs is not None and GATHER_TAIL_ATTR in func.attrs:
        n_gemm = int(func.attrs[GATHER_TAIL_ATTR])
        if not isinstance(m, int) or not 1 < n_gemm < len(blocks):
            raise NotHandled("a gather tail after a GEMM of symbolic M or without an epilogue")
    inl = _Inliner(params, acc, c, dims)
    last, last_ivs, last_value = c, None, None
    for block, _ in blocks[1:n_gemm]:
        if any(iv.iter_type != tirx.IterVar.DataPar for iv in block.iter_vars):
            raise NotHandled(f"block {block.name_hint} after the GEMM is not elementwise")
        body = block.body
        if not isinstance(body, tirx.BufferStore) or block.init is not None:
            raise NotHandled(f"block {block.name_hint} is not a single store")
        ivs = [iv.var for iv in block.iter_vars]
        if len(body.indices) != len(ivs) or not all(
                ix.same_as(v) for ix, v in zip(body.indices, ivs)):
            raise NotHandled(f"block {block.name_hint} writes other than X[v0, v1, ...]")
        inl.defs.append((body.buffer, ivs, body.value))
        last, last_ivs, last_value = body.buffer, block.iter_vars, body.value
    if last_ivs is None:
        raise NotHandled("no epilogue block: the GEMM writes its fp32 accumulator directly")
    expr = inl.inline(last_value, list(zip([iv.var for iv in last_ivs], dims)))
    if inl.reads == {"pair"}:
        if n % 2:
            raise NotHandled(f"pair epilogue over an odd N={n}")
        out_n, acc_odd = n // 2, inl.acc_odd
    elif inl.reads == {"plain"}:
        out_n, acc_odd = n, None
    else:
        raise NotHandled("the epilogue reads the GEMM result not at all or both as C[i, j] and "
                         "as pairs")
    if n_gemm < len(blocks):
        if acc_odd is not None or [int(d) for d in last.shape] != [m, n]:
            raise NotHandled("a gather tail after an epilogue that does not write (M, N)")
        try:
            tail, out = gather_tail(func, n_gemm, last, m, n, dims)
        except TailNotHandled as err:
            raise NotHandled(f"gather tail: {err}") from err
        out_pos = next(i for i, p in enumerate(params) if p.same_as(out))
        if out_pos in (a_pos, b_pos):
            raise NotHandled("output aliases an input")
        return FusedGemm(a_pos, b_pos, out_pos, m, n, k, in_dtype, str(last.dtype), layout,
                         (m, n), expr, acc, dims, [p.name for p in params], None, tail)
    extents = [iv.dom.extent for iv in last_ivs]
    if len(extents) != 2 or not (same_dim(extents[0], m) and same_dim(extents[1], out_n)):
        raise NotHandled(f"the output block does not span the (M, {out_n}) output")
    out_pos = next((i for i, p in enumerate(params) if p.same_as(last)), None)
    if out_pos is None:
        raise NotHandled("the last block does not write a parameter")
    written = [b.body.buffer for b, _ in blocks if isinstance(b.body, tirx.BufferStore)]
    if sum(1 for p in params if any(p.same_as(w) for w in written)) != 1:
        raise NotHandled("more than one output")
    if out_pos in (a_pos, b_pos):
        raise NotHandled("output aliases an input")
    return FusedGemm(a_pos, b_pos, out_pos, m, n, k, in_dtype, str(last.dtype), layout,
                     _rows_shape(last, symbolic_m), expr, acc, dims, [p.name for p in params],
                     acc_odd)


# ``loads(kernel buffer, indices)``: a replacement for that parameter load, or None to keep it
LoadHook = Callable[[tirx.Buffer, tuple], "tirx.PrimExpr | None"]


def expr_value(e, names: list, buffers: list, row_loads: tuple | None = None,
               loads: LoadHook | None = None) -> tirx.PrimExpr:
    """The epilogue expression rebuilt over the kernel's values.

    ``names`` is ``[(var, value)]`` for acc and dims (the kernel's accumulator load, row and column
    expressions); ``buffers`` is ``[(buffer, kernel buffer)]`` of params. ``row_loads = (row dim,
    [(buffer, value)])``: loads ``buffer[row, 0]`` of these (M, 1) buffers become ``value`` (row
    statistics the kernel computes itself); any other load of them fails. ``loads(kernel buffer,
    indices)`` may return the value a parameter load is replaced with (a kernel's own copy of
    it, e.g. one lane of a vector load), None to keep the load. Nodes are made as
    TVMScript makes them (Python operators, ``T.*`` calls), so constant folding and dtype
    promotion are those of a kernel written by hand.
    """
    row_dim, row_values = row_loads if row_loads is not None else (None, [])

    def t(x):
        if isinstance(x, tirx.Var):
            found = _lookup(names, x)
            return found if found is not None else _fail(f"variable {x.name}")
        if isinstance(x, tirx.IntImm):
            return getattr(T, _dt(x))(int(x.value)) if _dt(x) != "bool" else bool(x.value)
        if isinstance(x, tirx.FloatImm):
            v = float(x.value)
            if v != v or v in (float("inf"), float("-inf")):
                _fail("non-finite constant")
            return getattr(T, _dt(x))(v)
        if isinstance(x, tirx.Cast):
            return T.Cast(_dt(x), t(x.value))
        if isinstance(x, _Load):
            value = next((v for b, v in row_values if b.same_as(x.source)), None)
            if value is not None:
                if not is_row_index(x.indices, row_dim):
                    _fail(f"{x.source.name} read other than at [row, 0]")
                return value
            buf = next((nb for b, nb in buffers if b.same_as(x.source)), None)
            if buf is None:
                _fail(f"buffer {x.source.name}")
            idx = tuple(t(i) for i in x.indices)
            got = loads(buf, idx) if loads is not None else None
            return got if got is not None else buf[idx]
        if type(x) in _BINARY_BUILD:
            return _BINARY_BUILD[type(x)](t(x.a), t(x.b))
        if isinstance(x, tirx.Select):
            return T.Select(t(x.condition), t(x.true_value), t(x.false_value))
        if isinstance(x, tirx.Not):
            return T.Not(t(x.a))
        if isinstance(x, _Call) and x.op.name.endswith("if_then_else"):  # a gather tail's branches
            return T.if_then_else(*(t(a) for a in x.args))
        if isinstance(x, _Call) and x.op.name == "tirx.call_pure_extern":  # CUDA fast-math calls
            return T.call_pure_extern(_dt(x), str(x.args[0].value), *(t(a) for a in x.args[1:]))
        if isinstance(x, _Call):
            return getattr(T, x.op.name.removeprefix("tirx."))(*(t(a) for a in x.args))
        return _fail(f"{type(x).__name__}")

    return t(e)


# how TVMScript builds each binary node: arithmetic by Python operators (constant folding and
# promotion included), comparisons and logic as the nodes themselves, min / max / floordiv / mod by
# their T.* functions
_BINARY_BUILD = {
    tirx.Add: lambda a, b: a + b, tirx.Sub: lambda a, b: a - b, tirx.Mul: lambda a, b: a * b,
    tirx.Div: lambda a, b: a / b,
    tirx.EQ: tirx.EQ, tirx.NE: tirx.NE, tirx.LT: tirx.LT, tirx.LE: tirx.LE, tirx.GT: tirx.GT,
    tirx.GE: tirx.GE, tirx.Min: T.min, tirx.Max: T.max, tirx.FloorDiv: T.floordiv,
    tirx.FloorMod: T.floormod, tirx.And: T.And, tirx.Or: T.Or,
}


def is_row_index(indices, row_dim) -> bool:
    """``indices`` is ``[row_dim, 0]`` (the row index possibly cast to another integer width)."""
    if len(indices) != 2 or not (isinstance(indices[1], tirx.IntImm) and int(indices[1].value) == 0):
        return False
    first = indices[0].value if isinstance(indices[0], tirx.Cast) else indices[0]
    return first.same_as(row_dim)


def _fail(what: str):
    raise NotHandled(f"cannot build epilogue: {what}")
